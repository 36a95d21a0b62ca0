"""Triton code of the activation quantization (imported by kernels/triton/quant.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_grid(q):
    """q (|q| <= 448) rounded to the nearest E4M3 value, ties to even, in f32 arithmetic: adding
    and subtracting M = 1.5 * 2^23 * step rounds to a multiple of the binade's step (2^(e-3), and
    2^-9 below 2^-6, the subnormals) through the f32 add's own nearest-even rounding, carries into
    the next binade included. The E4M3 cast after it is then exact on any converter (the Triton
    interpreter's rounds ties away and loses carries)."""
    bits = q.to(tl.int32, bitcast=True)
    be = tl.maximum((bits >> 23) & 0xFF, 121)  # biased exponent, the subnormal binade's below 2^-6
    m = (((be + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(q) + m) - m
    # the sign bit put back as a bit: -0.0 for tiny negatives, as the reference (Triton's float
    # negation is 0 - r, which gives +0.0 on the GPU)
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale(amax):
    """Block amax (f32) -> (e, 2^-e): the scale 2^e = 2^ceil(log2(max(amax, 1e-4) / 448)) from the
    f32 bits (exact, as kernels.reference.fused.quantize_act), e clamped to +-127 and its exact
    inverse (the codes are x * 2^-e)."""
    bits = (tl.maximum(amax, 1e-4) / 448.0).to(tl.int32, bitcast=True)  # normal: >= 2.2e-7
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return e, ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact (|e| <= 126 here)


@triton.jit
def quantize_act_fwd(x_ptr, q_ptr, s_ptr, D, NBLK, s_x, s_q, s_s,
                     BLOCK: tl.constexpr, NB: tl.constexpr, E8M0: tl.constexpr):
    """NB blocks of BLOCK channels of one row: amax -> power-of-two scale 2^ceil(log2(amax/448))
    from the f32 bits (exact, as kernels.reference.fused.quantize_act), codes = x * 2^-e clamped to
    +-448 and rounded to E4M3 (nearest-even); scales as e8m0 bytes (E8M0) or f32."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = (col < D) & (blk[:, None] < NBLK)
    x = tl.load(x_ptr + row * s_x + col, mask=m, other=0.0).to(tl.float32)
    e, inv = pow2_scale(tl.max(tl.abs(x), axis=1))
    q = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    q = e4m3_grid(q)
    tl.store(q_ptr + row * s_q + col, q.to(tl.float8e4nv), mask=m)
    bm = blk < NBLK
    if E8M0:
        tl.store(s_ptr + row * s_s + blk, (e + 127).to(tl.uint8), mask=bm)
    else:
        tl.store(s_ptr + row * s_s + blk, ((e + 127) << 23).to(tl.float32, bitcast=True), mask=bm)
