"""Random checkpoints in the exact storage formats of a spec list (for tests and benchmarks).

Every tensor is drawn from its own generator seeded by ``(seed, checkpoint tensor name)``, so values do
not depend on spec order, on which subset of specs is asked for, or on stacking (``experts.*`` gives the
same values as the ``E`` per-expert specs).

Values by spec dtype:

* ``fp8e4m3`` ``X.weight`` + ``X.scale``: ``N(0, init_std)`` quantized with :func:`quantize_fp8_block`, the
  block inferred from the scale spec's shape (32x32, 128x128, or 1x32 rows for Engram tables);
* ``fp4x2`` ``X.weight`` + ``X.scale``: ``N(0, init_std)`` ``[O, I]`` through :func:`quantize_mxfp4`;
* float (bf16/f16/f32/f64): RMSNorm weights (``...norm.weight``) ``1 + N(0, init_std)``, everything
  else (projections, embeddings, ``hc_*``, ``attn_sink``, router bias, ...) ``N(0, init_std)``;
* ``*.tid2eid`` integer tables: per row distinct expert ids below the sibling ``gate.weight``'s row
  count; other integers uniform in [0, 16); bool: fair coin; unpaired e8m0: exponents in [2^-8, 1].
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from megagraph.kernels.formats import infer_block_size, quantize_fp8_block, quantize_mxfp4

from .spec import WeightSpec, scale_name, validate_specs

__all__ = ["random_weights", "write_random_checkpoint"]

_NORM_RE = re.compile(r"(^|[._])norm\.weight$")


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))


def _n_experts_for(name: str, by_name: dict[str, WeightSpec]) -> int | None:
    if "gate." not in name:
        return None
    w = by_name.get(name.rsplit(".", 1)[0] + ".weight")
    return w.shape[0] if w is not None and w.shape else None


def _member(spec: WeightSpec, name: str, scale: WeightSpec | None, by_name: dict[str, WeightSpec],
            seed: int, init_std: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = _gen(seed, name)
    shape = spec.member_shape
    dt = spec.dtype
    if dt == "fp8e4m3":
        w = torch.randn(shape, generator=g) * init_std
        if scale is None:
            return w.to(torch.float8_e4m3fn), None
        return quantize_fp8_block(w, infer_block_size(shape, scale.member_shape))
    if dt == "fp4x2":
        o, h = shape
        w = torch.randn((o, 2 * h), generator=g) * init_std
        if scale is None:
            raise ValueError(f"{name}: fp4x2 weight without scale")
        return quantize_mxfp4(w, block=2 * h // scale.member_shape[1])
    if dt in ("bf16", "f16", "f32", "f64"):
        w = torch.randn(shape, generator=g, dtype=torch.float64) * init_std
        if _NORM_RE.search(name):
            w = w + 1.0
        return w.to(spec.torch_dtype), None
    if dt == "bool":
        return torch.rand(shape, generator=g) < 0.5, None
    if dt == "e8m0":
        return torch.randint(119, 128, shape, generator=g, dtype=torch.int32).to(torch.uint8).view(
            torch.float8_e8m0fnu), None
    # integer dtypes
    n_exp = _n_experts_for(spec.name, by_name) if name.endswith("tid2eid") else None
    if n_exp is not None and len(shape) == 2 and shape[1] <= n_exp:
        ids = torch.rand((shape[0], n_exp), generator=g).argsort(dim=1)[:, : shape[1]]
        return ids.to(spec.torch_dtype), None
    return torch.randint(0, 16, shape, generator=g, dtype=torch.int64).to(spec.torch_dtype), None


def random_weights(specs: Sequence[WeightSpec], *, seed: int, init_std: float = 0.02,
                   stacked: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors in each spec's storage format.

    Keys: per-tensor checkpoint names (``experts.0.w1.weight``, ...: ready for :func:`write_checkpoint`)
    or, with ``stacked=True``, the spec names with stacked ``*`` tensors (the form
    :meth:`Checkpoint.load` returns).  Scales must be explicit specs (:func:`validate_specs`).
    """
    specs = list(specs)
    pairs = validate_specs(specs)
    by_name = {s.name: s for s in specs}
    paired_scales = {p.name for p in pairs.values()}
    members: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.name in paired_scales:
            continue  # produced with its weight
        sc = pairs.get(s.name)
        for n in s.member_names():
            w, q = _member(s, n, sc, by_name, seed, init_std)
            members[n] = w
            if sc is not None:
                members[scale_name(n)] = q
    # order as the specs list it (weights and scales in spec order)
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        names = s.member_names()
        if stacked and s.stacked:
            out[s.name] = torch.stack([members[n] for n in names])
        else:
            for n in names:
                out[n] = members[n]
    return out


def write_random_checkpoint(path: str | os.PathLike, specs: Sequence[WeightSpec], *, seed: int,
                            init_std: float = 0.02, max_shard_bytes: int | None = None,
                            metadata: dict | None = None, overwrite: bool = False) -> Path:
    """``write_checkpoint(path, random_weights(specs, seed=seed))`` (metadata records the seed)."""
    from .writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

    tensors = random_weights(specs, seed=seed, init_std=init_std)
    meta = {"generator": "megagraph.random_weights", "seed": seed, "init_std": init_std, **(metadata or {})}
    return write_checkpoint(path, tensors, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                            metadata=meta, overwrite=overwrite)

