"""Read an official-layout safetensors checkpoint: validate against specs, then stream shard by shard.

Layouts accepted by :func:`open_checkpoint`:

* a directory with ``model.safetensors.index.json`` (HF ``{"metadata": {"total_size": N}, "weight_map":
  {tensor: shard file}}``) and its shards;
* a directory with a single ``model.safetensors``;
* a path to one ``.safetensors`` file.

Opening parses only the JSON headers (never tensor data) and checks every shard for damage: a header
that is not valid JSON, or one whose data offsets run past the end of the file (truncated download or
copy), raises :class:`CheckpointError` naming the file (and the first tensor cut off).

:meth:`Checkpoint.load` checks **all** expected tensors (presence, shape, dtype) before reading any
data, then reads shard by shard through ``safe_open`` (memory-mapped; only the requested tensors are
materialized), stacking ``*`` expert specs into one preallocated tensor.

Scale pairing for ``dequantize=True``: a quantized ``X.weight`` (fp8e4m3 or fp4x2) is decoded with
``X.scale`` (e8m0) - fp8 with the block size inferred from the two shapes (32x32, 128x128, row-wise
1x32 for Engram tables; ragged edges fine), fp4x2 as MXFP4 (``[O, I/2]`` + ``[O, I/32]``).  The result
holds ``X.weight`` as a float tensor and **no** ``X.scale`` entry.

Checkpoints as tools write them: two kinds of stored dtype other than the spec's own are accepted,
because each holds at least the declared precision (:data:`ACCEPTED`):

* an ``e8m0`` tensor stored as ``U8`` (converters and older safetensors write E8M0 bytes as U8):
  the bytes are read as E8M0 unchanged, so values are bit-exact;
* a float stored wider than declared (``F32``/``F64`` for ``bf16``/``f16``, ``F64`` for ``f32``):
  returned as stored with ``keep_wider=True`` (the dense reference path, whose graph declares
  ``f32``), else rounded to the declared dtype (round to nearest even): a storage-format graph's
  weight types are fixed at compile time and its kernels read the declared dtype.  A float that
  was widened from the declared dtype (what converters do) comes back bit-exact either way.

When any tensor is stored so, :meth:`Checkpoint.check` (which :meth:`Checkpoint.load` runs first)
logs one summary line (logger ``megagraph.checkpoint``, level WARNING, so it reaches stderr
without any logging set-up): how many tensors, stored as what, read how.  A narrower or different
dtype, a wrong shape or a missing tensor is still an error naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from megagraph.kernels.formats import (
    DTYPES,
    dequantize_fp8_block,
    unpack_mxfp4,
)

from .errors import CheckpointError
from .spec import QUANTIZED_DTYPES, WeightSpec, bytes_needed, expand_spec, scale_name, validate_specs

__all__ = ["TensorInfo", "Checkpoint", "open_checkpoint", "read_header", "dequantize_tensor", "INDEX_NAME",
           "SINGLE_NAME", "ACCEPTED"]

log = logging.getLogger("megagraph.checkpoint")

#: stored safetensors dtypes accepted for an IR dtype besides its own (module docstring says how
#: each is read): E8M0 bytes tagged U8, and floats wider than declared
ACCEPTED: dict[str, tuple[str, ...]] = {"e8m0": ("U8",), "bf16": ("F32", "F64"), "f16": ("F32", "F64"),
                                        "f32": ("F64",)}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# bytes per element of every safetensors dtype (for size checks of dtypes megagraph does not use)
_ST_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: shard file, safetensors dtype string, shape, byte range in the data."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse one safetensors file's header (no tensor data read): ``({name: TensorInfo}, __metadata__)``.

    Raises :class:`CheckpointError` if the file is missing, too short, its header is not valid JSON or
    inconsistent, or the data it describes extends past the end of the file (truncated).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(path, f"not a safetensors file: only {size} bytes (truncated?)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise CheckpointError(path, f"corrupt header: claims a {n}-byte header")
            if 8 + n > size:
                raise CheckpointError(path, f"truncated: header claims {n} bytes but the file holds {size} bytes")
            hdr = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(path, "file not found") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, expected a .safetensors file") from None
    try:
        meta = json.loads(hdr.decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(path, f"corrupt header (not valid JSON): {e}") from None
    user_meta = meta.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    data_size = size - 8 - n
    worst: tuple[int, str] | None = None
    for name, d in meta.items():
        try:
            dtype, shape, (b, e) = d["dtype"], tuple(int(x) for x in d["shape"]), d["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(path, f"corrupt header entry {d!r}", tensor=name) from None
        item = _ST_ITEMSIZE.get(dtype)
        if item is not None and e - b != math.prod(shape) * item:
            raise CheckpointError(path, f"corrupt header: {dtype}{list(shape)} needs {math.prod(shape) * item} "
                                  f"bytes but data_offsets span {e - b}", tensor=name)
        if e > data_size and (worst is None or b < worst[0]):
            worst = (b, name)
        infos[name] = TensorInfo(name, path, dtype, shape, (b, e))
    if worst is not None:
        need = max(i.data_offsets[1] for i in infos.values())
        raise CheckpointError(
            path,
            f"truncated: header claims {need} bytes of tensor data but the file holds {max(data_size, 0)} "
            f"(file size {size}, expected {8 + n + need})",
            tensor=worst[1],
        )
    return infos, dict(user_meta)


class Checkpoint:
    """An opened checkpoint: header-level inventory of every tensor, plus :meth:`load`."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo], files: list[Path],
                 metadata: dict, index_file: Path | None):
        self.root = root
        self.tensors = tensors
        self.files = files
        self.index_file = index_file
        self._metadata = metadata

    # ------------------------------------------------------------------ inventory
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(self._where(), "not in checkpoint", tensor=name) from None

    def metadata(self) -> dict:
        """Index ``metadata`` (always with ``total_size``) or, for one file, its ``__metadata__``."""
        return dict(self._metadata)

    @property
    def total_size(self) -> int:
        """Sum of all tensor data bytes, from the headers."""
        return sum(i.nbytes for i in self.tensors.values())

    def specs(self) -> list[WeightSpec]:
        """Per-tensor specs of everything in the checkpoint (``I8`` read as ``i8``; unknown dtypes skipped)."""
        from megagraph.kernels.formats import safetensors_to_ir

        out = []
        for i in self.tensors.values():
            try:
                out.append(WeightSpec(i.name, i.shape, safetensors_to_ir(i.dtype)))
            except ValueError:
                continue
        return out

    def _where(self) -> Path:
        return self.index_file or (self.files[0] if len(self.files) == 1 else self.root)

    # ------------------------------------------------------------------ validation
    def check(self, specs: Sequence[WeightSpec], *, cast_floats: bool = False,
              warn_unexpected: bool = True, keep_wider: bool = False,
              note: bool = True) -> list[WeightSpec]:
        """Validate every expected tensor (presence, shape, dtype) without reading data.

        Returns the expanded per-tensor specs.  Raises one :class:`CheckpointError` listing every
        problem (missing tensors by name - the first few -, then mismatches with file, expected and
        found).  Extra checkpoint tensors not in ``specs`` produce a warning.  ``cast_floats`` accepts
        any of bf16/f16/f32 for a float spec (converted on load).  Stored dtypes of :data:`ACCEPTED`
        pass; with ``note`` one line saying how they will be read (``keep_wider``: see :meth:`load`)
        is logged.
        """
        flat = expand_spec(specs)
        missing: list[str] = []
        problems: list[tuple[str | None, str | None, str]] = []
        for s in flat:
            info = self.tensors.get(s.name)
            if info is None:
                missing.append(s.name)
                continue
            if info.shape != s.shape:
                problems.append((str(info.file), s.name,
                                 f"shape mismatch: expected {list(s.shape)}, found {list(info.shape)}"))
            if not _dtype_ok(s.dtype, info.dtype, cast_floats):
                also = "".join(f" or {x}" for x in ACCEPTED.get(s.dtype, ()))
                problems.append((str(info.file), s.name,
                                 f"dtype mismatch: expected {s.dtype} ({s.safetensors_dtype}{also}), "
                                 f"found {info.dtype}"))
        if missing:
            shown = ", ".join(missing[:5]) + (f", ... ({len(missing) - 5} more)" if len(missing) > 5 else "")
            problems.insert(0, (str(self._where()), missing[0],
                                f"{len(missing)} expected tensor(s) missing from the checkpoint: {shown}"))
        if problems:
            f, t, r = problems[0]
            raise CheckpointError(f, r, tensor=t, problems=problems)
        if warn_unexpected:
            wanted = {s.name for s in flat}
            extra = [n for n in self.tensors if n not in wanted]
            if extra:
                shown = ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else "")
                warnings.warn(f"{self._where()}: {len(extra)} checkpoint tensor(s) not in the specs "
                              f"(ignored): {shown}", stacklevel=3)
        if note and not cast_floats:
            line = self.reinterpretation_note(flat, keep_wider=keep_wider)
            if line:
                log.warning(line)
        return flat

    def reinterpretation_note(self, specs: Sequence[WeightSpec], *, keep_wider: bool = False) -> str | None:
        """One line on the tensors of ``specs`` stored in an :data:`ACCEPTED` dtype other than
        their own, or None when every tensor is stored as declared."""
        as_bytes: list[str] = []
        wider: dict[tuple[str, str], list[str]] = {}
        for s in expand_spec(specs):
            info = self.tensors.get(s.name)
            if info is None or info.dtype == s.safetensors_dtype:
                continue
            if s.dtype == "e8m0" and info.dtype == "U8":
                as_bytes.append(s.name)
            elif info.dtype in ACCEPTED.get(s.dtype, ()):
                wider.setdefault((s.safetensors_dtype, info.dtype), []).append(s.name)
        parts = []
        if as_bytes:
            parts.append(f"{len(as_bytes)} e8m0 tensor(s) stored as U8 read as their E8M0 bytes "
                         f"(bit-exact; e.g. {as_bytes[0]})")
        for (declared, found), names in sorted(wider.items()):
            how = f"kept as {found}" if keep_wider else f"rounded to the declared {declared}"
            parts.append(f"{len(names)} tensor(s) declared {declared} stored as wider {found}, {how} "
                         f"(e.g. {names[0]})")
        if not parts:
            return None
        return f"{self._where()}: reinterpreted on load: " + "; ".join(parts)

    # ------------------------------------------------------------------ loading
    def load(
        self,
        specs: Sequence[WeightSpec],
        *,
        dequantize: bool = False,
        dequant_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        progress: bool = True,
        cast_floats: bool = False,
        warn_unexpected: bool = True,
        keep_wider: bool = False,
        note: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Load the tensors of ``specs`` -> ``{spec name: tensor}`` (stacked ``*`` specs as one tensor).

        Everything is validated first (:meth:`check`); then shards are streamed one at a time in file
        order.  ``dequantize=True``: quantized ``X.weight`` + ``X.scale`` pairs become one float tensor
        ``X.weight`` of ``dequant_dtype`` (the scale entries are dropped); other tensors are returned as
        stored (floats cast to ``dequant_dtype`` too if ``cast_floats``).  ``progress`` shows a tqdm bar in
        bytes with ETA.  Tensors in the spec's dtype come back in it; e8m0 stored as U8 comes back as
        E8M0 (same bytes); a float stored wider than its spec comes back as stored with
        ``keep_wider`` (for callers that convert to their own float dtype, like the dense reference
        path) and otherwise rounded to the spec's dtype.  ``note``: log the one-line summary of such
        tensors (:meth:`check`).
        """
        specs = list(specs)
        pairs = validate_specs(specs) if dequantize else {}
        flat = self.check(specs, cast_floats=cast_floats, warn_unexpected=warn_unexpected,
                          keep_wider=keep_wider, note=note)
        device = torch.device(device)
        # member tensor name -> (spec, index in the stack or None)
        owner: dict[str, tuple[WeightSpec, int | None]] = {}
        for s in specs:
            if s.stacked:
                for e, n in enumerate(s.member_names()):
                    owner[n] = (s, e)
            else:
                owner[s.name] = (s, None)
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        target: dict[str, torch.dtype] = {}  # spec name -> dtype it is returned in
        for m in flat:
            by_file.setdefault(self.tensors[m.name].file, []).append(m.name)
            spec = owner[m.name][0]
            t = _read_dtype(spec, self.tensors[m.name].dtype, keep_wider)
            if spec.name not in target or t.itemsize > target[spec.name].itemsize:
                target[spec.name] = t  # a stack takes its widest member
        total = sum(self.tensors[m.name].nbytes for m in flat)
        bar = _progress(total, progress)
        try:
            for path in self.files:
                names = by_file.get(path)
                if not names:
                    continue
                names.sort(key=lambda n: self.tensors[n].data_offsets[0])  # sequential reads
                n = None
                try:
                    with safe_open(str(path), framework="pt", device="cpu") as f:
                        for n in names:
                            spec, e = owner[n]
                            t = f.get_tensor(n)
                            want = target[spec.name]
                            if t.dtype == torch.uint8 and want == torch.float8_e8m0fnu:
                                t = t.view(want)  # E8M0 bytes tagged U8: the same bytes
                            elif t.dtype != want:
                                t = t.to(want)  # a wider float rounded, or cast_floats
                            if e is None:
                                out[spec.name] = t.to(device) if device.type != "cpu" else t
                            else:
                                dst = out.get(spec.name)
                                if dst is None:
                                    dst = out[spec.name] = torch.empty(spec.shape, dtype=want, device=device)
                                dst[e].copy_(t)
                            bar.update(self.tensors[n].nbytes)
                except CheckpointError:
                    raise
                except Exception as err:  # safetensors raises its own error types
                    raise CheckpointError(path, f"read failed: {err}", tensor=n) from err
        finally:
            bar.close()
        out = {s.name: out[s.name] for s in specs}  # spec order
        if dequantize:
            out = _dequantize_all(out, specs, pairs, dequant_dtype, cast_floats)
        return out

    def bytes_needed(self, specs: Iterable[WeightSpec], *, dequantize: bool = False) -> int:
        """Bytes :meth:`load` would return for ``specs`` (see :func:`spec.bytes_needed`)."""
        return bytes_needed(specs, dequantize=dequantize)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.root)!r}, {len(self.tensors)} tensors in {len(self.files)} file(s))"


def _dtype_ok(ir: str, found: str, cast_floats: bool) -> bool:
    want = DTYPES[ir].safetensors
    if found == want or found in ACCEPTED.get(ir, ()):
        return True
    return cast_floats and ir in ("bf16", "f16", "f32") and found in ("BF16", "F16", "F32")


_ST_TORCH = {"F32": torch.float32, "F64": torch.float64}


def _read_dtype(spec: WeightSpec, found: str, keep_wider: bool) -> torch.dtype:
    """The dtype a tensor of ``spec`` stored as ``found`` is returned in (see :meth:`Checkpoint.load`)."""
    if keep_wider and found in ACCEPTED.get(spec.dtype, ()) and found in _ST_TORCH:
        return _ST_TORCH[found]
    return spec.torch_dtype


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n):  # noqa: D401
                pass

            def close(self):
                pass

        return _Null()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading weights",
                dynamic_ncols=True)


def _dequantize_all(out: dict[str, torch.Tensor], specs: list[WeightSpec], pairs: dict[str, WeightSpec],
                    dtype: torch.dtype, cast_floats: bool) -> dict[str, torch.Tensor]:
    by_name = {s.name: s for s in specs}
    res: dict[str, torch.Tensor] = {}
    consumed = {p.name for p in pairs.values()}
    for name, t in out.items():
        if name in consumed:
            continue
        s = by_name[name]
        if name in pairs:
            res[name] = dequantize_tensor(t, out[scale_name(name)], s.dtype).to(dtype)
        elif s.dtype in QUANTIZED_DTYPES:
            res[name] = t.to(torch.float32).to(dtype) if s.dtype == "fp8e4m3" else t  # scale-less
        elif cast_floats and t.dtype.is_floating_point:
            res[name] = t.to(dtype)
        else:
            res[name] = t
    return res


def dequantize_tensor(w: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """Decode a quantized weight (IR ``dtype`` fp8e4m3 or fp4x2) with its e8m0 scale -> float32.
    Leading dims (stacked experts) are supported."""
    if dtype == "fp4x2":
        return unpack_mxfp4(w, scale)  # leading (expert) dims supported
    if dtype == "fp8e4m3":
        return dequantize_fp8_block(w, scale)
    raise ValueError(f"dequantize_tensor: {dtype} is not a quantized dtype")


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint directory (index + shards, or one ``model.safetensors``) or one file.

    Reads headers only.  Raises :class:`CheckpointError` for a missing directory, a malformed index, an
    index entry whose shard is missing or lacks the tensor, and damaged/truncated shards.
    """
    root = Path(path)
    if root.is_file():
        infos, meta = read_header(root)
        return Checkpoint(root.parent, infos, [root], {**meta, "total_size": sum(i.nbytes for i in infos.values())}, None)
    if not root.is_dir():
        raise CheckpointError(root, "checkpoint directory not found")
    index = root / INDEX_NAME
    if index.is_file():
        return _open_index(root, index)
    single = root / SINGLE_NAME
    if single.is_file():
        infos, meta = read_header(single)
        return Checkpoint(root, infos, [single], {**meta, "total_size": sum(i.nbytes for i in infos.values())}, None)
    others = sorted(p.name for p in root.glob("*.safetensors"))
    hint = f" (found {', '.join(others[:3])}{', ...' if len(others) > 3 else ''} without an index)" if others else ""
    raise CheckpointError(root, f"no {INDEX_NAME} or {SINGLE_NAME}{hint}")


def _open_index(root: Path, index: Path) -> Checkpoint:
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(index, f"malformed index JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CheckpointError(index, "malformed index: no 'weight_map' object")
    wmap = doc["weight_map"]
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict):
        raise CheckpointError(index, "malformed index: 'metadata' is not an object")
    shard_of: dict[str, list[str]] = {}
    for name, shard in wmap.items():
        if not isinstance(shard, str) or not shard or os.path.isabs(shard) or ".." in Path(shard).parts:
            raise CheckpointError(index, f"malformed index: bad shard file name {shard!r}", tensor=name)
        shard_of.setdefault(shard, []).append(name)
    files: list[Path] = []
    tensors: dict[str, TensorInfo] = {}
    for shard in sorted(shard_of):
        p = root / shard
        names = shard_of[shard]
        if not p.is_file():
            raise CheckpointError(p, f"index {index.name} refers to a missing shard ({len(names)} tensor(s), "
                                     f"e.g. {', '.join(names[:3])})", tensor=names[0])
        infos, _ = read_header(p)
        for n in names:
            if n not in infos:
                raise CheckpointError(p, f"index {index.name} maps the tensor to this shard but the shard does "
                                         "not contain it", tensor=n)
            tensors[n] = infos[n]
        files.append(p)
    total = sum(i.nbytes for i in tensors.values())
    claimed = meta.get("total_size")
    if claimed is not None and claimed != total:
        warnings.warn(f"{index}: metadata.total_size = {claimed} but the shard headers sum to {total}", stacklevel=3)
    meta = {**meta, "total_size": claimed if claimed is not None else total}
    return Checkpoint(root, tensors, files, meta, index)
