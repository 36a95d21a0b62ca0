"""The reference ops that run over row chunks (kernels/common/chunks.py) give bitwise the same
result with a tiny chunk budget (one row per pass, or a few rows with a ragged last pass) as in one
pass, on a mixed batch of requests of different lengths.

Heads are a multiple of 4: MKL's sgemm takes another path, with other rounding, for a product of
a few rows (below 4 with one thread; below 12 and not a multiple of 4 with two), so a one-row chunk
of 3 heads would differ by BLAS path, not by chunking; the model's 64 heads never get there."""
import pytest
import torch
from _reference_helpers import step_meta

from megagraph.kernels.common import chunks as _chunks
from megagraph.kernels.attention import reference as attention
from megagraph.kernels.indexer import reference as indexer
from megagraph.kernels.fused.reference import sparse_attn_q

REQS = [(2, 0, 7), (0, 13, 1), (3, 4, 11), (1, 20, 6)]  # (slot, cached, new): 25 tokens
H, D, W, S, C, K = 4, 16, 6, 4, 24, 5
HI, DI = 4, 8
ROPE = dict(rope_dim=8, theta=160000.0, yarn_factor=16.0, yarn_original=64, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0)
LONGEST = max(n for _, _, n in REQS)


def _meta():
    m = step_meta(REQS)
    return m, (m["positions"], m["token_req"], m["seq_slots"])


def _attn_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    m, _ = _meta()
    T = m["positions"].shape[0]
    q = (torch.randn(T, H, D, generator=g) * 2).to(torch.bfloat16)
    kv = torch.randn(T, D, generator=g)
    ring = torch.randn(S, W, D, generator=g)
    ckv = torch.randn(S, C, D, generator=g)
    topk = torch.randint(-1, C, (T, K), generator=g)
    sink = torch.randn(H, generator=g)
    return m, q, kv, ring, ckv, topk, sink


def _index_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    m, meta3 = _meta()
    T = m["positions"].shape[0]
    qi = torch.randn(T, HI, DI, generator=g)
    w = torch.randn(T, HI, generator=g)
    ikey = torch.randn(S, C, DI, generator=g).to(torch.bfloat16)
    return (qi, w, ikey, *meta3)


def _whole_and_chunked(monkeypatch, fn, row_elems, split_rows=LONGEST):
    """fn() in one pass, then with budgets of 1 row and of 3 rows (of row_elems elements) per pass;
    checks that the 3-row budget splits ``split_rows`` rows into several passes, the last ragged."""
    whole = fn()
    chunked = []
    for rows in (1, 3):
        monkeypatch.setattr(_chunks, "ROW_CHUNK_ELEMS", rows * row_elems)
        chunked.append(fn())
    sizes = [s.stop - s.start for s in _chunks.row_slices(0, split_rows, row_elems)]
    assert len(sizes) >= 3 and sizes[0] == 3 and 0 < sizes[-1] < 3
    return whole, chunked


def _bits(t):
    """The raw bits of t (torch.equal on floats holds −0 == +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_all_equal(whole, chunked):
    whole = whole if isinstance(whole, tuple) else (whole,)
    for res in chunked:
        for a, b in zip(whole, res if isinstance(res, tuple) else (res,), strict=True):
            assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("mode", ["topk", "all", "window"])
def test_sparse_attn_chunked_equals_whole(monkeypatch, mode):
    m, q, kv, ring, ckv, topk, sink = _attn_inputs(80)
    ck, tk, kw = {"topk": (ckv, topk, {}), "all": (ckv, None, {"attend_all_compressed": True}),
                  "window": (None, None, {})}[mode]

    def run():
        return attention.sparse_attn(q, kv, ring, ck, tk, sink, m["positions"], m["token_req"],
                                     m["seq_slots"], m["seq_cached"], window=W, scale=D ** -0.5,
                                     ratio=2, **kw)

    # keys per row of the longest request: ring + its step rows (+ compressed entries)
    keys = W + LONGEST + (C if ck is not None else 0)
    whole, chunked = _whole_and_chunked(monkeypatch, run, H * keys)
    assert whole.abs().sum() > 0
    _assert_all_equal(whole, chunked)


def test_sparse_attn_q_chunked_equals_whole(monkeypatch):
    m, q, kv, ring, ckv, topk, sink = _attn_inputs(81)

    def run():
        return sparse_attn_q(q, kv, ring, ckv, topk, sink, m["positions"], m["token_req"], m["seq_slots"],
                             m["seq_cached"], window=W, scale=D ** -0.5, ratio=2,
                             attend_all_compressed=False, act_fmt="fp8_1x128", **ROPE)

    whole, chunked = _whole_and_chunked(monkeypatch, run, H * (W + LONGEST + C))
    _assert_all_equal(whole, chunked)


def test_index_scores_chunked_equals_whole(monkeypatch):
    args = _index_inputs(82)

    def run():
        return indexer.index_scores(*args, ratio=2, weight_scale=0.3)

    whole, chunked = _whole_and_chunked(monkeypatch, run, HI * C)
    assert torch.isfinite(whole).any() and torch.isinf(whole).any()
    _assert_all_equal(whole, chunked)


def test_selections_chunked_equal_whole(monkeypatch):
    """candidate_mask / topk_select over the mixed batch's index scores (rows of C entries); the
    rounded scores tie, so the lower-index tie rule is exercised in every chunk."""
    scores = indexer.index_scores(*_index_inputs(83), ratio=2, weight_scale=0.3).round(decimals=0)
    g = torch.Generator().manual_seed(84)
    mask = torch.rand(scores.shape, generator=g) > 0.2

    def run():
        return (indexer.candidate_mask(scores, block=4, topk_blocks=3), indexer.topk_select(scores, k=6),
                indexer.topk_select(scores, mask, k=6))

    whole, chunked = _whole_and_chunked(monkeypatch, run, C, split_rows=scores.shape[0])
    _assert_all_equal(whole, chunked)
