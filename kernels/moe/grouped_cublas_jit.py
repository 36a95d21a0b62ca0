"""Triton kernels of moe_grouped_cublas (the prefill L1 on cuBLAS's grouped FP8 GEMM): the
MXFP4 -> E4M3 row upcast of the experts and the activation row gather / requant."""
import triton
import triton.language as tl

from megagraph.kernels.moe.triton_jit import exp2_biased, fp4_rel6, fp4_tile_e4m3


@triton.jit
def mxfp4_rows_e4m3(w_ptr, s_ptr, cnt_ptr, out_ptr, os_ptr, N, K, stride_wg, stride_wn,
                    stride_sg, stride_sn, stride_og, stride_on, stride_osg,
                    NG: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    USE_ASM: tl.constexpr):
    """Rows [pid1 * BN, +BN) of expert pid0 (skipped when its count is 0): MXFP4 bytes
    [N, K/2] + E8M0 [N, K/32] -> E4M3 [N, K] and the row scale 2^(S - 127), S = the row's
    largest exponent - 6 (module doc), through the GEMMs' own upcast (moe_jit.fp4_tile_e4m3:
    the per-lane PRMT table with USE_ASM, its arithmetic twin without) on offsets rel + 6 per
    32-column group, broadcast over the group's 16 bytes (one scale load per group, not per
    byte: the first version gathered one per byte and took ~19 instructions per element)."""
    g = tl.program_id(0)
    if tl.load(cnt_ptr + g) == 0:
        return
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < N
    g64 = g.to(tl.int64)
    rg = tl.arange(0, NG)
    e = tl.load(s_ptr + g64 * stride_sg + rn[:, None] * stride_sn + rg[None, :],
                mask=nmask[:, None] & (rg < K // 32)[None, :], other=0).to(tl.int32)
    S = tl.maximum(tl.max(e, axis=1) - 6, 1)  # biased; >= 1 (a zero row: any scale works)
    tl.store(os_ptr + g64 * stride_osg + rn, exp2_biased(S), mask=nmask)
    rk2 = tl.arange(0, BK // 2)
    rq = tl.arange(0, BK // 32)
    for k0 in range(0, K, BK):
        p = tl.load(w_ptr + g64 * stride_wg + rn[:, None] * stride_wn + (k0 // 2 + rk2)[None, :],
                    mask=nmask[:, None], other=0)
        eg = tl.load(s_ptr + g64 * stride_sg + rn[:, None] * stride_sn + (k0 // 32 + rq)[None, :],
                     mask=nmask[:, None], other=0).to(tl.int32)
        rel6 = fp4_rel6(eg, S)  # [BN, BK/32]
        rel6_p = tl.reshape(tl.broadcast_to(rel6[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
        b = fp4_tile_e4m3(p.to(tl.uint8, bitcast=True), rel6_p, BN, BK, USE_ASM)
        rk = k0 + tl.arange(0, BK)
        tl.store(out_ptr + g64 * stride_og + rn[:, None] * stride_on + rk[None, :], b,
                 mask=nmask[:, None])


@triton.jit
def gather_rows_e4m3(x_ptr, xs_ptr, srt_ptr, out_ptr, os_ptr, P, D, stride_x, stride_xs,
                     stride_o, TOPK: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr,
                     BD: tl.constexpr):
    """Sorted rows [pid * BR, +BR): A'[r] = x_q[srt[r] // TOPK] with one power-of-two scale
    per row (the row's largest of its 128-column scales; module doc) into out / os."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rr < P
    tok = (tl.load(srt_ptr + rr, mask=rmask, other=0) // TOPK).to(tl.int64)
    rb = tl.arange(0, NB)
    xs = tl.load(xs_ptr + tok[:, None] * stride_xs + rb[None, :],
                 mask=rmask[:, None] & (rb < D // BD)[None, :], other=0.0)
    smax = tl.max(xs, axis=1)
    smax = tl.where(smax > 0, smax, 1.0)
    tl.store(os_ptr + rr, smax, mask=rmask)
    rd = tl.arange(0, BD)
    for b0 in range(0, D // BD):
        sb = tl.load(xs_ptr + tok * stride_xs + b0, mask=rmask, other=0.0)
        x = tl.load(x_ptr + tok[:, None] * stride_x + (b0 * BD + rd)[None, :],
                    mask=rmask[:, None], other=0.0).to(tl.float32)
        y = (x * (sb / smax)[:, None]).to(tl.float8e4nv)  # power-of-two ratio <= 1
        tl.store(out_ptr + rr[:, None].to(tl.int64) * stride_o + (b0 * BD + rd)[None, :],
                 y, mask=rmask[:, None])
