"""Triton code of the activation quantization and fake quantization (imported by kernels/dense/triton_quant.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.attention.triton_jit import cast_to, round_e2m1


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
def ceil_log2_div(amax, DIV: tl.constexpr, LIM: tl.constexpr):
    """e = ceil(log2(max(amax, 1e-4) / DIV)) clamped to +-LIM, from the f32 bits of the quotient
    rounded correctly (div_rn, as torch; Triton's fp32 `/` is div.approx on the GPU, which can
    land one ulp above an exact power of two and double the scale), exactly the reference's
    frexp (kernels.fused.reference.quantize_act; kernels.dense.quant.ceil_log2_div gets the
    same exponent with no division at all)."""
    bits = tl.math.div_rn(tl.maximum(amax, 1e-4), DIV).to(tl.int32, bitcast=True)  # normal
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -LIM), LIM)


@triton.jit
def pow2_scale(amax):
    """Block amax (f32) -> (e, 2^-e): quantize_act's scale 2^e = 2^ceil(log2(max(amax, 1e-4) /
    448)), e clamped to +-127, and its exact inverse (the codes are x * 2^-e)."""
    e = ceil_log2_div(amax, 448.0, 127)
    return e, ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact (|e| <= 126 here)


@triton.jit
def quantize_act_fwd(x_ptr, q_ptr, s_ptr, D, NBLK, s_x, s_q, s_s,
                     BLOCK: tl.constexpr, NB: tl.constexpr, E8M0: tl.constexpr):
    """NB blocks of BLOCK channels of one row: amax -> power-of-two scale 2^ceil(log2(amax/448))
    from the f32 bits (exact, as kernels.fused.reference.quantize_act), codes = x * 2^-e clamped to
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


@triton.jit
def with_sign(r, bits):
    """r (>= 0) with the sign bit of the f32 bits `bits`, set as a bit (Triton's float negation is
    0 - r, which gives +0.0 for r = 0 on the GPU; the reference keeps -0.0)."""
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_grid(y):
    """y rounded to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), nearest with ties to the
    even code, saturating at 6, the sign following y's sign bit (-0.0 for tiny negatives):
    kernels.formats.f32_to_e2m1_codes(ties='even') decoded. The grid is attention_jit's
    round_e2m1 (the compressor's); only the sign is set as a bit here (its `-mag` is 0 - mag,
    +0.0 for a tiny negative, where the reference keeps -0.0)."""
    return with_sign(tl.abs(round_e2m1(y)), y.to(tl.int32, bitcast=True))


@triton.jit
def pow2_ceil_div(amax, DIV: tl.constexpr):
    """(2^e, 2^-e) for 2^e = 2^ceil(log2(max(amax, 1e-4) / DIV)), |e| <= 126 (ceil_log2_div)."""
    e = ceil_log2_div(amax, DIV, 126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fake_quant_fwd(x_ptr, o_ptr, N, s_x, D: tl.constexpr, FMT: tl.constexpr,
                   BLOCK: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, MANUAL: tl.constexpr):
    """kernels.dense.quant.fake_quant of BR rows x NB blocks of BLOCK channels (D % BLOCK == 0)
    in one pass, bitwise: FMT 1 fp8_e4m3 (scale 2^ceil(log2(amax/448)), codes x * 2^-e clamped to
    +-448 on the E4M3 grid), 2 mxfp4 (scale 2^ceil(log2(amax/6)), codes x * 2^-e on the E2M1 grid;
    x * 2^-e is the reference's x / 2^e exactly), both with amax floored at 1e-4; 3 nvfp4 (scale =
    E4M3(min(max(amax, 6 * 2^-9) / 6, 448)), codes E2M1(x / scale), correctly rounded division).
    out = code * scale (exact in f32) in o's dtype; o contiguous [N, D]."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    col = blk[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]  # [1, NB, BLOCK]
    m = (r < N)[:, None, None] & (col < D)
    r64 = r.to(tl.int64)[:, None, None]
    x = tl.load(x_ptr + r64 * s_x + col, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    if FMT == 3:
        s = tl.minimum(tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), 6.0), 448.0)
        scale = e4m3_grid(s)[:, :, None]
        q = e2m1_grid(tl.math.div_rn(x, scale))
    else:
        if FMT == 1:
            scale, inv = pow2_ceil_div(amax, 448.0)
        else:
            scale, inv = pow2_ceil_div(amax, 6.0)
        scale = scale[:, :, None]
        y = x * inv[:, :, None]
        if FMT == 1:
            # clamp |y| to 448 and put y's sign back as a bit (e4m3_grid keeps its input's sign
            # bit: -0.0 for tiny negatives and for -0.0, as the reference's E4M3 cast)
            q = e4m3_grid(with_sign(tl.minimum(tl.abs(y), 448.0), y.to(tl.int32, bitcast=True)))
        else:
            q = e2m1_grid(y)
    tl.store(o_ptr + r64 * D + col, cast_to(q * scale, o_ptr.dtype.element_ty, MANUAL), mask=m)
