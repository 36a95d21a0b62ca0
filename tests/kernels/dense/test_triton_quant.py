"""kernels/dense/triton_quant.py (activation quantization) vs the reference: bitwise.

CUDA GPU, or the CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_interp.py runs this
file that way); skipped otherwise. Codes and scales must be bitwise equal: the scale is a power of
two derived from the f32 bits and the codes round x * 2^-e to nearest-even E4M3, the reference's
arithmetic exactly, so no tolerance is needed.
"""
from __future__ import annotations

import pytest
import torch
from triton_run import CUDA, DEV, pytestmark  # noqa: F401

from megagraph.kernels.fused.reference import quantize_act as ref_quantize_act


def inputs(g, shape, dtype):
    """Fresh random values spread over ~12 decades per row, a few exact zeros and a tiny block."""
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 6, shape[-1])[torch.randperm(shape[-1], generator=g)]
    x.view(-1, shape[-1])[0, :7] = 0.0
    if shape[-1] >= 256:
        x.view(-1, shape[-1])[-1, 128:256] = 1e-9  # amax below the 1e-4 floor
    return x.to(dtype)


@pytest.mark.parametrize("act_fmt", ["fp8_1x128", "mxfp8"])
@pytest.mark.parametrize("width", [40, 128, 300, 1600, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_act_bitwise(act_fmt, width, dtype):
    from megagraph.kernels.dense.triton_quant import quantize_act

    g = torch.Generator().manual_seed(width + (act_fmt == "mxfp8"))
    x = inputs(g, (3, 7, width), dtype)
    q, s = quantize_act(x.to(DEV), act_fmt=act_fmt)
    rq, rs = ref_quantize_act(x, act_fmt=act_fmt)
    assert q.shape == rq.shape and q.dtype == rq.dtype and s.shape == rs.shape and s.dtype == rs.dtype
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8))


@pytest.mark.parametrize("act_fmt", ["fp8_1x128", "mxfp8"])
def test_quantize_act_exact_power_scales(act_fmt):
    """Blocks whose amax / 448 is exactly a power of two (amax = 448 * 2^k, e.g. 3.5 or 7: one bf16
    mantissa in 128): the scale is 2^k only if that quotient is rounded correctly (an approximate
    division a hair above 2^k doubles the scale). The interpreter divides exactly; this is for the
    GPU, where Triton's `/` is div.approx."""
    from megagraph.kernels.dense.triton_quant import quantize_act

    g = torch.Generator().manual_seed(9)
    block = 128 if act_fmt == "fp8_1x128" else 32
    k = torch.arange(-12, 12, dtype=torch.float32)
    amax = 448.0 * torch.exp2(k)  # 24 rows, one exact power per row, 8 blocks per row
    x = (torch.rand(24, 8, block, generator=g) * 2 - 1) * amax[:, None, None]
    x[:, :, 5] = amax[:, None] * torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0)
    x = x.reshape(24, 8 * block).bfloat16()
    q, s = quantize_act(x.to(DEV), act_fmt=act_fmt)
    rq, rs = ref_quantize_act(x, act_fmt=act_fmt)
    assert torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8))
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


def test_quantize_act_strided_rows_and_empty():
    from megagraph.kernels.dense.triton_quant import quantize_act

    g = torch.Generator().manual_seed(5)
    big = inputs(g, (9, 1024), torch.bfloat16).to(DEV)
    x = big[::2, 128:896]  # rows with a stride, a column offset
    q, s = quantize_act(x, act_fmt="fp8_1x128")
    rq, rs = ref_quantize_act(x.cpu(), act_fmt="fp8_1x128")
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
    q0, s0 = quantize_act(big[:0], act_fmt="fp8_1x128")
    assert q0.shape == (0, 1024) and s0.shape == (0, 8)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_quantize_act_captures_in_cuda_graph():
    from megagraph.kernels.dense.triton_quant import quantize_act

    x = torch.randn(64, 5120, device=DEV, dtype=torch.bfloat16)
    quantize_act(x, act_fmt="fp8_1x128")  # compile outside capture
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        q, s = quantize_act(x, act_fmt="fp8_1x128")
    x.copy_(torch.randn_like(x) * 3)
    gr.replay()
    rq, rs = ref_quantize_act(x.cpu(), act_fmt="fp8_1x128")
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
