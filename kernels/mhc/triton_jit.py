"""Triton code of Mega-mHC (imported only by kernels/mhc/triton.py, after triton): the mixer
projection with RMS statistics (split over K for few tokens), and the per-token finish: mixer
coefficients (sigmoids, softmax + Sinkhorn on n x n), stream collapse, RMSNorm and activation
quantization into the MoE input buffers; mhc_fused runs both in one launch (last-arriver split-K).
Docs: kernels/mhc/triton.py, docs/kernels/mhc.md."""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.moe.triton_jit import cast_out, dot_split_bf16, round_e4m3, round_like


@triton.jit
def proj_tile(h_ptr, fn_ptr, rm, rmask, k_lo, k_hi, stride_h, stride_fn, NM: tl.constexpr,
              NPAD: tl.constexpr, SPLIT_BF16: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """(acc [BM, NPAD], sq [BM]): h[rm, k_lo:k_hi] @ fn[:, k_lo:k_hi]^T and the sum of squares of
    the same h elements, BK columns at a time in increasing k (the one projection body of
    mhc_proj and mhc_fused: both give the same bits for the same K range)."""
    rn = tl.arange(0, NPAD)
    nmask = rn < NM
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, NPAD), dtype=tl.float32)
    sq = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kmask = (k0 + rk) < k_hi
        h = tl.load(h_ptr + rm[:, None].to(tl.int64) * stride_h + (k0 + rk)[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        f = tl.load(fn_ptr + rn[:, None] * stride_fn + (k0 + rk)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        hf = h.to(tl.float32)
        sq += tl.sum(hf * hf, axis=1)
        if SPLIT_BF16:
            acc = dot_split_bf16(h.to(tl.bfloat16), f, acc)
        else:
            acc = tl.dot(hf, tl.trans(f), acc, input_precision="ieee")
    return acc, sq


@triton.jit
def mhc_proj(h_ptr, fn_ptr, m_ptr, sq_ptr, T, KD, k_per, stride_h, stride_fn,
             NM: tl.constexpr, NPAD: tl.constexpr, SPLIT_BF16: tl.constexpr,
             BM: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr):
    """m[s, t, :NM] = h[t] @ fn^T and sq[s, t] = sum(h[t]^2) over the K range s of program axis 1
    (k_per columns each): partial sums, one [T, NPAD] / [T] slab per split, reduced in a fixed
    order by mhc_reduce (no atomics: the same bits on every run). SPLIT_BF16: bf16 h times fn
    split into bf16 hi + lo (two exact-product MMAs, ~2^-16 relative); else fp32 "ieee". Program
    axis 0: blocks of BT <= BM tokens (the MMA tile keeps BM rows, BM - BT of them masked)."""
    pm = tl.program_id(0)
    ps = tl.program_id(1)
    rm = pm * BT + tl.arange(0, BM)
    rmask = (tl.arange(0, BM) < BT) & (rm < T)
    rn = tl.arange(0, NPAD)
    k_lo = ps * k_per
    acc, sq = proj_tile(h_ptr, fn_ptr, rm, rmask, k_lo, tl.minimum(k_lo + k_per, KD), stride_h,
                        stride_fn, NM, NPAD, SPLIT_BF16, BM, BK)
    slab = ps.to(tl.int64) * T
    tl.store(m_ptr + (slab + rm[:, None]) * NPAD + rn[None, :], acc, mask=rmask[:, None])
    tl.store(sq_ptr + slab + rm, sq, mask=rmask)


@triton.jit
def reduce_tile(part_ptr, sqp_ptr, rm, rmask, T, SPLIT, NPAD: tl.constexpr, BM: tl.constexpr,
                CG: tl.constexpr):
    """(sum over s of part[s, rm], sum of sqp[s, rm]) added in the order s = 0, 1, ... from zero
    (CG: loads through L2 only, for slabs other programs of the same launch wrote)."""
    rn = tl.arange(0, NPAD)
    acc = tl.zeros((BM, NPAD), dtype=tl.float32)
    sq = tl.zeros((BM,), dtype=tl.float32)
    for s in tl.range(0, SPLIT, loop_unroll_factor=8):  # 8 slabs' loads in flight, same adds
        slab = s * T
        if CG:
            acc += tl.load(part_ptr + (slab + rm[:, None]) * NPAD + rn[None, :],
                           mask=rmask[:, None], other=0.0, cache_modifier=".cg")
            sq += tl.load(sqp_ptr + slab + rm, mask=rmask, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(part_ptr + (slab + rm[:, None]) * NPAD + rn[None, :],
                           mask=rmask[:, None], other=0.0)
            sq += tl.load(sqp_ptr + slab + rm, mask=rmask, other=0.0)
    return acc, sq


@triton.jit
def mhc_reduce(part_ptr, sqp_ptr, m_ptr, sq_ptr, T, SPLIT, NPAD: tl.constexpr, BM: tl.constexpr):
    """m[t] = sum over s of part[s, t] and sq[t] = sum of sqp[s, t], added in the order
    s = 0, 1, ... (what makes the split projection deterministic)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rm < T
    rn = tl.arange(0, NPAD)
    acc, sq = reduce_tile(part_ptr, sqp_ptr, rm, rmask, T, SPLIT, NPAD, BM, False)
    tl.store(m_ptr + rm[:, None] * NPAD + rn[None, :], acc, mask=rmask[:, None])
    tl.store(sq_ptr + rm, sq, mask=rmask)


@triton.jit
def finish_rows(rm, m_ptr, sq_ptr, base_ptr, scale_ptr, h_ptr, mix_ptr, nw_ptr, x_ptr, xq_ptr,
                xs_ptr, pre_ptr, post_ptr, comb_ptr, T, D, eps, hc_eps, norm_eps, stride_h,
                stride_x, stride_xq, stride_xs, HC: tl.constexpr, NPAD: tl.constexpr,
                ITERS: tl.constexpr, HAS_MIX: tl.constexpr, HAS_NW: tl.constexpr,
                E8M0: tl.constexpr, QB: tl.constexpr, BM: tl.constexpr, RDT: tl.constexpr,
                MANUAL: tl.constexpr, FSTAGES: tl.constexpr, NQ: tl.constexpr):
    """The finish of the BM tokens rm (mhc_finish's body; mhc_fused runs the same code on the same
    [BM, ...] shapes, so the reductions over a 4 x 4 row and the final sum of squares take the
    same order on the GPU too): see mhc_finish. Pass 1 (collapse, [BM, QB] per stream and step,
    elementwise) is software pipelined FSTAGES deep (cp.async; 1: plain loop), pass 2 (norm +
    quantize: no sums, so its tile does not change any bit) takes NQ quantization blocks per
    step, after a barrier (its elements were written by other threads)."""
    rmask = rm < T
    rm64 = rm.to(tl.int64)
    ci = tl.arange(0, HC)
    r = tl.rsqrt(tl.load(sq_ptr + rm, mask=rmask, other=1.0) / (HC * D) + eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    mrow = m_ptr + rm[:, None] * NPAD
    mp = tl.load(mrow + ci[None, :], mask=rmask[:, None], other=0.0) * r[:, None]
    pre = tl.sigmoid(mp * s0 + tl.load(base_ptr + ci)[None, :]) + hc_eps
    mq = tl.load(mrow + HC + ci[None, :], mask=rmask[:, None], other=0.0) * r[:, None]
    post = 2.0 * tl.sigmoid(mq * s1 + tl.load(base_ptr + HC + ci)[None, :])
    cc = ci[:, None] * HC + ci[None, :]
    mc = tl.load(m_ptr + rm[:, None, None] * NPAD + 2 * HC + cc[None, :, :],
                 mask=rmask[:, None, None], other=0.0) * r[:, None, None]
    a = mc * s2 + tl.load(base_ptr + 2 * HC + cc)[None, :, :]
    mx = tl.max(a, axis=2)
    ex = tl.exp(a - mx[:, :, None])
    c = ex / tl.sum(ex, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(pre_ptr + rm[:, None] * HC + ci[None, :], pre, mask=rmask[:, None])
    tl.store(post_ptr + rm[:, None] * HC + ci[None, :], post, mask=rmask[:, None])
    tl.store(comb_ptr + rm[:, None, None] * (HC * HC) + cc[None, :, :], c,
             mask=rmask[:, None, None])
    # collapse x = rdt(w0 h0 + w1 h1 + ...) (rounded to x's dtype like the reference; streams
    # added in order c = 0, 1, ..., each element in its own thread) and its sum of squares
    # (per-thread partial sums over the steps, one tree at the end): no data crosses threads
    tl.static_assert(HC <= 4)
    if HAS_MIX:
        wrow = mix_ptr + rm * HC
    else:
        wrow = pre_ptr + rm * HC  # this site's pre, read back (stored above: the barrier)
        tl.debug_barrier()
    w0 = tl.load(wrow, mask=rmask, other=0.0)[:, None]
    if HC > 1:
        w1 = tl.load(wrow + 1, mask=rmask, other=0.0)[:, None]
    if HC > 2:
        w2 = tl.load(wrow + 2, mask=rmask, other=0.0)[:, None]
        w3 = tl.load(wrow + 3, mask=rmask, other=0.0)[:, None]
    rq = tl.arange(0, QB)
    hrow = h_ptr + rm64[:, None] * stride_h + rq[None, :]
    xrow = x_ptr + rm64[:, None] * stride_x + rq[None, :]
    ss2 = tl.zeros((BM, QB), dtype=tl.float32)
    for d0 in tl.range(0, D, QB, num_stages=FSTAGES):
        acc = w0 * tl.load(hrow + d0, mask=rmask[:, None], other=0.0).to(tl.float32)
        if HC > 1:
            acc += w1 * tl.load(hrow + D + d0, mask=rmask[:, None], other=0.0).to(tl.float32)
        if HC > 2:
            acc += w2 * tl.load(hrow + 2 * D + d0, mask=rmask[:, None], other=0.0).to(tl.float32)
            acc += w3 * tl.load(hrow + 3 * D + d0, mask=rmask[:, None], other=0.0).to(tl.float32)
        xb = round_like(acc, RDT)
        ss2 += xb * xb
        tl.store(xrow + d0, cast_out(xb, x_ptr.dtype.element_ty, MANUAL), mask=rmask[:, None])
    ss = tl.sum(ss2, axis=1)
    rr = tl.rsqrt(ss / D + norm_eps)
    # norm + quantize, NQ blocks of QB columns a step (other threads' x: after the barrier)
    tl.debug_barrier()
    nq = tl.arange(0, NQ)
    for d0 in range(0, D, NQ * QB):
        cols = d0 + nq[:, None] * QB + rq[None, :]
        cmask = cols < D
        mask = rmask[:, None, None] & cmask[None, :, :]
        xp = x_ptr + rm64[:, None, None] * stride_x + cols[None, :, :]
        xb = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        y = xb * rr[:, None, None]
        if HAS_NW:
            y = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :, :] * y
        y = round_like(y, RDT)
        tl.store(xp, cast_out(y, x_ptr.dtype.element_ty, MANUAL), mask=mask)
        amax = tl.maximum(tl.max(tl.abs(y), axis=2), 1e-4)
        yb = (amax / 448.0).to(tl.int32, bitcast=True)
        e = ((yb >> 23) & 0xFF) + ((yb & 0x7FFFFF) != 0).to(tl.int32)
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
        q = round_e4m3(tl.minimum(tl.maximum(y * inv[:, :, None], -448.0), 448.0))
        tl.store(xq_ptr + rm64[:, None, None] * stride_xq + cols[None, :, :],
                 q.to(tl.float8e4nv), mask=mask)
        sp = xs_ptr + rm64[:, None] * stride_xs + (d0 // QB + nq)[None, :]
        smask = rmask[:, None] & (d0 + nq * QB < D)[None, :]
        if E8M0:
            tl.store(sp, e.to(tl.uint8), mask=smask)
        else:
            tl.store(sp, (e << 23).to(tl.float32, bitcast=True), mask=smask)


@triton.jit
def mhc_finish(m_ptr, sq_ptr, base_ptr, scale_ptr, h_ptr, mix_ptr, nw_ptr, x_ptr, xq_ptr, xs_ptr,
               pre_ptr, post_ptr, comb_ptr, T, D, eps, hc_eps, norm_eps, stride_h, stride_x,
               stride_xq, stride_xs, HC: tl.constexpr, NPAD: tl.constexpr, ITERS: tl.constexpr,
               HAS_MIX: tl.constexpr, HAS_NW: tl.constexpr, E8M0: tl.constexpr,
               QB: tl.constexpr, BM: tl.constexpr, RDT: tl.constexpr, MANUAL: tl.constexpr,
               FSTAGES: tl.constexpr, NQ: tl.constexpr):
    """BM tokens: a = m * rsqrt(sq / (HC*D) + eps) * s + base; pre = sigmoid(a[:HC]) + hc_eps,
    post = 2 sigmoid(a[HC:2HC]), comb = Sinkhorn(softmax(a[2HC:] as HC x HC) + hc_eps)
    (column, then ITERS-1 x (row, column) normalizations); x = rdt(sum_c w_c h_c) with w = mix
    or pre; x = rdt(nw * x * rsqrt(mean(x^2) + norm_eps)) (rdt: rounding to x's dtype); per QB
    columns: scale = 2^ceil(log2(max(amax, 1e-4) / 448)), x_q = e4m3(x / scale)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    finish_rows(rm, m_ptr, sq_ptr, base_ptr, scale_ptr, h_ptr, mix_ptr, nw_ptr, x_ptr, xq_ptr,
                xs_ptr, pre_ptr, post_ptr, comb_ptr, T, D, eps, hc_eps, norm_eps, stride_h,
                stride_x, stride_xq, stride_xs, HC, NPAD, ITERS, HAS_MIX, HAS_NW, E8M0, QB, BM,
                RDT, MANUAL, FSTAGES, NQ)


@triton.jit
def mhc_fused(h_ptr, fn_ptr, part_ptr, sqp_ptr, m_ptr, sq_ptr, cnt_ptr, base_ptr, scale_ptr,
              mix_ptr, nw_ptr, x_ptr, xq_ptr, xs_ptr, pre_ptr, post_ptr, comb_ptr, T, D, KD,
              k_per, nsplit, eps, hc_eps, norm_eps, stride_h, stride_fn, stride_x, stride_xq,
              stride_xs, NM: tl.constexpr, HC: tl.constexpr, NPAD: tl.constexpr,
              ITERS: tl.constexpr, HAS_MIX: tl.constexpr, HAS_NW: tl.constexpr,
              E8M0: tl.constexpr, QB: tl.constexpr, RDT: tl.constexpr, MANUAL: tl.constexpr,
              SPLIT_BF16: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr, BT: tl.constexpr, FBM: tl.constexpr, FSTAGES: tl.constexpr,
              NQ: tl.constexpr):
    """Mega-mHC in one launch (run on the H200 once: kernels/mhc/triton.py): program (pm, ps)
    projects the BT tokens of block pm (rows of a BM-row MMA tile) over the K range ps
    (proj_tile, as mhc_proj), then

    SPLIT (nsplit > 1 programs per block): writes its partial slab, then (after a CTA barrier, so
    every thread's slab stores precede it) adds 1 to cnt[pm] (one acq_rel atomic, gpu scope);
    the program that reads nsplit - 1 arrived last: it adds the slabs s = 0..nsplit-1 from zero
    (reduce_tile, as mhc_reduce: the same bits, whichever program came last), puts cnt[pm] back
    to 0 for the next launch / graph replay, and runs the finish of the block; the others exit.
    Else (one program per block): the finish follows the projection in the same program.

    The block's m / sq go through the [T, NPAD] / [T] scratch (a CTA barrier between the stores
    and the finish's loads) so that the finish is finish_rows on FBM-token sub-blocks, the same
    code and shapes as mhc_finish with BM = FBM: fused and unfused launches give the same bits
    (checked on the H200 at d = 5120)."""
    pm = tl.program_id(0)
    rm = pm * BT + tl.arange(0, BM)
    rmask = (tl.arange(0, BM) < BT) & (rm < T)
    rn = tl.arange(0, NPAD)
    if SPLIT:
        ps = tl.program_id(1)
        k_lo = ps * k_per
        acc, sq = proj_tile(h_ptr, fn_ptr, rm, rmask, k_lo, tl.minimum(k_lo + k_per, KD),
                            stride_h, stride_fn, NM, NPAD, SPLIT_BF16, BM, BK)
        slab = ps.to(tl.int64) * T
        tl.store(part_ptr + (slab + rm[:, None]) * NPAD + rn[None, :], acc, mask=rmask[:, None])
        tl.store(sqp_ptr + slab + rm, sq, mask=rmask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pm, 1, sem="acq_rel", scope="gpu")
        last = arrived == nsplit - 1
    else:
        acc, sq = proj_tile(h_ptr, fn_ptr, rm, rmask, 0, KD, stride_h, stride_fn, NM, NPAD,
                            SPLIT_BF16, BM, BK)
        last = True
    if last:
        if SPLIT:
            acc, sq = reduce_tile(part_ptr, sqp_ptr, rm, rmask, T, nsplit, NPAD, BM, True)
            tl.atomic_xchg(cnt_ptr + pm, 0, sem="relaxed", scope="gpu")
        tl.store(m_ptr + rm[:, None] * NPAD + rn[None, :], acc, mask=rmask[:, None])
        tl.store(sq_ptr + rm, sq, mask=rmask)
        tl.debug_barrier()
        for j in range(0, BT // FBM):
            if pm * BT + j * FBM < T:
                finish_rows(pm * BT + j * FBM + tl.arange(0, FBM), m_ptr, sq_ptr, base_ptr,
                            scale_ptr, h_ptr, mix_ptr, nw_ptr, x_ptr, xq_ptr, xs_ptr, pre_ptr,
                            post_ptr, comb_ptr, T, D, eps, hc_eps, norm_eps, stride_h, stride_x,
                            stride_xq, stride_xs, HC, NPAD, ITERS, HAS_MIX, HAS_NW, E8M0, QB,
                            FBM, RDT, MANUAL, FSTAGES, NQ)
