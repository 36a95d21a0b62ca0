"""Triton code of the fused V4.1 compressor (imported by kernels/state/triton_compressor.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.attention.triton_jit import cast_to, fake_quant_rows, rope_chunk


@triton.jit
def proj_gemm(x_ptr, w_ptr, out_ptr, M, N, Kd, s_xm, s_wn, s_om,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * w[n, k] in fp32 (bf16 operands are exact in fp32, so the
    tensor-core product with fp32 accumulation equals the reference's fp32 GEMM up to order)."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, Kd, BK):
        km = (k0 + rk) < Kd
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * s_xm + (k0 + rk)[None, :],
                    mask=(rm < M)[:, None] & km[None, :], other=0.0)
        b = tl.load(w_ptr + rn.to(tl.int64)[:, None] * s_wn + (k0 + rk)[None, :],
                    mask=(rn < N)[:, None] & km[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * s_om + rn[None, :], acc,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _pooled(proj_ptr, pk_ptr, pg_ptr, rows, tmask, p, first, slot, ch,
            s_pr, s_ps, s_pp, DC: tl.constexpr, RATIO: tl.constexpr, BT: tl.constexpr,
            CK: tl.constexpr):
    """Softmax-gated pooled latent channels ch of the group ending at each row's position p:
    member q = p-RATIO+1+m comes from this step's row (rows - (p - q)) if q >= first, else from
    the slot's pending row q % RATIO (u in proj[:, :DC] / pend_kv, s in proj[:, DC:] / pend_gate)."""
    if RATIO == 1:
        return tl.load(proj_ptr + rows.to(tl.int64)[:, None] * s_pr + ch[None, :],
                       mask=tmask[:, None], other=0.0)
    m_run = tl.full([BT, CK], float("-inf"), tl.float32)
    den = tl.zeros([BT, CK], tl.float32)
    num = tl.zeros([BT, CK], tl.float32)
    for m in tl.static_range(RATIO):
        q = p - (RATIO - 1) + m
        step = q >= first
        srow = tl.maximum(rows - (p - q), 0).to(tl.int64)
        prow = slot * s_ps + (q % RATIO) * s_pp
        ms = tmask & step
        mp = tmask & (q < first)
        u = tl.load(proj_ptr + srow[:, None] * s_pr + ch[None, :], mask=ms[:, None], other=0.0) \
            + tl.load(pk_ptr + prow[:, None] + ch[None, :], mask=mp[:, None], other=0.0)
        s = tl.load(proj_ptr + srow[:, None] * s_pr + DC + ch[None, :], mask=ms[:, None], other=0.0) \
            + tl.load(pg_ptr + prow[:, None] + ch[None, :], mask=mp[:, None], other=0.0)
        m_new = tl.maximum(m_run, s)
        alpha = tl.exp(m_run - m_new)
        e = tl.exp(s - m_new)
        den = den * alpha + e
        num = num * alpha + e * u
        m_run = m_new
    return num / den


@triton.jit
def compress_rows(proj_ptr, pk_ptr, pg_ptr, normw_ptr, wk_ptr, knormw_ptr, freq_ptr,
                  ikey_ptr, ckv_ptr, pos_ptr, req_ptr, slots_ptr, first_ptr,
                  T, eps, offset, s_pr, s_ps, s_pp, s_wk, s_is, s_ic, s_cs, s_cc,
                  DC: tl.constexpr, DI: tl.constexpr, RATIO: tl.constexpr, ROPE_DIM: tl.constexpr,
                  BT: tl.constexpr, CK: tl.constexpr, IK_FMT: tl.constexpr,
                  IK_BLOCK: tl.constexpr, CKV_FMT: tl.constexpr, CKV_BLOCK: tl.constexpr,
                  MANUAL_FP8: tl.constexpr, PREC: tl.constexpr):
    """For each of BT tokens that completes a group ((p+1) % RATIO == 0, entry g = (p+1)//RATIO-1):
    latent = rms_norm(pool(group)) (two passes over CK-channel chunks: sum of squares, then the
    normalized chunks); ckv[slot, g] = fake_quant(rope(latent)); ikey[slot, g] =
    fake_quant(rope(rms_norm(latent @ wk^T))) - RoPE at p + offset (the group's first token)."""
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    inb = rows < T
    rc = tl.minimum(rows, T - 1)
    p = tl.load(pos_ptr + rc)
    tmask = inb & (((p + 1) % RATIO) == 0)
    if tl.max(tmask.to(tl.int32), axis=0) > 0:
        r = tl.load(req_ptr + rc)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        first = tl.load(first_ptr + r)
        g = ((p + 1) // RATIO - 1).to(tl.int64)
        pos_f = (p + offset).to(tl.float32)
        ssq = tl.zeros([BT], tl.float32)
        for c0 in range(0, DC, CK):
            ch = c0 + tl.arange(0, CK)
            u = _pooled(proj_ptr, pk_ptr, pg_ptr, rows, tmask, p, first, slot, ch,
                        s_pr, s_ps, s_pp, DC, RATIO, BT, CK)
            ssq += tl.sum(u * u, axis=1)
        rstd = tl.math.rsqrt(ssq / DC + eps)
        dk = tl.arange(0, DI)
        ik = tl.zeros([BT, DI], tl.float32)
        for c0 in range(0, DC, CK):
            ch = c0 + tl.arange(0, CK)
            u = _pooled(proj_ptr, pk_ptr, pg_ptr, rows, tmask, p, first, slot, ch,
                        s_pr, s_ps, s_pp, DC, RATIO, BT, CK)
            lat = tl.load(normw_ptr + ch).to(tl.float32)[None, :] * (u * rstd[:, None])
            wk = tl.load(wk_ptr + dk[None, :] * s_wk + ch[:, None]).to(tl.float32)  # [CK, DI]
            ik += tl.dot(lat, wk, input_precision=PREC)
            if c0 + CK > DC - ROPE_DIM:
                lat = rope_chunk(lat, pos_f, freq_ptr, BT, CK, c0, DC, ROPE_DIM, False)
            cq = fake_quant_rows(lat, BT, CK, CKV_FMT, CKV_BLOCK, MANUAL_FP8)
            tl.store(ckv_ptr + slot[:, None] * s_cs + g[:, None] * s_cc + ch[None, :],
                     cast_to(cq, ckv_ptr.dtype.element_ty, MANUAL_FP8), mask=tmask[:, None])
        krstd = tl.math.rsqrt(tl.sum(ik * ik, axis=1) / DI + eps)
        ik = tl.load(knormw_ptr + dk).to(tl.float32)[None, :] * (ik * krstd[:, None])
        ik = rope_chunk(ik, pos_f, freq_ptr, BT, DI, 0, DI, ROPE_DIM, False)
        ik = fake_quant_rows(ik, BT, DI, IK_FMT, IK_BLOCK, MANUAL_FP8)
        tl.store(ikey_ptr + slot[:, None] * s_is + g[:, None] * s_ic + dk[None, :],
                 cast_to(ik, ikey_ptr.dtype.element_ty, MANUAL_FP8), mask=tmask[:, None])


@triton.jit
def pending_write(proj_ptr, pk_ptr, pg_ptr, pos_ptr, req_ptr, slots_ptr, last_ptr,
                  s_pr, s_ps, s_pp, DC: tl.constexpr, RATIO: tl.constexpr, BD: tl.constexpr):
    """Rows of each request's trailing incomplete group go to the pending state (after
    compress_rows has read the old pending rows)."""
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    r = tl.load(req_ptr + t)
    last = tl.load(last_ptr + r)
    if p >= (last + 1) // RATIO * RATIO:
        slot = tl.load(slots_ptr + r).to(tl.int64)
        base = slot * s_ps + (p % RATIO) * s_pp
        for c0 in tl.static_range(0, DC, BD):
            ch = c0 + tl.arange(0, BD)
            src = proj_ptr + t.to(tl.int64) * s_pr + ch
            tl.store(pk_ptr + base + ch, tl.load(src))
            tl.store(pg_ptr + base + ch, tl.load(src + DC))
