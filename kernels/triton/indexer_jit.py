"""Triton code of the lightning indexer scores (imported by kernels/triton/indexer.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def index_scores_fwd(qi_ptr, w_ptr, ikey_ptr, out_ptr, pos_ptr, items_ptr, ivalid_ptr, tslot_ptr,
                     C, ratio, weight_scale, s_qt, s_qh, s_wt, s_ks, s_kc, s_ot,
                     HI: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     PREC: tl.constexpr):
    """One tile of BT tokens of one request x BC compressed entries:
    out[t, j] = sum_h w[t,h]*weight_scale * relu(qi[t,h] . ikey[slot, j]) for j < (p_t+1)//ratio,
    -inf for the other j < C. The BT*HI (token, head) rows form one [BT*HI, DI] x [DI, BC] product;
    column blocks past every token's visible prefix skip the keys."""
    n = tl.program_id(0)
    cb = tl.program_id(1)
    bt = tl.arange(0, BT)
    tok = tl.load(items_ptr + n * BT + bt)
    tv = tl.load(ivalid_ptr + n * BT + bt) != 0
    slot = tl.load(tslot_ptr + n).to(tl.int64)
    p = tl.load(pos_ptr + tok)
    vis = tl.where(tv, (p + 1) // ratio, 0)
    cols = cb * BC + tl.arange(0, BC)
    if cb * BC < tl.max(vis, axis=0):
        d = tl.arange(0, DI)
        kmask = cols < tl.minimum(tl.max(vis, axis=0), C)
        keys = tl.load(ikey_ptr + slot * s_ks + cols.to(tl.int64)[:, None] * s_kc + d[None, :],
                       mask=kmask[:, None], other=0.0).to(tl.float32)
        rows = tl.arange(0, BT * HI)
        rt = rows // HI
        rh = rows % HI
        tok_r = tl.load(items_ptr + n * BT + rt)
        q = tl.load(qi_ptr + tok_r.to(tl.int64)[:, None] * s_qt + rh[:, None] * s_qh + d[None, :])
        q = q.to(tl.float32)
        if PREC == "bf16":
            dots = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)))
        else:
            dots = tl.dot(q, tl.trans(keys), input_precision=PREC)
        w = tl.load(w_ptr + tok_r.to(tl.int64) * s_wt + rh).to(tl.float32) * weight_scale
        sc = tl.maximum(dots, 0.0) * w[:, None]
        sc = tl.sum(tl.reshape(sc, (BT, HI, BC)), axis=1)
        sc = tl.where(cols[None, :] < vis[:, None], sc, float("-inf"))
    else:
        sc = tl.full([BT, BC], float("-inf"), tl.float32)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * s_ot + cols[None, :], sc,
             mask=tv[:, None] & (cols < C)[None, :])
