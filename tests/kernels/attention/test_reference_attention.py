"""sparse_attn / ring_update vs a naive per-token, per-head formulation over the full key history;
mixed batch ≡ each request alone; chunked decode (ring_update between steps) ≡ one-shot prefill.
Tolerance: fp32 op vs fp64 naive 1e-5; batch-vs-alone and chunked-vs-oneshot 1e-5 (fp32 reorderings)."""
import math
import random

import torch
from _reference_helpers import random_chunks, step_meta

from megagraph.kernels.reference_table import ring_update, sparse_attn

H, D, W, RATIO = 3, 16, 6, 2
SCALE = D ** -0.5


def naive_token(q, p, kv_full, ckv_full, sel, sink):
    """q [H, D]; kv_full: the request's kv by position; ckv_full: its compressed entries; sel: list of
    selected entry ids (−1 = none) or 'all' or None."""
    keys = [kv_full[j].double() for j in range(max(0, p - W + 1), p + 1)]
    if sel is not None and ckv_full is not None:
        ids = range(ckv_full.shape[0]) if sel == "all" else sorted({g for g in sel if g >= 0})
        keys += [ckv_full[g].double() for g in ids if g < (p + 1) // RATIO]
    out = torch.zeros(H, D, dtype=torch.float64)
    for h in range(H):
        s = [SCALE * float(q[h].double() @ k) for k in keys]
        if not s:
            continue
        m = max(max(s), -1e30)
        den = math.exp(sink[h].item() - m) + sum(math.exp(v - m) for v in s)
        for v, k in zip(s, keys):
            out[h] += math.exp(v - m) * k / den
    return out


def make_ring(kv_full, c, gen):
    """Ring [W, D] for a slot with c cached tokens: row j = latest q < c with q % W == j, else junk."""
    ring = torch.randn(W, D, generator=gen) * 5
    for q in range(max(0, c - W), c):
        ring[q % W] = kv_full[q]
    return ring


REQS = [(2, 0, 5), (0, 13, 1), (3, 4, 9), (1, 20, 3)]  # (slot, cached, new)
S, C, K = 4, 16, 5


def _batch(seed=50):
    g = torch.Generator().manual_seed(seed)
    meta = step_meta(REQS)
    kv_full = {r: torch.randn(c + n, D, generator=g) for r, (_, c, n) in enumerate(REQS)}
    ckv_full = {r: torch.randn(C, D, generator=g) for r in range(len(REQS))}
    ring = torch.randn(S, W, D, generator=g)
    ckv = torch.randn(S, C, D, generator=g)
    for r, (slot, c, n) in enumerate(REQS):
        ring[slot] = make_ring(kv_full[r], c, g)
        ckv[slot] = ckv_full[r]
    kv = torch.cat([kv_full[r][c:] for r, (_, c, n) in enumerate(REQS)])
    T = kv.shape[0]
    q = torch.randn(T, H, D, generator=g) * 2
    topk = torch.randint(-1, C, (T, K), generator=g)
    sink = torch.randn(H, generator=g)
    return meta, kv_full, ckv_full, ring, ckv, kv, q, topk, sink


def _call(q, kv, ring, ckv, topk, sink, meta, **kw):
    kw.setdefault("ratio", RATIO)
    return sparse_attn(q, kv, ring, ckv, topk, sink, meta["positions"], meta["token_req"],
                       meta["seq_slots"], meta["seq_cached"], window=W, scale=SCALE, **kw)


def test_sparse_attn_mixed_batch_matches_naive():
    meta, kv_full, ckv_full, ring, ckv, kv, q, topk, sink = _batch()
    variants = [(ckv, topk, {}, "topk"), (ckv, None, {"attend_all_compressed": True}, "all"),
                (None, None, {"ratio": 0}, None)]
    for ck, tk, kw, mode in variants:
        out = _call(q, kv, ring, ck, tk, sink, meta, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype
        for t in range(q.shape[0]):
            r = int(meta["token_req"][t])
            p = int(meta["positions"][t])
            sel = topk[t].tolist() if mode == "topk" else mode
            ref = naive_token(q[t], p, kv_full[r], ckv_full[r], sel, sink)
            torch.testing.assert_close(out[t].double(), ref, rtol=1e-5, atol=1e-5)


def test_sparse_attn_bf16_io_and_sink_bounds():
    meta, kv_full, ckv_full, ring, ckv, kv, q, topk, sink = _batch(51)
    out = _call(q.to(torch.bfloat16), kv.to(torch.bfloat16), ring.to(torch.bfloat16),
                ckv.to(torch.bfloat16), topk, sink, meta)
    assert out.dtype == torch.bfloat16
    ref = _call(q, kv, ring, ckv, topk, sink, meta)
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)
    # a huge sink absorbs all attention mass
    tiny = _call(q, kv, ring, ckv, topk, torch.full((H,), 80.0), meta)
    assert tiny.abs().max() < 1e-20


def test_sparse_attn_batch_equals_each_request_alone():
    meta, kv_full, ckv_full, ring, ckv, kv, q, topk, sink = _batch(52)
    out = _call(q, kv, ring, ckv, topk, sink, meta)
    start = 0
    for r, (slot, c, n) in enumerate(REQS):
        m1 = step_meta([(slot, c, n)])
        sl = slice(start, start + n)
        alone = _call(q[sl], kv[sl], ring, ckv, topk[sl], sink, m1)
        torch.testing.assert_close(alone, out[sl], rtol=1e-5, atol=1e-6)
        start += n


def test_ring_update_matches_sequential_writes():
    g = torch.Generator().manual_seed(53)
    reqs = [(1, 3, 2), (0, 10, 15), (2, 0, 1)]  # middle request has more than W new rows
    meta = step_meta(reqs)
    ring = torch.randn(3, W, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(meta["positions"].shape[0], D, generator=g)
    out = ring_update(ring, kv, meta["positions"], meta["token_req"], meta["seq_slots"], window=W)
    ref = ring.clone()
    for t in range(kv.shape[0]):
        ref[int(meta["seq_slots"][meta["token_req"][t]]), int(meta["positions"][t]) % W] = kv[t].to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert not torch.equal(out, ring)


def test_chunked_steps_with_ring_update_equal_one_shot():
    rng = random.Random(54)
    g = torch.Generator().manual_seed(54)
    lens = {0: 31, 1: 22}
    slots = {0: 1, 1: 0}
    Cn = 16
    q_full = {r: torch.randn(L, H, D, generator=g) * 2 for r, L in lens.items()}
    kv_full = {r: torch.randn(L, D, generator=g) for r, L in lens.items()}
    ckv_full = {r: torch.randn(Cn, D, generator=g) for r in lens}
    topk_full = {r: torch.randint(-1, Cn, (L, 7), generator=g) for r, L in lens.items()}
    sink = torch.randn(H, generator=g)

    # one-shot prefill of each request (all compressed entries present, empty ring)
    oneshot = {}
    for r, L in lens.items():
        m = step_meta([(slots[r], 0, L)])
        ring = torch.randn(2, W, D, generator=g)
        ckv = torch.zeros(2, Cn, D)
        ckv[slots[r]] = ckv_full[r]
        oneshot[r] = _call(q_full[r], kv_full[r], ring, ckv, topk_full[r], sink, m)

    # chunked: both requests advance in the same steps with independent random chunkings
    chunks = {r: random_chunks(L, rng, 9) for r, L in lens.items()}
    done = {r: 0 for r in lens}
    ring = torch.randn(2, W, D, generator=g) * 3  # junk where nothing was written yet
    outs = {r: [] for r in lens}
    while any(chunks.values()):
        reqs, order = [], []
        for r in lens:
            if chunks[r]:
                n = chunks[r].pop(0)
                reqs.append((slots[r], done[r], n))
                order.append(r)
        m = step_meta(reqs)
        # compressed cache holds only entries complete by the end of this step; the rest is junk
        ckv = torch.randn(2, Cn, D, generator=g) * 3
        for (slot, c, n), r in zip(reqs, order):
            valid = (c + n) // RATIO
            ckv[slot, :valid] = ckv_full[r][:valid]
        sl = [slice(c, c + n) for (_, c, n) in reqs]
        q = torch.cat([q_full[r][s] for r, s in zip(order, sl)])
        kv = torch.cat([kv_full[r][s] for r, s in zip(order, sl)])
        tk = torch.cat([topk_full[r][s] for r, s in zip(order, sl)])
        out = _call(q, kv, ring, ckv, tk, sink, m)
        ring = ring_update(ring, kv, m["positions"], m["token_req"], m["seq_slots"], window=W)
        start = 0
        for (slot, c, n), r in zip(reqs, order):
            outs[r].append(out[start:start + n])
            done[r] += n
            start += n
    for r in lens:
        torch.testing.assert_close(torch.cat(outs[r]), oneshot[r], rtol=1e-5, atol=1e-6)
