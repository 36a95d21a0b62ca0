"""FP8 H on the warp-specialized prefill kernels: the L1's epilogue quantizing H per row and 128
columns (moe_gluon_ws.l1_gluon_ws(out_scale=...)) and the down GEMM on E4M3 H run by the L1's
kernel (moe_gluon_l2_fp8.l2_gluon_ws_fp8, EPI 2).

GPU (CUDA sm_90 + Triton 3.6 Gluon, else skipped):
- the L1's E4M3 H and its scales are BIT FOR BIT quantize_act(fp8_1x128) of the same kernel's
  fp32 H (the fp32-out launch runs the same wgmmas, promotions and SwiGLU: the same fp32 values
  reach both epilogues), every valid row written (NaN-poisoned outputs), and each dequantized
  element within E4M3's half step of that H (2^-4 relative, or half the subnormal step 2^-10 x
  the block's scale);
- the down GEMM against the fp32 math on the dequantized H and W2 (gluon_cases.l2_reference)
  within 1e-3 relative for fp32 y - E4M3 x E4M3 products are exact; what remains is the tensor
  core's accumulation inside a 128-column chunk (about 2^-13 relative) and the fp32 promotions:
  measured ~1e-4, a tenth of the bound - and 1e-2 for bf16 y (bf16 rounds at 2^-9 per element);
  against the Triton FP8-H L2 (moe_jit, role l2_fp8h: the same math, other sum order) within
  the same bounds; every routed slot written, every other slot still NaN; tiles of 1..128 rows,
  experts of several tiles, empty experts, 2-chunk K (fewer chunks than the loader's lag),
  persistent grids of 1..3 CTAs (ring phases running on across many tiles), row frames vs
  per-chunk frames, the loader's upcast share on / off, ring depths: all the same bits;
  repeated launches and a CUDA-graph capture;
- routed_experts(fp8_h=True) at prefill sizes takes both kernels and matches the Triton FP8-H
  path within 8e-3 (H's codes may differ by one E4M3 step where the two kernels' fp32 H sit on
  either side of a rounding boundary: test_triton_moe_fp8h's TOL_Q).

CPU: the launchers' checks; with Triton 3.6 (make sm90-h200) the EPI 1 / EPI 2 builds: no stack /
local memory, the MMA and upcast loops the fp16-H L1's (the epilogue is outside them), the
release order.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from gluon_cases import check_repeats_and_graph, dbg_bank, explicit_rows, l2_reference, rel, \
    rows_case
from gluon_cases import gluon_build, gluon_gpu
from megagraph.kernels.moe import gluon_l2_fp8 as m8
from megagraph.kernels.moe.config import MoeConfig
from megagraph.kernels.moe import gluon_ws as mw
from poisoned_alloc import poisoned

gpu = gluon_gpu(m8)
build = gluon_build(mw)

# (rows per expert, tokens, top-k, d, F, W2 exponent range)
CASES = {
    # tile sizes 1..128, experts of 2-3 tiles, empty experts; 331 tokens (odd); 3 chunks
    "tiles": ([1, 0, 3, 64, 65, 127, 128, 129, 0, 300], 331, 3, 512, 384, (119, 125)),
    # K = 256: 2 chunks (fewer than the loader's lag), a 20-binade exponent range (no row
    # frames: per-chunk frames, flushed weights)
    "short_k_wide_exps": ([3, 0, 130, 1, 9], 77, 3, 256, 256, (108, 128)),
    # 9 chunks, one column tile
    "long_k": ([200, 57, 0, 128], 200, 2, 256, 1152, (119, 125)),
}


def _h_fp8(P, F, seed):
    """Random H quantized as the L1's epilogue does (quantize_act fp8_1x128): blocks of 128
    with magnitudes spread over 2^-8 .. 2^4. On the GPU: (codes E4M3 [P, F], scales f32 [P, F /
    128])."""
    from megagraph.kernels.fused.reference import quantize_act

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(P, F // 128, 128, generator=g) * \
        torch.exp2(torch.randint(-8, 5, (P, F // 128, 1), generator=g).float())
    q, s = quantize_act(h.view(P, F), act_fmt="fp8_1x128")
    return q.cuda(), s.float().contiguous().cuda()


def _deq(q, s):
    """E4M3 codes x their per-128 scales, fp32."""
    P, F = q.shape
    return (q.float().view(P, F // 128, 128) * s[..., None]).view(P, F)


def _l2_case(name, seed=0):
    """(hq, hs, w2, counts, srt, wts [T, k], ks) of CASES[name] on the GPU; ks = k + 1 (one
    unrouted slot per token)."""
    rows, T, k, d, F, exps = CASES[name]
    P = sum(rows)
    hq, hs = _h_fp8(P, F, seed + len(name))
    g = torch.Generator().manual_seed(seed + 7)
    w = torch.randint(-128, 128, (len(rows), d, F // 2), dtype=torch.int8, generator=g)
    e = torch.randint(*exps, (len(rows), d, F // 32), dtype=torch.uint8, generator=g)
    w2 = dbg_bank(w, e, "cuda")
    srt, counts = explicit_rows(rows, T, k, seed + len(name))
    wts = (torch.rand(T, k, generator=g) + 0.25).cuda()
    return hq, hs, w2, counts, srt, wts, k + 1


def _run(hq, hs, w2, counts, srt, wts, ks, dtype, **kw):
    """l2_gluon_ws_fp8 into a NaN-poisoned y [T, ks, d] of dtype; waited for (with a deadline)."""
    from test_moe_gluon_l2_ws import _sync

    T, k = wts.shape
    y = torch.full((T, ks, w2.n), float("nan"), dtype=dtype, device="cuda")
    P = srt.numel()
    m8.l2_gluon_ws_fp8(hq, hs, w2, counts, srt, wts.reshape(-1), y.view(T * ks, -1), topk=k,
                       ks=ks, max_tiles=min(P, P // m8.BM + counts.numel()), **kw)
    _sync("l2_gluon_ws_fp8")
    return y


def _bits(y):
    return y.view({4: torch.int32, 2: torch.int16}[y.element_size()])


def _triton_l2_fp8(hq, hs, w2, counts, srt, wts, ks, dtype):
    """The Triton FP8-H L2 as routed_experts launches it (moe.gemm role l2_fp8h)."""
    from megagraph.kernels.moe import triton as moe

    T, k = wts.shape
    P, E = srt.numel(), counts.numel()
    y = torch.full((T, ks, w2.n), float("nan"), dtype=dtype, device="cuda")
    rpg = P / max(1, min(E, P))
    moe.gemm(hq, hs, w2, y.view(T * ks, -1), role="l2_fp8h", rows_per_group=rpg, counts=counts,
             c_idx=srt, row_w=wts.reshape(-1), topk=k, ks=ks,
             max_tiles=min(P, P // moe.pick_tile("l2_fp8h", rpg).bm + E))
    torch.cuda.synchronize()
    return y


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("name", list(CASES))
def test_l2_fp8_matches(name, dtype, tol):
    """Against the fp32 math and the Triton FP8-H L2; routed slots written, the rest still NaN;
    row frames (where they apply) vs per-chunk frames, the loader's share off, persistent grids
    of 1 and 3 CTAs and a 3:2 ring: the same bits."""
    hq, hs, w2, counts, srt, wts, ks = _l2_case(name)
    T, k = wts.shape
    y = _run(hq, hs, w2, counts, srt, wts, ks, dtype)
    routed = torch.zeros(T, ks, dtype=torch.bool, device="cuda")
    routed_pairs = torch.zeros(T * k, dtype=torch.bool, device="cuda")
    routed_pairs[srt.long()] = True
    routed[:, :k] = routed_pairs.view(T, k)
    assert torch.isfinite(y[routed].float()).all(), "a routed slot was not written / not finite"
    assert torch.isnan(y[~routed].float()).all(), "an unrouted slot was written"
    ref = l2_reference(_deq(hq, hs), w2, counts, srt, wts, ks)
    err = rel(y[routed], ref[routed])
    assert err < tol, f"vs fp32 math: {err:.3e}"
    y_tr = _triton_l2_fp8(hq, hs, w2, counts, srt, wts, ks, dtype)
    assert rel(y[routed], y_tr[routed]) < tol, \
        f"vs the Triton FP8-H L2: {rel(y[routed], y_tr[routed]):.3e}"
    for kw in (dict(frames=False), dict(lup=False), dict(ctas=1), dict(ctas=3),
               dict(stages=3, bstages=2, lup=False)):
        other = _run(hq, hs, w2, counts, srt, wts, ks, dtype, **kw)
        assert torch.equal(_bits(other), _bits(y)), f"{kw} gave other bits"


@gpu
def test_l2_fp8_frames_apply():
    """The cases' row frames: a narrow exponent range gets them (the fast path is what the
    tests run), the 20-binade one falls back to per-chunk frames."""
    assert m8.down_frames(_l2_case("tiles")[2]) is not None
    assert m8.down_frames(_l2_case("short_k_wide_exps")[2]) is None


@gpu
def test_l2_fp8_repeat_and_graph():
    """20 launches and 3 CUDA-graph replays give the first launch's bits."""
    hq, hs, w2, counts, srt, wts, ks = _l2_case("tiles")
    T, k = wts.shape
    want = _run(hq, hs, w2, counts, srt, wts, ks, torch.float32)
    P = srt.numel()

    def launch(y):
        m8.l2_gluon_ws_fp8(hq, hs, w2, counts, srt, wts.reshape(-1), y.view(T * ks, -1), topk=k,
                           ks=ks, max_tiles=min(P, P // m8.BM + counts.numel()))

    check_repeats_and_graph(launch, torch.empty_like(want), want,
                            lambda o, w: torch.equal(_bits(o), _bits(w)))


L1_CASES = {  # (rows per expert, tokens, top-k, d, F, exponent range, limit): F % 128 == 0
    "tiles_1_128": ([1, 2, 0, 3, 7, 16, 31, 33, 64, 65, 0, 100, 127, 128], 331, 3, 1024, 256,
                    (119, 125), 10.0),
    "big_experts": ([0, 129, 300, 0, 256, 5, 0], 257, 3, 1024, 128, (119, 125), 10.0),
    "short_k_wide_exps": ([3, 0, 130, 1, 9], 77, 3, 256, 128, (108, 128), None),
}


@gpu
@pytest.mark.parametrize("stma", [False, True])
@pytest.mark.parametrize("name", list(L1_CASES))
def test_l1_ws_fp8_h_epilogue(name, stma):
    """E4M3 H + scales = quantize_act(fp8_1x128) of the same kernel's fp32 H, bit for bit; every
    valid row written; each element within E4M3's half step of the fp32 H; with the loader's
    small copies by TMA too (stma, where K / 32 % 16 == 0)."""
    from megagraph.kernels.fused.reference import quantize_act

    rows, T, k, d, F, exps, limit = L1_CASES[name]
    if stma and (d // 32) % 16:
        pytest.skip("exponent rows of K / 32 % 16 != 0 bytes: no STMA")
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=len(name), exps=exps)
    P = a_idx.numel()
    kw = dict(topk=k, max_tiles=min(P, P // mw.BM + counts.numel()), limit=limit,
              bn=mw.BN_WIDE, a_tma=True, persist=True, frames=mw.row_frames(w1, w3),
              stma=stma)
    with poisoned():
        h32 = torch.empty((P, F), dtype=torch.float32, device="cuda")
        hq = torch.empty((P, F), dtype=torch.float8_e4m3fn, device="cuda")
        hs = torch.empty((P, F // 128), dtype=torch.float32, device="cuda")
    mw.l1_gluon_ws(xq, xs, a_idx, w1, w3, counts, h32, **kw)
    mw.l1_gluon_ws(xq, xs, a_idx, w1, w3, counts, hq, out_scale=hs, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(h32).all() and torch.isfinite(hs).all(), "a row was not written"
    assert not torch.isnan(hq.float()).any(), "an H code was not written"
    q_ref, s_ref = quantize_act(h32, act_fmt="fp8_1x128")
    assert torch.equal(hs, s_ref.float()), "other scales than quantize_act's"
    diff = int((hq.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    assert diff == 0, f"{diff} other codes than quantize_act's"
    step = hs.repeat_interleave(128, dim=1)
    err = (_deq(hq, hs) - h32).abs()
    assert (err <= h32.abs() * 2 ** -4 + step * 2 ** -10).all(), "beyond E4M3's half step"


@gpu
def test_routed_experts_fp8_h_takes_ws(monkeypatch):
    """routed_experts(fp8_h=True) at > wide_l1_min_rows rows per expert runs the
    warp-specialized L1 with the FP8 epilogue and l2_gluon_ws_fp8, and matches the Triton FP8-H
    kernels (gluon off) within 8e-3; the default (fp8_h None) does the same with fp8_h_prefill
    on, keeps fp16 H at decode sizes and with fp8_h_prefill off (the fp16-H ws L1 then)."""
    from gluon_cases import case
    from megagraph.kernels.moe import triton as moe

    T, E, d, F, k = 640, 4, 512, 256, 2  # ~320 rows per expert
    xq, xs, w1, w3, _, _ = case(T, E, d, F, k, seed=3)
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (E, d, F // 2), dtype=torch.int8, generator=g)
    e = torch.randint(119, 125, (E, d, F // 32), dtype=torch.uint8, generator=g)
    w2 = dbg_bank(w, e, "cuda")
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32).cuda()
    wts = torch.rand(T, k, generator=g).cuda()
    calls = []
    for mod, name in ((mw, "l1_gluon_ws"), (m8, "l2_gluon_ws_fp8")):
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append((_name, kw.get("out_scale") is not None))
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, spy)

    def run(fp8_h=True, n=T, cfg=MoeConfig()):
        y = torch.full((n, k, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        c = torch.bincount(ids[:n].flatten().long(), minlength=E).to(torch.int32)
        moe.routed_experts(xq[:n], xs[:n], ids[:n], wts[:n], c, w1, w3, w2, y, topk=k,
                           swiglu_limit=10.0, fp8_h=fp8_h, cfg=cfg)
        torch.cuda.synchronize()
        return y

    y = run()
    assert calls == [("l1_gluon_ws", True), ("l2_gluon_ws_fp8", False)], calls
    # the default (fp8_h None, fp8_h_prefill on): the same kernels, the same bits at prefill
    # sizes; fp16 H at decode sizes (8 tokens: 4 rows per expert)
    calls.clear()
    assert torch.equal(run(None).view(torch.int16), y.view(torch.int16))
    assert calls == [("l1_gluon_ws", True), ("l2_gluon_ws_fp8", False)], calls
    calls.clear()
    small = run(None, 8)
    assert calls == [] and torch.isfinite(small.float()).all()
    assert run(None, T, MoeConfig(fp8_h_prefill=False)) is not None
    assert calls == [("l1_gluon_ws", False)], calls
    calls.clear()
    y_tr = run(cfg=MoeConfig(gluon=False))
    assert calls == [], "gluon off still ran a Gluon kernel"
    assert torch.isfinite(y.float()).all()
    assert rel(y, y_tr) < 8e-3, f"vs the Triton FP8-H path: {rel(y, y_tr):.3e}"


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


def test_l2_fp8_args():
    """The launcher's checks, before any launch (CPU tensors)."""
    E, d, F, k, T = 2, 256, 256, 2, 3
    w2 = dbg_bank(torch.zeros(E, d, F // 2), torch.full((E, d, F // 32), 127), "cpu")
    P = T * k
    hq = torch.zeros(P, F, dtype=torch.float8_e4m3fn)
    hs = torch.ones(P, F // 128)
    y = torch.zeros(T * k, d)
    assert m8.args_problem(hq, hs, w2, y) is None
    assert "E4M3" in m8.args_problem(hq.float(), hs, w2, y)
    assert "scales" in m8.args_problem(hq, hs[:, :1], w2, y)
    assert "scales" in m8.args_problem(hq, hs.double(), w2, y)
    assert "y [rows" in m8.args_problem(hq, hs, w2, y.double())
    narrow = dbg_bank(torch.zeros(E, 128, F // 2), torch.full((E, 128, F // 32), 127), "cpu")
    assert "do not fit the 256-column" in m8.args_problem(hq, hs, narrow, y[:, :128])
    if not mw._IMPORT_OK:
        return
    counts = torch.tensor([P, 0], dtype=torch.int32)
    srt = torch.arange(P, dtype=torch.int32)
    kw = dict(topk=k, ks=k, max_tiles=2)
    with pytest.raises(ValueError, match="row_w"):
        m8.l2_gluon_ws_fp8(hq, hs, w2, counts, srt, torch.ones(P).double(), y, **kw)
    with pytest.raises(ValueError, match="E4M3"):
        m8.l2_gluon_ws_fp8(hq.half(), hs, w2, counts, srt, torch.ones(P), y, **kw)
    # the L1: an E4M3 out needs its scales; the scales' shape is checked
    xq = torch.zeros(T, F, dtype=torch.float8_e4m3fn)
    w1 = dbg_bank(torch.zeros(E, 128, F // 2), torch.full((E, 128, F // 32), 127), "cpu")
    h = torch.zeros(P, 128, dtype=torch.float8_e4m3fn)
    l1 = dict(topk=k, max_tiles=2, bn=mw.BN_WIDE, a_tma=True)
    with pytest.raises(ValueError, match="needs out_scale"):
        mw.l1_gluon_ws(xq, torch.ones(T, F // 128), srt, w1, w1, counts, h, **l1)
    with pytest.raises(ValueError, match="scales"):
        mw.l1_gluon_ws(xq, torch.ones(T, F // 128), srt, w1, w1, counts, h,
                       out_scale=torch.ones(P, 2), **l1)
    # max_tiles == 0: checked, nothing launched
    assert m8.l2_gluon_ws_fp8(hq, hs, w2, counts, srt, torch.ones(P), y, topk=k, ks=k,
                              max_tiles=0, frames=False) is y


def test_fp8_h_kernel_choice(monkeypatch):
    """routed_experts' FP8-H pickers and default (available() forced: the predicates' own logic
    on any machine): above 100 rows per expert _h_and_kernels with fp8_h gives an E4M3 H with
    its scales, l1_gluon_ws on the 128-column tile's rings with A by TMA, row frames and
    out_scale = those scales, and the down GEMM's launch; _prefill_fp8_h_may says yes there and
    no at 100 rows, with fp8_h_prefill off or without Gluon; a bank the down GEMM refuses (d =
    128: no 256-column tile) leaves the Triton L2 (routed_experts then takes fp16 H)."""
    from megagraph.kernels.moe import triton as moe

    for mod in (mw, m8):
        monkeypatch.setattr(mod, "available", lambda device=None: True)
    cfg = MoeConfig()
    frames = object()
    monkeypatch.setattr(mw, "row_frames", lambda w1, w3: frames)
    E, d, F, T, k = 4, 256, 256, 300, 2
    xq = torch.zeros(T, d, dtype=torch.float8_e4m3fn)
    xs = torch.ones(T, d // 128)
    w13 = dbg_bank(torch.zeros(E, F, d // 2), torch.full((E, F, d // 32), 127), "cpu")

    def choose(dd, rpg=150.0):
        w2 = dbg_bank(torch.zeros(E, dd, F // 2), torch.full((E, dd, F // 32), 127), "cpu")
        y = torch.zeros(T, k, dd)
        return moe._h_and_kernels(xq, xs, w13, w13, w2, y, T * k, rpg, True, cfg)

    h, hs, l1, l2 = choose(d)
    assert h.dtype == torch.float8_e4m3fn and tuple(h.shape) == (T * k, F)
    assert hs.dtype == torch.float32 and tuple(hs.shape) == (T * k, F // 128)
    assert l1[0] == "gluon_ws_fp8h" and l1[1].func is mw.l1_gluon_ws and l1[2] == mw.BM
    kw = l1[1].keywords
    assert (kw["bn"], kw["stages"], kw["bstages"], kw["a_tma"], kw["persist"]) == \
        (mw.BN_WIDE, *cfg.ws_wide_rings, True, True)
    assert kw["frames"] is frames and kw["out_scale"] is hs
    assert l2[0] == "gluon_l2_fp8" and l2[2] == m8.BM
    assert choose(128)[3][0] == "triton"  # d = 128: the down GEMM's 256-column tile
    assert choose(d, rpg=100.0)[2][0] == "triton"  # at or below 100 rows per expert
    assert moe._prefill_fp8_h_may(xq, 150.0, cfg) and not moe._prefill_fp8_h_may(xq, 100.0, cfg)
    assert not moe._prefill_fp8_h_may(xq, 150.0, dataclasses.replace(cfg, fp8_h_prefill=False))
    monkeypatch.setattr(mw, "available", lambda device=None: False)
    assert not moe._prefill_fp8_h_may(xq, 150.0, cfg)


def test_fp8_h_consts():
    """The FP8-H epilogues need the 128-column tile with A by TMA (and set A by TMA)."""
    for kw in (dict(bn=mw.BN), dict(bn=mw.BN_WIDE, a_tma=False)):
        with pytest.raises(ValueError, match="FP8 H"):
            mw.kernel_consts(topk=6, has_limit=False, epi=1, **kw)
    with pytest.raises(ValueError, match="epi 3"):
        mw.kernel_consts(topk=6, has_limit=False, epi=3)
    c = mw.kernel_consts(topk=6, has_limit=False, bn=mw.BN_WIDE, epi=2, frames=True)
    assert c["EPI"] == 2 and c["A_TMA"] and c["AREG"] and c["LUP"] and c["UPP"] == 2


@build
@pytest.mark.parametrize("epi,cty", [(1, "*fp8e4nv"), (2, "*bf16"), (2, "*fp32")])
def test_fp8_h_sm90_build(epi, cty):
    """EPI 1 / 2 at the default schedule (row frames, A in registers, the loader's share): no
    stack / local memory, the MMA and upcast loops the fp16-H build's (the epilogue is after
    them): the same wgmmas, promotions, upcast and barriers, within 3% of their length."""
    import test_moe_gluon_ws as t
    from sm90_build import count, gluon_sm90, usage_and_sass

    def comp(e, c_ty):
        consts = mw.kernel_consts(topk=6, has_limit=epi == 1, bn=mw.BN_WIDE, a_tma=True,
                                  frames=True, epi=e)
        types = dict(t._types(True, mw.BN_WIDE), ep_ptr="*fp32", ep_stride="i32", c_ptr=c_ty)
        return gluon_sm90(mw.l1_ws_kernel, types, consts, num_warps=mw.NUM_WARPS,
                          maxnreg=mw.launch_maxnreg(consts))

    usage, sass = usage_and_sass(comp(epi, cty))
    base = t.partition_loops(usage_and_sass(comp(0, "*fp16"))[1])
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 16, usage
    loops = t.partition_loops(sass)
    for kind, pat in (("mma", r"\bQGMMA\b|\bFFMA\b|SYNCS"), ("upcast", r"\bPRMT\b|\bSTS|SYNCS")):
        # (the loader's loop holds its upcast share: "upcast" by its PRMTs; left out - its
        # address arithmetic differs with the epilogue's pointers)
        got, want = ([sorted((b for b in ls[kind] if count(b, "UTMALDG") == 0), key=len)
                      for ls in (loops, base)])
        assert len(got) == len(want), kind
        for b, b0 in zip(got, want):  # the same work; register allocation moves a few
            assert count(b, pat) == count(b0, pat), kind
            assert abs(len(b) - len(b0)) <= 0.03 * len(b0), (kind, len(b), len(b0))
    assert t.ws_order_problems({"mma": loops["mma"]}) == []
