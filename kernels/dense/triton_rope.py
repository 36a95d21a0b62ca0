"""Interleaved-pair RoPE on the GPU (Triton): kernels.dense.capturable.rope with one pass over x.

The capturable version is a chain of ~20 small torch kernels per call (frequencies, angles,
cos / sin, slices, four products, a difference and a sum, stack, cast, concatenation); the H200's
5-layer slice spent 12% of an eager decode step at 256 requests in `rope` (the per-node split of
benchmarks/results/h200-decode.md). Here the cos / sin table [T, rope_dim/2] is made by the
capturable version's own torch code (the frequencies cached per device and attributes, outside
CUDA-graph capture), and one kernel reads x once and writes the result once: the leading
channels copied, the last rope_dim rotated as interleaved pairs with torch's fp32 arithmetic
(each product and sum rounded on its own: the launch turns off FMA contraction), then rounded to
x's dtype. The result is bitwise kernels.dense.capturable.rope's on the same device (and the
reference's wherever the two share the table, e.g. the CPU under the interpreter).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device

TILE_ELEMS = 4096  # channels one program holds (rows x D)
_FREQS: dict[tuple, Tensor] = {}


def _capturing(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def frequencies(dev: torch.device, **kw) -> Tensor:
    """kernels.dense.capturable.rope_frequencies on `dev`, made once per (device, attributes)
    outside CUDA-graph capture (inside a capture the kernels that make it would only be
    recorded: a cached tensor would hold garbage until the graph's first replay)."""
    from megagraph.kernels.dense.capturable import rope_frequencies

    key = (str(dev), tuple(sorted(kw.items())))
    f = _FREQS.get(key)
    if f is None:
        f = rope_frequencies(dev, **kw)
        if not _capturing(dev):
            _FREQS[key] = f
    return f


def rope(x: Tensor, positions: Tensor, *, rope_dim: int, theta: float, yarn_factor: float = 1.0,
         yarn_original: int = 0, yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0,
         offset: int = 0, inverse: bool = False) -> Tensor:
    d = x.shape[-1]
    if (not (available() and _on_device(x)) or x.numel() == 0 or x.dim() not in (2, 3) or d % 2
            or rope_dim > d or rope_dim % 2 or rope_dim == 0
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        # odd widths (pairs not aligned with the rotated part), other ranks and dtypes, bad
        # rope_dim (the capturable version raises the reference's error)
        from megagraph.kernels.dense.capturable import rope as fallback

        return fallback(x, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                        yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                        yarn_beta_slow=yarn_beta_slow, offset=offset, inverse=inverse)
    import triton

    from megagraph.kernels.dense.triton_rope_jit import rope_fwd

    freqs = frequencies(x.device, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                        yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                        yarn_beta_slow=yarn_beta_slow)
    # the capturable version's table (its `sin = -sin` is the kernel's INVERSE)
    from megagraph.kernels.dense.capturable import rope_table

    cos, sin = rope_table(positions, freqs, offset)
    t = x.shape[0]
    h = x.shape[1] if x.dim() == 3 else 1
    s_xh = x.stride(1) if x.dim() == 3 else 0
    if x.stride(-1) != 1:
        x = x.contiguous()
        s_xh = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = t * h
    bp = triton.next_power_of_2(d // 2)
    br = min(max(1, TILE_ELEMS // (2 * bp)), triton.next_power_of_2(n))
    rope_fwd[(triton.cdiv(n, br),)](
        x, cos, sin, out, n, h, x.stride(0), s_xh, cos.stride(0),
        D=d, ROPE_DIM=rope_dim, BR=br, BP=bp, INVERSE=bool(inverse), MANUAL=INTERPRET,
        num_warps=1 if INTERPRET else 4,
        enable_fp_fusion=False)  # torch rounds a*c, b*s and their difference each on its own
    return out


rope.capturable = True
