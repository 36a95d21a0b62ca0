"""Triton code of the Engram hash and gated write (imported by kernels/engram/triton.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from megagraph.kernels.attention.triton_jit import cast_to


@triton.jit
def engram_hash_fwd(cids_ptr, hist_ptr, pos_ptr, req_ptr, slots_ptr, cached_ptr, tab_ptr, out_ptr,
                    T, pad_id, s_h, K: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr):
    """Row ids of the 2..K-grams ending at each of BT tokens (kernels.engram.reference.engram_hash);
    tab = [multipliers (K), primes ((K-1)*NH), offsets ((K-1)*NH)] as int64."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    tc = tl.minimum(t, T - 1)
    p = tl.load(pos_ptr + tc)
    r = tl.load(req_ptr + tc)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    c = tl.load(cached_ptr + r)
    blocked = t < 0
    h = tl.zeros([BT], tl.int64)
    NC: tl.constexpr = (K - 1) * NH
    for s in tl.static_range(K):
        q = p - s
        src = tl.load(cids_ptr + tl.maximum(tc - s, 0)).to(tl.int64)
        if s > 0:
            hidx = tl.minimum(tl.maximum((K - 1) - (c - q), 0), K - 2)
            src = tl.where(q >= c, src, tl.load(hist_ptr + slot * s_h + hidx).to(tl.int64))
        src = tl.where(q >= 0, src, -1)
        blocked = blocked | (src < 0)
        tok = tl.where(blocked, pad_id, src).to(tl.int64)
        term = tok * tl.load(tab_ptr + s)
        if s == 0:
            h = term
        else:
            h = h ^ term
            for j in tl.static_range(NH):
                col = (s - 1) * NH + j
                v = h % tl.load(tab_ptr + K + col) + tl.load(tab_ptr + K + NC + col)
                tl.store(out_ptr + t.to(tl.int64) * NC + col, v, mask=tm)


@triton.jit
def engram_gate_fwd(h_ptr, kv_ptr, qw_ptr, kw_ptr, out_ptr, eps, inv_sqrt_d, s_ht, s_hn, s_kvt,
                    s_ot, s_on, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    MANUAL: tl.constexpr):
    """Stream c of token t: z = <H_c, q_c*k_c*K_c> * rsqrt(mean H_c^2 + eps) * rsqrt(mean K_c^2 + eps)
    / sqrt(d); gate = sigmoid(sign(z) sqrt(max(|z|, 1e-6))); out = H_c + gate * value (fp32)."""
    t = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1)
    hrow = h_ptr + t * s_ht + cs * s_hn
    krow = kv_ptr + t * s_kvt + cs * D
    vrow = kv_ptr + t * s_kvt + N * D
    acc_hh = tl.zeros([BD], tl.float32)
    acc_kk = tl.zeros([BD], tl.float32)
    acc_z = tl.zeros([BD], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        hv = tl.load(hrow + d, mask=dm, other=0.0).to(tl.float32)
        kv = tl.load(krow + d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(qw_ptr + cs * D + d, mask=dm, other=0.0).to(tl.float32) \
            * tl.load(kw_ptr + cs * D + d, mask=dm, other=0.0).to(tl.float32)
        acc_hh += hv * hv
        acc_kk += kv * kv
        acc_z += hv * w * kv
    rho = tl.math.rsqrt(tl.sum(acc_hh, axis=0) / D + eps) * tl.math.rsqrt(tl.sum(acc_kk, axis=0) / D + eps)
    z = tl.sum(acc_z, axis=0) * rho * inv_sqrt_d
    sg = tl.where(z > 0, 1.0, tl.where(z < 0, -1.0, 0.0))
    gate = tl.sigmoid(sg * tl.sqrt(tl.maximum(tl.abs(z), 1e-6)))
    orow = out_ptr + t * s_ot + cs * s_on
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        hv = tl.load(hrow + d, mask=dm, other=0.0).to(tl.float32)
        v = tl.load(vrow + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(orow + d, cast_to(hv + gate * v, out_ptr.dtype.element_ty, MANUAL), mask=dm)
