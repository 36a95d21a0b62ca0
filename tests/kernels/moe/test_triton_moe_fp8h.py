"""The FP8-H routed-expert path (MoeConfig.fp8_h / routed_experts(fp8_h=True); at every size
off by default, the prefill default fp8_h_prefill runs the Gluon kernels): L1's SwiGLU epilogue writes H as E4M3 codes with one
power-of-two f32 scale per row and 128 columns (moe_jit.quantize_out), and L2 runs the FP8 MMA on
them (A_SCALED, L1's machinery).

Without CUDA this module runs under the Triton interpreter (test_triton_interp.py starts it in a
child pytest), on small dims. Inputs are fresh random values under poisoned allocations
(test_triton_moe.poisoned: every torch.empty is NaN), so an H code, an H scale or an output
element nobody wrote shows up as NaN.

Tolerances and where they come from (relative Frobenius error unless said otherwise):
* L1 epilogue vs quantize_act: the same L1 tile run once with an fp32 output and once with the
  quantized one computes the same fp32 H, so the codes and scales must equal
  kernels.fused.reference.quantize_act(H_fp32) bit for bit (interpreter); on the GPU the two
  compiled variants may contract the SwiGLU epilogue differently: <= 0.1% of the codes one E4M3
  step apart, scales equal.
* L2 on given FP8 H vs torch fp32 on the dequantized H: fp32 accumulation order only, TOL_GEMM
  (1e-5 interpreter; 1e-3 GPU: the FP8 MMA's ~2^-14 accumulation per 128-chunk).
* Whole routed experts vs the reference that quantizes H the same way
  (reference.moe.moe_experts(h_fmt="fp8_1x128")): the kernel's fp32 H differs from the
  reference's by the summation order (interpreter ~1e-7 relative; GPU ~2^-14 from L1's FP8 MMA),
  so an H element within that distance of an E4M3 rounding boundary may round to the neighbour:
  probability ~16 * eps per element, each flip 2^-3 / m relative (m the mantissa), i.e.
  ~sqrt(16 eps) * 0.08 relative overall: ~1.3e-4 interpreter, ~3e-3 GPU. Bounds TOL_Q = 1e-3
  (interpreter; measured 1e-8 .. 6e-8) / 8e-3 (GPU) for fp32 outputs, + 3 * 2^-9 for bf16 outputs
  (Y rounded to bf16 per slot, and both results rounded to bf16: <= 2^-9 relative each).
* Whole routed experts vs the unquantized (fp32-H) reference: the E4M3 rounding of H itself,
  |delta| <= 2^-4 per element (round to nearest, 3 mantissa bits), RMS ~ 2^-3 / sqrt(12) *
  sqrt(E[1/m^2]) ~ 2.4% for random mantissas m in [1, 2). With random W2 rows the errors add in
  quadrature as the values do, so the output's relative error is the h^2 w^2-weighted RMS of the
  per-element errors: ~2.5%, noisier with few dominant terms (measured 2.6-3.8% at these dims), and
  never above the per-element worst case 2^-4 in expectation: LOOSE = (0.005, 2^-4); the lower
  end proves that H really was quantized (the fp16-H path is at ~2e-4).
"""
from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from megagraph.kernels import formats  # noqa: E402
from megagraph.kernels.fused import reference as rf  # noqa: E402
from megagraph.kernels.moe import reference as rmoe  # noqa: E402
from megagraph.kernels.moe import triton as tm  # noqa: E402
from megagraph.kernels.gemm.config import Tile  # noqa: E402
from megagraph.kernels.moe.config import MoeConfig  # noqa: E402
from test_triton_moe import (  # noqa: E402
    ACT,
    DEV,
    GPU,
    MOE_KW,
    RUNNABLE,
    TOL_GEMM,
    _mhc_inputs,
    _moe_weights,
    finite,
    fp8_block,
    gen,
    mxfp4,
    pinned,
    poisoned,
    randn,
    rel,
)

pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")

TOL_Q = 8e-3 if GPU else 1e-3
TOL_Q_BF16 = TOL_Q + 3 * 2.0 ** -9
LOOSE = (0.005, 2.0 ** -4)
HFMT = "fp8_1x128"
FP8_H = MoeConfig(fp8_h=True)  # FP8 H at every size


def _bank(E, d, F, g):
    return (*mxfp4(E, F, d, g), *mxfp4(E, F, d, g), *mxfp4(E, d, F, g))


def _cfg(bm, bn, qsplit=1):
    """A tile for both FP8-H roles: the H200 prefill tile shape on the GPU, small ones here.
    qsplit = 2: L1's 128 columns as two 64-column K loops (moe_jit.moe_tile QSPLIT)."""
    if GPU:
        return Tile(max(bm, 16), bn, 128, 8 if bm >= 64 and qsplit == 1 else 4, 3, par=True,
                    qsplit=qsplit)
    return Tile(bm, bn, 128, 4, 1, par=True, qsplit=qsplit)


def _routing(T, E, k, g, subset=None):
    pool = torch.tensor(subset) if subset else torch.arange(E)
    ids = pool[torch.randint(0, len(pool), (T, k), generator=g)]
    wts = torch.rand(T, k, generator=g) + 0.1
    return ids.to(DEV), wts.to(DEV)


def _l1_setup(T, E, k, d, F, g, subset):
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    bank = _bank(E, d, F, g)
    ids, wts = _routing(T, E, k, g, subset)
    ids32 = ids.to(torch.int32).contiguous()
    counts = torch.bincount(ids32.flatten().long(), minlength=E).to(torch.int32)
    srt = tm.permute(ids32.reshape(-1), counts, E)
    banks = [tm.bank(w, s, "mxfp4") for w, s in zip(bank[0::2], bank[1::2], strict=True)]
    return xq, xs, ids, wts, counts, srt, banks, bank


# ---------------------------------------------------------------------------------------------
# the L1 epilogue: bit for bit quantize_act of the same tile's fp32 H
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k,F,bm,bn,subset,qsplit", [
    (13, 6, 3, 128, 16, 128, (0, 2, 5), 1),   # odd token count, 3 of 6 experts empty
    (9, 4, 2, 384, 16, 256, None, 1),         # two 128-blocks per tile, last N tile half past F
    (13, 6, 3, 256, 16, 128, (0, 2, 5), 2),   # the 128 columns as two 64-column K loops
    (40, 3, 2, 384, 32, 128, None, 2),        # split, 27 rows per expert: full and partial tiles
])
def test_l1_epilogue_equals_quantize_act(T, E, k, F, bm, bn, subset, qsplit):
    """The quantized run's tile may split its 128 columns (qsplit 2); the fp32 run is the
    unsplit 128-column tile (qsplit applies to quantized outputs only), so the bitwise equality
    also proves that the split computes the same fp32 H."""
    check_l1_epilogue(T, E, k, F, subset, pinned(l1_fp8h=_cfg(bm, bn, qsplit=qsplit)))


def check_l1_epilogue(T, E, k, F, subset, cfg: MoeConfig):
    """The "l1_fp8h" tile of cfg run with an fp32 output and with the quantized
    one (codes + scales, under poisoned allocations): the codes and scales are quantize_act of
    the fp32 H bit for bit (interpreter; GPU: <= 0.1% of the codes one E4M3 step apart), and the
    dequantized codes are within E4M3 rounding of that H."""
    g = gen(T * 7 + F)
    d = 128
    xq, xs, _ids, _wts, counts, srt, banks, _ = _l1_setup(T, E, k, d, F, g, subset)
    P = T * k
    tile = tm.pick_tile("l1_fp8h", P / E, cfg)
    kw = dict(b2=banks[1], role="l1_fp8h", rows_per_group=P / E, counts=counts, a_idx=srt,
              topk=k, max_tiles=min(P, P // tile.bm + E), limit=10.0, kc=cfg)
    h32 = torch.empty(P, F, dtype=torch.float32, device=DEV)
    tm.gemm(xq, xs, banks[0], h32, **kw)
    with poisoned():
        hq = torch.empty(P, F, dtype=torch.float8_e4m3fn, device=DEV)
        hs = torch.empty(P, F // 128, dtype=torch.float32, device=DEV)
        tm.gemm(xq, xs, banks[0], hq, out_scale=hs, **kw)
    finite(h32, hq, hs)  # every row of H (each belongs to one expert's tile) written
    want_q, want_s = rf.quantize_act(h32, act_fmt=HFMT)
    assert torch.equal(hs, want_s)
    same = hq.view(torch.uint8) == want_q.view(torch.uint8)
    if GPU:
        assert same.float().mean() >= 0.999
        step = (hq.float() - want_q.float()).abs() / want_q.float().abs().clamp_min(2.0 ** -9)
        assert step.max() <= 0.125 + 1e-6
    else:
        assert same.all(), f"{int((~same).sum())} codes differ"
    # the H the reference quantizes: the dequantized codes are within 2^-4 relative (+ the
    # subnormal half-step) of the fp32 H - i.e. the codes are H, not garbage that matches
    deq = rf.dequant_act(hq, hs, act_fmt=HFMT)
    bound = 2.0 ** -4 * h32.abs() + 2.0 ** -10 * hs.repeat_interleave(128, dim=1)
    assert ((deq - h32).abs() <= bound + 1e-30).all()


def test_quant_out_needs_whole_blocks():
    """A tile narrower than 128 columns cannot own a scale block: refused, not miscomputed."""
    g = gen(3)
    xq, xs, _ids, _wts, counts, srt, banks, _ = _l1_setup(4, 4, 2, 128, 128, g, None)
    narrow = pinned(l1_fp8h=Tile(16, 64, 128, 4, 1, par=True))
    hq = torch.empty(8, 128, dtype=torch.float8_e4m3fn, device=DEV)
    hs = torch.empty(8, 1, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="multiples of 128"):
        tm.gemm(xq, xs, banks[0], hq, b2=banks[1], role="l1_fp8h", rows_per_group=2,
                counts=counts, a_idx=srt, topk=2, max_tiles=8, limit=10.0, out_scale=hs,
                kc=narrow)
    # the 128-column split exists for bn = 128 only (two 64-column halves)
    hq2 = torch.empty(8, 256, dtype=torch.float8_e4m3fn, device=DEV)
    hs2 = torch.empty(8, 2, dtype=torch.float32, device=DEV)
    _, _, _, _, counts2, srt2, banks2, _ = _l1_setup(4, 4, 2, 128, 256, g, None)
    for bad in (Tile(16, 256, 128, 4, 1, par=True, qsplit=2),
                Tile(16, 128, 128, 4, 1, par=True, qsplit=4)):
        with pytest.raises(ValueError, match="qsplit"):
            tm.gemm(xq, xs, banks2[0], hq2, b2=banks2[1], role="l1_fp8h", rows_per_group=2,
                    counts=counts2, a_idx=srt2, topk=2, max_tiles=8, limit=10.0, out_scale=hs2,
                    kc=pinned(l1_fp8h=bad))


# ---------------------------------------------------------------------------------------------
# L2 on FP8 A with per-128 scales
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k,F,subset", [(11, 5, 2, 256, (1, 3)), (6, 3, 3, 128, None)])
def test_l2_fp8_h_vs_torch(T, E, k, F, subset):
    """L2 alone on given H codes + scales (per-row scales spread over 2^-8 .. 2^4, so a wrong
    scale column shows) against fp32 torch on the dequantized H: summation order only."""
    check_l2_fp8_h(T, E, k, F, subset, pinned(l2_fp8h=_cfg(16, 32 if not GPU else 128)))


def check_l2_fp8_h(T, E, k, F, subset, cfg: MoeConfig):
    """The "l2_fp8h" tile of cfg on random E4M3 H codes whose per-(row, 128)
    scales span 2^-8 .. 2^4 (a scale applied to the wrong row or block shows), under poisoned
    allocations, against fp32 torch on the dequantized H: < TOL_GEMM (summation order only)."""
    g = gen(50 + T)
    d = 128
    _, _, ids, wts, counts, srt, banks, bank = _l1_setup(T, E, k, d, F, g, subset)
    P = T * k
    h = torch.randn(P, F, generator=g) * torch.exp2(torch.randint(-8, 5, (P, F // 128),
                                                                  generator=g).float()
                                                    ).repeat_interleave(128, dim=1)
    hq, hs = rf.quantize_act(h.to(DEV), act_fmt=HFMT)
    tile = tm.pick_tile("l2_fp8h", P / E, cfg)
    with poisoned():
        y = torch.empty(T, k, d, dtype=torch.float32, device=DEV)
        tm.gemm(hq, hs, banks[2], y.view(T * k, d), role="l2_fp8h", rows_per_group=P / E,
                counts=counts, c_idx=srt, row_w=wts.reshape(-1).float().contiguous(), topk=k,
                ks=k, max_tiles=min(P, P // tile.bm + E), kc=cfg)
    finite(y)
    hd = rf.dequant_act(hq, hs, act_fmt=HFMT).cpu()
    w2 = [rmoe.dequantize_weight(bank[4][e].cpu(), bank[5][e].cpu(), "mxfp4") for e in range(E)]
    want = torch.zeros(T, k, d)
    pairs = srt.cpu().long()
    flat_ids, flat_w = ids.cpu().reshape(-1), wts.cpu().reshape(-1)
    for r in range(P):
        p = int(pairs[r])
        want[p // k, p % k] = flat_w[p] * (hd[r] @ w2[int(flat_ids[p])].t())
    assert rel(y, want) < TOL_GEMM


# ---------------------------------------------------------------------------------------------
# the whole routed experts with the switch on
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k,d,F,subset,tile,out_dtype", [
    (1, 8, 3, 128, 128, None, None, "f32"),            # one token
    (13, 8, 3, 128, 256, (0, 2, 5), None, "f32"),      # odd count, 5 of 8 experts empty
    (96, 4, 2, 128, 128, None, (64, 128), "f32"),      # prefill-like: 48 rows / expert, 64-row tile
    (31, 6, 2, 256, 128, (1, 4), (32, 128), "bf16"),   # odd, empty experts, bf16 out
    (96, 4, 2, 128, 256, None, (64, 128, 2), "f32"),  # prefill-like, L1 split in 64-col halves
])
def test_routed_experts_fp8_h(T, E, k, d, F, subset, tile, out_dtype):
    cfg = pinned(FP8_H, l1_fp8h=_cfg(*tile), l2_fp8h=_cfg(tile[0], 128)) if tile else FP8_H
    check_routed_fp8_h(T, E, k, d, F, subset, out_dtype, cfg)


def check_routed_fp8_h(T, E, k, d, F, subset, out_dtype, cfg: MoeConfig):
    """moe_experts_q with the FP8-H path on (cfg: fp8_h and the tiles) under
    poisoned allocations: finite, < TOL_Q (TOL_Q_BF16) vs the reference that quantizes H the
    same way (h_fmt fp8_1x128), and within LOOSE of the fp32-H reference (H really quantized)."""
    g = gen(T * 31 + F)
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    bank = _bank(E, d, F, g)
    ids, wts = _routing(T, E, k, g, subset)
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype=out_dtype)
    with poisoned():
        y = tm.moe_experts_q(xq, xs, ids, wts, *bank, **kw, kernel_config=cfg)
    finite(y)
    ref_q = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw, h_fmt=HFMT)
    ref = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    e_q, e_f = rel(y, ref_q), rel(y, ref)
    print(f"T={T} F={F} {out_dtype}: vs quantized-H reference {e_q:.2e}, vs fp32-H {e_f:.2e}")
    assert e_q < (TOL_Q if out_dtype == "f32" else TOL_Q_BF16)
    assert LOOSE[0] < e_f < LOOSE[1]


def test_mega_moe_with_switch(monkeypatch):
    """The whole layer with the switch on (routed experts FP8-H; shared expert unchanged), through
    the router's counts: both FP8-H roles launched, every output written, and vs the unquantized
    reference within test_triton_moe's bf16 layer bound (1e-2) plus H's rounding (LOOSE[1]; the
    residual streams and the shared expert dilute it little at these dims)."""
    g = gen(91)
    T, n, d, F, E, k = 5, 4, 256, 128, 8, 3
    streams, fn, base, scale, nw = _mhc_inputs(T, n, d, g)
    x, xq, xs, _pre, post, comb = rf.mega_mhc(streams, fn, base, scale, None, nw, eps=1e-20,
                                             hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20,
                                             act_fmt=ACT)
    gate, bias, routed, shared = _moe_weights(E, d, F, g)
    args = (x, xq, xs, streams, post, comb, gate, bias, *routed, *shared)
    seen = []
    real = tm.gemm

    def spy(a, *r, **kw):
        seen.append((kw["role"], a.dtype, kw.get("out_scale") is not None))
        return real(a, *r, **kw)

    monkeypatch.setattr(tm, "gemm", spy)
    with poisoned():
        out = tm.mega_moe(*args, topk=k, **MOE_KW, kernel_config=FP8_H)
    ref = rf.mega_moe(*args, topk=k, **MOE_KW)
    finite(out)
    assert ("l1_fp8h", torch.float8_e4m3fn, True) in seen
    assert ("l2_fp8h", torch.float8_e4m3fn, False) in seen
    assert rel(out, ref) < 1e-2 + LOOSE[1]


# ---------------------------------------------------------------------------------------------
# the switch: off by default, the default path unchanged
# ---------------------------------------------------------------------------------------------


def test_switch_defaults_off_and_default_path_unchanged(monkeypatch):
    """fp8_h is off by default (FP8 H only at prefill sizes, fp8_h_prefill); the default path is
    fp16 H on the l1 / l2 roles with the tiles the H200 sweep chose; routed_experts(fp8_h=...)
    overrides the config per call."""
    assert MoeConfig().fp8_h is False and MoeConfig().fp8_h_prefill is True
    assert tm.pick_tile("l1", 100, interpret=False) == Tile(64, 64, 128, 4, 3, par=True)
    assert tm.pick_tile("l2", 100, interpret=False) == Tile(64, 128, 128, 4, 3, par=True)
    assert tm.pick_tile("l1_fp8h", 100).bn % 128 == 0
    assert tm.pick_tile("l1_fp8h", 1.5).bn % 128 == 0
    g = gen(8)
    T, E, k, d, F = 9, 4, 2, 128, 128
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    bank = _bank(E, d, F, g)
    ids, wts = _routing(T, E, k, g)
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype="f32")
    seen = []
    real = tm.gemm

    def spy(a, a_scale, b1, out, **kw2):
        seen.append((kw2["role"], a.dtype, out.dtype, kw2.get("out_scale") is not None))
        return real(a, a_scale, b1, out, **kw2)

    monkeypatch.setattr(tm, "gemm", spy)
    # the Triton kernels' roles: the Gluon decode kernels (the GPU default at this size) off
    no_gluon = MoeConfig(gluon=False)
    y = tm.moe_experts_q(xq, xs, ids, wts, *bank, **kw, kernel_config=no_gluon)
    assert seen == [("l1", torch.float8_e4m3fn, torch.float16, False),
                    ("l2", torch.float16, torch.float32, False)]
    ref = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    assert rel(y, ref) < 2e-3  # test_triton_moe's bound for the fp16-H path
    # the per-call argument overrides the config
    seen.clear()
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    yb = torch.empty(T, k, d, dtype=torch.float32, device=DEV)
    banks = [tm.bank(w, s, "mxfp4") for w, s in zip(bank[0::2], bank[1::2], strict=True)]
    tm.routed_experts(xq, xs, ids.to(torch.int32), wts, counts, *banks, yb, topk=k,
                      swiglu_limit=10.0, fp8_h=True, cfg=no_gluon)
    assert [s[0] for s in seen] == ["l1_fp8h", "l2_fp8h"]
    assert rel(yb.sum(1), rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw, h_fmt=HFMT)) < TOL_Q


def test_reference_h_fmt_is_quantize_act():
    """The reference's H quantization (fake_quant fp8_e4m3 / 128) is quantize_act fp8_1x128's
    round trip, bit for bit, on values spanning many binades (and tiny blocks: the 1e-4 floor)."""
    g = gen(12)
    h = torch.randn(7, 384, generator=g) * torch.exp2(torch.randint(-20, 10, (7, 384),
                                                                     generator=g).float())
    h[3, 128:256] *= 1e-9
    q, s = rf.quantize_act(h, act_fmt=HFMT)
    fmt, block = rmoe.H_FMTS[HFMT]
    assert torch.equal(rmoe.fake_quant(h, fmt=fmt, block=block), rf.dequant_act(q, s, act_fmt=HFMT))


# ---------------------------------------------------------------------------------------------
# the shared expert with FP8 H (moe.shared_expert_fp8h: cuBLAS L1 -> swiglu_rows_q -> cuBLAS W2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,F,limit", [(13, 384, 10.0), (8, 1024, None), (5, 2048, 10.0)])
def test_swiglu_fp8_equals_quantize_act(T, F, limit):
    """moe.swiglu_fp8 (swiglu_rows_q) on a bf16 L1 output [T, 2F]: the codes and scales are
    quantize_act fp8_1x128 of the fp32 H that swiglu_rows computes from the same input, bit for
    bit (interpreter; GPU, two compiled kernels that may contract the SwiGLU differently: <= 0.1%
    of the codes one E4M3 step apart, scales equal); every element written (poisoned), the scales
    in cuBLAS's outer-dim-major layout; T odd / not a multiple of the row block, 128-column
    blocks (F 384) and 512-column ones."""
    g = gen(T + F)
    y13 = randn(T, 2 * F, g=g, scale=3.0, dtype=torch.bfloat16)
    h32 = torch.empty(T, F, dtype=torch.float32, device=DEV)
    tm._jit().swiglu_rows[(T, -(-F // 128))](y13, h32, F, float(limit or 0.0), y13.stride(0),
                                              h32.stride(0), HAS_LIMIT=limit is not None,
                                              BF=128, num_warps=4)
    with poisoned():
        hq, hs = tm.swiglu_fp8(y13, F, limit)
    finite(hq, hs)
    assert hs.shape == (T, F // 128) and hs.stride() == (1, T)
    want_q, want_s = rf.quantize_act(h32, act_fmt=HFMT)
    assert torch.equal(hs, want_s)
    same = hq.view(torch.uint8) == want_q.view(torch.uint8)
    if GPU:
        assert same.float().mean() >= 0.999
    else:
        assert same.all(), f"{int((~same).sum())} codes differ"
    # and H is the SwiGLU of the input (not garbage that matches): the torch formula within
    # E4M3's half step (+ the subnormal half-step)
    gt, up = y13[:, :F].float(), y13[:, F:].float()
    if limit:
        gt, up = gt.clamp(max=limit), up.clamp(-limit, limit)
    h_t = torch.nn.functional.silu(gt) * up
    bound = 2.0 ** -4 * h_t.abs() + 2.0 ** -10 * hs.repeat_interleave(128, dim=1) + 1e-6
    assert ((rf.dequant_act(hq, hs, act_fmt=HFMT) - h_t).abs() <= bound).all()


def test_swiglu_fp8_refuses_partial_blocks():
    with pytest.raises(ValueError, match="multiple of 128"):
        tm.swiglu_fp8(torch.zeros(2, 192, device=DEV), 96, None)


def test_combine_reads_the_shared_output_from_its_own_tensor():
    """moe.combine(shared_out=...) (the shared expert's output in its own tensor, as
    shared_expert_fp8h returns it) gives the bits of the same values in y's slot k, with the
    mHC expand and without."""
    g = gen(31)
    T, k, d, n = 9, 3, 384, 4
    y = randn(T, k + 1, d, g=g, dtype=torch.bfloat16)
    streams = randn(T, n, d, g=g, dtype=torch.bfloat16)
    post, comb = randn(T, n, g=g), randn(T, n, n, g=g)
    for kw in (dict(streams=streams, post=post, comb=comb), {}):
        shape = (T, n, d) if kw else (T, d)
        a = tm.combine(y, torch.empty(shape, dtype=torch.bfloat16, device=DEV), topk=k,
                       shared=True, rdt=torch.bfloat16, **kw)
        with poisoned():
            b = tm.combine(y[:, :k], torch.empty(shape, dtype=torch.bfloat16, device=DEV),
                           topk=k, shared=True, rdt=torch.bfloat16,
                           shared_out=y[:, k].clone(), **kw)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with pytest.raises(ValueError, match="shared output"):
        tm.combine(y[:, :k], torch.empty(T, d, dtype=torch.bfloat16, device=DEV), topk=k,
                   shared=True, rdt=torch.bfloat16, shared_out=y[:, k].t().contiguous().t())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="cuBLAS's FP8 GEMM: CUDA only")
@pytest.mark.parametrize("T,d,F", [(37, 256, 384), (256, 512, 1024), (1101, 512, 1024)])
def test_shared_expert_fp8h(T, d, F):
    """shared_expert_fp8h (both GEMMs on cuBLAS, H quantized by swiglu_rows_q) against fp32 math
    with the same roundings - the L1 output rounded to bf16, H fake-quantized per 128 columns
    (h_fmt fp8_1x128) - within TOL_Q_BF16 (an H element that the FP8 MMA's accumulation order
    moves across a bf16 / E4M3 rounding boundary flips: the argument of TOL_Q; the bf16 output);
    and against the unquantized shared expert (fp32 H, reference.fused.swiglu_mlp_q) within
    LOOSE: H really was quantized. T 37: cuBLAS's padding to rows of 4; F 384: 128-column
    blocks; T 1101: a prefill-sized call (>= GemmConfig.cublas_prefill_rows: the 128 x 128 weight
    recipe, cublas_form_prefill)."""
    g = gen(T + F)
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    sw = (*fp8_block(F, d, g), *fp8_block(F, d, g), *fp8_block(d, F, g))
    banks = [tm.bank(w, s, "fp8_block") for w, s in zip(sw[0::2], sw[1::2], strict=True)]
    with poisoned():
        y = tm.shared_expert_fp8h(xq, xs, *banks, swiglu_limit=10.0, out_dtype=torch.bfloat16)
    assert y is not None and y.shape == (T, d) and y.dtype == torch.bfloat16
    finite(y)
    xd = rf.dequant_act(xq, xs, act_fmt=ACT)
    w1, w3, w2 = (formats.dequantize_fp8_block(w, s, 32) for w, s in zip(sw[0::2], sw[1::2]))
    gt = (xd @ w1.t()).bfloat16().float().clamp(max=10.0)
    up = (xd @ w3.t()).bfloat16().float().clamp(-10.0, 10.0)
    fmt, block = rmoe.H_FMTS[HFMT]
    want = rmoe.fake_quant(torch.nn.functional.silu(gt) * up, fmt=fmt, block=block) @ w2.t()
    assert rel(y, want) < TOL_Q_BF16
    plain = rf.swiglu_mlp_q(xq, xs, *sw, fmt="fp8_block", swiglu_limit=10.0, act_fmt=ACT,
                            out_dtype="bf16")
    assert LOOSE[0] < rel(y, plain) < LOOSE[1]
    assert rel(rf.swiglu_mlp_q(xq, xs, *sw, fmt="fp8_block", swiglu_limit=10.0, act_fmt=ACT,
                               out_dtype="bf16", h_fmt=HFMT), want) < TOL_Q_BF16
