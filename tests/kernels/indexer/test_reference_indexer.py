"""index_scores / candidate_mask / topk_select vs naive per-token loops. Tolerance: scores fp32 vs
fp64 naive 1e-5; masks and indices exact (random scores have no ties)."""
import math

import torch
from _reference_helpers import step_meta

from megagraph.kernels.reference_table import candidate_mask, index_scores, topk_select

INF = float("inf")


def test_index_scores_matches_naive_mixed_batch():
    g = torch.Generator().manual_seed(70)
    Hi, Di, S, C, ratio, ws = 3, 8, 3, 10, 2, 8 ** -0.5 * 3 ** -0.5
    reqs = [(2, 0, 4), (0, 7, 1), (1, 12, 6)]
    m = step_meta(reqs)
    T = m["positions"].shape[0]
    qi = torch.randn(T, Hi, Di, generator=g)
    w = torch.randn(T, Hi, generator=g)
    ikey = torch.randn(S, C, Di, generator=g).to(torch.bfloat16)
    out = index_scores(qi, w, ikey, m["positions"], m["token_req"], m["seq_slots"], ratio=ratio, weight_scale=ws)
    assert out.dtype == torch.float32 and out.shape == (T, C)
    for t in range(T):
        slot = int(m["seq_slots"][m["token_req"][t]])
        p = int(m["positions"][t])
        for j in range(C):
            if j >= (p + 1) // ratio:
                assert out[t, j] == -INF
                continue
            ref = sum(w[t, h].item() * ws * max(0.0, float(qi[t, h].double() @ ikey[slot, j].double()))
                      for h in range(Hi))
            assert math.isclose(out[t, j].item(), ref, rel_tol=1e-5, abs_tol=1e-5)
    # each request alone gives the same rows
    start = 0
    for slot, c, n in reqs:
        m1 = step_meta([(slot, c, n)])
        sl = slice(start, start + n)
        alone = index_scores(qi[sl], w[sl], ikey, m1["positions"], m1["token_req"], m1["seq_slots"],
                             ratio=ratio, weight_scale=ws)
        torch.testing.assert_close(alone, out[sl], rtol=1e-6, atol=1e-6)
        start += n


def naive_candidates(row, block, topk_blocks):
    C = len(row)
    vis = [v > -INF for v in row]
    n_vis = sum(vis)
    nb = -(-C // block)
    bs = []
    for b in range(nb):
        vals = [row[j] for j in range(b * block, min(C, (b + 1) * block))]
        bs.append(max(vals))
    if n_vis:
        bs[(n_vis - 1) // block] = INF
    order = sorted(range(nb), key=lambda b: -bs[b])[:min(topk_blocks, nb)]
    keep = {b for b in order if bs[b] > -INF}
    return [vis[j] and (j // block) in keep for j in range(C)]


def test_candidate_mask_matches_naive():
    g = torch.Generator().manual_seed(71)
    T, C, block = 6, 37, 4  # ragged last block
    scores = torch.randn(T, C, generator=g)
    n_vis = [37, 30, 13, 1, 0, 22]
    for t, nv in enumerate(n_vis):
        scores[t, nv:] = -INF
    scores[1, 28] = -50.0  # newest visible block scores low but is forced in
    for kb in (3, 20):
        out = candidate_mask(scores, block=block, topk_blocks=kb)
        assert out.dtype == torch.bool
        for t in range(T):
            assert out[t].tolist() == naive_candidates(scores[t].tolist(), block, kb), (kb, t)
    out = candidate_mask(scores, block=block, topk_blocks=3)
    assert out[1, 28] and not out[4].any() and out.sum(dim=1).max() <= 3 * block


def naive_topk(row, mask, k):
    cand = [(v, j) for j, v in enumerate(row) if (mask is None or mask[j]) and v > -INF]
    top = sorted(cand, key=lambda vj: -vj[0])[:min(k, len(row))]
    ids = sorted(j for _, j in top)
    return ids + [-1] * (k - len(ids))


def test_topk_select_matches_naive():
    g = torch.Generator().manual_seed(72)
    T, C = 5, 12
    scores = torch.randn(T, C, generator=g)
    scores[1, 3:] = -INF
    scores[2, :] = -INF
    mask = torch.rand(T, C, generator=g) > 0.3
    for k, msk in [(4, None), (4, mask), (12, mask), (16, None)]:
        out = topk_select(scores, msk, k=k)
        assert out.dtype == torch.int64 and out.shape == (T, k)
        for t in range(T):
            ref = naive_topk(scores[t].tolist(), None if msk is None else msk[t].tolist(), k)
            assert out[t].tolist() == ref, (k, t)


def test_indexer_pipeline_candidates_then_topk():
    # layer-20 style: candidates from one score set restrict another layer's top-k
    g = torch.Generator().manual_seed(73)
    scores_a = torch.randn(3, 40, generator=g)
    scores_b = torch.randn(3, 40, generator=g)
    scores_a[:, 33:] = -INF
    scores_b[:, 33:] = -INF
    cand = candidate_mask(scores_a, block=8, topk_blocks=2)
    sel = topk_select(scores_b, cand, k=10)
    for t in range(3):
        chosen = [j for j in sel[t].tolist() if j >= 0]
        assert chosen and all(cand[t, j] for j in chosen) and cand[t, 32]  # newest block forced
        assert sel[t].tolist() == naive_topk(scores_b[t].tolist(), cand[t].tolist(), 10)


def test_topk_ties_break_toward_lower_index_on_every_device():
    """ReLU-weighted index scores tie at exactly 0 and blocks share maxima; torch.topk's tie order
    differs between CPU and CUDA, so the selection fixes it: the lower index wins."""
    from megagraph.kernels.indexer.reference import candidate_mask, topk_select

    g = torch.Generator().manual_seed(7)
    s = torch.relu(torch.randn(40, 96, generator=g)).round(decimals=1)  # many exact ties
    s[:, 80:] = float("-inf")
    s[3] = 0.0
    out = topk_select(s, k=12)
    assert torch.equal(out[3], torch.arange(12))
    for t in range(40):  # every selected entry beats or ties every unselected one, ties by index
        sel = out[t][out[t] >= 0]
        rest = torch.ones(96, dtype=torch.bool)
        rest[sel] = False
        kth = s[t, sel].min()
        assert (s[t, rest] <= kth).all()
        tied_rest = rest.nonzero().flatten()[s[t, rest] == kth]
        tied_sel = sel[s[t, sel] == kth]
        assert tied_rest.numel() == 0 or tied_sel.max() < tied_rest.min()
    m = candidate_mask(s, block=4, topk_blocks=5)
    devices = ["cuda"] if torch.cuda.is_available() else []
    for dev in devices:
        assert torch.equal(topk_select(s.to(dev), k=12).cpu(), out)
        assert torch.equal(candidate_mask(s.to(dev), block=4, topk_blocks=5).cpu(), m)


def test_selections_in_row_chunks_equal_whole(monkeypatch):
    """The selections run over chunks of rows to bound their temporaries; chunking changes nothing."""
    from megagraph.kernels.common import chunks as _chunks
    from megagraph.kernels.indexer import reference as ix

    g = torch.Generator().manual_seed(11)
    s = torch.relu(torch.randn(37, 100, generator=g)).round(decimals=1)
    s[:, 90:] = float("-inf")
    m = torch.rand(37, 100, generator=g) > 0.2
    whole = (ix.topk_select(s, m, k=12), ix.topk_select(s, k=12), ix.candidate_mask(s, block=4, topk_blocks=5))
    monkeypatch.setattr(_chunks, "ROW_CHUNK_ELEMS", 300)  # 3 rows per chunk, a ragged last chunk
    chunked = (ix.topk_select(s, m, k=12), ix.topk_select(s, k=12), ix.candidate_mask(s, block=4, topk_blocks=5))
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)
