"""Mega-mHC's outputs against the reference op's, for the mHC kernel tests and the MoE tests
that run mega_mhc in front of mega_moe."""
from __future__ import annotations

import torch

from megagraph.kernels.fused import reference as rf

GPU = torch.cuda.is_available()
TOL_COEF = 1e-4 if GPU else 1e-5  # mixer coefficients (approximate exp / rsqrt on the GPU)


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_mhc(out, ref, act_fmt) -> None:
    """Mega-mHC's six outputs (x, x_q, x_scale, pre, post, comb) against the reference op's:
    dtypes and shapes, the coefficients within TOL_COEF, x within bf16 (1e-2), the dequantized
    x_q within one E4M3 step of the reference's (2e-2: x may round the other way) and of x
    (5e-2: the quantizer's own error). Shared by the MoE and the mHC tests (mega_mhc feeds mega_moe)."""
    names = ("x", "x_q", "x_scale", "pre", "post", "comb")
    for name, a, b in zip(names, out, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
    x, xq, xs, pre, post, comb = out
    rx, rxq, rxs, rpre, rpost, rcomb = ref
    for a, b in ((pre, rpre), (post, rpost), (comb, rcomb)):
        assert rel(a, b) < TOL_COEF
    assert rel(x, rx) < 1e-2
    deq = rf.dequant_act(xq, xs, act_fmt=act_fmt)
    rdeq = rf.dequant_act(rxq, rxs, act_fmt=act_fmt)
    assert rel(deq, rdeq) < 2e-2  # one E4M3 step where x rounded the other way
    assert rel(deq, x.float()) < 5e-2  # the quantizer's own error
