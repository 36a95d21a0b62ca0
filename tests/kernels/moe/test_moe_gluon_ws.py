"""The warp-specialized Gluon prefill L1 (kernels/moe/gluon_ws.py): loader / upcast / two
MMA warpgroups on mbarrier rings, BM = 128 expert-sorted rows x BN = 64 or 128 (BN_WIDE) columns of
W1 and W3; the 128-column tile's schedules (A by TMA, qlag, two upcast partitions) give the
64-column tile's bits.

GPU (CUDA sm_90 + Triton 3.6 Gluon, else skipped): against the fp32 math of the same quantized
operands (gluon_cases.reference) and the Triton L1 launch of routed_experts (moe.gemm role "l1")
within 2e-3 relative (the decode tests' bound and argument: exact E4M3 weight codes, exact fp8
products, fp16 H rounding + fp32 sum order); explicit rows per expert (tiles of 1..128 rows,
experts of > 128 rows, empty experts, odd token counts) into poisoned outputs; PTX upcast vs its
integer twin bit for bit (20-wide exponent spread: flushed weights); 20 launches giving the same
bits; CUDA-graph capture.

CPU: the kernel compiled ahead of time for sm_90 (Triton 3.6, make sm90-h200): no stack / local
memory, the partitions' setmaxnreg values, shared memory within 227 KB at >= 3 raw stages, per
partition K loop (one chunk each: the loops are not unrolled) the pinned instruction counts and
the proxy-fence / barrier order before every arrive (ws_order_problems).
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from gluon_cases import TYPES, case, check_repeats_and_graph, reference, rel, rows_case
from gluon_cases import gluon_build, gluon_gpu
from megagraph.kernels.moe import gluon_ws as mw
from poisoned_alloc import poisoned
from sm90_build import count, gluon_sm90, usage_and_sass
from sm90_build import partition_loops as sm90_partition_loops

gpu = gluon_gpu(mw)
build = gluon_build(mw)


def _max_tiles(P, E):
    """routed_experts' bound on the row tiles of 128 rows."""
    return min(P, P // mw.BM + E)


# (rows per expert, tokens, top-k, d, F, exponent range, limit)
CASES = {
    # tile sizes 1..128 (one partial tile per expert), empty experts; 331 tokens (odd)
    "tiles_1_128": ([1, 2, 0, 3, 7, 16, 31, 33, 64, 65, 0, 100, 127, 128], 331, 3, 1024, 256,
                    (119, 125), 10.0),
    # experts of > 128 rows (2-3 tiles, the last partial) between empty ones; 257 tokens
    "big_experts": ([0, 129, 300, 0, 256, 5, 0], 257, 3, 1024, 128, (119, 125), 10.0),
    # K = 256 (2 chunks, fewer than the ring's stages), no clamp, a 20-wide exponent range
    "short_k_wide_exps": ([3, 0, 130, 1, 9], 77, 3, 256, 64, (108, 128), None),
}


def _launch(xq, xs, a_idx, w1, w3, counts, out, k, limit, **kw):
    P = a_idx.numel()
    mw.l1_gluon_ws(xq, xs, a_idx, w1, w3, counts, out, topk=k,
                   max_tiles=_max_tiles(P, counts.numel()), limit=limit, **kw)


def _triton_l1(xq, xs, a_idx, w1, w3, counts, k, limit, F):
    """The Triton L1 as routed_experts launches it at prefill sizes."""
    from megagraph.kernels.moe import triton as moe

    P, E = a_idx.numel(), counts.numel()
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    rpg = P / max(1, min(E, P))
    mt = min(P, P // moe.pick_tile("l1", rpg).bm + E)
    moe.gemm(xq, xs, w1, h, b2=w3, role="l1", rows_per_group=rpg, counts=counts, a_idx=a_idx,
             topk=k, max_tiles=mt, limit=limit)
    return h


W = mw.BN_WIDE  # the 128-column tile


@gpu
@pytest.mark.parametrize("stages,bstages,lag,persist,a_tma,bn", [
    (None, None, None, None, None, 64), (3, 2, None, None, None, 64),
    (6, 3, None, None, None, 64), (4, 2, 3, None, None, 64), (6, 3, 5, None, None, 64),
    (3, 2, 2, None, None, 64), (4, 2, 1, True, None, 64), (4, 2, 3, True, None, 64),
    (6, 3, 2, True, None, 64), (2, 2, 1, True, None, 64), (4, 2, 1, None, True, 64),
    (6, 3, 1, True, True, 64), (6, 3, 3, True, True, 64),
    # the 128-column tile: its default 4:2, shallower rings, lags, persistent, A by TMA
    (None, None, None, None, None, W), (3, 2, None, None, None, W), (2, 2, 1, None, None, W),
    (4, 2, 3, None, None, W), (4, 2, 1, True, None, W), (3, 2, 2, True, None, W),
    (2, 2, 1, True, None, W), (4, 2, 1, True, True, W),
    # ... with A by TMA: the next quarter's wgmma in flight during each promotion (qlag 1)
    (None, None, None, None, True, W), (3, 2, 2, True, True, W), (2, 2, 1, True, True, W)])
@pytest.mark.parametrize("name", list(CASES))
def test_l1_ws_matches(name, stages, bstages, lag, persist, a_tma, bn):
    """Into a poisoned output (torch.empty under poisoned(): NaN): every valid row written and
    finite, within 2e-3 of the fp32 math and of the Triton L1; ring depths, the loader's lag,
    persistent CTAs (each walking many tiles, ring phases running on across them) and the
    128-column tile only move the schedule, never the bits (the 2-chunk case has fewer chunks
    than the lag); A by TMA from the expert-sorted copy too (rows past P zero-filled by the TMA
    unit). The 128-column tile runs the cases whose F it divides."""
    rows, T, k, d, F, exps, limit = CASES[name]
    if F % bn:
        pytest.skip(f"F {F} is not a multiple of the {bn}-column tile")
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=len(name), exps=exps)
    with poisoned():
        out = torch.empty((sum(rows), F), dtype=torch.float16, device="cuda")
    # persistent: 3 CTAs, so each walks many tiles (its rings' phases running on)
    _launch(xq, xs, a_idx, w1, w3, counts, out, k, limit, stages=stages, bstages=bstages,
            lag=lag, persist=persist, ctas=3 if persist else None, a_tma=a_tma, bn=bn)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written (or is not finite)"
    lim = float("inf") if limit is None else limit
    ref = reference(xq, xs, w1, w3, counts, a_idx, k, lim)
    assert rel(out, ref) < 2e-3, f"vs fp32 math: {rel(out, ref):.3e}"
    h = _triton_l1(xq, xs, a_idx, w1, w3, counts, k, limit, F)
    torch.cuda.synchronize()
    assert rel(out, h) < 2e-3, f"vs the Triton L1: {rel(out, h):.3e}"
    base = torch.full_like(out, float("nan"))
    _launch(xq, xs, a_idx, w1, w3, counts, base, k, limit)
    assert torch.equal(out, base), "another ring depth gave other bits"


@gpu
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[4] % W == 0])
@pytest.mark.parametrize("a_tma,qlag,upp,skip", [
    (False, 0, 1, False), (True, 0, 1, False), (True, 1, 1, False), (True, 0, 2, False),
    (True, 0, 2, True), (False, 0, 1, True)])
def test_l1_ws_wide_schedules(name, a_tma, qlag, upp, skip):
    """The 128-column tile's schedules - A gathered or by TMA, quarters one at a time or the
    next in flight (qlag), one upcast partition or two (W1's and W3's, 20 warps at a launch cap
    of 96 registers), the rows 64.. warpgroup idle on tiles of <= 64 rows (skip) - each
    persistent over 3 CTAs and over one per tile, give the 64-column tile's bits into poisoned
    outputs."""
    _same_bits_as_default(name, a_tma=a_tma, bn=W, qlag=qlag, upp=upp, skip=skip)


def _same_bits_as_default(name: str, frames: bool = False, **kw):
    """CASES[name] launched with kw (and its banks' row frames where frames), persistent over 3
    CTAs and with one CTA per tile, into poisoned outputs: every row written and the bits of
    the default launch."""
    rows, T, k, d, F, exps, limit = CASES[name]
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=len(name), exps=exps)
    if frames:
        kw["frames"] = mw.row_frames(w1, w3)
        assert kw["frames"] is not None, "the case's exponents span <= 11 binades"
    base = torch.full((sum(rows), F), float("nan"), dtype=torch.float16, device="cuda")
    _launch(xq, xs, a_idx, w1, w3, counts, base, k, limit)
    for persist in (True, False):
        with poisoned():
            out = torch.empty((sum(rows), F), dtype=torch.float16, device="cuda")
        _launch(xq, xs, a_idx, w1, w3, counts, out, k, limit, persist=persist,
                ctas=3 if persist else None, **kw)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"persist {persist}: a row not written"
        assert torch.equal(out, base), f"persist {persist}: {rel(out, base):.3e}"


@gpu
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[4] % W == 0])
@pytest.mark.parametrize("a_tma,upp,skip,areg", [
    (True, 2, None, False), (True, 1, None, False), (False, 1, None, False),
    (True, 2, False, False), (True, 2, None, True), (True, 1, None, True),
    (True, 2, False, True)])
def test_l1_ws_row_frames(name, a_tma, upp, skip, areg):
    """The 128-column tile with each weight row's frame over all of K (row_frames: promotions by
    the A scales alone, the frames applied in the epilogue): the 64-column per-chunk-frame
    tile's bits, every row written - A gathered or by TMA, one or two upcast partitions, the
    idle rows skipped or not, the A rows in registers (areg) or read by each wgmma, persistent
    over 3 CTAs and one CTA per tile."""
    _same_bits_as_default(name, frames=True, a_tma=a_tma, bn=W, upp=upp, skip=skip, areg=areg)


@gpu
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[4] % W == 0])
@pytest.mark.parametrize("frames,areg", [(False, False), (True, False), (True, True)])
def test_l1_ws_loader_upcast(name, frames, areg):
    """The loader upcasting the last 32-row block of W1 and W3 of every chunk, LUP_LAG chunks
    behind its loads (lup; two upcast partitions doing three blocks each): the default launch's
    bits, every row written, with per-chunk or row frames, the A rows in registers or not,
    persistent over 3 CTAs (the loader's share running on across tiles) and one CTA per tile
    (the share's tail after the last load)."""
    _same_bits_as_default(name, frames=frames, a_tma=True, bn=W, upp=2, lup=True, areg=areg)


STMA_CASES = [n for n, c in CASES.items() if c[4] % W == 0 and (c[3] // 32) % 16 == 0]


@gpu
@pytest.mark.parametrize("name", STMA_CASES)
@pytest.mark.parametrize("frames,lup", [(True, None), (False, None), (True, False)])
def test_l1_ws_small_tma(name, frames, lup):
    """The loader's small copies (A scales from the transposed sorted copy, exponents in [BN,
    16]-byte boxes, frames) by TMA on the stage's barrier (stma: no cp.async, no publish): the
    default launch's bits, every row written, with row frames or per-chunk ones, the loader's
    upcast share on or off, persistent over 3 CTAs and one CTA per tile."""
    _same_bits_as_default(name, frames=frames, a_tma=True, bn=W, stma=True, lup=lup)


@gpu
def test_l1_ws_small_tma_refused():
    """stma where the exponent rows are no TMA stream (K / 32 = 8 bytes) or A is gathered: a
    ValueError before any launch; None (the default) then runs without it."""
    rows, T, k, d, F, exps, limit = CASES["short_k_wide_exps"]
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, 128, seed=1, exps=exps)
    out = torch.empty((sum(rows), 128), dtype=torch.float16, device="cuda")
    for kw in (dict(a_tma=True), dict(a_tma=False)):
        with pytest.raises(ValueError, match="stma"):
            _launch(xq, xs, a_idx, w1, w3, counts, out, k, limit, bn=W, stma=True, **kw)


@gpu
def test_row_frames_cached_and_refused():
    """row_frames is built once per weight (the same tensors back) and refuses banks with a row
    spanning more than FRAME_SPAN binades (None: routed_experts keeps the per-chunk frames)."""
    from megagraph.kernels.moe import triton as moe

    rows, T, k, d, F, exps, limit = CASES["tiles_1_128"]
    _, _, w1, w3, _, _ = rows_case(rows, T, k, d, F, seed=1, exps=exps)
    f = mw.row_frames(w1, w3)
    assert f is not None and all(a is b for a, b in zip(f, mw.row_frames(w1, w3)))
    assert torch.equal(f[0], mw.frames_of(w1.s.cpu()).cuda())
    s_wide = w3.s.clone()
    s_wide[0, 0, 0] = int(s_wide[0, 0].max()) - 12
    assert mw.row_frames(w1, moe.bank(w3.w, s_wide, "mxfp4")) is None


@pytest.mark.parametrize("span,ok", [(0, True), (5, True), (11, True), (12, False),
                                     (20, False)])
def test_frames_of(span, ok):
    """frames_of (CPU): S = max(largest exponent - 6, 1) per row over all of K; None as soon as one
    row holds an exponent more than FRAME_SPAN (11) binades below its largest - the per-chunk
    frames would keep that group where the row frame flushes it."""
    g = torch.Generator().manual_seed(span)
    e = torch.randint(120, 124, (3, 5, 16), generator=g, dtype=torch.int32)
    e[1, 2, 7] = int(e[1, 2].max()) - span
    e[2, 4] = torch.tensor([0, 1, 2, 3] * 4)  # small exponents: the frame clamps at 1
    got = mw.frames_of(e.to(torch.uint8).view(torch.float8_e8m0fnu))
    if not ok:
        assert got is None
        return
    want = (e.amax(-1) - 6).clamp_min(1)
    assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, want)
    assert int(got[2, 4]) == 1


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_l1_ws_skip_idle(name):
    """The 64-column tile with the rows 64.. warpgroup idle on tiles of <= 64 rows (tiles of 1..
    128 rows, experts of 2-3 tiles, empty experts): the same bits as without, every row
    written; persistent over 3 CTAs and one CTA per tile."""
    _same_bits_as_default(name, skip=True)


@gpu
def test_l1_ws_balanced_case():
    """gluon_cases.case routing (every token top-k over 16 experts, ~110 rows each), fp32 and
    bf16 outputs besides fp16, and a prebuilt tile list."""
    from megagraph.kernels.moe import triton as moe

    T, E, d, F, k = 293, 16, 512, 192, 6
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=3, distinct=True)
    P = T * k
    ref = reference(xq, xs, w1, w3, counts, srt, k, 10.0)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        out = torch.full((P, F), float("nan"), dtype=dt, device="cuda")
        _launch(xq, xs, srt, w1, w3, counts, out, k, 10.0)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and rel(out.float(), ref) < 2e-3, dt
    o1 = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    o2 = torch.full_like(o1, float("nan"))
    mt = _max_tiles(P, E)
    _launch(xq, xs, srt, w1, w3, counts, o1, k, 10.0)
    _launch(xq, xs, srt, w1, w3, counts, o2, k, 10.0, tiles=moe.tile_list(counts, mw.BM, mt))
    assert torch.equal(o1, o2), "prebuilt tile list differs"


@gpu
@pytest.mark.parametrize("bn", [64, W])
def test_l1_ws_asm_vs_arith(bn):
    """Exponents 108 .. 127 (every table offset, flushed weights), no clamp: the PTX table
    upcast and its integer twin give the same bits (both tiles: the 128-column one upcasts
    two 64-row blocks per matrix)."""
    rows, T, k, d, F = [0, 77, 129, 3], 101, 3, 512, 128
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=9, exps=(108, 128))
    outs = []
    for use_asm in (True, False):
        out = torch.full((sum(rows), F), float("nan"), dtype=torch.float16, device="cuda")
        _launch(xq, xs, a_idx, w1, w3, counts, out, k, None, use_asm=use_asm, bn=bn)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"PTX vs arithmetic upcast: {rel(*outs):.3e}"
    ref = reference(xq, xs, w1, w3, counts, a_idx, k, float("inf"))
    assert rel(outs[0], ref) < 2e-3, f"vs fp32 math: {rel(outs[0], ref):.3e}"


@gpu
@pytest.mark.parametrize("persist,a_tma,bn", [(False, False, 64), (True, False, 64),
                                              (True, True, 64), (True, False, W),
                                              (True, True, W)])
def test_l1_ws_repeat_and_graph(persist, a_tma, bn):
    """20 eager launches give the same bits (earlier Gluon prefill variants did not), and the
    launch captured in a CUDA graph (tile list built inside the capture, host TMA descriptors
    filled at capture) replays them into a re-poisoned output; persistent: 2 CTAs over every
    tile; the 128-column tile too."""
    rows, T, k, d, F = [5, 0, 128, 231, 1, 64, 0, 77], 199, 3, 1024, 256
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=77)
    P = sum(rows)

    def launch(out):
        _launch(xq, xs, a_idx, w1, w3, counts, out, k, 10.0, persist=persist,
                ctas=2 if persist else None, a_tma=a_tma, bn=bn)

    want = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    launch(want)
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
    check_repeats_and_graph(launch, torch.full_like(want, float("nan")), want, torch.equal,
                            lambda o, w: f"rel {rel(o, w):.3e}")


@gpu
@pytest.mark.parametrize("ws", [True, False, "wide"])
def test_routed_experts_prefill_uses_ws(ws, monkeypatch):
    """routed_experts at a prefill size (600 tokens, top-2 of 8 experts: 150 rows per expert)
    runs its L1 on l1_gluon_ws (persistent, MoeConfig.ws_rings) when gluon_ws_l1 is on (the
    default; once) and not when off (the wide decode L1 then); with ws_l1_bn = 128 on the
    128-column tile and its rings (ws_wide_rings); each against the reference op within
    test_triton_moe's bound (fp32 output)."""
    from test_triton_moe import ACT, FP16_H, check_routed, routed_case

    cfg = dataclasses.replace(FP16_H, gluon_ws_l1=bool(ws), ws_l1_bn=W if ws == "wide" else 64)
    calls = []
    real = mw.l1_gluon_ws
    monkeypatch.setattr(mw, "l1_gluon_ws", lambda *a, **k: calls.append(
        (k.get("persist"), k.get("stages"), k.get("bstages"), k.get("bn"))) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(600, 8, 256, 128, 2, seed=78)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"), cfg)
    want = {True: [(True, *cfg.ws_rings, 64)], False: [],
            "wide": [(True, *cfg.ws_wide_rings, W)]}[ws]
    assert calls == want


# ---------------------------------------------------------------------------------------------
# CPU: launcher checks, the ahead-of-time sm_90 build
# ---------------------------------------------------------------------------------------------

def test_gluon_l1_ws_choice(monkeypatch):
    """routed_experts' prefill L1 (available() forced: the predicate's own logic, on any
    machine): above 100 rows per expert the persistent ws L1 - at ws_l1_bn = 128 (the default)
    the 128-column tile on its rings ws_wide_rings with A by TMA (ws_wide_a_tma), where
    F % 128 == 0; at F = 192 or ws_l1_bn = 64 the 64-column tile on ws_rings with A gathered;
    gluon_ws_l1 off: not the ws kernel; the 128-column tile gets row_frames' answer with
    ws_l1_frames (default) and None without, the 64-column tile None."""
    from gluon_cases import dbg_bank
    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe.config import MoeConfig

    assert MoeConfig().ws_l1_bn == 128
    monkeypatch.setattr(mw, "available", lambda device=None: True)
    frames = object()  # row_frames' answer (cached per weight, CUDA only): passed through as is
    monkeypatch.setattr(mw, "row_frames", lambda w1, w3: frames)
    E, d = 4, 256
    xq = torch.zeros(300, d, dtype=torch.float8_e4m3fn)
    xs = torch.ones(300, d // 128)

    def pick(F, rpg=150.0, cfg=MoeConfig()):
        w = dbg_bank(torch.zeros(E, F, d // 2), torch.full((E, F, d // 32), 127), "cpu")
        h = torch.zeros(300, F, dtype=torch.float16)
        p = moe._l1_kernel("gluon_ws", xq, xs, w, w, h, None, rpg, cfg)
        if rpg <= cfg.wide_l1_min_rows or "gluon_ws" not in cfg.l1_candidates(rpg, False):
            return None  # not a candidate at this size / with this config
        if isinstance(p, str) or getattr(p[0], "func", None) is not mw.l1_gluon_ws:
            return None
        kw = p[0].keywords
        assert kw["frames"] is (frames if kw["bn"] == mw.BN_WIDE and cfg.ws_l1_frames
                                else None), kw["frames"]
        return kw["bn"], kw["stages"], kw["bstages"], kw["a_tma"], kw["persist"], p[1]

    base = MoeConfig()
    wide = (mw.BN_WIDE, *base.ws_wide_rings, base.ws_wide_a_tma, True, mw.BM)
    narrow = (mw.BN, *base.ws_rings, False, True, mw.BM)
    assert pick(256) == wide
    assert pick(192) == narrow  # F % 128 != 0: the 64-column tile
    assert pick(256, cfg=MoeConfig(ws_l1_frames=False)) == wide  # no row frames (see pick)
    assert pick(256, cfg=MoeConfig(ws_l1_bn=64)) == narrow
    assert pick(256, rpg=90.0) is None  # at or below 100 rows per expert: not the ws L1
    assert pick(256, cfg=MoeConfig(gluon_ws_l1=False)) is None


def test_l1_ws_args():
    """The launcher's checks run before any launch (CPU tensors): ring depths >= 2, K / N that
    fit the tile (64 or 128 columns), E4M3 activations."""
    from megagraph.kernels.moe import triton as moe

    if not mw._IMPORT_OK:
        with pytest.raises(RuntimeError):
            mw.l1_gluon_ws(None, None, None, None, None, None, None, topk=1, max_tiles=1)
        return
    E, F, d, T, k = 2, 64, 256, 3, 1
    w = torch.zeros(E, F, d // 2, dtype=torch.int8)
    s = torch.full((E, F, d // 32), 127, dtype=torch.uint8)
    s = s.view(torch.float8_e8m0fnu)
    bank = moe.bank(w, s, "mxfp4")
    xq = torch.zeros(T, d, dtype=torch.float8_e4m3fn)
    xs = torch.ones(T, d // 128)
    a_idx = torch.arange(T, dtype=torch.int32)
    counts = torch.tensor([T, 0], dtype=torch.int32)
    out = torch.empty(T, F, dtype=torch.float16)
    with pytest.raises(ValueError, match="stages"):
        mw.l1_gluon_ws(xq, xs, a_idx, bank, bank, counts, out, topk=k, max_tiles=2, stages=1)
    for lag in (0, 4):  # 1 <= lag < stages (4)
        with pytest.raises(ValueError, match="lag"):
            mw.l1_gluon_ws(xq, xs, a_idx, bank, bank, counts, out, topk=k, max_tiles=2,
                           stages=4, lag=lag)
    with pytest.raises(ValueError, match="E4M3"):
        mw.l1_gluon_ws(xq.float(), xs, a_idx, bank, bank, counts, out, topk=k, max_tiles=2)
    narrow = moe.bank(w[:, :32].contiguous(), s[:, :32].contiguous(), "mxfp4")
    with pytest.raises(ValueError, match="do not fit"):
        mw.l1_gluon_ws(xq, xs, a_idx, narrow, narrow, counts, out[:, :32], topk=k, max_tiles=2)
    # the 128-column tile needs F % 128 == 0 (F = 64 here); other tiles do not exist
    with pytest.raises(ValueError, match="do not fit the 128-column"):
        mw.l1_gluon_ws(xq, xs, a_idx, bank, bank, counts, out, topk=k, max_tiles=2, bn=128)
    with pytest.raises(ValueError, match="bn 96"):
        mw.l1_gluon_ws(xq, xs, a_idx, bank, bank, counts, out, topk=k, max_tiles=2, bn=96)
    # two upcast partitions: the 128-column tile, A by TMA and one quarter at a time only
    for kw in (dict(bn=64, a_tma=True), dict(bn=128, a_tma=False), dict(bn=128, a_tma=True,
                                                                         qlag=1)):
        with pytest.raises(ValueError, match="upp 2"):
            mw.kernel_consts(topk=1, has_limit=False, upp=2, **kw)
    # max_tiles == 0: checked, then nothing launched
    assert mw.l1_gluon_ws(xq, xs, a_idx, bank, bank, counts, out, topk=k, max_tiles=0) is out


def _types(a_tma: bool = False, bn: int = mw.BN):
    """TYPES with the TMA descriptors in place of the weight pointers and their strides (and A's
    for a_tma; else the placeholder the launcher passes); weight boxes of bn rows."""
    from megagraph.kernels.moe import gluon_decode as md

    desc = f"tensordesc<u8[{bn}, {mw.BK // 2}],{md.W_TMA_LAYOUT!r}>"
    types = {n: t for n, t in TYPES.items()
             if n not in ("b1_ptr", "b2_ptr", "stride_bg", "stride_bn")}
    a_desc = desc if not a_tma else f"tensordesc<fp8e4nv[{mw.BM}, {mw.BK}],{mw.A_TMA_LAYOUT!r}>"
    return dict(types, w1_desc=desc, w3_desc=desc, a_desc=a_desc, f1_ptr="*i32", f3_ptr="*i32",
                ep_ptr="*fp32", ep_stride="i32",
                **{n: desc for n in ("e1_desc", "e3_desc", "sa_desc", "f1_desc", "f3_desc")})


def _stma_types(bn: int = mw.BN_WIDE):
    """_types(a_tma=True) with STMA's descriptors (exponent, A-scale and frame boxes)."""
    e = f"tensordesc<u8[{bn}, 16],{mw.E_TMA_LAYOUT!r}>"
    sa = f"tensordesc<fp32[1, {mw.BM}],{mw.S_TMA_LAYOUT!r}>"
    f = f"tensordesc<i32[1, {bn}],{mw.S_TMA_LAYOUT!r}>"
    return dict(_types(True, bn), e1_desc=e, e3_desc=e, sa_desc=sa, f1_desc=f, f3_desc=f)


def _compile(**kw):
    """The sm_90 build at kernel_consts(**kw); the loader's upcast share (lup, the default with
    two upcast partitions) only where kw asks: the other build tests pin the partitions' loops
    without it, test_l1_ws_sm90_build_loader_upcast with it."""
    kw.setdefault("lup", False)
    consts = mw.kernel_consts(topk=6, has_limit=True, **kw)
    return gluon_sm90(mw.l1_ws_kernel, _types(consts["A_TMA"], consts["BN"]), consts,
                      num_warps=mw.NUM_WARPS, maxnreg=mw.launch_maxnreg(consts))


def partition_loops(sass: str) -> dict:
    """The K loop of each partition (SASS text up to ';', one instruction a list item), by what
    only it runs: "mma" (both MMA warpgroups: QGMMA), "upcast" (PRMT), "loader" (UTMALDG). A
    loop = the body of a conditional backward branch longer than 16 instructions (the mbarrier
    try-wait retries ptxas moves out of line are 2-3): sm90_build.partition_loops."""
    return sm90_partition_loops(sass, (("mma", "QGMMA"), ("upcast", r"\bPRMT\b"),
                                       ("loader", "UTMALDG")))


def ws_order_problems(loops: dict) -> list[str]:
    """The order every release needs (the module docstring): before each partition's first
    mbarrier arrive of a chunk (SYNCS.ARRIVE.TRANS64.A1T0) a BAR.SYNC of the partition that
    follows - loader: its cp.async wait (DEPBAR.LE SB0) and then its proxy fence
    (FENCE.VIEW.ASYNC.S: writer-side, before the barrier); upcast: its last st.shared and then its
    proxy fence; MMA: its last wgmma wait (WARPGROUP.DEPBAR.LE gsb0, 0x0). [] when right."""
    probs = []
    need = {"loader": (r"^(@\S+\s+)?DEPBAR\.LE\s+SB0", r"FENCE\.VIEW\.ASYNC\.S"),
            "upcast": (r"\bSTS", r"FENCE\.VIEW\.ASYNC\.S"),
            "mma": (r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", None)}
    for kind, bodies in loops.items():
        last_write, fence = need[kind]
        for body in bodies:
            arr = next((i for i, t in enumerate(body) if "SYNCS.ARRIVE.TRANS64.A1T0" in t), None)
            if arr is None:
                probs.append(f"{kind}: no arrive in the loop")
                continue
            w = max((i for i in range(arr) if re.search(last_write, body[i])), default=None)
            f = max((i for i in range(arr) if fence and re.search(fence, body[i])), default=None)
            b = max((i for i in range(arr) if re.search(r"\bBAR\.SYNC\b", body[i])), default=None)
            if w is None or b is None or b < w:
                probs.append(f"{kind}: no partition barrier between {last_write} and the arrive")
            if fence and (f is None or not (w is not None and w < f < b)):
                probs.append(f"{kind}: the proxy fence is not between {last_write} and the "
                             "barrier before the arrive (writer-side)")
    return probs




LOOP_COUNTS = {  # per chunk (each partition's loop holds one chunk)
    "mma": dict(QGMMA=(r"\bQGMMA\.64x64x32\.F32\.E4M3\.E4M3\b", 8),
                WG_ARRIVE=(r"WARPGROUP\.ARRIVE", 2), WG_DEPBAR=(r"WARPGROUP\.DEPBAR", 2),
                FFMA=(r"\bFFMA\b", 64), FMUL=(r"\bFMUL\b", 64), TRYWAIT=(r"SYNCS\.PHASECHK", 2),
                ARRIVE=(r"SYNCS\.ARRIVE\.TRANS64\.A1T0", 2), STS=(r"\bSTS", 0),
                FENCE=(r"FENCE\.VIEW", 0)),
    "upcast": dict(PRMT=(r"\bPRMT\b", 64), LDS128=(r"\bLDS\.128\b", 4),
                   STS128=(r"\bSTS\.128\b", 8), TRYWAIT=(r"SYNCS\.PHASECHK", 2),
                   ARRIVE=(r"SYNCS\.ARRIVE\.TRANS64\.A1T0", 2), FENCE=(r"FENCE\.VIEW", 1),
                   QGMMA=(r"GMMA", 0)),
    "loader": dict(UTMALDG=(r"\bUTMALDG\b", 2), LDGSTS128=(r"\bLDGSTS\.E\.BYPASS\.128\b", 8),
                   LDGSTS4=(r"\bLDGSTS\.E\s", 2), DEPBAR=(r"^(@\S+\s+)?DEPBAR\.LE\s+SB0", 1),
                   EXPECT=(r"SYNCS\.ARRIVE\.TRANS64\s", 1),
                   ARRIVE=(r"SYNCS\.ARRIVE\.TRANS64\.A1T0", 1), TRYWAIT=(r"SYNCS\.PHASECHK", 1),
                   FENCE=(r"FENCE\.VIEW", 1)),
}
# each loop's instruction count when written (+- 10%): the upcast's is the work per chunk that
# the MMA warpgroups' must hide (2 x 64 rows x 64 packed bytes for 128 threads)
LOOP_SIZES = {"mma": 217, "upcast": 258, "loader": 125}  # upcast 306 with the byte-spread table


@build
def test_l1_ws_sm90_build():
    """Triton 3.6 sm_90 build at the defaults (NS = 4, NU = 2): no stack / local memory, REG =
    the launch cap (128: 16 warps fill the SM's 64K), the partitions' setmaxnreg (200 for the
    default MMA warpgroup, REGS for the workers), <= 227 KB of shared memory (one CTA per SM),
    the per-partition K-loop counts (LOOP_COUNTS, LOOP_SIZES) and release order."""
    k = _compile()
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    assert int(re.search(r"REG:(\d+)", usage).group(1)) == mw.MAXNREG, usage
    ptx_regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                           k.asm["ptx"])}
    default = 4 * mw.MAXNREG - sum(mw.REGS)
    assert {default, *mw.REGS} <= ptx_regs, ptx_regs
    shared = k.metadata.shared
    assert shared <= 227 * 1024, shared
    loops = partition_loops(sass)
    assert [len(loops[n]) for n in ("mma", "upcast", "loader")] == [2, 1, 1], \
        {n: len(v) for n, v in loops.items()}
    stats = {}
    for kind, pats in LOOP_COUNTS.items():
        for body in loops[kind]:
            got = {n: count(body, p) for n, (p, _) in pats.items()}
            stats[kind] = (len(body), got)
            assert got == {n: v for n, (_, v) in pats.items()}, (kind, got)
            assert abs(len(body) - LOOP_SIZES[kind]) <= 0.1 * LOOP_SIZES[kind], (kind, len(body))
    print(f"\nsm_90 ws build: {shared} B shared, setmaxnreg {sorted(ptx_regs)}, "
          f"loops per chunk {stats}")
    assert ws_order_problems(loops) == []


@build
@pytest.mark.parametrize("stages,bstages,use_asm,lag,persist", [
    (3, 2, True, None, False), (6, 3, True, None, False), (4, 2, False, None, False),
    (4, 2, True, 3, False), (6, 3, True, 5, False), (4, 2, True, 1, True),
    (6, 3, True, 3, True), (6, 3, True, 1, "a_tma")])
def test_l1_ws_sm90_build_variants(stages, bstages, use_asm, lag, persist):
    """Other ring depths, loader lags, persistent CTAs and the integer upcast: no stack /
    spills, within 227 KB, the same release order. (6, 3): the deepest default-tile ring that
    fits."""
    kw = dict(persist=True, a_tma=True) if persist == "a_tma" else dict(persist=persist)
    k = _compile(stages=stages, bstages=bstages, use_asm=use_asm, lag=lag, **kw)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    assert ws_order_problems(partition_loops(sass)) == []


# the 128-column tile per chunk: four quarters of 4 QGMMA each, one wait and 32 FFMA + 32 FMUL of
# promotion after each; the upcast twice the 64-row blocks; the loader one more 4-byte copy (the
# exponents of 256 weight rows: 2 a thread)
WIDE_LOOP_COUNTS = {
    "mma": dict(LOOP_COUNTS["mma"], QGMMA=(LOOP_COUNTS["mma"]["QGMMA"][0], 16),
                WG_ARRIVE=(r"WARPGROUP\.ARRIVE", 4), WG_DEPBAR=(r"WARPGROUP\.DEPBAR", 4),
                FFMA=(r"\bFFMA\b", 128), FMUL=(r"\bFMUL\b", 128)),
    "upcast": dict(LOOP_COUNTS["upcast"], PRMT=(r"\bPRMT\b", 128),
                   LDS128=(r"\bLDS\.128\b", 8), STS128=(r"\bSTS\.128\b", 16)),
    "loader": dict(LOOP_COUNTS["loader"], LDGSTS4=(r"\bLDGSTS\.E\s", 3)),
}
# (upcast 571 with the byte-spread table the sign-by-prmt one replaced)
WIDE_LOOP_SIZES = {"mma": 390, "upcast": 475, "loader": 138}


@build
def test_l1_ws_sm90_build_wide():
    """The 128-column tile at its default rings (4:2): no stack / spills, <= 227 KB, the pinned
    per-chunk counts, the release order, and each quarter's promotion (32 FFMA) between its
    wgmma wait and the next quarter's wgmmas - the non-pure asm fma that keeps LLVM from sinking
    the promotions below later wgmmas (which spilled 480 bytes: four partials live)."""
    k = _compile(bn=mw.BN_WIDE)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    loops = partition_loops(sass)
    assert [len(loops[n]) for n in ("mma", "upcast", "loader")] == [2, 1, 1]
    for kind, pats in WIDE_LOOP_COUNTS.items():
        for body in loops[kind]:
            got = {n: count(body, p) for n, (p, _) in pats.items()}
            assert got == {n: v for n, (_, v) in pats.items()}, (kind, got)
            assert abs(len(body) - WIDE_LOOP_SIZES[kind]) <= 0.1 * WIDE_LOOP_SIZES[kind], \
                (kind, len(body))
    for body in loops["mma"]:
        marks = [("w" if "WARPGROUP.DEPBAR" in t else "a" if "WARPGROUP.ARRIVE" in t else "f")
                 for t in body if re.search(r"WARPGROUP\.(DEPBAR|ARRIVE)|\bFFMA\b", t)]
        seq = "".join(marks)
        assert seq == "a" + "w" + "f" * 32 + ("a" + "w" + "f" * 32) * 3, seq
    assert ws_order_problems(loops) == []


@build
def test_l1_ws_sm90_build_frames():
    """The 128-column tile with row frames (A by TMA, two upcasts, A read by each wgmma: areg off)
    : no stack / spills at the same setmaxnreg, and per chunk the MMA loop's promotions are FFMAs by the A scales alone - no
    FMUL, no shared loads but the A scales (2 LDS) -, each quarter's 32 FFMA still between its
    wgmma wait and the next wgmmas; the upcasts compute no chunk frame (no SHFL reduction) and
    the loader copies the frames (2 more 4-byte cp.async)."""
    k = _compile(bn=mw.BN_WIDE, a_tma=True, frames=True, areg=False)
    base = _compile(bn=mw.BN_WIDE, a_tma=True)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    assert k.metadata.shared <= 227 * 1024
    loops, base_loops = partition_loops(sass), partition_loops(usage_and_sass(base)[1])
    assert [len(loops[n]) for n in ("mma", "upcast", "loader")] == [2, 2, 1]
    for body in loops["mma"]:
        assert count(body, r"\bQGMMA\b") == 16 and count(body, r"\bFFMA\b") == 128
        assert count(body, r"\bFMUL\b") == 0 and count(body, r"\bLDS") <= 2
        marks = "".join("w" if "WARPGROUP.DEPBAR" in t else "a" if "WARPGROUP.ARRIVE" in t
                        else "f" for t in body
                        if re.search(r"WARPGROUP\.(DEPBAR|ARRIVE)|\bFFMA\b", t))
        assert marks == ("a" + "w" + "f" * 32) * 4, marks
    for body in loops["upcast"]:
        assert count(body, r"\bPRMT\b") == 64 and count(body, r"SHFL") == 0
    ld, ld0 = loops["loader"][0], base_loops["loader"][0]
    assert count(ld, r"\bLDGSTS") == count(ld0, r"\bLDGSTS") + 2
    assert ws_order_problems(loops) == []


@build
@pytest.mark.parametrize("kw", [dict(), dict(upp=1)])
def test_l1_ws_sm90_build_areg(kw):
    """Row frames with the A rows in registers (areg; A by TMA - with gathered A it is refused:
    16 bytes spilled): no stack / spills (REGS_WIDE_AREG at two upcasts), per chunk and MMA warpgroup 4 LDSM of its A rows and 16 QGMMA with a register A
    operand (no A descriptor), the promotions' order unchanged, the release order."""
    k = _compile(bn=mw.BN_WIDE, frames=True, areg=True, a_tma=True, **kw)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    loops = partition_loops(sass)
    assert len(loops["mma"]) == 2
    for body in loops["mma"]:
        assert count(body, r"\bLDSM\b") == 4 and count(body, r"\bFMUL\b") == 0
        assert count(body, r"\bQGMMA\.64x64x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc") == 16
        marks = "".join("w" if "WARPGROUP.DEPBAR" in t else "a" if "WARPGROUP.ARRIVE" in t
                        else "f" for t in body
                        if re.search(r"WARPGROUP\.(DEPBAR|ARRIVE)|\bFFMA\b", t))
        assert marks == ("a" + "w" + "f" * 32) * 4, marks
    assert ws_order_problems(loops) == []
    with pytest.raises(ValueError, match="areg"):
        mw.kernel_consts(topk=6, has_limit=True, bn=mw.BN_WIDE, frames=True, areg=True,
                         a_tma=False)


@build
def test_l1_ws_sm90_build_wide_qlag():
    """The 128-column tile with A by TMA and qlag 1: no stack / spills at
    REGS_WIDE_Q (the loader without gathered A fits 24 registers), and per chunk two quarters'
    wgmmas issued before the first wait, then each wait leaving one group in flight (gsb0 0x1)
    but the last: the next quarter's wgmma runs while a partial is promoted."""
    k = _compile(bn=mw.BN_WIDE, a_tma=True, qlag=1)
    assert k.metadata.shared <= 227 * 1024
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    ptx_regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                           k.asm["ptx"])}
    assert set(mw.REGS_WIDE_Q) <= ptx_regs, ptx_regs
    loops = partition_loops(sass)
    assert len(loops["mma"]) == 2
    for body in loops["mma"]:
        assert count(body, r"\bQGMMA\b") == 16 and count(body, r"\bFFMA\b") == 128
        marks = "".join("w" if "WARPGROUP.DEPBAR" in t else "a" if "WARPGROUP.ARRIVE" in t
                        else "" for t in body)
        assert marks == "aawawaww", marks
        waits = [re.search(r"gsb0,\s*(0x\d)", t).group(1) for t in body
                 if "WARPGROUP.DEPBAR" in t]
        assert waits == ["0x1", "0x1", "0x1", "0x0"], waits
    assert ws_order_problems(loops) == []


@build
@pytest.mark.parametrize("kw", [dict(), dict(bn=W, a_tma=True)])
def test_l1_ws_sm90_build_skip(kw):
    """skip=True (the rows 64.. warpgroup idle on tiles of <= 64 rows): no stack / spills, the
    same per-chunk wgmma / promotion counts and release order as without, the loop a branch
    longer; skip=False is the same SASS as before the
    switch existed."""
    on, off = _compile(skip=True, **kw), _compile(skip=False, **kw)
    for k in (on, off):
        usage, sass = usage_and_sass(k)
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
        assert not re.search(r"\b(LDL|STL)\b", sass)
    l_on = partition_loops(usage_and_sass(on)[1])
    l_off = partition_loops(usage_and_sass(off)[1])
    assert ws_order_problems(l_on) == []
    for a, b in zip(l_on["mma"], l_off["mma"]):
        for pat in (r"\bQGMMA\b", r"\bFFMA\b", r"\bFMUL\b", r"SYNCS\.ARRIVE"):
            assert count(a, pat) == count(b, pat), pat
        assert len(b) < len(a) <= len(b) + 8


@build
def test_l1_ws_sm90_build_two_upcasts():
    """The 128-column tile's default with A by TMA: two upcast partitions (W1's, W3's), 20 warps
    at launch cap 96 (REG 96), setmaxnreg REGS_WIDE_U2 for the workers and the rest (184) for
    the default MMA warpgroup - Triton's budget: with an 8-warp upcast partition instead it
    left the default warpgroup at 256, more than the pool holds -, no stack / spills, each
    upcast loop half of the one-partition upcast (64 PRMT), the release order."""
    k = _compile(bn=mw.BN_WIDE, a_tma=True)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"REG:(\d+)", usage).group(1)) == 96, usage
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    ptx = k.asm["ptx"]
    r_mma, r_up, r_ld = mw.REGS_WIDE_U2
    default = (96 * 20 - (r_mma + 2 * r_up + r_ld) * 4) // 4
    dec = {int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)}
    inc = {int(r) for r in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert default == r_mma and {default, r_up, r_ld} <= dec and r_mma in inc, (dec, inc)
    loops = partition_loops(sass)
    assert [len(loops[n]) for n in ("mma", "upcast", "loader")] == [2, 2, 1]
    for body in loops["upcast"]:
        assert count(body, r"\bPRMT\b") == 64 and count(body, r"\bSTS\.128\b") == 8
    assert ws_order_problems(loops) == []


@build
@pytest.mark.parametrize("frames,areg", [(True, True), (True, False), (False, False)])
def test_l1_ws_sm90_build_loader_upcast(frames, areg):
    """lup (the loader upcasting the last 32-row block of W1 and W3 of each chunk; routed_experts'
    default with row frames and AREG): at REGS_WIDE_LUP (A rows read by the wgmmas, the loader at
    48 registers) no stack / spills; at REGS_WIDE_LUP_AREG (the default: the loader at 32) at most
    16 B of stack and 4 local loads / stores, all in the loader's loops; each upcast partition's
    loop three 32-row blocks (48 PRMT, 6 STS.128, 3 LDS.128: 3/4 of the 64-row pair's), the
    loader's loop its two (32 PRMT, 4 STS.128) beside its TMA issues, and per chunk the loader's
    three arrivals (r_ready's publish, its r_free and b_ready); the upcasts' and the MMA
    warpgroups' release order; lup is refused where it does not apply."""
    k = _compile(bn=mw.BN_WIDE, a_tma=True, persist=True, frames=frames, areg=areg, lup=True)
    usage, sass = usage_and_sass(k)
    regs = mw.REGS_WIDE_LUP_AREG if areg else mw.REGS_WIDE_LUP
    dec = {int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)",
                                      k.asm["ptx"])}
    assert set(regs[1:]) <= dec, dec
    loops = partition_loops(sass)
    spills = len(re.findall(r"\b(LDL|STL)\b", sass))
    if not areg:
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
        assert spills == 0, "local memory (spills) in the kernel"
    else:
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 16, usage
        in_loader = sum(count(b, r"\b(LDL|STL)\b") for b in loops["upcast"]
                        if count(b, r"\bUTMALDG\b") > 0)
        assert spills <= 8 and in_loader <= 4, (spills, in_loader)
    ups = [b for b in loops["upcast"] if count(b, r"\bUTMALDG\b") == 0]
    lds = [b for b in loops["upcast"] if count(b, r"\bUTMALDG\b") > 0]
    assert len(ups) == 2 and lds, {n: len(v) for n, v in loops.items()}
    for body in ups:
        assert (count(body, r"\bPRMT\b"), count(body, r"\bSTS\.128\b"),
                count(body, r"\bLDS\.128\b")) == (48, 6, 3)
    for body in lds:
        assert (count(body, r"\bPRMT\b"), count(body, r"\bSTS\.128\b"),
                count(body, r"SYNCS\.ARRIVE\.TRANS64\.A1T0")) == (32, 4, 3)
    assert ws_order_problems({"upcast": ups, "mma": loops["mma"], "loader": []}) == []
    for kw in (dict(bn=mw.BN_WIDE, a_tma=True, upp=1), dict(bn=mw.BN_WIDE, a_tma=True, lag=3),
               dict(bn=mw.BN_WIDE, a_tma=True, stages=2)):
        with pytest.raises(ValueError, match="lup"):
            mw.kernel_consts(topk=6, has_limit=True, lup=True, **kw)
        # the default (lup None) leaves it off there instead (the H200 suite's 2-stage rings)
        assert not mw.kernel_consts(topk=6, has_limit=True, **kw)["LUP"]


@build
@pytest.mark.parametrize("frames,lup", [(True, True), (False, False)])
def test_l1_ws_sm90_build_small_tma(frames, lup):
    """stma (the A scales, exponents and frames by TMA): no stack / spills beyond the lup
    default's, <= 227 KB of shared memory (the exponent stages 4x larger), and per chunk the
    loader's loop holds no cp.async and no cp.async wait - its TMA issues (W1, W3, A,
    exponents x 2, A scales, frames x 2 with frames) and one expect, and arrives only with its
    upcast share (r_free, b_ready); the upcasts' and the MMA warpgroups' loops and release
    order unchanged; refused with gathered A and for the down GEMM."""
    consts = mw.kernel_consts(topk=6, has_limit=True, bn=mw.BN_WIDE, a_tma=True, persist=False,
                              frames=frames, lup=lup, stma=True)
    k = gluon_sm90(mw.l1_ws_kernel, _stma_types(), consts, num_warps=mw.NUM_WARPS,
                   maxnreg=mw.launch_maxnreg(consts))
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 16, usage
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    loops = partition_loops(sass)
    kinds = ("upcast", "loader")
    ld = [b for n in kinds for b in loops[n] if count(b, r"\bUTMALDG\b") > 0]
    ups = [b for b in loops["upcast"] if count(b, r"\bUTMALDG\b") == 0]
    assert len(ld) == 1 and len(ups) == 2 and len(loops["mma"]) == 2, \
        {n: len(v) for n, v in loops.items()}
    body = ld[0]
    assert count(body, r"\bLDGSTS") == 0 and count(body, r"^(@\S+\s+)?DEPBAR") == 0
    assert count(body, r"\bUTMALDG\b") == 6 + 2 * frames
    assert count(body, r"SYNCS\.ARRIVE\.TRANS64\s") == 1  # the expect
    assert count(body, r"SYNCS\.ARRIVE\.TRANS64\.A1T0") == (2 if lup else 0)
    assert ws_order_problems({"upcast": ups, "mma": loops["mma"], "loader": []}) == []
    for kw in (dict(a_tma=False), dict(epi=2)):
        with pytest.raises(ValueError, match="stma"):
            mw.kernel_consts(topk=6, has_limit=True, bn=mw.BN_WIDE, stma=True, **kw)


@build
@pytest.mark.parametrize("kw", [dict(stages=3), dict(stages=2), dict(persist=True),
                                dict(persist=True, a_tma=True), dict(use_asm=False),
                                dict(stages=4, bstages=2, lag=3), dict(a_tma=True, stages=2),
                                dict(a_tma=True, use_asm=False), dict(a_tma=True, upp=1)])
def test_l1_ws_sm90_build_wide_variants(kw):
    """The 128-column tile at other rings, lags, persistent, A by TMA and the integer upcast:
    no stack / spills, within 227 KB, the same release order."""
    k = _compile(bn=mw.BN_WIDE, **kw)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    assert ws_order_problems(partition_loops(sass)) == []


def test_ws_order_problems():
    """The order check on hand-written loops: the right order passes; a fence after the
    barrier (reader-side) and a missing barrier fail."""
    good = {"loader": [["DEPBAR.LE SB0, 0x1", "BAR.SYNC.DEFER_BLOCKING 0x4, 0x80",
                        "FENCE.VIEW.ASYNC.S", "BAR.SYNC.DEFER_BLOCKING 0x4, 0x80",
                        "@!P5 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8+0x21550], RZ"]],
            "upcast": [["STS.128 [R5], R20", "FENCE.VIEW.ASYNC.S", "BAR.SYNC 0x3, 0x80",
                        "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR11], RZ"]],
            "mma": [["WARPGROUP.DEPBAR.LE gsb0, 0x0", "BAR.SYNC 0x0, 0x80",
                     "@!P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR32], RZ"]]}
    assert ws_order_problems(good) == []
    reader = dict(good, loader=[["DEPBAR.LE SB0, 0x1", "BAR.SYNC 0x4, 0x80",
                                 "FENCE.VIEW.ASYNC.S",
                                 "@!P5 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8], RZ"]])
    assert ws_order_problems(reader)
    unsynced = dict(good, mma=[["WARPGROUP.DEPBAR.LE gsb0, 0x0",
                                "@!P1 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR32], RZ"]])
    assert ws_order_problems(unsynced)
