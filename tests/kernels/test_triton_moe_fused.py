"""GemmConfig.fuse (kernels/moe/triton_jit.py: moe_acc_fused, off by default): the SwiGLU GEMM on
MXFP4 weights as one MMA per K chunk (W1 / W3 rows interleaved into one B tile, one wgmma group
and one wait per chunk instead of four) against the reference ops, with the option forced on.

Without CUDA this module runs under the Triton interpreter in a child pytest
(test_triton_interp.py); with CUDA the same tests run the compiled kernels. The sm_90 build
(one wgmma group / one WARPGROUP.DEPBAR per K chunk, no local memory) is pinned by the case
"moe l1 fused prefill" of tests/kernels/test_triton_attention_sm90.py.

Tolerances (relative Frobenius error, test_triton_moe.py's): fp32 outputs 2e-3 (fp16 H feeding
the second GEMM), bf16 outputs 1e-2. The fused loop keeps the default's per-chunk promotion
(sa x sb per row and weight row), so its error budget is the default's; only each chunk's
partial-product summation order differs (K in column order instead of evens then odds).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megagraph.kernels.moe import triton as tm

from test_triton_moe import (ACT, GPU, LaunchSpy, _experts, check_dense_swiglu, check_routed,
                             check_scale_spread, gen, routed_case)

RUNNABLE = torch.cuda.is_available() or tm.INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")


def _fused(bm: int, bn: int, warps: int = 4) -> tm.GemmConfig:
    """A fused L1 tile (stages 1 in the interpreter; the sm_90 tiles of moe_tune on the GPU)."""
    return tm.GemmConfig(bm, bn, 128, warps, 1 if not GPU else 3, fuse=True)


@pytest.mark.parametrize("T,subset,bm,bn,out", [
    (1, None, 16, 16, "f32"), (9, None, 16, 32, "f32"), (17, (0, 2, 5), 16, 16, "f32"),
    (33, None, 32, 16, "bf16")])
def test_fused_l1_matches_reference(T, subset, bm, bn, out, monkeypatch):
    """Odd token counts, empty experts (`subset`), column tiles (bn 16 / 32 of F = 128:
    rows of the interleaved B tile past one tile), two K chunks (d = 256: the exponent
    prefetch past K), under poisoned allocations; the launches really pass FUSE = 1 for L1
    and not for L2."""
    from megagraph.kernels.moe import triton_jit as moe_jit

    cfg = _fused(bm, bn) if not GPU else _fused(64, 64)
    monkeypatch.setattr(tm, "CONFIG_OVERRIDE", {"l1": cfg})
    spy = LaunchSpy(moe_jit.moe_gemm, "FUSE")
    monkeypatch.setattr(moe_jit, "moe_gemm", spy)
    E, d, F, k = 8, 256, 128, 3
    xq, xs, ids, wts, bank = routed_case(T, E, d, F, k, seed=T, subset=subset)
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype=out)
    check_routed(xq, xs, ids, wts, bank, kw)
    assert spy.values == [1, 0], spy.values  # L1 fused, L2 (one weight bank) not


@pytest.mark.parametrize("spread", [0, 11, 14])
def test_fused_scale_spread(spread, monkeypatch):
    """Block scales of one row spanning `spread` binades within 128 columns, per matrix (the
    interleaved tile folds each row's own exponents: W1 and W3 rows get different ones)."""
    monkeypatch.setattr(tm, "CONFIG_OVERRIDE", {"l1": _fused(16, 16) if not GPU
                                                 else _fused(64, 64)})
    check_scale_spread(200 + spread, 6, ((1, 120), (3, 117)), spread)  # W1 / W3 only


def test_fused_dense_swiglu(monkeypatch):
    """The dense SwiGLU MLP on MXFP4 weights (role dense_swiglu, moe_gemm not grouped) with the
    option on: same tile code, M rows instead of expert tiles."""
    monkeypatch.setattr(tm, "CONFIG_OVERRIDE", {"dense_swiglu": _fused(16, 32) if not GPU
                                                 else _fused(64, 64)})
    check_dense_swiglu(77, 21)


def test_fuse_applies_only_where_it_can():
    """_fuse_ok: SwiGLU on MXFP4 with a 128-column chunk and no quantized output; the option is
    ignored elsewhere (FP8-block weights, one bank, bk 64, the FP8-H epilogue)."""
    g = gen(5)
    w1, s1, w3, s3, _, _ = _experts(2, 256, 128, g)
    b1, b3 = tm.bank(w1, s1, "mxfp4"), tm.bank(w3, s3, "mxfp4")
    on = tm.GemmConfig(64, 64, 128, 4, 3, fuse=True)
    assert tm._fuse_ok(on, b1, b3, tm.MMA_FP8, None)
    assert tm._fuse_ok(on, b1, b3, tm.MMA_FP16, None)
    assert not tm._fuse_ok(tm.GemmConfig(64, 64, 128, 4, 3), b1, b3, tm.MMA_FP8, None)
    assert not tm._fuse_ok(on, b1, b1, tm.MMA_FP8, None)
    assert not tm._fuse_ok(on, b1, b3, tm.MMA_F32, None)
    assert not tm._fuse_ok(tm.GemmConfig(64, 64, 64, 4, 3, fuse=True), b1, b3, tm.MMA_FP8, None)
    assert not tm._fuse_ok(on, b1, b3, tm.MMA_FP8, torch.empty(1))
