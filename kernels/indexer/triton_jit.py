"""Triton code of the lightning indexer scores (imported by kernels/indexer/triton.py)."""
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


@triton.jit
def _stream_rows(qi_ptr, w_ptr, ikey_ptr, out_ptr, pos_ptr, tok, tv, slot, n0, C, ratio,
                 weight_scale, c0, c1, s_qt, s_qh, s_wt, s_ks, s_kc, s_ot,
                 HI: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 PREC: tl.constexpr, KEYS_M: tl.constexpr, STAGES: tl.constexpr):
    """Entries [c0, c1) of the rows tok [BT] (those with tv) of one request on `slot`; the tile's
    tokens are n0 .. n0 + BT - 1 (clamped into the step)."""
    p = tl.load(pos_ptr + tok)
    vis = tl.where(tv, (p + 1) // ratio, 0)
    cv = tl.minimum(c1, tl.max(vis, axis=0))
    orow = tok.to(tl.int64)[:, None] * s_ot
    if c0 < cv:
        d = tl.arange(0, DI)
        rows = tl.arange(0, BT * HI)
        tok_r = tl.minimum(n0 + rows // HI, tl.max(tok, axis=0)).to(tl.int64)
        q = tl.load(qi_ptr + tok_r[:, None] * s_qt + (rows % HI)[:, None] * s_qh + d[None, :])
        q = q.to(tl.bfloat16) if PREC == "bf16" else q.to(tl.float32)
        w = tl.load(w_ptr + tok_r * s_wt + rows % HI).to(tl.float32) * weight_scale
        kbase = ikey_ptr + slot * s_ks
        for c in tl.range(c0, cv, BC, num_stages=STAGES):
            cols = c + tl.arange(0, BC)
            keys = tl.load(kbase + cols.to(tl.int64)[:, None] * s_kc + d[None, :],
                           mask=(cols < cv)[:, None], other=0.0)
            keys = keys.to(tl.bfloat16) if PREC == "bf16" else keys.to(tl.float32)
            if KEYS_M:
                if PREC == "bf16":
                    dots = tl.dot(keys, tl.trans(q))
                else:
                    dots = tl.dot(keys, tl.trans(q), input_precision=PREC)
                sc = tl.maximum(dots, 0.0) * w[None, :]
                sc = tl.trans(tl.sum(tl.reshape(sc, (BC, BT, HI)), axis=2))
            else:
                if PREC == "bf16":
                    dots = tl.dot(q, tl.trans(keys))
                else:
                    dots = tl.dot(q, tl.trans(keys), input_precision=PREC)
                sc = tl.maximum(dots, 0.0) * w[:, None]
                sc = tl.sum(tl.reshape(sc, (BT, HI, BC)), axis=1)
            sc = tl.where(cols[None, :] < vis[:, None], sc, float("-inf"))
            tl.store(out_ptr + orow + cols[None, :], sc, mask=tv[:, None] & (cols < c1)[None, :])
    # the span's entries past every row's visible prefix (whole blocks after the loop's last)
    start = c0 + tl.cdiv(tl.maximum(cv - c0, 0), BC) * BC
    ninf = tl.full([BT, BC], float("-inf"), tl.float32)
    for c in range(start, c1, BC):
        cols = c + tl.arange(0, BC)
        tl.store(out_ptr + orow + cols[None, :], ninf, mask=tv[:, None] & (cols < c1)[None, :])


@triton.jit
def index_scores_stream(qi_ptr, w_ptr, ikey_ptr, out_ptr, pos_ptr, req_ptr, slots_ptr, cls_ptr,
                        T, C, ratio, weight_scale, span, s_qt, s_qh, s_wt, s_ks, s_kc, s_ot,
                        HI: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        PREC: tl.constexpr, KEYS_M: tl.constexpr, STAGES: tl.constexpr,
                        CLS: tl.constexpr):
    """The same scores as index_scores_fwd, with the queries stationary: one program holds the
    [BT*HI, DI] queries of BT tokens of one request (loaded and converted once) and walks the
    entries [s*span, (s+1)*span) of its slot BC at a time. index_scores_fwd reloads the queries
    (BT*HI*DI fp32, 64 KB at BT 4) for every 64 entries, ~5x the bytes of the keys it multiplies;
    here they are read once per span, and the keys once per BT tokens.

    Tiles need no tile list: program n takes the step's tokens n*BT .. n*BT+BT-1 whose request's
    class (cls_ptr, per request) is CLS. Requests of the BT > 1 class hold >= BT tokens each
    (the launcher's LONG_REQUEST), so at most two of them meet in BT consecutive tokens: the
    program makes one pass per request (the first and the last of its tile).

    Grid (token tiles, spans), token tiles the fast axis: the programs resident at one time work
    on the same span, so a span's keys come from HBM about once per request and from L2 after.
    KEYS_M puts the keys on the MMA's M side ([BC, BT*HI] products, the sum over heads along N,
    inside a thread and its quad) instead of the queries ([BT*HI, BC], the sum across warps)."""
    n = tl.program_id(0)
    sp = tl.program_id(1)
    n0 = n * BT
    tok = tl.minimum(n0 + tl.arange(0, BT), T - 1)
    req = tl.load(req_ptr + tok)
    mine = (n0 + tl.arange(0, BT) < T) & (tl.load(cls_ptr + req) == CLS)
    c0 = sp * span
    c1 = tl.minimum(c0 + span, C)
    r0 = tl.min(tl.where(mine, req, 1 << 62), axis=0)
    r1 = tl.max(tl.where(mine, req, -1), axis=0)
    if r1 >= 0:  # a tile with a row of this class
        tv = mine & (req == r0)
        slot = tl.load(slots_ptr + r0).to(tl.int64)
        _stream_rows(qi_ptr, w_ptr, ikey_ptr, out_ptr, pos_ptr, tok, tv, slot, n0, C, ratio,
                     weight_scale, c0, c1, s_qt, s_qh, s_wt, s_ks, s_kc, s_ot,
                     HI, DI, BT, BC, PREC, KEYS_M, STAGES)
        if BT > 1:
            if r1 != r0:
                tv = mine & (req == r1)
                slot = tl.load(slots_ptr + r1).to(tl.int64)
                _stream_rows(qi_ptr, w_ptr, ikey_ptr, out_ptr, pos_ptr, tok, tv, slot, n0, C,
                             ratio, weight_scale, c0, c1, s_qt, s_qh, s_wt, s_ks, s_kc, s_ot,
                             HI, DI, BT, BC, PREC, KEYS_M, STAGES)
