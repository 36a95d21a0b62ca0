"""Triton code of the RMSNorm (imported by kernels/dense/triton_norm.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.attention.triton_jit import cast_to


@triton.jit
def rms_norm_rows(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, HAS_W: tl.constexpr,
                  BLOCK: tl.constexpr, MANUAL: tl.constexpr):
    """Row program_id(0): out = w * (x * rsqrt(sum(x^2) / D + eps)) in fp32, cast to out's
    dtype (round to nearest even, the interpreter's bf16 cast included)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < D
    x = tl.load(x_ptr + r * stride_x + c, mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D
    y = x * tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    if HAS_W:
        y = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32) * y
    tl.store(out_ptr + r * stride_o + c, cast_to(y, out_ptr.dtype.element_ty, MANUAL), mask=m)
