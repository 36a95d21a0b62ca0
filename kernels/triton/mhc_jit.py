"""Triton code of Mega-mHC (imported only by kernels/triton/mhc.py, after triton): the mixer
projection with RMS statistics (split over K for few tokens), and the per-token finish: mixer
coefficients (sigmoids, softmax + Sinkhorn on n x n), stream collapse, RMSNorm and activation
quantization into the MoE input buffers. Docs: kernels/triton/mhc.py."""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_jit import cast_out, round_e4m3, round_like


@triton.jit
def mhc_proj(h_ptr, fn_ptr, m_ptr, sq_ptr, T, KD, k_per, stride_h, stride_fn,
             NM: tl.constexpr, NPAD: tl.constexpr, SPLIT_BF16: tl.constexpr,
             BM: tl.constexpr, BK: tl.constexpr):
    """m[s, t, :NM] = h[t] @ fn^T and sq[s, t] = sum(h[t]^2) over the K range s of program axis 1
    (k_per columns each): partial sums, one [T, NPAD] / [T] slab per split, reduced in a fixed
    order by mhc_reduce (no atomics: the same bits on every run). SPLIT_BF16: bf16 h times fn
    split into bf16 hi + lo (two exact-product MMAs, ~2^-16 relative); else fp32 "ieee"."""
    pm = tl.program_id(0)
    ps = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rmask = rm < T
    rn = tl.arange(0, NPAD)
    nmask = rn < NM
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, NPAD), dtype=tl.float32)
    sq = tl.zeros((BM,), dtype=tl.float32)
    k_lo = ps * k_per
    k_hi = tl.minimum(k_lo + k_per, KD)
    for k0 in range(k_lo, k_hi, BK):
        kmask = (k0 + rk) < k_hi
        h = tl.load(h_ptr + rm[:, None].to(tl.int64) * stride_h + (k0 + rk)[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        f = tl.load(fn_ptr + rn[:, None] * stride_fn + (k0 + rk)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        hf = h.to(tl.float32)
        sq += tl.sum(hf * hf, axis=1)
        if SPLIT_BF16:
            hb = h.to(tl.bfloat16)
            hi = f.to(tl.bfloat16)
            lo = (f - hi.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(hb, tl.trans(hi), acc)
            acc = tl.dot(hb, tl.trans(lo), acc)
        else:
            acc = tl.dot(hf, tl.trans(f), acc, input_precision="ieee")
    slab = ps.to(tl.int64) * T
    tl.store(m_ptr + (slab + rm[:, None]) * NPAD + rn[None, :], acc, mask=rmask[:, None])
    tl.store(sq_ptr + slab + rm, sq, mask=rmask)


@triton.jit
def mhc_reduce(part_ptr, sqp_ptr, m_ptr, sq_ptr, T, SPLIT, NPAD: tl.constexpr, BM: tl.constexpr):
    """m[t] = sum over s of part[s, t] and sq[t] = sum of sqp[s, t], added in the order
    s = 0, 1, ... (what makes the split projection deterministic)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rm < T
    rn = tl.arange(0, NPAD)
    acc = tl.zeros((BM, NPAD), dtype=tl.float32)
    sq = tl.zeros((BM,), dtype=tl.float32)
    for s in range(0, SPLIT):
        slab = s * T
        acc += tl.load(part_ptr + (slab + rm[:, None]) * NPAD + rn[None, :], mask=rmask[:, None],
                       other=0.0)
        sq += tl.load(sqp_ptr + slab + rm, mask=rmask, other=0.0)
    tl.store(m_ptr + rm[:, None] * NPAD + rn[None, :], acc, mask=rmask[:, None])
    tl.store(sq_ptr + rm, sq, mask=rmask)


@triton.jit
def mhc_finish(m_ptr, sq_ptr, base_ptr, scale_ptr, h_ptr, mix_ptr, nw_ptr, x_ptr, xq_ptr, xs_ptr,
               pre_ptr, post_ptr, comb_ptr, T, D, eps, hc_eps, norm_eps, stride_h, stride_x,
               stride_xq, stride_xs, HC: tl.constexpr, NPAD: tl.constexpr, ITERS: tl.constexpr,
               HAS_MIX: tl.constexpr, HAS_NW: tl.constexpr, E8M0: tl.constexpr,
               QB: tl.constexpr, BM: tl.constexpr, RDT: tl.constexpr, MANUAL: tl.constexpr):
    """BM tokens: a = m * rsqrt(sq / (HC*D) + eps) * s + base; pre = sigmoid(a[:HC]) + hc_eps,
    post = 2 sigmoid(a[HC:2HC]), comb = Sinkhorn(softmax(a[2HC:] as HC x HC) + hc_eps)
    (column, then ITERS-1 x (row, column) normalizations); x = rdt(sum_c w_c h_c) with w = mix
    or pre; x = rdt(nw * x * rsqrt(mean(x^2) + norm_eps)) (rdt: rounding to x's dtype); per QB
    columns: scale = 2^ceil(log2(max(amax, 1e-4) / 448)), x_q = e4m3(x / scale)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
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
    if HAS_MIX:
        w = tl.load(mix_ptr + rm[:, None] * HC + ci[None, :], mask=rmask[:, None], other=0.0)
    else:
        w = pre
    # collapse (x rounded to its dtype like the reference) and its sum of squares
    rq = tl.arange(0, QB)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for d0 in range(0, D, QB):
        hv = tl.load(h_ptr + rm64[:, None, None] * stride_h + ci[None, :, None] * D
                     + (d0 + rq)[None, None, :], mask=rmask[:, None, None], other=0.0)
        xb = round_like(tl.sum(w[:, :, None] * hv.to(tl.float32), axis=1), RDT)
        ss += tl.sum(xb * xb, axis=1)
        tl.store(x_ptr + rm64[:, None] * stride_x + (d0 + rq)[None, :],
                 cast_out(xb, x_ptr.dtype.element_ty, MANUAL), mask=rmask[:, None])
    rr = tl.rsqrt(ss / D + norm_eps)
    # norm + quantize (each program re-reads only the rows it wrote)
    for d0 in range(0, D, QB):
        xp = x_ptr + rm64[:, None] * stride_x + (d0 + rq)[None, :]
        xb = tl.load(xp, mask=rmask[:, None], other=0.0).to(tl.float32)
        y = xb * rr[:, None]
        if HAS_NW:
            y = tl.load(nw_ptr + d0 + rq).to(tl.float32)[None, :] * y
        y = round_like(y, RDT)
        tl.store(xp, cast_out(y, x_ptr.dtype.element_ty, MANUAL), mask=rmask[:, None])
        amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)
        yb = (amax / 448.0).to(tl.int32, bitcast=True)
        e = ((yb >> 23) & 0xFF) + ((yb & 0x7FFFFF) != 0).to(tl.int32)
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
        q = round_e4m3(tl.minimum(tl.maximum(y * inv[:, None], -448.0), 448.0))
        tl.store(xq_ptr + rm64[:, None] * stride_xq + (d0 + rq)[None, :],
                 q.to(tl.float8e4nv), mask=rmask[:, None])
        if E8M0:
            tl.store(xs_ptr + rm64 * stride_xs + d0 // QB, e.to(tl.uint8), mask=rmask)
        else:
            tl.store(xs_ptr + rm64 * stride_xs + d0 // QB,
                     (e << 23).to(tl.float32, bitcast=True), mask=rmask)
