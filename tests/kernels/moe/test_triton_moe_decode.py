"""Tile.swap (kernels/moe/triton_jit.py: moe_acc_swap; the default decode tiles): the routed-expert
GEMMs on MXFP4 weights with the MMA operands swapped (C^T = W A^T per K chunk: the weight rows are
the MMA's M, the few rows of a decode tile its N, so a 16-row tile runs on wgmma m64n16 with the
E4M3 weight tile instead of mma.sync on an fp16 copy routed through shared memory), against the
reference ops with the tiles pinned (MoeConfig.tiles), for L1 (SwiGLU, fp8 MMA) and L2 (fp16 H,
fp16 MMA), and with the FP8-H path (MoeConfig.fp8_h / routed_experts(fp8_h=True)): the "l2_fp8h" role on E4M3
H with per-128 scales (fp8 MMA, A_SCALED: QGMMA m64n16 on E4M3 H x E4M3 W2 on sm_90, no fp16 copy)
and the "l1_fp8h" role (the swapped tile's H quantized in the epilogue, qsplit 1).

Without CUDA this module runs under the Triton interpreter in a child pytest
(test_triton_interp.py); with CUDA the same tests run the compiled kernels. The sm_90 build
(QGMMA / HGMMA 64x16, no HMMA, no F2FP upcast in the L1 K loop, no local memory) is pinned by the
cases "moe l1 swap decode" / "moe l2 swap decode" of tests/kernels/test_triton_attention_sm90.py.

Tolerances (relative Frobenius error, test_triton_moe.py's): fp32 outputs 2e-3 (fp16 H feeding
the second GEMM), bf16 outputs 1e-2. The swapped loop keeps the default's per-chunk promotion
(the same fp32 products sb x sa), so its error budget is the default's; only each chunk's
partial-product summation order inside the tensor core differs. FP8-H: test_triton_moe_fp8h.py's
checks and tolerances (derived in its docstring), run on the swapped tiles: L1's codes and scales
bit for bit quantize_act of the same tile's fp32 H (interpreter), L2 alone vs torch on the
dequantized H (TOL_GEMM), the routed experts vs the reference that quantizes H the same way
(TOL_Q) and vs the fp32-H one (LOOSE).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megagraph.kernels.gemm.config import GemmConfig, Tile
from megagraph.kernels.moe import triton as tm
from megagraph.kernels.moe.config import MoeConfig

from test_triton_moe import (ACT, GPU, LaunchSpy, _experts, check_dense_swiglu, check_routed,
                             check_scale_spread, gen, pinned, routed_case)
from test_triton_moe_fp8h import check_l1_epilogue, check_l2_fp8_h, check_routed_fp8_h

RUNNABLE = torch.cuda.is_available() or tm.INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")


def _swap(bm: int, bn: int, par: bool = True, warps: int = 4) -> Tile:
    """A swapped tile (stages 1 in the interpreter; the sm_90 decode tile on the GPU)."""
    return Tile(bm, bn, 128, warps, 1 if not GPU else 3, par=par, swap=True)


@pytest.mark.parametrize("T,subset,bm,bn,par,out", [
    (1, None, 16, 32, True, "f32"), (5, (1, 6), 16, 16, True, "f32"),
    (9, None, 16, 32, False, "f32"), (19, (0, 2, 5), 16, 64, True, "bf16")])
def test_swap_matches_reference(T, subset, bm, bn, par, out, monkeypatch):
    """Decode-sized batches (1-19 tokens, experts with 0-5 rows, a tile mostly padding), empty
    experts (`subset`), several column tiles (bn 16 / 32 / 64 of F = 128 and d = 256), two K
    chunks in each GEMM (the exponent prefetch past K), with and without the parity split,
    under poisoned allocations; both launches really pass SWAP = 1."""
    from megagraph.kernels.moe import triton_jit as moe_jit

    tile = _swap(bm, bn, par) if not GPU else _swap(16, 128, par)
    spy = LaunchSpy(moe_jit.moe_gemm, "SWAP")
    monkeypatch.setattr(moe_jit, "moe_gemm", spy)
    E, d, F, k = 8, 256, 256, 3
    xq, xs, ids, wts, bank = routed_case(T, E, d, F, k, seed=40 + T, subset=subset)
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype=out)
    check_routed(xq, xs, ids, wts, bank, kw, pinned(l1=tile, l2=tile))
    assert spy.values == [1, 1], spy.values  # L1 and L2 both swapped


@pytest.mark.parametrize("spread", [0, 11, 14])
def test_swap_scale_spread(spread):
    """Block scales of one row spanning `spread` binades within 128 columns (W1 / W3 / W2 each
    fold their own per-row exponents; the promotion scale is per weight row = per MMA row)."""
    tile = _swap(16, 32) if not GPU else _swap(16, 128)
    check_scale_spread(300 + spread, 3, ((1, 120), (3, 117), (5, 121)), spread,
                       pinned(l1=tile, l2=tile))


def test_swap_dense():
    """The dense SwiGLU MLP on MXFP4 weights (roles dense_swiglu / dense, moe_gemm not grouped)
    with the option on: same K loop, M rows instead of expert tiles (M = 5: a decode batch)."""
    tile = _swap(16, 32) if not GPU else _swap(16, 128)
    specs = (tile.spec("dense_swiglu"), tile.spec("dense"))
    check_dense_swiglu(78, 5, GemmConfig(tiles=specs))


def test_swap_applies_only_where_it_can():
    """_swap_ok: MXFP4 with the fp8 / fp16 MMA, a 128-column chunk, a quantized output only
    unsplit. The compiled kernels' default tiles (pick_tile outside the interpreter) swap
    where the H200 sweep timed it faster: the decode L1 and both FP8-H decode roles; never the
    fp16-H L2 or prefill sizes."""
    g = gen(6)
    w1, s1, _, _, _, _ = _experts(2, 256, 128, g)
    b1 = tm.bank(w1, s1, "mxfp4")
    on = Tile(16, 128, 128, 4, 3, par=True, swap=True)
    assert tm._swap_ok(on, b1, tm.MMA_FP8, None)
    assert tm._swap_ok(on, b1, tm.MMA_FP16, None)
    assert not tm._swap_ok(Tile(16, 128, 128, 4, 3, par=True), b1, tm.MMA_FP8, None)
    assert not tm._swap_ok(on, b1, tm.MMA_F32, None)
    assert not tm._swap_ok(Tile(16, 128, 64, 4, 3, swap=True), b1, tm.MMA_FP8, None)
    # a quantized output (the FP8-H L1) unsplit only
    assert tm._swap_ok(on, b1, tm.MMA_FP8, torch.empty(1))
    assert not tm._swap_ok(Tile(16, 128, 128, 4, 3, par=True, qsplit=2, swap=True), b1,
                           tm.MMA_FP8, torch.empty(1))

    def pick(role, rows):
        return tm.pick_tile(role, rows, interpret=False)

    assert tm._swap_ok(pick("l1", 1.6), b1, tm.MMA_FP8, None)
    assert not tm._swap_ok(pick("l2", 1.6), b1, tm.MMA_FP16, None)
    for role in ("l1", "l2", "l1_fp8h", "l2_fp8h"):
        assert pick(role, 1.6).swap == (role != "l2"), role
        assert not pick(role, 100.0).swap, role


# ---------------------------------------------------------------------------------------------
# with the FP8-H path: L2 on E4M3 H (fp8 MMA, A_SCALED), L1's quantizing epilogue
# ---------------------------------------------------------------------------------------------


def _swap_fp8h(bn: int, par: bool = True) -> Tile:
    """A swapped FP8-H tile: bn any power of two for l2_fp8h, a multiple of 128 for l1_fp8h (its
    epilogue owns whole scale blocks); the sm_90 decode tile on the GPU."""
    return _swap(16, bn, par) if not GPU else _swap(16, 128, par)


@pytest.mark.parametrize("T,subset,bn2,par,out,l1_swap", [
    (1, None, 32, True, "f32", True),        # one token: every tile 15 rows of padding
    (7, (1, 6), 16, True, "f32", False),     # L2 swapped alone (L1 unswapped)
    (12, None, 64, False, "f32", True),      # without the parity split
    (19, (0, 2, 5), 128, True, "bf16", True)])
def test_swap_fp8_h_routed(T, subset, bn2, par, out, l1_swap, monkeypatch):
    """Routed experts at decode sizes with FP8-H on and the swapped tiles (F = 256: two 128-blocks
    of H scales, two K chunks in L2; d = 256), empty experts, under poisoned allocations, against
    the reference that quantizes H the same way (reference moe.moe_experts(h_fmt="fp8_1x128"))
    and the fp32-H one; the launches really pass SWAP (L1 when asked, L2 always)."""
    from megagraph.kernels.moe import triton_jit as moe_jit

    l1 = _swap_fp8h(128, par) if l1_swap else Tile(16, 128, 128, 4, 1 if not GPU else 3,
                                                   par=True)
    cfg = pinned(MoeConfig(fp8_h=True), l1_fp8h=l1, l2_fp8h=_swap_fp8h(bn2, par))
    spy = LaunchSpy(moe_jit.moe_gemm, "SWAP")
    monkeypatch.setattr(moe_jit, "moe_gemm", spy)
    check_routed_fp8_h(T, 8, 3, 256, 256, subset, out, cfg)
    assert spy.values == [int(l1_swap), 1], spy.values


@pytest.mark.parametrize("T,E,k,F,subset,bn,par", [
    (11, 5, 2, 256, (1, 3), 32, True), (6, 3, 3, 128, None, 16, False), (4, 4, 3, 256, None, 128,
                                                                         True)])
def test_swap_l2_fp8_h_vs_torch(T, E, k, F, subset, bn, par, monkeypatch):
    """L2 alone, swapped, on E4M3 H whose per-(row, 128) scales span 2^-8 .. 2^4: the activation
    scale is per column of the transposed accumulator (per token row), the weight scale per
    accumulator row; a swapped orientation would show at once."""
    from megagraph.kernels.moe import triton_jit as moe_jit

    spy = LaunchSpy(moe_jit.moe_gemm, "SWAP")
    monkeypatch.setattr(moe_jit, "moe_gemm", spy)
    check_l2_fp8_h(T, E, k, F, subset, pinned(l2_fp8h=_swap_fp8h(bn, par)))
    assert spy.values == [1]


@pytest.mark.parametrize("T,E,k,F,subset,par", [(13, 6, 3, 128, (0, 2, 5), True),
                                                (9, 4, 2, 256, None, False)])
def test_swap_l1_fp8_h_epilogue(T, E, k, F, subset, par, monkeypatch):
    """The FP8-H L1 on the swapped tile: its codes and scales are quantize_act of the same
    swapped tile's fp32 H, bit for bit in the interpreter (the epilogue sees the accumulators
    after the one transpose, in the default's [BM, BN] orientation)."""
    from megagraph.kernels.moe import triton_jit as moe_jit

    spy = LaunchSpy(moe_jit.moe_gemm, "SWAP")
    monkeypatch.setattr(moe_jit, "moe_gemm", spy)
    check_l1_epilogue(T, E, k, F, subset, pinned(l1_fp8h=_swap_fp8h(128, par)))
    assert spy.values == [1, 1]  # the fp32-output run and the quantized one
