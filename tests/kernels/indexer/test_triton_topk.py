"""kernels/indexer/triton_topk.py (the indexer's top-k selection and two-level candidate mask,
a streaming exact select per row) vs the reference kernels.indexer.reference.topk_select /
candidate_mask: torch.equal on every case (integer / bool output, so bitwise).

Cases: k above C, fewer selectable entries than k (rows fully -inf, -inf suffixes as the indexer
produces them, -inf at random places), a mask (also broadcast), heavy ties at the k-th value (a few
distinct values: the lowest-column rule), -0.0 / +0.0 mixed, +inf scores, C not a multiple of the
kernel's step, T = 1 and a few hundred rows, bf16 / fp16 scores, strided scores; every output
element written (poisoned outputs); the fallbacks; on CUDA a graph replay equal to eager and the
real prefill size (T = 512, C = 34816, k = 512 and 2048). candidate_mask: visible prefixes and
-inf at random places (the forced block is the one of entry n_visible - 1), block sizes 2 / 3 /
8 / 16, more blocks wanted than exist, +inf ties with the forced block, bf16, topk_blocks = 0,
its output feeding topk_select; on CUDA the V4.1 size (blocks of 8, 2048 kept) and a graph replay.

The select also runs with tiny steps / buffers (`stream_knobs`: explicit IndexerConfigs reaching
every tightening path, the "whole bin" stops, several segments per row and their merge) on rows
built to stress it: ascending rows (every entry enters the buffer), long runs of equal values and
all-equal rows (the bin of the k-th value is the whole row), signed zeros, +-inf, -FLT_MAX,
denormals, fewer selectable entries than k; a seeded fuzz over shapes x knobs x data; on CUDA the
V4.1 ratio-1 sizes (512 x 135168 and 64 x 135168, top-512; candidate blocks of 8, 2048 kept) and
graph replays.

CUDA GPU, or the CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_interp.py runs this file
that way); skipped otherwise."""
from __future__ import annotations

import pytest
import torch
from megagraph.kernels.indexer.reference import candidate_mask as ref_candidate_mask
from megagraph.kernels.indexer.reference import topk_select as ref_topk_select
from megagraph.kernels.indexer import triton_topk as tk
from megagraph.kernels.indexer.config import IndexerConfig
from poisoned_alloc import poisoned
from triton_run import CUDA, DEV, pytestmark  # noqa: F401

NINF = float("-inf")
FMAX = torch.finfo(torch.float32).max


# stream knob sets: (stream_block, stream_tb, stream_cap, topk_segments, cand_stream_elems).
# tight: the smallest buffer (cap = KK + one step, slack 0: every tightening exact, one after
# nearly every step); slack: room for "whole bin" stops; segments: 3 per row (merge kernels);
# the merges' tile = the select's (several steps per merge); default: the shipped config (one
# segment and no tightening at these small sizes).
KNOB_FIELDS = ("stream_block", "stream_tb", "stream_cap", "topk_segments", "cand_stream_elems")


def knobs(block, tb, cap, segments, cand_elems) -> IndexerConfig:
    """An IndexerConfig with these stream knobs; the merges' tiles = the select's."""
    return IndexerConfig(**dict(zip(KNOB_FIELDS, (block, tb, cap, segments, cand_elems))),
                         stream_merge_tb=tb, cand_merge_tb=tb)


STREAM_KNOBS = {"tight": knobs(32, 32, 0, 1, 32), "slack": knobs(64, 32, 400, 1, 64),
                "segments": knobs(32, 32, 0, 3, 32), "default": IndexerConfig()}


@pytest.fixture(params=list(STREAM_KNOBS))
def stream_knobs(request) -> IndexerConfig:
    """Each knob set of STREAM_KNOBS."""
    return STREAM_KNOBS[request.param]


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
    elif kind == "asc":  # ascending rows: the stream's worst case (every entry enters the buffer)
        s = torch.arange(C).float().repeat(T, 1) + torch.rand(T, C, generator=g)
    elif kind == "ascties":  # ascending runs of 7 equal values
        s = (torch.arange(C) // 7).float().repeat(T, 1) - C / 14
    elif kind == "const":  # one value: the k-th value's bin is the whole row
        s = torch.full((T, C), 1.5)
    elif kind == "extreme":  # +-inf, +-FLT_MAX, +-denormal, -0.0 among normal values
        s = torch.randn(T, C, generator=g)
        p = torch.rand(T, C, generator=g)
        for lo, v in ((0.0, float("inf")), (0.05, -FMAX), (0.1, FMAX), (0.15, 1e-45),
                      (0.2, -1e-45), (0.25, -0.0), (0.3, NINF)):
            s = torch.where((p >= lo) & (p < lo + 0.05), torch.full_like(s, v), s)
    else:
        raise ValueError(kind)
    return s.to(dtype).to(DEV)


def mixed(T, C, seed, kinds, *, dtype=torch.float32):
    """T rows of C scores, row r of kind kinds[r % len(kinds)]. Every row is its own problem for
    the kernels (one program, or one set of segments, per row), so one launch covers every kind:
    the interpreter's cost is per program step, and this keeps the programs few."""
    return torch.cat([scores(1, C, seed=seed + r, kind=kinds[r % len(kinds)], dtype=dtype)
                      for r in range(T)])


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


def check(s, mask=None, *, k, cfg=None):
    with poisoned():
        got = tk.topk_select(s, mask, k=k, kernel_config=cfg)
    want = ref_topk_select(s, mask, k=k)
    assert got.dtype == torch.int64 and got.shape == want.shape == (s.shape[0], k)
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()
    return got


@pytest.mark.parametrize("T,C,k", [(1, 100, 8), (4, 1024, 64), (5, 3000, 512), (8, 1500, 100),
                                   (3, 2049, 600), (4, 40, 64), (2, 1, 8), (4, 512, 512)])
def test_topk_select_matches_reference(T, C, k):
    """Rows of distinct values, of few values (ties), of signed zeros, of ReLU'd values."""
    check(mixed(T, C, T * 1009 + C * 7 + k, ["randn", "few", "zeros", "relu"]), k=k)


@pytest.mark.parametrize("T,C,k", [(3, 1300, 256), (3, 300, 600), (3, 2500, 32)])
def test_topk_select_fewer_selectable_than_k(T, C, k):
    """-inf suffixes (the indexer's invisible entries; first row all -inf, last none), -inf at
    random places (dense and sparse): those are never selected, -1 pads instead."""
    base = mixed(T, C, C + k, ["randn", "few", "relu"])
    check(suffix_inf(base, seed=1), k=k)
    check(random_inf(base, seed=2), k=k)
    check(random_inf(base, seed=3, frac=0.97), k=k)
    check(torch.full_like(base, NINF), k=k)


def test_topk_select_mask():
    """The mask argument: masked-out entries count as -inf, with -inf scores too; a [C] mask
    broadcast over the rows as the reference's masked_fill does."""
    T, C, k = 4, 1777, 200
    s = suffix_inf(mixed(T, C, 11, ["randn", "few"]), seed=12)
    g = torch.Generator().manual_seed(13)
    dense = (torch.rand(T, C, generator=g) < 0.3).to(DEV)
    check(s, dense, k=k)
    check(s, (torch.rand(T, C, generator=g) < 0.97).to(DEV), k=k)
    check(s, torch.zeros(T, C, dtype=torch.bool, device=DEV), k=k)
    check(s, (torch.rand(C, generator=g) < 0.5).to(DEV), k=k)


def test_topk_select_infinities_and_signed_zeros():
    """+inf scores (selected first, tied among themselves), -0.0 == +0.0 as one tied value
    across the k-th position, -FLT_MAX (the smallest selectable key), all in one row set."""
    T, C = 4, 900
    g = torch.Generator().manual_seed(21)
    s = scores(T, C, seed=22, kind="zeros")
    pick = torch.rand(T, C, generator=g)
    s = torch.where((pick < 0.05).to(DEV), torch.full_like(s, float("inf")), s)
    s = torch.where(((pick > 0.05) & (pick < 0.1)).to(DEV), torch.full_like(s, NINF), s)
    s[1] = -torch.finfo(torch.float32).max
    s[2, ::3] = -torch.finfo(torch.float32).max
    s[3] = float("inf")
    for k in (8, 60, 1000):
        check(s, k=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_select_half_inputs(dtype):
    """bf16 / fp16 scores are widened to fp32 as the reference's .float(): heavy ties from the
    coarse rounding too."""
    s = suffix_inf(scores(4, 2200, seed=31, dtype=dtype), seed=32)
    check(s, k=300)
    check(scores(3, 700, seed=33, dtype=dtype, kind="zeros"), k=64)


def test_topk_select_many_rows_and_strided():
    """A few hundred rows; a row-strided view gives the reference's (and its copy's) result."""
    check(suffix_inf(scores(24, 200, seed=41, kind="relu"), seed=42), k=16)
    wide = scores(4, 2 * 777, seed=43, kind="few")
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

def check_cand(s, *, block, topk_blocks, cfg=None):
    with poisoned():
        got = tk.candidate_mask(s, block=block, topk_blocks=topk_blocks, kernel_config=cfg)
    want = ref_candidate_mask(s, block=block, topk_blocks=topk_blocks)
    assert got.dtype == torch.bool and got.shape == want.shape == s.shape
    assert bool((got.view(torch.uint8) <= 1).all()), "an element was not written"
    assert torch.equal(got, want), (got != want).nonzero()[:8].tolist()
    return got


@pytest.mark.parametrize("T,C,block,kb", [(1, 100, 8, 5), (7, 1024, 8, 64), (5, 3000, 8, 200),
                                          (8, 700, 8, 30), (3, 2049, 2, 600), (4, 500, 16, 1000),
                                          (6, 999, 3, 40), (2, 1, 8, 4), (5, 300, 8, 1)])
def test_candidate_mask_matches_reference(T, C, block, kb):
    """Visible prefixes (first row none, last row all), block sizes 2 / 3 / 8 / 16 (C not a
    multiple of them), more blocks wanted than there are, a single block."""
    s = suffix_inf(mixed(T, C, T * 31 + C + block * 7 + kb, ["randn", "few", "relu"]), seed=C)
    check_cand(s, block=block, topk_blocks=kb)


def test_candidate_mask_corners():
    """-inf at random places (the newest block is then the one of entry n_visible - 1, as the
    reference computes it, even where that block holds no visible entry), +inf scores tied with
    the forced block, signed zeros, bf16 scores, all rows -inf, topk_blocks = 0."""
    T, C = 3, 1500
    s = suffix_inf(mixed(T, C, 81, ["randn", "few", "zeros"]), seed=82)
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
    s = suffix_inf(scores(4, 2000, seed=91, kind="relu"), seed=92)
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


# the select at tiny knobs - every path of its candidate buffer -
# and at the V4.1 ratio-1 sizes

FUZZ_CASES = 40 if CUDA else 12  # the interpreter runs each case's programs one by one
STRESS = ["randn", "few", "zeros", "relu", "asc", "ascties", "const", "extreme"]


@pytest.mark.parametrize("C,k", [(1200, 64), (500, 100), (300, 600), (1, 8)])
def test_topk_select_stream(C, k, stream_knobs):
    """Rows that stress the stream: ascending (every entry enters the buffer, a tightening every
    step at the tight knobs), runs of equal values and one value for the whole row (the k-th
    value's bin is the row: the exact tie rule at every tightening), signed zeros, +-inf,
    +-FLT_MAX, denormals; with -inf suffixes (the first row without a selectable entry, the
    last fully visible)."""
    check(suffix_inf(mixed(len(STRESS), C, 5003 + C + k, STRESS), seed=C + 1), k=k,
          cfg=stream_knobs)


def test_topk_select_stream_masks_and_few_selectable(stream_knobs):
    """Masks (dense, sparse, none selectable, broadcast), -inf at random places, all -inf, bf16."""
    T, C, k = 3, 600, 120
    g = torch.Generator().manual_seed(5101)
    s = suffix_inf(scores(T, C, seed=5102, kind="relu"), seed=5103)
    dens = torch.tensor([0.1, 0.5, 0.97])[:, None]  # one density per row: dense .. sparse
    check(s, (torch.rand(T, C, generator=g) < dens).to(DEV), k=k, cfg=stream_knobs)
    check(s, torch.zeros(T, C, dtype=torch.bool, device=DEV), k=k, cfg=stream_knobs)
    check(s, (torch.rand(C, generator=g) < 0.3).to(DEV), k=k, cfg=stream_knobs)
    check(random_inf(s, seed=5104, frac=0.93), k=k, cfg=stream_knobs)
    check(torch.full_like(s, NINF), k=k, cfg=stream_knobs)
    check(scores(T, C, seed=5105, kind="few", dtype=torch.bfloat16), k=k, cfg=stream_knobs)


CAND_STRESS = ["randn", "few", "zeros", "asc", "const", "extreme"]


@pytest.mark.parametrize("C,block,kb", [(1600, 8, 30), (600, 3, 50), (500, 16, 1000),
                                        (400, 1, 64), (1500, 8, 2)])
def test_candidate_mask_stream(C, block, kb, stream_knobs):
    """candidate_mask on the same stress rows, visible prefixes and -inf at
    random places (the forced block then may hold no visible entry)."""
    s = suffix_inf(mixed(len(CAND_STRESS), C, 5201 + C + block * 3 + kb, CAND_STRESS),
                   seed=5202 + C)
    s = torch.cat([s[:3], random_inf(s[3:], seed=5203, frac=0.9)])  # half the rows holed
    check_cand(s, block=block, topk_blocks=kb, cfg=stream_knobs)


@pytest.mark.parametrize("kb", [1, 6, 7])
def test_candidate_mask_stream_forced_block_ties(kb, stream_knobs):
    """The forced block (of entry n_visible - 1) tied at +inf with six lower +inf blocks: kept
    only while it is among the kb lowest of them (not at 6, kept at 7). Row 0: its own max is
    low (never buffered: the merge's virtual entry); row 1: it holds a +inf itself (buffered, read as +inf); row 2: its
    n_visible - 1 falls in block 64, whose entries are all -inf (visibility not a prefix: forced
    without a visible entry)."""
    C, block = 800, 8
    s = scores(3, C, seed=5301, kind="randn").clone()
    for r in range(3):
        for b in (10, 20, 30, 40, 50, 60):
            s[r, b * block + 3] = float("inf")
        s[r, 65 * block:] = NINF
    s[0, 65 * block: 65 * block + 3] = -50.0  # visible up to entry 522, block 65
    s[1, 65 * block: 65 * block + 5] = float("inf")
    s[2, 64 * block: 65 * block] = NINF
    s[2, 66 * block - 1] = -1.0  # visible: 0..511 and 527, so n_visible - 1 = 512 (block 64)
    check_cand(s, block=block, topk_blocks=kb, cfg=stream_knobs)


def test_stream_fuzz():
    """A seeded fuzz over shapes x knobs x data (both ops, masks, bf16): equal to the reference
    on every case."""
    import random

    rng = random.Random(20261201)
    for i in range(FUZZ_CASES):
        cfg = IndexerConfig(stream_block=rng.choice([16, 32, 64, 1024]),
                            stream_tb=rng.choice([16, 32, 256]),
                            stream_merge_tb=rng.choice([16, 512]),
                            cand_merge_tb=rng.choice([16, 256]),
                            stream_cap=rng.choice([0, 100, 4096]),
                            topk_segments=rng.choice([0, 1, 2, 5]),
                            cand_stream_elems=rng.choice([16, 64, 2048]))
        T, C = rng.choice([1, 2, 4]), rng.choice([1, 7, 100, 333, 1000, 2049])
        s = scores(T, C, seed=5400 + i, kind=rng.choice(STRESS))
        if rng.random() < 0.4:
            s = suffix_inf(s, seed=5500 + i)
        if rng.random() < 0.2:
            s = s.bfloat16()
        if i % 2:
            mask = None
            if rng.random() < 0.3:
                g = torch.Generator().manual_seed(5600 + i)
                mask = (torch.rand(T, C, generator=g) < rng.choice([0.1, 0.9])).to(DEV)
            check(s, mask, k=rng.choice([1, 8, 64, 600]), cfg=cfg)
        else:
            check_cand(s, block=rng.choice([1, 3, 8]), topk_blocks=rng.choice([1, 20, 300]),
                       cfg=cfg)


def test_choose_follows_the_config():
    """IndexerConfig.choose is the dispatch: the stream select up to stream_max_k kept entries
    (the capturable kernel above, with the same output), bf16 products on the stream score
    kernel and fp32 products on the tile kernel; an override moves the choice."""
    d = IndexerConfig()
    assert d.choose({"k": 512, "columns": 135168, "topk_blocks": 2048, "block": 8,
                     "bf16_products": 1}) == {"index_scores": "stream", "topk_select": "stream",
                                              "candidate_mask": "stream"}
    assert d.choose({"bf16_products": 0})["index_scores"] == "tile"
    assert IndexerConfig(index_kernel_bf16="tile").choose({})["index_scores"] == "tile"
    assert IndexerConfig(index_kernel_fp32="stream").choose(
        {"bf16_products": 0})["index_scores"] == "stream"
    small = IndexerConfig(stream_max_k=16)
    assert small.choose({"k": 50, "columns": 900})["topk_select"] == "capturable"
    assert small.choose({"k": 50, "columns": 10})["topk_select"] == "stream"  # kk = C = 10
    s = suffix_inf(scores(4, 900, seed=5701, kind="few"), seed=5702)
    assert torch.equal(tk.topk_select(s, k=50, kernel_config=small), ref_topk_select(s, k=50))
    cand = ref_candidate_mask(s, block=8, topk_blocks=20)
    assert torch.equal(tk.candidate_mask(s, block=8, topk_blocks=20, kernel_config=small), cand)


RATIO1_C = 135168  # V4.1 ratio-1 layer at 8192 new tokens over a 131072-token context (prefill)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the interpreter case stays small)")
@pytest.mark.parametrize("T", [512, 64])
@pytest.mark.parametrize("kind", ["randn", "relu", "few", "asc"])
def test_topk_select_stream_ratio1_size(T, kind):
    """The ratio-1 row length (512 rows: one segment each; 64 rows: the decode-like shape,
    several segments per row and the merge), visible prefixes, with and without a
    candidate-density mask: equal to the reference."""
    s = suffix_inf(scores(T, RATIO1_C, seed=5801 + T, kind=kind), seed=5802)
    check(s, k=512)
    g = torch.Generator(device=DEV).manual_seed(5803)
    check(s, torch.rand(T, RATIO1_C, device=DEV, generator=g) < 0.12, k=512)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the interpreter case stays small)")
@pytest.mark.parametrize("T", [512, 64])
@pytest.mark.parametrize("kind", ["randn", "relu", "few"])
def test_candidate_mask_stream_ratio1_size(T, kind):
    """candidate_mask at the ratio-1 row length (blocks of 8, 2048 kept), then topk_select under
    its mask (the V4.1 chain)."""
    s = suffix_inf(scores(T, RATIO1_C, seed=5901 + T, kind=kind), seed=5902)
    cand = check_cand(s, block=8, topk_blocks=2048)
    check(s, cand, k=512)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [64, 512])
def test_stream_captures_in_cuda_graph(T):
    """Both stream ops inside one CUDA graph at the ratio-1 row length (64 rows: segments and the
    merge kernels; 512: one segment), replayed on new scores written into the same input."""
    s = suffix_inf(scores(T, RATIO1_C, seed=6001 + T, kind="relu"), seed=6002)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st):
        warm = tk.candidate_mask(s, block=8, topk_blocks=2048)  # (compiles outside the capture)
        tk.topk_select(s, warm, k=512)
        tk.topk_select(s, None, k=512)
        with torch.cuda.graph(g):
            cand = tk.candidate_mask(s, block=8, topk_blocks=2048)
            top = tk.topk_select(s, cand, k=512)
            top_nomask = tk.topk_select(s, None, k=512)
    torch.cuda.current_stream().wait_stream(st)
    for seed in (6003, 6004):
        s.copy_(suffix_inf(scores(T, RATIO1_C, seed=seed, kind="randn"), seed=seed + 1))
        g.replay()
        torch.cuda.synchronize()
        want_cand = ref_candidate_mask(s, block=8, topk_blocks=2048)
        assert torch.equal(cand, want_cand)
        assert torch.equal(top, ref_topk_select(s, want_cand, k=512))
        assert torch.equal(top_nomask, ref_topk_select(s, None, k=512))
