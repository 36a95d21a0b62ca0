"""What a graph expects from a checkpoint: one :class:`WeightSpec` per (possibly stacked) tensor.

Names are the official checkpoint names (``layers.3.attn.wq_a.weight``).  A name may contain one
``*`` as a whole path segment, meaning a **stacked** weight over experts::

    WeightSpec("layers.3.ffn.experts.*.w1.weight", (E, O, I // 2), "fp4x2")
      <->  checkpoint tensors layers.3.ffn.experts.{0..E-1}.w1.weight, each [O, I/2]

**Scales are explicit specs.**  A quantized weight ``X.weight`` (dtype ``fp8e4m3`` or ``fp4x2``) is
always accompanied in the spec list by ``X.scale`` (dtype ``e8m0``), so the graph declares every tensor
it reads and nothing is implied.  Shapes (``b`` = block):

* fp8 block  ``X.weight [O, I]`` fp8e4m3  + ``X.scale [ceil(O/b), ceil(I/b)]`` e8m0  (b = 32 V4.1, 128 V4)
* fp8 rows   ``X.weight [R, W]`` fp8e4m3  + ``X.scale [R, W/32]`` e8m0  (Engram tables)
* mxfp4      ``X.weight [O, I/2]`` fp4x2  + ``X.scale [O, I/32]`` e8m0  (routed experts)

and the same with a leading ``E`` for stacked (``*``) specs.  :func:`validate_specs` checks the pairing;
:func:`fp8_linear_specs`, :func:`fp4_expert_specs` and :func:`with_scales` build paired specs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from megagraph.kernels.formats import DTYPES, infer_block_size

from .errors import SpecError

__all__ = [
    "WeightSpec",
    "expand_spec",
    "validate_specs",
    "bytes_needed",
    "scale_name",
    "weight_name_for_scale",
    "fp8_linear_specs",
    "fp4_expert_specs",
    "with_scales",
    "QUANTIZED_DTYPES",
]

#: IR dtypes that need an ``e8m0`` companion scale when the tensor is named ``X.weight``
QUANTIZED_DTYPES = frozenset({"fp8e4m3", "fp4x2"})


@dataclass(frozen=True)
class WeightSpec:
    """One expected tensor: official name (optionally with one ``*`` segment), shape, IR dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"WeightSpec name must be a non-empty string, got {self.name!r}")
        try:
            shape = tuple(int(d) for d in self.shape)
        except TypeError:
            raise SpecError(f"{self.name}: shape must be a sequence of ints, got {self.shape!r}") from None
        if any(d < 0 for d in shape):
            raise SpecError(f"{self.name}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPES:
            raise SpecError(f"{self.name}: unknown IR dtype {self.dtype!r} (known: {', '.join(DTYPES)})")
        n_star = self.name.count("*")
        if n_star > 1:
            raise SpecError(f"{self.name}: at most one '*' allowed")
        if n_star == 1:
            if "*" not in self.name.split("."):
                raise SpecError(f"{self.name}: '*' must be a whole dotted segment (experts.*.w1.weight)")
            if not shape:
                raise SpecError(f"{self.name}: a stacked ('*') spec needs a leading expert dimension")

    # ------------------------------------------------------------------ properties
    @property
    def stacked(self) -> bool:
        return "*" in self.name

    @property
    def num_stacked(self) -> int:
        """Number of stacked members (E) for a ``*`` spec, 1 otherwise."""
        return self.shape[0] if self.stacked else 1

    @property
    def member_shape(self) -> tuple[int, ...]:
        """Shape of one checkpoint tensor (drops the expert dim of a stacked spec)."""
        return self.shape[1:] if self.stacked else self.shape

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype].torch

    @property
    def safetensors_dtype(self) -> str:
        return DTYPES[self.dtype].safetensors

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def member_names(self) -> list[str]:
        """Checkpoint tensor names this spec covers (``E`` names for a stacked spec)."""
        if not self.stacked:
            return [self.name]
        return [self.name.replace("*", str(e)) for e in range(self.shape[0])]

    def expand(self) -> list["WeightSpec"]:
        """The per-tensor checkpoint view of this spec."""
        if not self.stacked:
            return [self]
        return [WeightSpec(n, self.member_shape, self.dtype) for n in self.member_names()]


def expand_spec(specs: Iterable[WeightSpec]) -> list[WeightSpec]:
    """Per-tensor checkpoint view: every stacked spec replaced by its ``E`` members (order kept).

    Raises :class:`SpecError` on duplicate names (after expansion).
    """
    out: list[WeightSpec] = []
    seen: set[str] = set()
    for s in specs:
        for m in s.expand():
            if m.name in seen:
                raise SpecError(f"duplicate tensor {m.name!r} in spec list")
            seen.add(m.name)
            out.append(m)
    return out


def bytes_needed(specs: Iterable[WeightSpec], *, dequantize: bool = False, float_bytes: int = 4) -> int:
    """Bytes the tensors of ``specs`` occupy once loaded.

    ``dequantize=False``: storage bytes (what :meth:`Checkpoint.load` returns).  ``dequantize=True``:
    quantized ``X.weight`` counted as ``float_bytes`` per logical value (fp4x2: 2 values per byte),
    their ``X.scale`` companions as 0 (consumed).
    """
    specs = list(specs)
    if not dequantize:
        return sum(s.nbytes for s in specs)
    quant = {s.name for s in specs if s.dtype in QUANTIZED_DTYPES and s.name.endswith(".weight")}
    total = 0
    for s in specs:
        if s.dtype == "e8m0" and weight_name_for_scale(s.name) in quant:
            continue
        if s.name in quant:
            total += s.numel * (2 if s.dtype == "fp4x2" else 1) * float_bytes
        else:
            total += s.nbytes
    return total


# ---------------------------------------------------------------------------------------------------
# scale pairing
# ---------------------------------------------------------------------------------------------------


def scale_name(weight_name: str) -> str:
    """``X.weight`` -> ``X.scale``."""
    if not weight_name.endswith(".weight"):
        raise SpecError(f"{weight_name!r}: only 'X.weight' tensors have an 'X.scale' companion")
    return weight_name[: -len(".weight")] + ".scale"


def weight_name_for_scale(scale: str) -> str:
    """``X.scale`` -> ``X.weight``."""
    if not scale.endswith(".scale"):
        raise SpecError(f"{scale!r} is not a '.scale' tensor name")
    return scale[: -len(".scale")] + ".weight"


def _check_pair(w: WeightSpec, s: WeightSpec) -> None:
    if s.dtype != "e8m0":
        raise SpecError(f"{s.name}: scale of quantized {w.name} must be e8m0, got {s.dtype}")
    if w.stacked != s.stacked or (w.stacked and w.shape[0] != s.shape[0]):
        raise SpecError(f"{w.name} {w.shape} and {s.name} {s.shape} disagree on stacking")
    ws, ss = w.member_shape, s.member_shape
    if len(ws) != 2 or len(ss) != 2:
        raise SpecError(f"{w.name} {w.shape} / {s.name} {s.shape}: quantized weights must be 2-D per member")
    if w.dtype == "fp4x2":
        cols = 2 * ws[1]
        if ss[0] != ws[0] or ss[1] == 0 or cols % ss[1]:
            raise SpecError(f"{s.name} {s.shape}: mxfp4 scale of {w.name} {w.shape} must be [O, I/32] "
                            f"(O={ws[0]}, I={cols})")
    else:
        try:
            infer_block_size(ws, ss)
        except ValueError as e:
            raise SpecError(f"{s.name} {s.shape} does not tile {w.name} {w.shape} in blocks: {e}") from None


def validate_specs(specs: Sequence[WeightSpec]) -> dict[str, WeightSpec]:
    """Check a spec list; return ``{weight name: scale spec}`` for every quantized weight.

    Rules: names unique (also after expansion); every ``X.weight`` of dtype fp8e4m3/fp4x2 has an
    ``X.scale`` e8m0 spec of a matching shape; every ``X.scale`` e8m0 spec has its ``X.weight``.
    (A quantized tensor not named ``.weight`` is allowed and has no scale.)
    """
    by_name: dict[str, WeightSpec] = {}
    for s in specs:
        if not isinstance(s, WeightSpec):
            raise SpecError(f"expected WeightSpec, got {type(s).__name__}")
        if s.name in by_name:
            raise SpecError(f"duplicate spec {s.name!r}")
        by_name[s.name] = s
    expand_spec(specs)  # duplicate members (e.g. stacked + explicit member)
    pairs: dict[str, WeightSpec] = {}
    for s in specs:
        if s.dtype in QUANTIZED_DTYPES and s.name.endswith(".weight"):
            sc = by_name.get(scale_name(s.name))
            if sc is None:
                raise SpecError(f"quantized {s.name} ({s.dtype}) has no {scale_name(s.name)} spec; scales are "
                                "declared explicitly (see with_scales)")
            _check_pair(s, sc)
            pairs[s.name] = sc
        elif s.dtype == "e8m0" and s.name.endswith(".scale"):
            w = by_name.get(weight_name_for_scale(s.name))
            if w is None or w.dtype not in QUANTIZED_DTYPES:
                raise SpecError(f"scale {s.name} has no quantized {weight_name_for_scale(s.name)} spec")
    return pairs


# ---------------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------------


def fp8_linear_specs(prefix: str, out_features: int, in_features: int, *, block: int = 32) -> list[WeightSpec]:
    """``prefix.weight`` fp8e4m3 ``[O, I]`` + ``prefix.scale`` e8m0 ``[ceil(O/b), ceil(I/b)]``."""
    return [
        WeightSpec(f"{prefix}.weight", (out_features, in_features), "fp8e4m3"),
        WeightSpec(f"{prefix}.scale", (-(-out_features // block), -(-in_features // block)), "e8m0"),
    ]


def fp4_expert_specs(prefix: str, num_experts: int | None, out_features: int, in_features: int,
                     *, block: int = 32) -> list[WeightSpec]:
    """mxfp4 ``prefix.weight`` fp4x2 ``[(E,) O, I/2]`` + ``prefix.scale`` e8m0 ``[(E,) O, I/32]``.

    ``prefix`` contains ``*`` and ``num_experts`` is E for a stacked spec; ``num_experts=None`` for one.
    """
    if in_features % block:
        raise SpecError(f"{prefix}: in_features {in_features} not a multiple of {block}")
    lead = () if num_experts is None else (num_experts,)
    return [
        WeightSpec(f"{prefix}.weight", lead + (out_features, in_features // 2), "fp4x2"),
        WeightSpec(f"{prefix}.scale", lead + (out_features, in_features // block), "e8m0"),
    ]


_ROWS_RE = re.compile(r"(^|\.)engram\.embed\.weight$")


def with_scales(specs: Iterable[WeightSpec], *, block: int = 32) -> list[WeightSpec]:
    """Add the missing ``X.scale`` spec after each quantized ``X.weight`` (fp8: ``b x b`` blocks, except
    Engram tables ``engram.embed.weight`` which get row scales ``[R, W/32]``; fp4x2: ``[O, I/32]``)."""
    specs = list(specs)
    names = {s.name for s in specs}
    out: list[WeightSpec] = []
    for s in specs:
        out.append(s)
        if s.dtype not in QUANTIZED_DTYPES or not s.name.endswith(".weight") or scale_name(s.name) in names:
            continue
        if len(s.member_shape) != 2:
            raise SpecError(f"{s.name} {s.shape}: quantized weights must be 2-D per member")
        lead, (o, i) = (s.shape[:1], s.member_shape) if s.stacked else ((), s.shape)
        if s.dtype == "fp4x2":
            shp = (o, 2 * i // 32)
        elif _ROWS_RE.search(s.name):
            shp = (o, -(-i // 32))
        else:
            shp = (-(-o // block), -(-i // block))
        out.append(WeightSpec(scale_name(s.name), lead + shp, "e8m0"))
    return out
