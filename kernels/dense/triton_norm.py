"""RMSNorm on the GPU (Triton): kernels.dense.norm.rms_norm in one launch, one program per row.

The capturable version is ~6 torch kernels per call (cast, square, mean, rsqrt, two products,
cast); the decode graph of the 5-layer V4.1 slice has 16 of them (the q / kv latent norms, the
final norm) at a few microseconds each in a CUDA graph, on rows of 512-5120 elements. Here a
program reads its row once (fp32 math: the sum of squares, rsqrt(mean + eps), the weight after
the normalization, as the reference) and writes it once. The sum of squares runs in Triton's
reduction order: the output can differ from the reference by one rounding of its dtype where the
fp32 value straddles a tie (bf16: 2^-8 relative), fp32 outputs by ~1e-6.
Registry status "available" on sm_90: its tests pass on the H200
(tests/kernels/dense/test_triton_norm.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_D = 16384  # one row per program, held in registers


def rms_norm(x: Tensor, weight: Tensor | None = None, *, eps: float) -> Tensor:
    """kernels.dense.norm.rms_norm: weight * x * rsqrt(mean(x^2) + eps) over the last axis,
    fp32 math, x's dtype out; the capturable kernel off the GPU / for shapes it does not take."""
    d = x.shape[-1]
    ok = (available() and _on_device(x) and x.dtype in DTYPES and 0 < d <= MAX_D
          and (weight is None or (weight.shape == (d,) and weight.dtype in DTYPES)))
    if not ok or x.numel() == 0:
        from megagraph.kernels.dense.capturable import rms_norm as fallback

        return fallback(x, weight, eps=eps)
    import triton

    from megagraph.kernels.dense.triton_norm_jit import rms_norm_rows

    rows = x.reshape(-1, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, d)
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    rms_norm_rows[(rows.shape[0],)](
        rows, weight if weight is not None else rows, out, d, rows.stride(0), out.stride(0),
        float(eps), HAS_W=weight is not None, BLOCK=block, MANUAL=INTERPRET,
        num_warps=1 if INTERPRET else min(8, max(1, block // 512)))
    return out.reshape(x.shape)


rms_norm.capturable = True
