"""Triton code of the MoE path (imported only by kernels/moe/triton.py, after triton): router
scores and top-k, the expert permutation, the grouped / dense GEMM on MXFP4 or FP8-block
weights with fused SwiGLU-clamp and fused combine weights, and the combine + mHC residual
expand. Docs of the design and the numerics: kernels/moe/triton.py. One file of ~950 lines:
the jit functions share the tile helpers (upcast, scale folding, promotion), and Triton resolves
a jit function's callees in its own module.

Formats: MXFP4 weights [G, N, K/2] int8 (two E2M1 codes per byte, low nibble = even column) with
E8M0 scales [G, N, K/32]; FP8-block weights [G, N, K] e4m3 with E8M0 scales
[G, ceil(N/bn), ceil(K/bk)]; activations e4m3 with one f32 power-of-two scale per 128 columns
(fp8_1x128), or fp16 / bf16 / f32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.dense.triton_quant_jit import e4m3_grid, pow2_scale

# MMA modes (constexpr MMA)
MMA_FP8 = 0  # e4m3 x e4m3 tensor cores, fp32 partial per K-chunk promoted with the two scales
MMA_FP16 = 1  # fp16 x fp16, same promotion (B upcast from e4m3 / fp8 block values)
MMA_BF16 = 2  # bf16 x bf16 on fully dequantized operands, no promotion (exact products)
MMA_F32 = 3  # fp32 "ieee" on fully dequantized operands (fp32 activations, the interpreter)
WFMT_MXFP4 = 0
WFMT_FP8 = 1

# E2M1 -> E4M3 in SIMD-within-a-register PTX (4 packed bytes = 8 codes per call). Every byte
# lane carries its OWN exponent offset: $3 holds rel + 6 (in [0, 12], see fp4_rel6) for each of
# the 4 elements of the pack. (A first version, which read one offset
# from byte 0 for all four, wrong on the H200 whenever Triton laid a pack across two rows -
# the dot-operand register layouts of the swapped decode tiles do; the element-wise contract
# of inline_asm_elementwise promises nothing about which elements share a pack.)
#   codes at 2^0: prmt of the magnitudes (c & 7) into the two lookup words of E4M3(e2m1(m)),
#   with m = 0 looking up 0x30 (as m = 1) so that no lane can go below zero;
#   + 8 * rel in every lane as ONE 32-bit add of (rel6 << 3) - 0x30303030: each lane's true sum
#   lies in [0x30 - 48, 0x4C + 48] = [0, 0x7C], so the packed total has no carries or borrows
#   between lanes and the 32-bit arithmetic gives every lane exactly;
#   lanes whose magnitude is zero or whose rel is -6 (rel6 = 0: below E4M3's normal range, see
#   fp4_rel6) are masked to zero (prmt with selector nibbles 0x8-0xB replicates each byte's bit 7:
#   bit 7 of x + 0x7F is set iff the lane x is non-zero); sign bits into bit 7.
# the steps for one nibble of each lane (t = its magnitudes; sign bits already in s), written
# to `dst`: once for the low nibbles ($0), once for the high ones ($1)
_FP4_NIBBLE = """prmt.b32 r1, la, lb, u;
shr.u32 u, u, 16;
prmt.b32 r2, la, lb, u;
prmt.b32 r1, r1, r2, 0x5410;
add.u32 r1, r1, o;
add.u32 m, t, 0x7F7F7F7F;
and.b32 m, m, f;
prmt.b32 m, m, m, 0xBA98;
and.b32 r1, r1, m;
"""
FP4_E4M3_ASM = tl.constexpr("""
{
.reg .b32 t, u, r1, r2, o, f, m, s, la, lb;
mov.b32 la, 0x3C383030;
mov.b32 lb, 0x4C484440;
shl.b32 o, $3, 3;
sub.u32 o, o, 0x30303030;
add.u32 f, $3, 0x7F7F7F7F;
and.b32 t, $2, 0x07070707;
shr.u32 u, t, 4;
or.b32 u, u, t;
""" + _FP4_NIBBLE + """shl.b32 s, $2, 4;
and.b32 s, s, 0x80808080;
or.b32 $0, r1, s;
shr.u32 t, $2, 4;
and.b32 t, t, 0x07070707;
shr.u32 u, t, 4;
or.b32 u, u, t;
""" + _FP4_NIBBLE + """and.b32 s, $2, 0x80808080;
or.b32 $1, r1, s;
}
""")


# ---------------------------------------------------------------------------------------------
# number formats
# ---------------------------------------------------------------------------------------------


@triton.jit
def exp2_biased(e):
    """2^(e-127) in fp32 for an int32 biased exponent e in [0, 254] (0 -> 2^-127, subnormal)."""
    bits = tl.where(e <= 0, 0x00400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """fp32 rounded to the nearest bf16 value (ties to even), as fp32 (the interpreter's bf16
    cast truncates)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def cast_out(x, dtype: tl.constexpr, MANUAL: tl.constexpr):
    if MANUAL and dtype == tl.bfloat16:
        x = round_bf16(x)
    return x.to(dtype)


@triton.jit
def round_like(x, RDT: tl.constexpr):
    """fp32 x rounded to dtype code RDT (0 fp32, 1 bf16, 2 fp16), returned as fp32."""
    if RDT == 1:
        return round_bf16(x)
    elif RDT == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def round_e4m3(v):
    """|v| <= 448 rounded to the E4M3 grid (nearest, ties to even) in fp32 arithmetic."""
    a = tl.abs(v)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 127 - 6) - 3  # ulp exponent: 3 mantissa bits, subnormal step 2^-9
    ulp = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv + 12582912.0) - 12582912.0) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def e2m1_e4m3_bits(c, rel):
    """E4M3 byte (int32) of E2M1 code c (int32, low 4 bits) times 2^rel; rel in [-5, 6] is exact,
    rel < -5 gives (signed) zero."""
    m = c & 7
    base = tl.where(m >= 2, m * 4 + 0x30, m * 0x30) + rel * 8
    base = tl.where((m == 0) | (rel < -5), 0, base)
    return base | ((c & 8) << 4)


@triton.jit
def e2m1_f32(c):
    """fp32 value of E2M1 code c (int32, low 4 bits)."""
    m = c & 7
    bits = tl.where(m == 1, 126 << 23, (((m >> 1) + 126) << 23) | ((m & 1) << 22))
    bits = tl.where(m == 0, 0, bits) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp4_rel6(e, S):
    """Exponent offsets of the E8M0 group exponents e [BN, NSUB] against the row's promotion
    exponent S [BN], as the upcasts take them: rel + 6 in [0, 12] (rel = e - S <= 6 by the choice
    of S; rel below -6 is clamped to -6, which the upcasts turn into zero as any rel < -5 -
    without the clamp, offsets below -128 would wrap in the PTX path's bytes)."""
    return tl.maximum(e - S[:, None], -6) + 6


@triton.jit
def fp4_tile_e4m3(p, rel6_p, BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed codes p uint8 [BN, BK//2] with exponent offsets rel6_p int32 [BN, BK//2] (rel + 6,
    fp4_rel6) -> float8e4nv [BN, BK] in column order."""
    lo, hi = fp4_halves_e4m3(p, rel6_p, USE_ASM)
    b = tl.reshape(tl.join(lo.to(tl.uint8, bitcast=True), hi.to(tl.uint8, bitcast=True)),
                   (BN, BK))
    return b.to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp4_halves_e4m3(p, rel6_p, USE_ASM: tl.constexpr):
    """Packed codes p uint8 [BN, BK//2] with exponent offsets rel6_p (rel + 6 in [0, 12],
    fp4_rel6) -> (even columns, odd columns) as float8e4nv [BN, BK//2] each: no interleave (the
    GEMM splits A the same way)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(FP4_E4M3_ASM, "=r,=r,r,r", [p, rel6_p.to(tl.uint8)],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        pi = p.to(tl.int32)
        rel_p = rel6_p - 6
        lo = e2m1_e4m3_bits(pi & 0xF, rel_p).to(tl.uint8)
        hi = e2m1_e4m3_bits(pi >> 4, rel_p).to(tl.uint8)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def load_b_fp4_halves(b_ptr, e, rn, nmask, k0, stride_bn, MMA: tl.constexpr,
                      NSUB: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
    """MXFP4 rows rn, columns k0 .. k0+BK-1 as (even columns, odd columns) [BN, BK//2] in the MMA
    dtype (fp8 / fp16) and the per-row promotion scale (see load_b_tile)."""
    rk2 = tl.arange(0, BK // 2)
    p = tl.load(b_ptr + rn[:, None] * stride_bn + (k0 // 2 + rk2)[None, :],
                mask=nmask[:, None], other=0).to(tl.uint8, bitcast=True)
    smax = tl.max(e, axis=1)
    S = tl.maximum(smax - 6, 1)
    rel6 = fp4_rel6(e, S)
    rel6_p = tl.reshape(tl.broadcast_to(rel6[:, :, None], (BN, NSUB, BK // NSUB // 2)),
                        (BN, BK // 2))
    lo, hi = fp4_halves_e4m3(p, rel6_p, USE_ASM)
    if MMA == 1:
        lo = lo.to(tl.float16)
        hi = hi.to(tl.float16)
    return lo, hi, exp2_biased(S)


@triton.jit
def promote(acc, part, sa, sb, A_SCALED: tl.constexpr, SWAP: tl.constexpr):
    """acc += one K chunk's fp32 partial product times its scales: sa per activation row (A's
    per-128 scale, only when A_SCALED) x sb per weight row (the promotion exponent of the
    upcast tile). acc / part are [BM, BN], or [BN, BM] with SWAP (weight rows first)."""
    if SWAP:
        if A_SCALED:
            acc += part * (sb[:, None] * sa[None, :])
        else:
            acc += part * sb[:, None]
    else:
        if A_SCALED:
            acc += part * (sa[:, None] * sb[None, :])
        else:
            acc += part * sb[None, :]
    return acc


@triton.jit
def mma_step_halves(acc, a_e, a_o, sa, b_lo, b_hi, sb, A_SCALED: tl.constexpr,
                    MMA: tl.constexpr, SWAP: tl.constexpr = False):
    """acc += (A_even @ B_lo^T + A_odd @ B_hi^T) * scales (the K-parity split of mma_step).
    SWAP: transposed, acc [BN, BM] += (B_lo @ A_even^T + B_hi @ A_odd^T) * scales (mma_step's
    SWAP: the same fp32 scale products sb x sa)."""
    if MMA == 1:
        a_e = a_e.to(tl.float16)
        a_o = a_o.to(tl.float16)
    if SWAP:
        part = tl.dot(b_lo, tl.trans(a_e))
        part = tl.dot(b_hi, tl.trans(a_o), part)
        acc = promote(acc, part, sa, sb, A_SCALED, True)
    else:
        part = tl.dot(a_e, tl.trans(b_lo))
        part = tl.dot(a_o, tl.trans(b_hi), part)
        acc = promote(acc, part, sa, sb, A_SCALED, False)
    return acc


# ---------------------------------------------------------------------------------------------
# one B tile: load + dequantize for the chosen MMA mode
# ---------------------------------------------------------------------------------------------


@triton.jit
def load_b_scales(bs_ptr, rn, nmask, k0, K, stride_bsn, BLK_N_S: tl.constexpr,
                  BLK_K_S: tl.constexpr, NSUB: tl.constexpr, BK: tl.constexpr):
    """Biased E8M0 exponents (int32 [BN, NSUB]) of B rows rn for columns k0 .. k0+BK-1 (127 past
    K: the loop prefetches one chunk ahead)."""
    rs = tl.arange(0, NSUB)
    srow = rn // BLK_N_S
    scol = (k0 + rs * (BK // NSUB)) // BLK_K_S
    return tl.load(bs_ptr + srow[:, None] * stride_bsn + scol[None, :],
                   mask=nmask[:, None] & ((k0 + rs * 0) < K)[None, :], other=127).to(tl.int32)


@triton.jit
def load_b_tile(b_ptr, e, rn, nmask, k0, stride_bn,
                WFMT: tl.constexpr, MMA: tl.constexpr, NSUB: tl.constexpr, USE_ASM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    """B rows rn [BN] (of one group, pointers already offset), columns k0 .. k0+BK-1, with their
    scale exponents e [BN, NSUB] (load_b_scales) -> (tile [BN, BK] in the MMA dtype, per-row
    promotion scale f32 [BN] (ones for the exact modes)). NSUB = scale groups along K in the chunk
    (BK // min(BK, BLK_K_S))."""
    if WFMT == 0:  # MXFP4
        rk2 = tl.arange(0, BK // 2)
        p = tl.load(b_ptr + rn[:, None] * stride_bn + (k0 // 2 + rk2)[None, :],
                    mask=nmask[:, None], other=0).to(tl.uint8, bitcast=True)
        if MMA == 0 or MMA == 1:
            smax = tl.max(e, axis=1)
            S = tl.maximum(smax - 6, 1)
            rel6 = fp4_rel6(e, S)
            rel6_p = tl.reshape(tl.broadcast_to(rel6[:, :, None], (BN, NSUB, BK // NSUB // 2)),
                                (BN, BK // 2))
            b = fp4_tile_e4m3(p, rel6_p, BN, BK, USE_ASM)
            if MMA == 1:
                b = b.to(tl.float16)
            sb = exp2_biased(S)
        else:
            pi = p.to(tl.int32)
            v = tl.reshape(tl.join(e2m1_f32(pi & 0xF), e2m1_f32(pi >> 4)), (BN, BK))
            sc = tl.reshape(tl.broadcast_to(exp2_biased(e)[:, :, None], (BN, NSUB, BK // NSUB)),
                            (BN, BK))
            b = v * sc
            if MMA == 2:
                b = b.to(tl.bfloat16)
            sb = tl.full((BN,), 1.0, tl.float32)
    else:  # FP8 block
        rk = tl.arange(0, BK)
        q = tl.load(b_ptr + rn[:, None] * stride_bn + (k0 + rk)[None, :], mask=nmask[:, None],
                    other=0.0)
        if MMA == 0:  # needs NSUB == 1 (one scale per row in the chunk)
            b = q
            sb = exp2_biased(tl.max(e, axis=1))
        elif MMA == 1:
            b = q.to(tl.float16)
            if NSUB > 1:
                smax = tl.max(e, axis=1)
                f = exp2_biased(e - smax[:, None] + 127)
                f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, NSUB, BK // NSUB)), (BN, BK))
                b = b * f.to(tl.float16)
                sb = exp2_biased(smax)
            else:
                sb = exp2_biased(tl.max(e, axis=1))
        else:
            sc = tl.reshape(tl.broadcast_to(exp2_biased(e)[:, :, None], (BN, NSUB, BK // NSUB)),
                            (BN, BK))
            b = q.to(tl.float32) * sc
            if MMA == 2:
                b = b.to(tl.bfloat16)
            sb = tl.full((BN,), 1.0, tl.float32)
    return b, sb


@triton.jit
def mma_step(acc, a, sa, b, sb, A_SCALED: tl.constexpr, MMA: tl.constexpr,
             SWAP: tl.constexpr = False):
    """acc [BM, BN] += A [BM, BK] @ B [BN, BK]^T (fp8 / fp16 MMA: the chunk's fp32 partial product
    promoted with the scales; bf16 / fp32: dequantized operands, accumulated in the MMA).
    SWAP (fp8 / fp16 MMA only; the moe_acc_swap loop): transposed, acc [BN, BM] += (B @ A^T) *
    scales, so the weight rows are the MMA's M and the few activation rows its N; the same fp32
    scale products (sb x sa)."""
    if SWAP:
        if MMA == 1:
            a = a.to(tl.float16)
        part = tl.dot(b, tl.trans(a))
        acc = promote(acc, part, sa, sb, A_SCALED, True)
    elif MMA == 0 or MMA == 1:
        if MMA == 1:
            a = a.to(tl.float16)
        part = tl.dot(a, tl.trans(b))
        acc = promote(acc, part, sa, sb, A_SCALED, False)
    else:
        af = a.to(tl.float32)
        if A_SCALED:
            af = af * sa[:, None]
        if MMA == 2:
            acc = tl.dot(af.to(tl.bfloat16), tl.trans(b), acc)
        else:
            acc = tl.dot(af, tl.trans(b), acc, input_precision="ieee")
    return acc


@triton.jit
def quantize_out(x, BM: tl.constexpr, BN: tl.constexpr):
    """fp32 tile x [BM, BN] (BN a multiple of 128) -> (E4M3 codes [BM, BN], f32 scales
    [BM, BN // 128]) per row and 128 columns, with the numerics of quantize_act fp8_1x128
    (kernels.fused.reference.quantize_act, quant_jit.quantize_act_fwd; DeepSeek's activation
    quantization before the expert down-projection): scale = 2^ceil(log2(max(amax, 1e-4) / 448))
    from the f32 bits (exact), codes = x / scale clamped to +-448, rounded to E4M3 nearest-even
    (e4m3_grid: exact on every converter, the interpreter's included)."""
    xb = tl.reshape(x, (BM, BN // 128, 128))
    e, inv = pow2_scale(tl.max(tl.abs(xb), axis=2))
    q = tl.minimum(tl.maximum(xb * inv[:, :, None], -448.0), 448.0)
    q = tl.reshape(e4m3_grid(q), (BM, BN))
    return q.to(tl.float8e4nv), ((e + 127) << 23).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------
# the GEMM
# ---------------------------------------------------------------------------------------------


@triton.jit
def chunk_scales(as_ptrs, rm, rmask, bs1, bs2, rn, nmask, k0, K, stride_bsn,
                 SWIGLU: tl.constexpr, A_SCALED: tl.constexpr, BLK_N_S: tl.constexpr,
                 BLK_K_S: tl.constexpr, NSUB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The small per-chunk scales of K chunk k0 (the K loops load them one chunk ahead): A's
    per-128 scales sa [BM] (ones when not A_SCALED; 1.0 past K) and the biased exponents of B1 /
    B2 (load_b_scales; e2 = e1 without SWIGLU)."""
    sa = tl.full((BM,), 1.0, tl.float32)
    if A_SCALED:
        sa = tl.load(as_ptrs + k0 // 128, mask=rmask & ((k0 + rm * 0) < K), other=1.0)
    e1 = load_b_scales(bs1, rn, nmask, k0, K, stride_bsn, BLK_N_S, BLK_K_S, NSUB, BK)
    e2 = e1
    if SWIGLU:
        e2 = load_b_scales(bs2, rn, nmask, k0, K, stride_bsn, BLK_N_S, BLK_K_S, NSUB, BK)
    return sa, e1, e2


@triton.jit
def moe_acc(a_ptrs, as_ptrs, rm, rmask, b1, bs1, b2, bs2, rn, nmask, K, stride_bn, stride_bsn,
            SWIGLU: tl.constexpr, A_SCALED: tl.constexpr, WFMT: tl.constexpr, MMA: tl.constexpr,
            BLK_N_S: tl.constexpr, BLK_K_S: tl.constexpr, NSUB: tl.constexpr,
            USE_ASM: tl.constexpr, PAR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):
    """The K loop of one [BM, BN] tile (B rows rn): fp32 accumulators (acc1 of B1, acc2 of B2
    when SWIGLU, else acc1 twice)."""
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    # the small scale loads are prefetched one chunk ahead by hand (the software pipeliner only
    # stages the big tiles): their latency hides behind the current chunk's work
    sa_next, e1_next, e2_next = chunk_scales(as_ptrs, rm, rmask, bs1, bs2, rn, nmask, 0, K,
                                             stride_bsn, SWIGLU, A_SCALED, BLK_N_S, BLK_K_S,
                                             NSUB, BM, BK)
    for k0 in range(0, K, BK):
        sa = sa_next
        e1 = e1_next
        e2 = e2_next
        sa_next, e1_next, e2_next = chunk_scales(as_ptrs, rm, rmask, bs1, bs2, rn, nmask,
                                                 k0 + BK, K, stride_bsn, SWIGLU, A_SCALED,
                                                 BLK_N_S, BLK_K_S, NSUB, BM, BK)
        a = tl.load(a_ptrs + k0, mask=rmask[:, None], other=0.0)
        if PAR:  # MXFP4, fp8 / fp16 MMA: K split by parity, no interleave of the upcast tile
            a_e, a_o = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            b_lo, b_hi, sb = load_b_fp4_halves(b1, e1, rn, nmask, k0, stride_bn, MMA, NSUB,
                                               USE_ASM, BN, BK)
            acc1 = mma_step_halves(acc1, a_e, a_o, sa, b_lo, b_hi, sb, A_SCALED, MMA)
            if SWIGLU:
                b_lo, b_hi, sb = load_b_fp4_halves(b2, e2, rn, nmask, k0, stride_bn, MMA, NSUB,
                                                   USE_ASM, BN, BK)
                acc2 = mma_step_halves(acc2, a_e, a_o, sa, b_lo, b_hi, sb, A_SCALED, MMA)
        else:
            b, sb = load_b_tile(b1, e1, rn, nmask, k0, stride_bn, WFMT, MMA, NSUB, USE_ASM, BN,
                                BK)
            acc1 = mma_step(acc1, a, sa, b, sb, A_SCALED, MMA)
            if SWIGLU:
                b, sb = load_b_tile(b2, e2, rn, nmask, k0, stride_bn, WFMT, MMA, NSUB, USE_ASM,
                                    BN, BK)
                acc2 = mma_step(acc2, a, sa, b, sb, A_SCALED, MMA)
    return acc1, acc2


@triton.jit
def moe_acc_swap(a_ptrs, as_ptrs, rm, rmask, b1, bs1, b2, bs2, rn, nmask, K, stride_bn,
                 stride_bsn, SWIGLU: tl.constexpr, A_SCALED: tl.constexpr, MMA: tl.constexpr,
                 NSUB: tl.constexpr, USE_ASM: tl.constexpr, PAR: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    """The K loop of one [BM, BN] tile on MXFP4 weights with the operands swapped (Tile.swap,
    the default decode tiles; docs/kernels/moe.md): each chunk
    is C^T [BN, BM] += W [BN, BK] @ A [BM, BK]^T, so the BN weight rows are the MMA's M (64 per
    warpgroup instruction) and the BM (16) activation rows its N. At BM = 16 the default loop is
    on mma.sync (Triton's wgmma needs M >= 64), which upcasts the E4M3 weight tile to fp16 in
    registers and converts it to the mma.sync operand layout through shared memory (64 KB STS +
    64 KB LDS per L1 chunk); swapped, the tile stays E4M3 (fp8 MMA) and goes to wgmma.
    PAR: the K-parity split (load_b_fp4_halves; A split by column parity in registers).
    A_SCALED (fp8 A with per-128 scales: x_q in L1, the FP8-H path's E4M3 H in L2, which then
    runs QGMMA on E4M3 H x E4M3 W2): sa per activation row, i.e. per column of the transposed
    accumulator (mma_step / mma_step_halves with SWAP). Returns (acc1, acc2) as moe_acc
    ([BM, BN] each: the accumulators transposed once, after the loop).
    Numerics: moe_acc's per-chunk promotion (the same fp32 sb x sa products); the tensor core's
    sum order within a chunk differs, so results are not bit-equal to the default's."""
    acc1 = tl.zeros((BN, BM), dtype=tl.float32)
    acc2 = tl.zeros((BN, BM), dtype=tl.float32)
    sa_next, e1_next, e2_next = chunk_scales(as_ptrs, rm, rmask, bs1, bs2, rn, nmask, 0, K,
                                             stride_bsn, SWIGLU, A_SCALED, 1, 32, NSUB, BM, BK)
    for k0 in range(0, K, BK):
        sa = sa_next
        e1 = e1_next
        e2 = e2_next
        sa_next, e1_next, e2_next = chunk_scales(as_ptrs, rm, rmask, bs1, bs2, rn, nmask,
                                                 k0 + BK, K, stride_bsn, SWIGLU, A_SCALED, 1, 32,
                                                 NSUB, BM, BK)
        a = tl.load(a_ptrs + k0, mask=rmask[:, None], other=0.0)
        if PAR:
            a_e, a_o = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            b_lo, b_hi, sb = load_b_fp4_halves(b1, e1, rn, nmask, k0, stride_bn, MMA, NSUB,
                                               USE_ASM, BN, BK)
            acc1 = mma_step_halves(acc1, a_e, a_o, sa, b_lo, b_hi, sb, A_SCALED, MMA, True)
            if SWIGLU:
                b_lo, b_hi, sb = load_b_fp4_halves(b2, e2, rn, nmask, k0, stride_bn, MMA, NSUB,
                                                   USE_ASM, BN, BK)
                acc2 = mma_step_halves(acc2, a_e, a_o, sa, b_lo, b_hi, sb, A_SCALED, MMA, True)
        else:
            b, sb = load_b_tile(b1, e1, rn, nmask, k0, stride_bn, 0, MMA, NSUB, USE_ASM, BN, BK)
            acc1 = mma_step(acc1, a, sa, b, sb, A_SCALED, MMA, True)
            if SWIGLU:
                b, sb = load_b_tile(b2, e2, rn, nmask, k0, stride_bn, 0, MMA, NSUB, USE_ASM, BN,
                                    BK)
                acc2 = mma_step(acc2, a, sa, b, sb, A_SCALED, MMA, True)
    return tl.trans(acc1), tl.trans(acc2)


@triton.jit
def swiglu_act(acc1, acc2, limit, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """The epilogue's activation: silu(min(g, lim)) * clamp(u, -lim, lim) of (acc1, acc2) with
    SWIGLU, else acc1."""
    if SWIGLU:
        gt = acc1
        up = acc2
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gt = tl.minimum(gt, limit)
        out = gt * tl.sigmoid(gt) * up
    else:
        out = acc1
    return out


@triton.jit
def swiglu_rows(y_ptr, h_ptr, F, limit, stride_y, stride_h, HAS_LIMIT: tl.constexpr,
                BF: tl.constexpr):
    """h[r, :F] = swiglu_act(y[r, :F], y[r, F:2F]) for the shared expert's L1 run as one GEMM on
    [W1; W3] (kernels/gemm/cublas_fp8.py): one program per (row, BF columns), fp32 math, h's dtype."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BF + tl.arange(0, BF)
    m = c < F
    g = tl.load(y_ptr + r * stride_y + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + r * stride_y + F + c, mask=m, other=0.0).to(tl.float32)
    out = swiglu_act(g, u, limit, True, HAS_LIMIT)
    tl.store(h_ptr + r * stride_h + c, out.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_rows_q(y_ptr, h_ptr, hs_ptr, T, F, limit, stride_y, stride_h, stride_hsr, stride_hsc,
                  HAS_LIMIT: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr):
    """swiglu_rows with FP8 H (the shared expert's W2 on cuBLAS's FP8 GEMM at prefill sizes):
    h[r, c] E4M3 codes and hs[r, c // 128] f32 scales of swiglu_act(y[r, c], y[r, F + c]) per
    row and 128 columns (quantize_out: quantize_act fp8_1x128's numerics, as the routed experts'
    L1 epilogue); BR rows x BF columns (F % BF == 0, BF % 128 == 0) per program; hs's strides
    are free (cuBLAS reads the scales outer-dim-major)."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BF + tl.arange(0, BF)
    rm = rr < T
    r64 = rr.to(tl.int64)[:, None]
    g = tl.load(y_ptr + r64 * stride_y + c[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    u = tl.load(y_ptr + r64 * stride_y + F + c[None, :], mask=rm[:, None],
                other=0.0).to(tl.float32)
    q, sc = quantize_out(swiglu_act(g, u, limit, True, HAS_LIMIT), BR, BF)
    tl.store(h_ptr + r64 * stride_h + c[None, :], q, mask=rm[:, None])
    cb = tl.program_id(1) * (BF // 128) + tl.arange(0, BF // 128)
    tl.store(hs_ptr + r64 * stride_hsr + cb[None, :].to(tl.int64) * stride_hsc, sc,
             mask=rm[:, None])


@triton.jit
def quantize_pair(x0, x1):
    """quantize_out of the [BM, 128] block whose columns are x0 [BM, 64] then x1 [BM, 64] (the
    QSPLIT = 2 tile): the same amax (max is exact in any order), scale and codes, with each half
    kept in the accumulator's own layout (the row amax is an in-warp reduction)."""
    amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
    e, inv = pow2_scale(amax)
    q0 = e4m3_grid(tl.minimum(tl.maximum(x0 * inv[:, None], -448.0), 448.0))
    q1 = e4m3_grid(tl.minimum(tl.maximum(x1 * inv[:, None], -448.0), 448.0))
    return q0.to(tl.float8e4nv), q1.to(tl.float8e4nv), ((e + 127) << 23).to(tl.float32,
                                                                              bitcast=True)


@triton.jit
def moe_tile(a_ptr, as_ptr, aidx_ptr, b1_ptr, bs1_ptr, b2_ptr, bs2_ptr, c_ptr, cidx_ptr, w_ptr,
             hs_ptr, g, row0, nrows, pid_n, N, K, limit,
             stride_am, stride_as, stride_ag, stride_asg,
             stride_bg, stride_bn, stride_bsg, stride_bsn, stride_cm, stride_cg, stride_hs,
             TOPK: tl.constexpr, KS: tl.constexpr,
             GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, WEIGHTED: tl.constexpr,
             SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, A_SCALED: tl.constexpr,
             WFMT: tl.constexpr, MMA: tl.constexpr, BLK_N_S: tl.constexpr, BLK_K_S: tl.constexpr,
             NSUB: tl.constexpr, USE_ASM: tl.constexpr, MANUAL: tl.constexpr, PAR: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QUANT_OUT: tl.constexpr,
             QSPLIT: tl.constexpr = 1, SWAP: tl.constexpr = 0):
    """One output tile: rows row0 .. row0 + min(nrows, BM) - 1 of group g, columns pid_n * BN ..
    (+BN) - the whole K loop and the epilogue (moe_gemm's flags). QUANT_OUT (the FP8-H path, off by default): the epilogue writes C as E4M3 codes
    (c_ptr fp8) with one power-of-two f32 scale per row and 128 columns at hs_ptr + row *
    stride_hs + column // 128 (quantize_out); BN a multiple of 128, no group stride.
    QSPLIT = 2 (QUANT_OUT, BN = 128, no SCATTER_C): the 128 columns are computed as two
    [BM, 64] halves one after the other (two K loops over the same A rows, the first half's fp32
    result kept until the second's is done), so the K loop is the 64-column tile's (the default
    prefill L1's register budget: no spills, two programs per SM) and the block amax spans both
    halves (quantize_pair); every element is computed by the same operations as at QSPLIT = 1."""
    g64 = g.to(tl.int64)
    rm = tl.arange(0, BM)
    rmask = rm < nrows
    rows = row0 + rm
    if GATHER_A:
        src = tl.load(aidx_ptr + rows, mask=rmask, other=0)
        a_rows = (src // TOPK).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN // QSPLIT)  # QSPLIT = 2: the first half's columns
    nmask = rn < N
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + g64 * stride_ag + a_rows[:, None] * stride_am + rk[None, :]
    as_ptrs = as_ptr + g64 * stride_asg + a_rows * stride_as
    b1 = b1_ptr + g64 * stride_bg
    bs1 = bs1_ptr + g64 * stride_bsg
    b2 = b2_ptr + g64 * stride_bg
    bs2 = bs2_ptr + g64 * stride_bsg
    if QSPLIT == 2:
        BNH: tl.constexpr = BN // 2
        rn0 = rn
        rn1 = rn0 + BNH
        acc1, acc2 = moe_acc(a_ptrs, as_ptrs, rm, rmask, b1, bs1, b2, bs2, rn0, nmask, K,
                             stride_bn, stride_bsn, SWIGLU, A_SCALED, WFMT, MMA, BLK_N_S,
                             BLK_K_S, NSUB, USE_ASM, PAR, BM, BNH, BK)
        out0 = swiglu_act(acc1, acc2, limit, SWIGLU, HAS_LIMIT)
        acc1, acc2 = moe_acc(a_ptrs, as_ptrs, rm, rmask, b1, bs1, b2, bs2, rn1, rn1 < N, K,
                             stride_bn, stride_bsn, SWIGLU, A_SCALED, WFMT, MMA, BLK_N_S,
                             BLK_K_S, NSUB, USE_ASM, PAR, BM, BNH, BK)
        out1 = swiglu_act(acc1, acc2, limit, SWIGLU, HAS_LIMIT)
        crow = rows.to(tl.int64)
        q0, q1, sc = quantize_pair(out0, out1)
        c_ptrs = c_ptr + g64 * stride_cg + crow[:, None] * stride_cm + rn0[None, :]
        tl.store(c_ptrs, q0, mask=rmask[:, None] & nmask[None, :])
        tl.store(c_ptrs + BNH, q1, mask=rmask[:, None] & (rn1 < N)[None, :])
        tl.store(hs_ptr + crow * stride_hs + pid_n, sc,
                 mask=rmask & ((pid_n * BN + rm * 0) < N))
    else:
        if SWAP > 0:  # MXFP4, fp8 / fp16 MMA: weight rows as the MMA's M (moe_acc_swap)
            acc1, acc2 = moe_acc_swap(a_ptrs, as_ptrs, rm, rmask, b1, bs1, b2, bs2, rn, nmask, K,
                                      stride_bn, stride_bsn, SWIGLU, A_SCALED, MMA, NSUB,
                                      USE_ASM, PAR, BM, BN, BK)
        else:
            acc1, acc2 = moe_acc(a_ptrs, as_ptrs, rm, rmask, b1, bs1, b2, bs2, rn, nmask, K,
                                 stride_bn, stride_bsn, SWIGLU, A_SCALED, WFMT, MMA, BLK_N_S,
                                 BLK_K_S, NSUB, USE_ASM, PAR, BM, BN, BK)
        out = swiglu_act(acc1, acc2, limit, SWIGLU, HAS_LIMIT)
        if SCATTER_C:
            pair = tl.load(cidx_ptr + rows, mask=rmask, other=0)
            crow = ((pair // TOPK) * KS + pair % TOPK).to(tl.int64)
            if WEIGHTED:
                out = out * tl.load(w_ptr + pair, mask=rmask, other=0.0)[:, None]
        else:
            crow = rows.to(tl.int64)
        c_ptrs = c_ptr + g64 * stride_cg + crow[:, None] * stride_cm + rn[None, :]
        if QUANT_OUT:
            q, sc = quantize_out(out, BM, BN)
            tl.store(c_ptrs, q, mask=rmask[:, None] & nmask[None, :])
            rb = pid_n * (BN // 128) + tl.arange(0, BN // 128)
            tl.store(hs_ptr + crow[:, None] * stride_hs + rb[None, :], sc,
                     mask=rmask[:, None] & (rb * 128 < N)[None, :])
        else:
            tl.store(c_ptrs, cast_out(out, c_ptr.dtype.element_ty, MANUAL),
                     mask=rmask[:, None] & nmask[None, :])


@triton.jit
def moe_gemm(a_ptr, as_ptr, aidx_ptr, b1_ptr, bs1_ptr, b2_ptr, bs2_ptr, c_ptr, cidx_ptr, w_ptr,
             cnt_ptr, M, N, K, G, limit,
             stride_am, stride_as, stride_ag, stride_asg,
             stride_bg, stride_bn, stride_bsg, stride_bsn, stride_cm, stride_cg,
             hs_ptr, stride_hs,
             TOPK: tl.constexpr, KS: tl.constexpr, GROUPED: tl.constexpr,
             GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, WEIGHTED: tl.constexpr,
             SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, A_SCALED: tl.constexpr,
             WFMT: tl.constexpr, MMA: tl.constexpr, BLK_N_S: tl.constexpr, BLK_K_S: tl.constexpr,
             NSUB: tl.constexpr, USE_ASM: tl.constexpr, MANUAL: tl.constexpr, PAR: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G_PAD: tl.constexpr,
             QUANT_OUT: tl.constexpr = False, QSPLIT: tl.constexpr = 1,
             SWAP: tl.constexpr = 0):
    """C = A @ B^T (fp32 accumulate), per group.

    GROUPED: program_id(0) = m_tile * num_n + n_tile over a static worst-case tile count; the
    rows of group g are the cnt[g] consecutive rows after sum(cnt[:g]) (expert-sorted order);
    tiles never span two groups; programs past the last tile return at once. Else (dense /
    batched): program_id(0) = m_tile * num_n + n_tile over M rows, program_id(1) = group
    (block-diagonal projections: pointer offsets stride_*g).
    GATHER_A: A row = aidx[row] // TOPK (the token of a sorted (token, slot) pair).
    SWIGLU: B1 = W1, B2 = W3 of the same rows; C = silu(min(g, lim)) * clamp(u, -lim, lim).
    SCATTER_C: C row of sorted row r = pair p = cidx[r] -> (p // TOPK) * KS + p % TOPK,
    times w[p] if WEIGHTED.
    QUANT_OUT (grouped / dense, not batched): C as E4M3 codes + per-(row, 128 columns) f32 scales
    at hs_ptr (row stride stride_hs): the FP8-H path's L1 (moe_tile). hs_ptr / stride_hs are
    the last runtime arguments, so the default kernels' other parameters keep their offsets.
    QSPLIT = 2 (with QUANT_OUT, BN = 128): each 128-column tile as two 64-column K loops
    (moe_tile), with the 64-column tile's registers.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if GROUPED:
        ge = tl.arange(0, G_PAD)
        cnt = tl.load(cnt_ptr + ge, mask=ge < G, other=0)
        tiles = (cnt + (BM - 1)) // BM
        tend = tl.cumsum(tiles, 0)
        total = tl.sum(tiles, 0)
        if pid_m >= total:
            return
        g = tl.sum((tend <= pid_m).to(tl.int32), 0)
        before = ge < g
        local0 = (pid_m - tl.sum(tl.where(before, tiles, 0), 0)) * BM
        row0 = tl.sum(tl.where(before, cnt, 0), 0) + local0
        nrows = tl.sum(tl.where(ge == g, cnt, 0), 0) - local0
    else:
        g = tl.program_id(1)
        row0 = pid_m * BM
        nrows = M - row0
    moe_tile(a_ptr, as_ptr, aidx_ptr, b1_ptr, bs1_ptr, b2_ptr, bs2_ptr, c_ptr, cidx_ptr, w_ptr,
             hs_ptr, g, row0, nrows, pid_n, N, K, limit,
             stride_am, stride_as, stride_ag, stride_asg,
             stride_bg, stride_bn, stride_bsg, stride_bsn, stride_cm, stride_cg, stride_hs,
             TOPK, KS, GATHER_A, SCATTER_C, WEIGHTED, SWIGLU, HAS_LIMIT, A_SCALED, WFMT, MMA,
             BLK_N_S, BLK_K_S, NSUB, USE_ASM, MANUAL, PAR, BM, BN, BK, QUANT_OUT, QSPLIT,
             SWAP)


# ---------------------------------------------------------------------------------------------
# the device-side tile list of a grouped GEMM (the Gluon kernels' persistent CTAs walk it)
# ---------------------------------------------------------------------------------------------


@triton.jit
def moe_tile_list(cnt_ptr, work_ptr, G, MT, BM: tl.constexpr, G_PAD: tl.constexpr,
                  BT: tl.constexpr):
    """Row tiles of the groups with rows, in group order, from the counts (no host sync):
    work = [total, grp[MT], row0[MT], rend[MT]] int32, total = sum(ceil(cnt / BM)) (<= MT, the
    static worst case); tile j < total covers rows row0[j] .. min(row0[j] + BM, rend[j]) - 1 of
    group grp[j] (expert-sorted order, as moe_gemm's scan); entries j >= total are not read.
    Program p fills tiles p * BT .. p * BT + BT - 1 (the same scan as moe_gemm, BT tiles at
    once)."""
    ge = tl.arange(0, G_PAD)
    cnt = tl.load(cnt_ptr + ge, mask=ge < G, other=0)
    tiles = (cnt + (BM - 1)) // BM
    tend = tl.cumsum(tiles, 0)
    rend = tl.cumsum(cnt, 0)
    j = tl.program_id(0) * BT + tl.arange(0, BT)
    g = tl.sum((tend[None, :] <= j[:, None]).to(tl.int32), 1)
    own = ge[None, :] == g[:, None]
    t0 = tl.sum(tl.where(own, tend - tiles, 0), 1)
    r_end = tl.sum(tl.where(own, rend, 0), 1)
    r0 = tl.sum(tl.where(own, rend - cnt, 0), 1) + (j - t0) * BM
    jm = j < MT
    tl.store(work_ptr + 1 + j, g, mask=jm)
    tl.store(work_ptr + 1 + MT + j, r0, mask=jm)
    tl.store(work_ptr + 1 + 2 * MT + j, r_end, mask=jm)
    if tl.program_id(0) == 0:
        tl.store(work_ptr, tl.sum(tiles, 0))


# ---------------------------------------------------------------------------------------------
# router: gate scores, top-k (+ expert counts), permutation
# ---------------------------------------------------------------------------------------------


@triton.jit
def dot_split_bf16(a, b, acc):
    """acc + a @ b^T on the bf16 tensor cores for bf16 a and fp32 b: b split into bf16 hi + lo,
    two exact-product MMAs (~2^-16 relative); the fp32 gate and mHC mixer weights' products."""
    hi = b.to(tl.bfloat16)
    lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(a, tl.trans(hi), acc)
    return tl.dot(a, tl.trans(lo), acc)


@triton.jit
def gate_scores(x_ptr, w_ptr, s_ptr, T, E, D, k_per, stride_x, stride_w, stride_s, stride_split,
                MODE: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """s[split, T, E] = x[:, K slice] @ w[:, K slice]^T in fp32, split = program axis 2 (K slices
    of k_per columns, a multiple of BK; route_topk adds the slabs in split order: few tokens
    give few programs, so the gate weight streams through more SMs). MODE 0: bf16 x bf16 (exact
    products); 1: x bf16, w fp32 split into bf16 hi + lo (two products, ~2^-16 relative); 2:
    fp32 "ieee"."""
    pm = tl.program_id(0)
    pe = tl.program_id(1)
    ps = tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    re = pe * BE + tl.arange(0, BE)
    mmask = rm < T
    emask = re < E
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    k_lo = ps * k_per
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, D), BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < D
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + re[:, None].to(tl.int64) * stride_w + rk[None, :],
                    mask=emask[:, None] & kmask[None, :], other=0.0)
        if MODE == 0:
            acc = tl.dot(x, tl.trans(w), acc)
        elif MODE == 1:
            acc = dot_split_bf16(x, w.to(tl.float32), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
    tl.store(s_ptr + ps.to(tl.int64) * stride_split + rm[:, None].to(tl.int64) * stride_s
             + re[None, :], acc, mask=mmask[:, None] & emask[None, :])


@triton.jit
def log1p_f32(z):
    """log(1 + z) for z >= 0, accurate for small z (Goldberg: log(u) * z / (u - 1), u = 1 + z)."""
    u = 1.0 + z
    d = u - 1.0
    return tl.where(d == 0.0, z, tl.log(u) * (z / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def route_topk(s_ptr, bias_ptr, ids_ptr, w_ptr, cnt_ptr, tid_ptr, tok_ptr, T, E, route_scale,
               stride_s, stride_split, SPLIT: tl.constexpr, TOPK: tl.constexpr,
               K_PAD: tl.constexpr, SCORE: tl.constexpr,
               HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HASH: tl.constexpr,
               COUNT: tl.constexpr, IDS64: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Scores (sqrtsoftplus / softmax / sigmoid of the logits), top-k of scores + bias (ties: the
    lower expert id), weights = unbiased scores of the chosen, normalized, times route_scale;
    HASH: experts from tid2eid[token_ids] instead. COUNT: cnt[e] += picks of e (atomics)."""
    pm = tl.program_id(0)
    rm = pm * BM + tl.arange(0, BM)
    rmask = rm < T
    ce = tl.arange(0, E_PAD)
    emask = ce < E
    lg = tl.load(s_ptr + rm[:, None].to(tl.int64) * stride_s + ce[None, :],
                 mask=rmask[:, None] & emask[None, :], other=0.0)
    for sp_i in tl.static_range(1, SPLIT):  # gate_scores' K slabs, in split order
        lg += tl.load(s_ptr + sp_i * stride_split + rm[:, None].to(tl.int64) * stride_s
                      + ce[None, :], mask=rmask[:, None] & emask[None, :], other=0.0)
    if SCORE == 0:
        sp = tl.where(lg > 20.0, lg, log1p_f32(tl.exp(tl.minimum(lg, 20.0))))
        sc = tl.sqrt_rn(sp)
    elif SCORE == 1:
        lm = tl.where(emask[None, :], lg, float("-inf"))
        mx = tl.max(lm, axis=1)
        ex = tl.exp(lm - mx[:, None])
        sc = ex / tl.sum(ex, axis=1)[:, None]
    else:
        sc = tl.sigmoid(lg)
    kk = tl.arange(0, K_PAD)
    wt = tl.zeros((BM, K_PAD), dtype=tl.float32)
    kmask = rmask[:, None] & (kk < TOPK)[None, :]
    if HASH:
        tok = tl.load(tok_ptr + rm, mask=rmask, other=0).to(tl.int64)
        idm = tl.load(tid_ptr + tok[:, None] * TOPK + kk[None, :], mask=kmask, other=0)
        idm = idm.to(tl.int32)
        for j in tl.static_range(TOPK):
            idj = tl.sum(tl.where(kk[None, :] == j, idm, 0), axis=1)
            wj = tl.sum(tl.where(ce[None, :] == idj[:, None], sc, 0.0), axis=1)
            wt = tl.where(kk[None, :] == j, wj[:, None], wt)
    else:
        sel = sc
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + ce, mask=emask, other=0.0)[None, :]
        sel = tl.where(emask[None, :], sel, float("-inf"))
        idm = tl.zeros((BM, K_PAD), dtype=tl.int32)
        for j in tl.static_range(TOPK):
            mx = tl.max(sel, axis=1)
            idj = tl.min(tl.where(sel == mx[:, None], ce[None, :], E_PAD), axis=1)
            hit = ce[None, :] == idj[:, None]
            wj = tl.sum(tl.where(hit, sc, 0.0), axis=1)
            sel = tl.where(hit, float("-inf"), sel)
            wt = tl.where(kk[None, :] == j, wj[:, None], wt)
            idm = tl.where(kk[None, :] == j, idj[:, None], idm)
    if NORM:
        wt = wt / (tl.sum(wt, axis=1)[:, None] + 1e-20)
    wt = wt * route_scale
    off = rm[:, None] * TOPK + kk[None, :]
    if IDS64:
        tl.store(ids_ptr + off, idm.to(tl.int64), mask=kmask)
    else:
        tl.store(ids_ptr + off, idm, mask=kmask)
    tl.store(w_ptr + off, wt, mask=kmask)
    if COUNT:
        tl.atomic_add(cnt_ptr + idm, 1, mask=kmask)


@triton.jit
def count_ids(ids_ptr, cnt_ptr, P, E, BP: tl.constexpr):
    """cnt[e] += number of ids == e (ids clamped into [0, E))."""
    rp = tl.program_id(0) * BP + tl.arange(0, BP)
    pm = rp < P
    e = tl.load(ids_ptr + rp, mask=pm, other=0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), E - 1)
    tl.atomic_add(cnt_ptr + e, 1, mask=pm)


@triton.jit
def moe_plan(cnt_ptr, cur_ptr, E, E_PAD: tl.constexpr):
    """cur[e] = sum(cnt[:e]) (one program): the first sorted row of each expert."""
    ce = tl.arange(0, E_PAD)
    cnt = tl.load(cnt_ptr + ce, mask=ce < E, other=0)
    tl.store(cur_ptr + ce, tl.cumsum(cnt, 0) - cnt, mask=ce < E)


@triton.jit
def moe_scatter(ids_ptr, cur_ptr, sorted_ptr, P, E, BP: tl.constexpr):
    """sorted[cur[e]++] = p for every pair p with expert e (atomic cursor started at the expert's
    first row by moe_plan: rows of one expert land in any order, which changes no result since
    every row is computed on its own)."""
    rp = tl.program_id(0) * BP + tl.arange(0, BP)
    pm = rp < P
    e = tl.load(ids_ptr + rp, mask=pm, other=0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), E - 1)
    pos = tl.atomic_add(cur_ptr + e, 1, mask=pm)
    tl.store(sorted_ptr + pos, rp, mask=pm)


@triton.jit
def moe_gather_rows(src_ptr, idx_ptr, dst_ptr, P, W, stride_src, stride_dst,
                    TOPK: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
    """dst[r] = src[idx[r] // TOPK] for sorted rows r < P, rows of W 32-bit words (the E4M3 A
    rows seen as int32: 16-byte accesses where the strides allow, which Triton's divisibility
    specialization sees). Why not index_select: its generic gather moved the 252 MB of A at
    8192 tokens in 117 us on the H200 (ncu), a third below the copy
    bandwidth; and its `idx // topk` is one more launch. This kernel: 79.7 us."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rr < P
    tok = (tl.load(idx_ptr + rr, mask=rm, other=0) // TOPK).to(tl.int64)
    src = src_ptr + tok[:, None] * stride_src
    dst = dst_ptr + rr.to(tl.int64)[:, None] * stride_dst
    for w0 in range(0, W, BW):
        cw = w0 + tl.arange(0, BW)
        m = rm[:, None] & (cw < W)[None, :]
        tl.store(dst + cw[None, :], tl.load(src + cw[None, :], mask=m), mask=m)


@triton.jit
def moe_tile_scales(as_ptr, idx_ptr, tiles_ptr, out_ptr, MT, P, KC, stride_as,
                    TOPK: tl.constexpr, BM: tl.constexpr, KC_PAD: tl.constexpr):
    """out[c, j BM + r] = a_scale[idx[row0_j + r] // TOPK, c] for the rows r of tile j of
    moe_tile_list's list (c < KC), 0 past a tile's rows and for the entries past the list's
    total (which hold garbage): the A scales in tile order, each tile's run of BM starting
    16-byte aligned for the warp-specialized L1's [1, BM] TMA boxes (moe_gluon_ws STMA). One
    program per list entry; the transposed store keeps the rows of a chunk contiguous."""
    j = tl.program_id(0)
    n = tl.load(tiles_ptr)
    row0 = tl.load(tiles_ptr + 1 + MT + j)
    rend = tl.where(j < n, tl.minimum(tl.load(tiles_ptr + 1 + 2 * MT + j), P), 0)
    r = tl.arange(0, BM)
    row = row0 + r
    ok = (row < rend) & (row >= 0)
    tok = tl.load(idx_ptr + row, mask=ok, other=0) // TOPK
    c = tl.arange(0, KC_PAD)
    m = ok[:, None] & (c < KC)[None, :]
    sa = tl.load(as_ptr + tok.to(tl.int64)[:, None] * stride_as + c[None, :], mask=m, other=0.0)
    out = out_ptr + c[None, :].to(tl.int64) * (MT * BM) + j * BM + r[:, None]
    tl.store(out, sa, mask=(c < KC)[None, :])


# ---------------------------------------------------------------------------------------------
# combine (+ shared) (+ mHC residual expand)
# ---------------------------------------------------------------------------------------------


@triton.jit
def moe_combine(y_ptr, s_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, D, stride_yt, stride_st,
                stride_ht, stride_hc, stride_ot, stride_oc, K: tl.constexpr, SHARED: tl.constexpr,
                EXPAND: tl.constexpr, HC: tl.constexpr, RDT: tl.constexpr,
                MANUAL: tl.constexpr, BD: tl.constexpr):
    """Per token t: routed = round_RDT(sum_j y[t, j]) (fp32 sum in slot order); with SHARED:
    y = round_RDT(routed + s[t]) (s: y's slot K, or the shared expert's own tensor).
    EXPAND: out[t, c] = post[t, c] * y + sum_i comb[t, i, c] * h[t, i] (fp32), else out[t] = y."""
    t = tl.program_id(0).to(tl.int64)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = rd < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(y_ptr + t * stride_yt + j * D + rd, mask=dm, other=0.0).to(tl.float32)
    y = round_like(acc, RDT)
    if SHARED:
        y = round_like(y + tl.load(s_ptr + t * stride_st + rd, mask=dm,
                                   other=0.0).to(tl.float32), RDT)
    if EXPAND:
        ci = tl.arange(0, HC)
        h = tl.load(h_ptr + t * stride_ht + ci[:, None] * stride_hc + rd[None, :],
                    mask=dm[None, :], other=0.0).to(tl.float32)
        post = tl.load(post_ptr + t * HC + ci)
        comb = tl.load(comb_ptr + t * HC * HC + ci[:, None] * HC + ci[None, :])
        mix = tl.sum(comb[:, :, None] * h[:, None, :], axis=0)
        out = post[:, None] * y[None, :] + mix
        tl.store(out_ptr + t * stride_ot + ci[:, None] * stride_oc + rd[None, :],
                 cast_out(out, out_ptr.dtype.element_ty, MANUAL), mask=dm[None, :])
    else:
        tl.store(out_ptr + t * stride_ot + rd, cast_out(y, out_ptr.dtype.element_ty, MANUAL),
                 mask=dm)


@triton.jit
def fp4_upcast_check(p_ptr, rel_ptr, out_asm_ptr, out_ref_ptr, BN: tl.constexpr, BK: tl.constexpr):
    """Both E2M1 -> E4M3 upcasts of one [BN, BK//2] packed tile with per-element offsets rel_ptr
    (rel + 6, int32), for the one-time device check of the PTX path (moe.py: asm_ok)."""
    rn = tl.arange(0, BN)
    rk2 = tl.arange(0, BK // 2)
    rk = tl.arange(0, BK)
    p = tl.load(p_ptr + rn[:, None] * (BK // 2) + rk2[None, :])
    rel = tl.load(rel_ptr + rn[:, None] * (BK // 2) + rk2[None, :])
    a = fp4_tile_e4m3(p, rel, BN, BK, True)
    b = fp4_tile_e4m3(p, rel, BN, BK, False)
    tl.store(out_asm_ptr + rn[:, None] * BK + rk[None, :], a.to(tl.uint8, bitcast=True))
    tl.store(out_ref_ptr + rn[:, None] * BK + rk[None, :], b.to(tl.uint8, bitcast=True))
