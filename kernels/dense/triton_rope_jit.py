"""Triton code of the rotary embedding (imported by kernels/dense/triton_rope.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.attention.triton_jit import cast_to


@triton.jit
def rope_fwd(x_ptr, cos_ptr, sin_ptr, o_ptr, N, H, s_xt, s_xh, s_c,
             D: tl.constexpr, ROPE_DIM: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
             INVERSE: tl.constexpr, MANUAL: tl.constexpr):
    """BR rows (row r = token r // H, head r % H) of x, each as BP channel pairs (D even): pair p
    is rotated iff k = p - (D - ROPE_DIM) / 2 >= 0, by the token's cos / sin table entry k (f32,
    kernels.dense.capturable.rope's own table) as torch does it, every product and sum rounded on
    its own (the launch passes enable_fp_fusion=False: an FMA would round a*c - b*s once):
        (a, b) -> (a*c - b*s, a*s + b*c)        and with INVERSE (the table's sin negated)
        (a, b) -> (a*c + b*s, b*c - a*s)        (the same IEEE results: x - (-y) is x + y and
                                                 -(a*s) + b*c is b*c - a*s, with no negation,
                                                 which Triton does as 0 - x, -0.0 -> +0.0),
    then rounded to x's dtype; the other pairs are copied in x's dtype. o: contiguous [N, D]."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < N
    t = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    p = tl.arange(0, BP)
    pm = p < D // 2
    k = p - (D - ROPE_DIM) // 2
    rot = k >= 0
    j = tl.arange(0, 2)
    col = 2 * p[None, :, None] + j[None, None, :]  # [1, BP, 2]
    m = rm[:, None, None] & pm[None, :, None] & (j[None, None, :] < 2)
    xv = tl.load(x_ptr + (t * s_xt + h * s_xh)[:, None, None] + col, mask=m, other=0.0)
    cm = rm[:, None] & (pm & rot)[None, :]
    cs_off = (t * s_c)[:, None] + tl.maximum(k, 0)[None, :]
    c = tl.load(cos_ptr + cs_off, mask=cm, other=0.0)
    s = tl.load(sin_ptr + cs_off, mask=cm, other=0.0)
    a, b = tl.split(xv.to(tl.float32))
    if INVERSE:
        a2 = a * c + b * s
        b2 = b * c - a * s
    else:
        a2 = a * c - b * s
        b2 = a * s + b * c
    y = cast_to(tl.join(a2, b2), o_ptr.dtype.element_ty, MANUAL)
    y = tl.where(rot[None, :, None], y, xv)
    tl.store(o_ptr + r.to(tl.int64)[:, None, None] * D + col, y, mask=m)
