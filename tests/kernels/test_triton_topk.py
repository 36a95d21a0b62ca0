"""kernels/triton/topk.py (the indexer's top-k selection and two-level candidate mask, radix
select per row) vs the reference kernels.reference.indexer.topk_select / candidate_mask:
torch.equal on every case (integer / bool output, so bitwise).

Cases: k above C, fewer selectable entries than k (rows fully -inf, -inf suffixes as the indexer
produces them, -inf at random places), a mask (also broadcast), heavy ties at the k-th value (a few
distinct values: the lowest-column rule), -0.0 / +0.0 mixed, +inf scores, C not a multiple of the
kernel's block, T = 1 and a few hundred rows, bf16 / fp16 scores, strided scores; every output
element written (poisoned outputs); the fallbacks; on CUDA a graph replay equal to eager and the
real prefill size (T = 512, C = 34816, k = 512 and 2048). candidate_mask: visible prefixes and
-inf at random places (the forced block is the one of entry n_visible - 1), block sizes 2 / 3 /
8 / 16, more blocks wanted than exist, +inf ties with the forced block, bf16, topk_blocks = 0,
its output feeding topk_select; on CUDA the V4.1 size (blocks of 8, 2048 kept) and a graph replay.

CUDA GPU, or the CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_interp.py runs this file
that way); skipped otherwise. NOT yet run on the H200 (registry status "unvalidated")."""
from __future__ import annotations

import pytest
import torch
from megagraph.kernels.reference.indexer import candidate_mask as ref_candidate_mask
from megagraph.kernels.reference.indexer import topk_select as ref_topk_select
from megagraph.kernels.triton import topk as tk
from poisoned_alloc import poisoned
from test_triton_attention import CUDA, DEV, pytestmark  # noqa: F401

NINF = float("-inf")


def scores(T, C, seed, *, dtype=torch.float32, kind="randn"):
    """Fresh random scores f32[T, C] (never all-equal): `kind` randn (distinct values), few (7
    distinct values: heavy ties), zeros (+-0.0 mixed with a few other values), relu (the indexer's
    look: many exact zeros, positive values)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        s = torch.randn(T, C, generator=g) * 4
    elif kind == "few":
        s = torch.randint(-3, 4, (T, C), generator=g).float() * 0.5
    elif kind == "zeros":
        sign = torch.where(torch.rand(T, C, generator=g) < 0.5, -1.0, 1.0)
        s = sign * 0.0
        other = torch.rand(T, C, generator=g) < 0.1
        s = torch.where(other, torch.randn(T, C, generator=g), s)
    elif kind == "relu":
        s = torch.randn(T, C, generator=g).relu() * 3
    else:
        raise ValueError(kind)
    return s.to(dtype).to(DEV)


def suffix_inf(s, seed):
    """-inf on a random suffix of each row (the indexer's invisible entries), some rows fully."""
    g = torch.Generator().manual_seed(seed)
    T, C = s.shape
    vis = torch.randint(0, C + 1, (T, 1), generator=g)
    vis[0] = 0
    vis[-1] = C
    col = torch.arange(C)[None, :]
    return torch.where((col < vis).to(s.device), s, torch.full_like(s, NINF))


def random_inf(s, seed, frac=0.5):
    g = torch.Generator().manual_seed(seed)
    hole = (torch.rand(s.shape, generator=g) < frac).to(s.device)
    return torch.where(hole, torch.full_like(s, NINF), s)


def check(s, mask=None, *, k):
    with poisoned():
        got = tk.topk_select(s, mask, k=k)
    want = ref_topk_select(s, mask, k=k)
    assert got.dtype == torch.int64 and got.shape == want.shape == (s.shape[0], k)
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()
    return got


@pytest.mark.parametrize("T,C,k", [(1, 100, 8), (7, 1024, 64), (5, 3000, 512), (64, 1500, 100),
                                   (3, 2049, 600), (9, 40, 64), (2, 1, 8), (4, 512, 512)])
@pytest.mark.parametrize("kind", ["randn", "few", "zeros", "relu"])
def test_topk_select_matches_reference(T, C, k, kind):
    check(scores(T, C, seed=T * 1009 + C * 7 + k, kind=kind), k=k)


@pytest.mark.parametrize("kind", ["randn", "few", "zeros"])
def test_topk_select_compare_digits(kind, monkeypatch):
    """The 4-bit radix counted by comparison (RADIX_BITS = 4; the default is 8, tl.histogram):
    the same outputs, ties, -inf suffixes and masks included."""
    monkeypatch.setattr(tk, "RADIX_BITS", 4)
    base = scores(6, 2100, seed=41, kind=kind)
    check(base, k=300)
    check(suffix_inf(base, seed=4), k=300)
    check(base, torch.rand(base.shape, generator=torch.Generator().manual_seed(5)).to(DEV) < 0.5,
          k=64)


@pytest.mark.parametrize("kind", ["randn", "few", "relu"])
@pytest.mark.parametrize("T,C,k", [(16, 1300, 256), (5, 300, 600), (8, 2500, 32)])
def test_topk_select_fewer_selectable_than_k(T, C, k, kind):
    """-inf suffixes (the indexer's invisible entries; first row all -inf, last none), -inf at
    random places (dense and sparse): those are never selected, -1 pads instead."""
    base = scores(T, C, seed=C + k, kind=kind)
    check(suffix_inf(base, seed=1), k=k)
    check(random_inf(base, seed=2), k=k)
    check(random_inf(base, seed=3, frac=0.97), k=k)
    check(torch.full_like(base, NINF), k=k)


@pytest.mark.parametrize("kind", ["randn", "few"])
def test_topk_select_mask(kind):
    """The mask argument: masked-out entries count as -inf, with -inf scores too; a [C] mask
    broadcast over the rows as the reference's masked_fill does."""
    T, C, k = 12, 1777, 200
    s = suffix_inf(scores(T, C, seed=11, kind=kind), seed=12)
    g = torch.Generator().manual_seed(13)
    dense = (torch.rand(T, C, generator=g) < 0.3).to(DEV)
    check(s, dense, k=k)
    check(s, (torch.rand(T, C, generator=g) < 0.97).to(DEV), k=k)
    check(s, torch.zeros(T, C, dtype=torch.bool, device=DEV), k=k)
    check(s, (torch.rand(C, generator=g) < 0.5).to(DEV), k=k)


def test_topk_select_infinities_and_signed_zeros():
    """+inf scores (selected first, tied among themselves), -0.0 == +0.0 as one tied value
    across the k-th position, -FLT_MAX (the smallest selectable key), all in one row set."""
    T, C = 6, 900
    g = torch.Generator().manual_seed(21)
    s = scores(T, C, seed=22, kind="zeros")
    pick = torch.rand(T, C, generator=g)
    s = torch.where((pick < 0.05).to(DEV), torch.full_like(s, float("inf")), s)
    s = torch.where(((pick > 0.05) & (pick < 0.1)).to(DEV), torch.full_like(s, NINF), s)
    s[1] = -torch.finfo(torch.float32).max
    s[2, ::3] = -torch.finfo(torch.float32).max
    s[3] = float("inf")
    for k in (8, 40, 60, 300, 1000):
        check(s, k=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_select_half_inputs(dtype):
    """bf16 / fp16 scores are widened to fp32 as the reference's .float(): heavy ties from the
    coarse rounding too."""
    s = suffix_inf(scores(20, 2200, seed=31, dtype=dtype), seed=32)
    check(s, k=300)
    check(scores(3, 700, seed=33, dtype=dtype, kind="zeros"), k=64)


def test_topk_select_many_rows_and_strided():
    """A few hundred rows; a row-strided view gives the reference's (and its copy's) result."""
    check(suffix_inf(scores(300, 200, seed=41, kind="relu"), seed=42), k=16)
    wide = scores(10, 2 * 777, seed=43, kind="few")
    view = wide[:, 5:5 + 777]
    got = check(view, k=100)
    assert torch.equal(got, tk.topk_select(view.contiguous(), k=100))


def test_topk_select_fallbacks():
    """Empty rows / columns and k = 0 take the capturable kernel (same results)."""
    for T, C, k in ((0, 50, 8), (4, 0, 8), (3, 50, 0)):
        s = torch.randn(T, C).to(DEV)
        assert torch.equal(tk.topk_select(s, k=k), ref_topk_select(s, k=k))


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the interpreter case stays small)")
@pytest.mark.parametrize("k", [512, 2048])
@pytest.mark.parametrize("kind", ["randn", "relu", "few"])
def test_topk_select_prefill_size(k, kind):
    """The real prefill size: 512 tokens over 34816 compressed entries, visible prefixes."""
    s = suffix_inf(scores(512, 34816, seed=61 + k, kind=kind), seed=62)
    check(s, k=k)
    check(s, (torch.rand(512, 34816, device=DEV) < 0.9), k=k)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_topk_select_captures_in_cuda_graph():
    s = suffix_inf(scores(256, 8192, seed=71, kind="relu"), seed=72)
    eager = tk.topk_select(s, k=512)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st), torch.cuda.graph(g):
        out = tk.topk_select(s, k=512)
    torch.cuda.current_stream().wait_stream(st)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(out, ref_topk_select(s, k=512))


# candidate_mask (the two-level candidate blocks; same module)

def check_cand(s, *, block, topk_blocks):
    with poisoned():
        got = tk.candidate_mask(s, block=block, topk_blocks=topk_blocks)
    want = ref_candidate_mask(s, block=block, topk_blocks=topk_blocks)
    assert got.dtype == torch.bool and got.shape == want.shape == s.shape
    assert bool((got.view(torch.uint8) <= 1).all()), "an element was not written"
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()
    return got


@pytest.mark.parametrize("T,C,block,kb", [(1, 100, 8, 5), (7, 1024, 8, 64), (5, 3000, 8, 200),
                                          (64, 700, 8, 30), (3, 2049, 2, 600), (4, 500, 16, 1000),
                                          (6, 999, 3, 40), (2, 1, 8, 4), (5, 300, 8, 1)])
@pytest.mark.parametrize("kind", ["randn", "few", "relu"])
def test_candidate_mask_matches_reference(T, C, block, kb, kind):
    """Visible prefixes (first row none, last row all), block sizes 2 / 3 / 8 / 16 (C not a
    multiple of them), more blocks wanted than there are, a single block."""
    s = suffix_inf(scores(T, C, seed=T * 31 + C + block * 7 + kb, kind=kind), seed=C)
    check_cand(s, block=block, topk_blocks=kb)


@pytest.mark.parametrize("kind", ["randn", "few", "zeros"])
def test_candidate_mask_corners(kind):
    """-inf at random places (the newest block is then the one of entry n_visible - 1, as the
    reference computes it, even where that block holds no visible entry), +inf scores tied with
    the forced block, signed zeros, bf16 scores, all rows -inf, topk_blocks = 0."""
    T, C = 9, 1500
    s = suffix_inf(scores(T, C, seed=81, kind=kind), seed=82)
    check_cand(random_inf(s, seed=83), block=8, topk_blocks=50)
    check_cand(random_inf(s, seed=84, frac=0.98), block=8, topk_blocks=50)
    g = torch.Generator().manual_seed(85)
    hot = (torch.rand(T, C, generator=g) < 0.01).to(DEV)
    check_cand(torch.where(hot, torch.full_like(s, float("inf")), s), block=8, topk_blocks=20)
    check_cand(s.bfloat16(), block=8, topk_blocks=50)
    check_cand(torch.full_like(s, NINF), block=8, topk_blocks=50)
    assert torch.equal(tk.candidate_mask(s, block=8, topk_blocks=0),
                       ref_candidate_mask(s, block=8, topk_blocks=0))


def test_candidate_mask_feeds_topk_select():
    """The V4.1 chain at a small size: candidates from the scores, then topk_select under them."""
    s = suffix_inf(scores(16, 2000, seed=91, kind="relu"), seed=92)
    cand = check_cand(s, block=8, topk_blocks=64)
    check(s, cand, k=128)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the interpreter case stays small)")
@pytest.mark.parametrize("kind", ["randn", "relu", "few"])
def test_candidate_mask_prefill_size(kind):
    """V4.1-Flash's candidate blocks at the prefill size: 512 tokens over 34816 entries, blocks of
    8, 2048 blocks kept."""
    s = suffix_inf(scores(512, 34816, seed=95, kind=kind), seed=96)
    check_cand(s, block=8, topk_blocks=2048)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_candidate_mask_captures_in_cuda_graph():
    s = suffix_inf(scores(256, 8192, seed=97, kind="relu"), seed=98)
    eager = tk.candidate_mask(s, block=8, topk_blocks=256)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st), torch.cuda.graph(g):
        out = tk.candidate_mask(s, block=8, topk_blocks=256)
    torch.cuda.current_stream().wait_stream(st)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(out, ref_candidate_mask(s, block=8, topk_blocks=256))
