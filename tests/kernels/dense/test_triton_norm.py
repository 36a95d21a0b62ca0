"""kernels/dense/triton_norm.py (RMSNorm, one program per row) vs the reference: within one rounding of
the output dtype (bf16 / fp16; fp32: 1e-6 relative) - the sum of squares runs in Triton's
reduction order, the rest is the reference's fp32 arithmetic (correctly rounded sqrt and
reciprocal). Every element written (poisoned outputs), weightless and 3-D inputs, strided rows,
odd D, the fallbacks, a CUDA-graph replay equal to eager.

CUDA GPU, or the CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_interp.py runs this file
that way); skipped otherwise. NOT yet run on the H200 (registry status "unvalidated")."""
from __future__ import annotations

import pytest
import torch
from poisoned_alloc import poisoned
from triton_run import CUDA, DEV, pytestmark  # noqa: F401

from megagraph.kernels.dense.capturable import rms_norm as cap_rms_norm
from megagraph.kernels.dense.norm import rms_norm as ref_rms_norm
from megagraph.kernels.dense import triton_norm as tn

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}


def case(shape, dtype, seed, weight=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEV) if weight else None
    return x, w


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all(), "an element was not written"
    err = (got.float() - want.float()).abs()
    assert bool((err <= ULP[got.dtype] * want.float().abs() + 1e-30).all()), float(err.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512), (7, 1280), (64, 5120), (5, 3, 200)])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_matches_reference(dtype, shape, weight):
    x, w = case(shape, dtype, seed=shape[0] * 31 + shape[-1], weight=weight)
    with poisoned():
        got = tn.rms_norm(x, w, eps=1e-6)
    assert_close(got, ref_rms_norm(x, w, eps=1e-6))


def test_rms_norm_strided_rows_and_fallbacks():
    """A row-strided view gives the same bits as its contiguous copy; a row wider than MAX_D
    takes the capturable kernel."""
    x, w = case((9, 2 * 640), torch.bfloat16, seed=4)
    view = x[:, :640]
    assert torch.equal(tn.rms_norm(view, w[:640], eps=1e-20),
                       tn.rms_norm(view.contiguous(), w[:640], eps=1e-20))
    wide, _ = case((2, tn.MAX_D + 16), torch.float32, seed=5, weight=False)
    assert torch.equal(tn.rms_norm(wide, None, eps=1e-6), cap_rms_norm(wide, None, eps=1e-6))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_rms_norm_captures_in_cuda_graph():
    x, w = case((64, 5120), torch.bfloat16, seed=8)
    eager = tn.rms_norm(x, w, eps=1e-20)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = tn.rms_norm(x, w, eps=1e-20)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
