"""Write official-layout checkpoints atomically.

Layout: ``model-00001-of-0000N.safetensors`` shards (5-digit numbering, as HF / DeepSeek) plus
``model.safetensors.index.json`` = ``{"metadata": {"total_size": <sum of tensor bytes>, ...},
"weight_map": {tensor: shard}}``.  Everything is written into a temporary directory next to the
target and moved into place with ``os.replace``: the target either appears complete or not at all.

Synthetic checkpoints (``random_weights``, ``write_random_checkpoint``) live in :mod:`.synthetic`
and are re-exported here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import CheckpointError
from .reader import INDEX_NAME, SINGLE_NAME

__all__ = ["write_checkpoint", "shard_name", "plan_shards", "random_weights", "write_random_checkpoint",
           "DEFAULT_MAX_SHARD_BYTES"]

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def shard_name(i: int, n: int) -> str:
    """``shard_name(0, 3) == 'model-00001-of-00003.safetensors'`` (``i`` is 0-based)."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy sharding in insertion order: start a new shard when the next tensor would push the current
    one past ``max_shard_bytes`` (a tensor larger than the limit gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        b = _nbytes(t)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards if shards[0] else []


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_checkpoint(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: Mapping | None = None,
    overwrite: bool = False,
    single_file: bool = False,
) -> Path:
    """Write ``tensors`` (official names -> CPU tensors in storage dtypes) as a checkpoint directory.

    ``metadata`` goes into the index's ``metadata`` next to ``total_size`` (JSON values).  With
    ``single_file=True`` and everything fitting one shard, writes a lone ``model.safetensors`` (HF
    single-file layout, ``metadata`` stringified into its header) instead of shards + index.

    Refuses (``FileExistsError``) an existing non-empty ``path`` unless ``overwrite=True``.  On any
    failure nothing is left behind (the temporary directory is removed; an existing target stays
    untouched).  Returns ``path``.
    """
    dst = Path(path)
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst} exists and is not empty (pass overwrite=True to replace it)")
    meta = dict(metadata or {})
    if "total_size" in meta:
        raise ValueError("metadata['total_size'] is computed, do not pass it")
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if "*" in name:
            raise ValueError(f"{name}: stacked ('*') names must be expanded before writing "
                             "(write the per-expert tensors)")
    json.dumps(meta)  # fail early on non-JSON metadata
    shards = plan_shards(tensors, max_shard_bytes)
    total = sum(_nbytes(t) for t in tensors.values())

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        if single_file and len(shards) <= 1:
            hdr = {"format": "pt", **{k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}}
            _save(tmp / SINGLE_NAME, {n: tensors[n] for n in (shards[0] if shards else [])}, hdr)
        else:
            n = len(shards)
            weight_map: dict[str, str] = {}
            for i, names in enumerate(shards):
                fname = shard_name(i, n)
                _save(tmp / fname, {k: tensors[k] for k in names}, {"format": "pt"})
                weight_map.update({k: fname for k in names})
            index = {"metadata": {**meta, "total_size": total}, "weight_map": weight_map}
            with open(tmp / INDEX_NAME, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        if dst.exists():
            # empty dir (rename replaces it) or overwrite: move the old one aside first
            if any(dst.iterdir()):
                old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
                os.replace(dst, old / "x")
                try:
                    os.replace(tmp, dst)
                except BaseException:
                    os.replace(old / "x", dst)
                    raise
                finally:
                    shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, dst)
        else:
            os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _save(file: Path, tensors: dict[str, torch.Tensor], header_meta: dict[str, str]) -> None:
    prepared = {}
    for k, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != _nbytes(t):
            t = t.clone()  # views share storage, which safetensors refuses to save
        prepared[k] = t
    try:
        save_file(prepared, str(file), metadata=header_meta)
    except Exception as e:
        raise CheckpointError(file, f"write failed: {e}") from e
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


from .synthetic import random_weights, write_random_checkpoint  # noqa: E402  (re-export)
