"""GemmConfig.swap (kernels/triton/moe_jit.py: moe_acc_swap, off by default): the routed-expert
GEMMs on MXFP4 weights with the MMA operands swapped (C^T = W A^T per K chunk: the weight rows are
the MMA's M, the few rows of a decode tile its N, so a 16-row tile runs on wgmma m64n16 with the
E4M3 weight tile instead of mma.sync on an fp16 copy routed through shared memory), against the
reference ops with the option forced on, for L1 (SwiGLU, fp8 MMA) and L2 (fp16 H, fp16 MMA).

Without CUDA this module runs under the Triton interpreter in a child pytest
(test_triton_interp.py); with CUDA the same tests run the compiled kernels. The sm_90 build
(QGMMA / HGMMA 64x16, no HMMA, no F2FP upcast in the L1 K loop, no local memory) is pinned by the
cases "moe l1 swap decode" / "moe l2 swap decode" of tests/kernels/test_triton_attention_sm90.py.

Tolerances (relative Frobenius error, test_triton_moe.py's): fp32 outputs 2e-3 (fp16 H feeding
the second GEMM), bf16 outputs 1e-2. The swapped loop keeps the default's per-chunk promotion
(the same fp32 products sb x sa), so its error budget is the default's; only each chunk's
partial-product summation order inside the tensor core differs.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megagraph.kernels.reference import fused as rf
from megagraph.kernels.triton import moe as tm

from test_triton_moe import (ACT, GPU, LaunchSpy, _experts, check_dense_swiglu, check_scale_spread,
                             finite, gen, poisoned, rel, routed_case)

RUNNABLE = torch.cuda.is_available() or tm.INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")


def _swap(bm: int, bn: int, par: bool = True, warps: int = 4) -> tm.GemmConfig:
    """A swapped tile (stages 1 in the interpreter; the sm_90 decode tile on the GPU)."""
    return tm.GemmConfig(bm, bn, 128, warps, 1 if not GPU else 3, par=par, swap=True)


@pytest.mark.parametrize("T,subset,bm,bn,par,out", [
    (1, None, 16, 32, True, "f32"), (5, (1, 6), 16, 16, True, "f32"),
    (9, None, 16, 32, False, "f32"), (19, (0, 2, 5), 16, 64, True, "bf16")])
def test_swap_matches_reference(T, subset, bm, bn, par, out, monkeypatch):
    """Decode-sized batches (1-19 tokens, experts with 0-5 rows, a tile mostly padding), empty
    experts (`subset`), several column tiles (bn 16 / 32 / 64 of F = 128 and d = 256), two K
    chunks in each GEMM (the exponent prefetch past K), with and without the parity split,
    under poisoned allocations; both launches really pass SWAP = 1."""
    from megagraph.kernels.triton import moe_jit

    cfg = _swap(bm, bn, par) if not GPU else _swap(16, 128, par)
    monkeypatch.setattr(tm, "CONFIG_OVERRIDE", {"l1": cfg, "l2": cfg})
    spy = LaunchSpy(moe_jit.moe_gemm, "SWAP")
    monkeypatch.setattr(moe_jit, "moe_gemm", spy)
    E, d, F, k = 8, 256, 256, 3
    xq, xs, ids, wts, bank = routed_case(T, E, d, F, k, seed=40 + T, subset=subset)
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype=out)
    with poisoned():
        y = tm.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    ref = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    finite(y)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert rel(y, ref) < (2e-3 if out == "f32" else 1e-2)
    assert spy.values == [1, 1], spy.values  # L1 and L2 both swapped


@pytest.mark.parametrize("spread", [0, 11, 14])
def test_swap_scale_spread(spread, monkeypatch):
    """Block scales of one row spanning `spread` binades within 128 columns (W1 / W3 / W2 each
    fold their own per-row exponents; the promotion scale is per weight row = per MMA row)."""
    cfg = _swap(16, 32) if not GPU else _swap(16, 128)
    monkeypatch.setattr(tm, "CONFIG_OVERRIDE", {"l1": cfg, "l2": cfg})
    check_scale_spread(300 + spread, 3, ((1, 120), (3, 117), (5, 121)), spread)


def test_swap_dense(monkeypatch):
    """The dense SwiGLU MLP on MXFP4 weights (roles dense_swiglu / dense, moe_gemm not grouped)
    with the option on: same K loop, M rows instead of expert tiles (M = 5: a decode batch)."""
    cfg = _swap(16, 32) if not GPU else _swap(16, 128)
    monkeypatch.setattr(tm, "CONFIG_OVERRIDE", {"dense_swiglu": cfg, "dense": cfg})
    check_dense_swiglu(78, 5)


def test_swap_applies_only_where_it_can():
    """_swap_ok: MXFP4 with the fp8 / fp16 MMA, a 128-column chunk, no quantized output, not
    with fuse; the default config never swaps."""
    g = gen(6)
    w1, s1, _, _, _, _ = _experts(2, 256, 128, g)
    b1 = tm.bank(w1, s1, "mxfp4")
    on = tm.GemmConfig(16, 128, 128, 4, 3, par=True, swap=True)
    assert tm._swap_ok(on, b1, tm.MMA_FP8, None)
    assert tm._swap_ok(on, b1, tm.MMA_FP16, None)
    assert not tm._swap_ok(tm.GemmConfig(16, 128, 128, 4, 3, par=True), b1, tm.MMA_FP8, None)
    assert not tm._swap_ok(tm.pick_config("l1", 1.6), b1, tm.MMA_FP8, None)
    assert not tm._swap_ok(tm.pick_config("l2", 1.6), b1, tm.MMA_FP16, None)
    assert not tm._swap_ok(on, b1, tm.MMA_F32, None)
    assert not tm._swap_ok(tm.GemmConfig(16, 128, 64, 4, 3, swap=True), b1, tm.MMA_FP8, None)
    assert not tm._swap_ok(tm.GemmConfig(16, 128, 128, 4, 3, swap=True, fuse=True), b1,
                           tm.MMA_FP8, None)
    assert not tm._swap_ok(on, b1, tm.MMA_FP8, torch.empty(1))
