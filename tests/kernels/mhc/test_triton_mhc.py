"""Mega-mHC (kernels/mhc/triton.py): the one-launch kernel (mhc_jit.mhc_fused: split-K with a
last-arriver finish, or projection + finish in one program unsplit) against the unfused 2-3
launch path (bitwise, at every plan) and the reference; the split-K reduction's fixed order; the
arrival counters (zero after every launch, CUDA-graph replays included).

Without CUDA this module runs under the Triton interpreter (test_triton_interp.py), which runs the
programs one after another in grid order: the last-arriver logic is exercised deterministically
(the program with the highest split index arrives last), the races are not; the run-to-run and
CUDA-graph tests only have teeth on the GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from poisoned_alloc import poisoned  # noqa: E402

pytest.importorskip("triton")

from megagraph.kernels.fused import reference as rf  # noqa: E402
from megagraph.kernels.mhc import triton as tmhc  # noqa: E402
from megagraph.kernels.mhc.config import MhcConfig  # noqa: E402
from megagraph.kernels.mhc import triton_jit as mhc_jit  # noqa: E402
from megagraph.kernels.common.triton import INTERPRET  # noqa: E402
from mhc_checks import check_mhc  # noqa: E402

RUNNABLE = torch.cuda.is_available() or INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
TOL_COEF = 1e-4 if GPU else 1e-5  # test_triton_moe.py's: approximate exp / rsqrt on the GPU
KW = dict(eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20)
NAMES = ("x", "x_q", "x_scale", "pre", "post", "comb")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same_bits(a, b) -> list[str]:
    """Names of the outputs that differ in any bit (dtype / shape included)."""
    return [n for n, x, y in zip(NAMES, a, b, strict=True)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y))]


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(T, n=4, d=256, seed=0, dtype=torch.bfloat16, mix=False):
    g = torch.Generator().manual_seed(seed * 1000 + T)
    streams = torch.randn(T, n, d, generator=g).to(dtype).to(DEV)
    fn = (torch.randn((2 + n) * n, n * d, generator=g) * 0.02).to(DEV)
    base = (torch.randn((2 + n) * n, generator=g) * 0.1).to(DEV)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    nw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEV)
    m = torch.softmax(torch.randn(T, n, generator=g), -1).to(DEV) if mix else None
    return streams, fn, base, scale, m, nw


def all_written(out, act_fmt):
    """No poison left: x / scales finite, no e4m3 NaN (0x7F / 0xFF) in x_q, no 0xFF e8m0."""
    x, xq, xs, pre, post, comb = out
    for name, t in (("x", x), ("pre", pre), ("post", post), ("comb", comb)):
        assert torch.isfinite(t.float()).all(), f"unwritten {name}"
    assert not ((bits(xq) & 0x7F) == 0x7F).any(), "unwritten x_q"
    if act_fmt == "mxfp8":
        assert not (bits(xs) == 0xFF).any(), "unwritten x_scale"
    else:
        assert torch.isfinite(xs).all() and (xs > 0).all(), "unwritten x_scale"


def counters_zero():
    c = tmhc._COUNTERS.get(torch.device(DEV) if not GPU else
                           torch.device("cuda", torch.cuda.current_device()))
    return c is None or int(c.abs().sum()) == 0


class Launches:
    """Counts the launches of the four Mega-mHC kernels (patched into mhc_jit)."""

    def __init__(self, monkeypatch):
        self.n = {}
        for name in ("mhc_proj", "mhc_reduce", "mhc_finish", "mhc_fused"):
            monkeypatch.setattr(mhc_jit, name, self._spy(name, getattr(mhc_jit, name)))

    def _spy(self, name, kernel):
        outer = self

        class Spy:
            def __getitem__(self, grid):
                outer.n[name] = outer.n.get(name, 0) + 1
                return kernel[grid]

        return Spy()


ALWAYS = MhcConfig(fused="always")  # one launch
NEVER = MhcConfig(fused="never")  # the unfused 2-3 launches


def forced(args, split, **tiles):
    """mega_mhc's `tiles` for these inputs: plan()'s with `split` programs per token block
    (None: the plan's) and other Plan fields (bt: tokens per block under the 16-row MMA tile,
    fbm, fstages, nq, warps); None (plan() itself) when nothing is forced."""
    if split is None and not tiles:
        return None
    T, kd, dev = args[0].shape[0], args[1].shape[1], args[0].device
    p = dataclasses.replace(tmhc.plan(T, kd, dev), **tiles)
    s = p.split if split is None else split
    k_per = -(-kd // (s * p.bk)) * p.bk
    return dataclasses.replace(p, split=-(-kd // k_per), k_per=k_per)


TILES = {"": {}, "bt4": dict(bt=4, fbm=4), "bt8/fbm2/nq2": dict(bt=8, fbm=2, nq=2),
         "nq4/fs2": dict(nq=4, fstages=2), "bt2/fbm1": dict(bt=2, fbm=1)}


# ---------------------------------------------------------------------------------------------
# fused (one launch) == unfused (2-3 launches), bit for bit; both vs the reference
# ---------------------------------------------------------------------------------------------


BITWISE_CASES = [
    (1, None, ""), (3, None, ""), (17, None, ""), (64, None, ""), (300, None, ""), (64, 3, ""),
    (300, 2, ""), (17, 8, ""), (1, 1, ""), (17, None, "bt4"), (64, 3, "bt4"),
    (40, 2, "bt8/fbm2/nq2"), (300, 2, "nq4/fs2"), (40, None, "nq4/fs2"), (5, 2, "bt2/fbm1")]


# both activation formats on alternate cases (the format only changes the finish's quantizer
# block, which every plan runs the same way)
@pytest.mark.parametrize("T,split,tiles,act_fmt", [
    (*c, "mxfp8" if i % 2 else "fp8_1x128") for i, c in enumerate(BITWISE_CASES)])
def test_fused_equals_unfused_bitwise(T, split, tiles, act_fmt, monkeypatch):
    """Split and unsplit token counts (default plan: split below 32 tokens in the interpreter,
    below 256 on the GPU; forced splits: uneven last K range at 3, one K step per split at 8;
    other tiles: token blocks smaller than the MMA tile, several finish steps per block, norm /
    quantize steps wider than d = 256 (masked blocks), a pipelined collapse), outputs and
    scratch poisoned: every element written, the two paths' bits equal, counters back to zero,
    and one launch for the fused path."""
    args = inputs(T)
    p = forced(args, split, **TILES[tiles])
    kw = dict(KW, act_fmt=act_fmt, tiles=p)
    spy = Launches(monkeypatch)
    with poisoned():
        fused = tmhc.mega_mhc(*args, **kw, kernel_config=ALWAYS)
    assert spy.n == {"mhc_fused": 1}
    assert counters_zero()
    with poisoned():
        plain = tmhc.mega_mhc(*args, **kw, kernel_config=NEVER)
    p = p or tmhc.plan(T, args[1].shape[1], args[0].device)
    assert spy.n["mhc_proj"] == 1 and spy.n.get("mhc_reduce", 0) == (p.split > 1)
    all_written(fused, act_fmt)
    assert same_bits(fused, plain) == []


@pytest.mark.parametrize("T,dtype,act_fmt,with_mix,split,tiles", [
    (3, torch.bfloat16, "fp8_1x128", False, None, ""),
    (40, torch.bfloat16, "fp8_1x128", True, None, ""),
    (40, torch.bfloat16, "fp8_1x128", False, 4, "bt4"),
    (5, torch.float32, "mxfp8", True, None, "bt2/fbm1"),
    (33, torch.float32, "fp8_1x128", False, None, "nq4/fs2"),
    (9, torch.float16, "mxfp8", False, 2, "bt8/fbm2/nq2"),
])
def test_fused_matches_reference(T, dtype, act_fmt, with_mix, split, tiles):
    """test_triton_moe.py::test_mega_mhc's tolerances, on the fused path."""
    streams, fn, base, scale, mix, nw = inputs(T, dtype=dtype, mix=with_mix, seed=3)
    kw = dict(KW, act_fmt=act_fmt)
    with poisoned():
        out = tmhc.mega_mhc(streams, fn, base, scale, mix, nw, **kw, kernel_config=ALWAYS,
                            tiles=forced((streams, fn), split, **TILES[tiles]))
    ref = rf.mega_mhc(streams, fn, base, scale, mix, nw, **kw)
    all_written(out, act_fmt)
    check_mhc(out, ref, act_fmt)


def test_launches_follow_the_config(monkeypatch):
    """MhcConfig.fused picks the launches: "auto" (the default) one launch up to fused_tokens,
    the unfused launches above; "never" / "always" at every T; a lower fused_tokens moves the
    crossover."""
    kw = dict(KW, act_fmt="fp8_1x128")
    spy = Launches(monkeypatch)
    top = MhcConfig().fused_tokens
    for cfg, T, want in ((None, 3, True), (None, top, True), (None, top + 1, False),
                         (NEVER, 3, False), (ALWAYS, top + 1, True),
                         (MhcConfig(fused_tokens=2), 3, False)):
        spy.n.clear()
        tmhc.mega_mhc(*inputs(T), **kw, kernel_config=cfg)
        assert (spy.n == {"mhc_fused": 1}) == want and ("mhc_finish" in spy.n) != want, cfg


# ---------------------------------------------------------------------------------------------
# determinism, counters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [3, 64 if GPU else 20, 300])
@pytest.mark.parametrize("fused", [True, False])
def test_same_bits_every_run(T, fused):
    """Three launches on the same inputs: every output bitwise equal (on the GPU the split path's
    programs arrive in a different order each run; the slabs are still added in split order)."""
    args = inputs(T, seed=5)
    kw = dict(KW, act_fmt="fp8_1x128")
    runs = [tmhc.mega_mhc(*args, **kw, kernel_config=ALWAYS if fused else NEVER)
            for _ in range(3)]
    for out in runs[1:]:
        assert same_bits(out, runs[0]) == []
    assert counters_zero()


def test_counters_stay_zero_across_token_counts():
    """Launches with different block counts and splits one after another (each leaves every
    counter at zero, so the next starts clean); reset_counters repairs a stale counter."""
    kw = dict(KW, act_fmt="fp8_1x128")
    for T in (40, 1, 17, 40):
        args = inputs(T, seed=7)
        tmhc.mega_mhc(*args, **kw, kernel_config=ALWAYS, tiles=forced(args, 3))
        assert counters_zero(), T
    c = tmhc.counters(torch.device(DEV))
    assert c.dtype == torch.int32 and c.numel() == tmhc.COUNTER_SLOTS
    c[:4] = 5  # as if a launch had been aborted
    tmhc.reset_counters()
    assert counters_zero()
    args = inputs(40, seed=7)
    kw["tiles"] = forced(args, 3)
    assert same_bits(tmhc.mega_mhc(*args, **kw, kernel_config=ALWAYS),
                     tmhc.mega_mhc(*args, **kw, kernel_config=NEVER)) == []


def test_incomplete_block_is_not_finished(monkeypatch):
    """A launch whose grid lacks the last split program of every block (grid axis 1 cut by one):
    no program may see itself last, so nothing is finished (outputs stay poisoned) and every
    block's counter holds split - 1 arrivals (an early finisher, e.g. a test on the first ticket,
    would write x; the interpreter's sequential order cannot show that otherwise: the last
    program's finish would overwrite it)."""
    T = 40
    args = inputs(T)
    p = forced(args, 3)
    real = mhc_jit.mhc_fused

    class Cut:
        def __getitem__(self, grid):
            return real[(grid[0], grid[1] - 1)]

    monkeypatch.setattr(mhc_jit, "mhc_fused", Cut())
    try:
        with poisoned():
            x, *_ = tmhc.mega_mhc(*args, **KW, act_fmt="fp8_1x128", kernel_config=ALWAYS,
                                  tiles=p)
        assert torch.isnan(x.float()).all()
        mt = -(-T // p.block)
        c = tmhc.counters(torch.device(DEV))
        assert mt > 1 and c[:mt].tolist() == [2] * mt and int(c[mt:].abs().sum()) == 0
    finally:
        tmhc.reset_counters()
    assert counters_zero()


@pytest.mark.parametrize("S,T", [(2, 3), (7, 17), (80, 8)])
def test_reduce_partials_adds_in_split_order(S, T):
    """Bitwise the sequential fp32 sum s = 0, 1, ...; the partials span 12 decades, so another
    order gives other bits (checked where S > 2: the reversed sum differs; two terms commute)."""
    g = torch.Generator().manual_seed(S * 100 + T)
    mag = torch.pow(10.0, torch.empty(S, T, 32).uniform_(-4, 8, generator=g))
    part = (torch.randn(S, T, 32, generator=g) * mag).float()
    sqp = (torch.rand(S, T, generator=g) * mag[:, :, 0]).float()
    want_m, want_sq = torch.zeros(T, 32), torch.zeros(T)
    for s in range(S):
        want_m, want_sq = want_m + part[s], want_sq + sqp[s]
    m, sq = tmhc.reduce_partials(part.to(DEV), sqp.to(DEV))
    assert torch.equal(m.cpu(), want_m) and torch.equal(sq.cpu(), want_sq)
    rev = torch.zeros(T, 32)
    for s in reversed(range(S)):
        rev = rev + part[s]
    assert S == 2 or not torch.equal(rev, want_m)


# ---------------------------------------------------------------------------------------------
# GPU only: CUDA graphs, real width
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("T", [64, 1000])
def test_fused_cuda_graph_replay(T):
    """The fused kernel captured once at V4.1 width (d = 5120; the decode plan at 64 tokens, the
    prefill plan's 64-row tiles at 1000, both split-K), replayed with new inputs copied into the
    static buffer, twice per input: equal to the eager unfused path bit for bit, counters zero
    after each replay."""
    streams, fn, base, scale, mix, nw = inputs(T, d=5120, seed=11)
    kw = dict(KW, act_fmt="fp8_1x128")
    static = streams.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tmhc.mega_mhc(static, fn, base, scale, mix, nw, **kw, kernel_config=ALWAYS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tmhc.mega_mhc(static, fn, base, scale, mix, nw, **kw, kernel_config=ALWAYS)
    for seed in (12, 13):
        fresh = inputs(T, d=5120, seed=seed)[0]
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert counters_zero()
        first = [t.clone() for t in out]
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(out, first) == []
        eager = tmhc.mega_mhc(fresh, fn, base, scale, mix, nw, **kw, kernel_config=NEVER)
        assert same_bits(out, eager) == [], seed
    ref = rf.mega_mhc(fresh, fn, base, scale, mix, nw, **kw)
    assert rel(out[3], ref[3]) < TOL_COEF and rel(out[0], ref[0]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_capture_before_counters_takes_unfused_path(monkeypatch):
    """A capture on a device with no counters yet records the unfused launches (no allocation
    under capture), with the same bits."""
    monkeypatch.setattr(tmhc, "_COUNTERS", {})
    T = 64
    streams, fn, base, scale, mix, nw = inputs(T, d=5120, seed=21)
    kw = dict(KW, act_fmt="fp8_1x128")
    tmhc.mega_mhc(streams, fn, base, scale, mix, nw, **kw, kernel_config=NEVER)  # compile outside
    static = streams.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tmhc.mega_mhc(static, fn, base, scale, mix, nw, **kw, kernel_config=ALWAYS)
    assert tmhc._COUNTERS == {}
    graph.replay()
    torch.cuda.synchronize()
    again = tmhc.mega_mhc(streams, fn, base, scale, mix, nw, **kw, kernel_config=ALWAYS)
    assert same_bits(out, again) == []


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 200, 4096])
def test_fused_equals_unfused_full_width(T):
    """V4.1 width (n = 4, d = 5120), each token count's plan (decode: 1, 64; 16-token blocks:
    200; 64-row tiles: 4096), fused vs unfused: bitwise."""
    args = inputs(T, d=5120, seed=31, mix=T == 200)
    kw = dict(KW, act_fmt="fp8_1x128")
    with poisoned():
        fused = tmhc.mega_mhc(*args, **kw, kernel_config=ALWAYS)
    plain = tmhc.mega_mhc(*args, **kw, kernel_config=NEVER)
    all_written(fused, "fp8_1x128")
    assert same_bits(fused, plain) == []
    assert counters_zero()


# ---------------------------------------------------------------------------------------------
# hc_expand at the attention sites (mega_moe's combine kernel with one slot)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,d,dtype", [(1, 256, torch.bfloat16), (5, 200, torch.bfloat16),
                                       (64, 512, torch.bfloat16), (300, 256, torch.float32),
                                       (3, 256, torch.float16)])
def test_hc_expand_matches_reference(T, d, dtype):
    """Every element written (poisoned output) and within one rounding of the output dtype of the
    reference's fp32 math (an element can round the other way at a tie) plus the fp32 summation
    order (the sum over source streams runs in the kernel's order: 1e-6 of the terms' magnitude,
    |post y| + sum |comb H|, which bounds cancellation). d = 200: a masked column tail. Without
    a GPU it runs in the interpreter child (test_triton_interp.py)."""
    from megagraph.kernels.mhc.reference import hc_expand as ref

    n = 4
    g = torch.Generator().manual_seed(T * 7 + d)
    H = torch.randn(T, n, d, generator=g).to(dtype).to(DEV)
    y = torch.randn(T, d, generator=g).to(dtype).to(DEV)
    post = (2 * torch.rand(T, n, generator=g)).to(DEV)
    comb = torch.softmax(torch.randn(T, n, n, generator=g), -1).to(DEV)
    with poisoned():
        out = tmhc.hc_expand(H, y, post, comb)
    want = ref(H, y, post, comb)
    assert out.dtype == want.dtype and out.shape == want.shape
    assert torch.isfinite(out.float()).all(), "an output element was not written"
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 0.0}[dtype]  # 1 ulp
    terms = ref(H.float().abs(), y.float().abs(), post.abs(), comb.abs())
    err = (out.float() - want.float()).abs()
    assert bool((err <= ulp * want.float().abs() + 1e-6 * terms).all()), float(err.max())


def test_hc_expand_strided_streams_and_fallback():
    """A non-contiguous stream view (the runtime's slot buffers) gives the same bits as its
    contiguous copy; an odd stream count (not a power of two) takes the capturable path."""
    from megagraph.kernels.dense.capturable import hc_expand as cap

    T, n, d = 7, 4, 256
    g = torch.Generator().manual_seed(11)
    big = torch.randn(T, n, 2 * d, generator=g).to(torch.bfloat16).to(DEV)
    H = big[:, :, :d]
    y = torch.randn(T, d, generator=g).to(torch.bfloat16).to(DEV)
    post, comb = torch.rand(T, n, generator=g).to(DEV), torch.rand(T, n, n, generator=g).to(DEV)
    a = tmhc.hc_expand(H, y, post, comb)
    b = tmhc.hc_expand(H.contiguous(), y, post, comb)
    assert torch.equal(a, b)
    H3 = torch.randn(T, 3, d, generator=g).to(torch.bfloat16).to(DEV)
    p3, c3 = torch.rand(T, 3, generator=g).to(DEV), torch.rand(T, 3, 3, generator=g).to(DEV)
    assert torch.equal(tmhc.hc_expand(H3, y, p3, c3), cap(H3, y, p3, c3))
