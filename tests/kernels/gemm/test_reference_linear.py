"""linear / grouped_linear on dense, fp8_block and mxfp4 weights vs naive per-element dequant +
per-token dot products. Tolerance: fp32 GEMM vs fp64 naive, rtol 1e-5 / atol 1e-4·scale."""
import pytest
import torch
from _reference_helpers import (naive_dequant_fp8_block, naive_unpack_mxfp4, random_e8m0,
                                random_mxfp4)

from megagraph.kernels.gemm.reference import grouped_linear, linear


def naive_matvec(x, W):
    """y[t, o] = Σ_i x[t,i]·W[o,i], one token at a time (fp64)."""
    xd = x.double()
    return torch.stack([(W * xd[t][None, :]).sum(dim=1) for t in range(x.shape[0])])


def _weights(fmt, O, I, g, b=32):
    if fmt == "dense":
        w = torch.randn(O, I, generator=g)
        return w, None, w.double()
    if fmt == "fp8_block":
        w = (torch.randn(O, I, generator=g) * 40).to(torch.float8_e4m3fn)
        s = random_e8m0((-(-O // b), -(-I // b)), gen=g)
        return w, s, naive_dequant_fp8_block(w, s, b)
    w = random_mxfp4((O, I // 2), gen=g)
    s = random_e8m0((O, I // 32), gen=g)
    return w, s, naive_unpack_mxfp4(w, s)


@pytest.mark.parametrize("fmt,O,I", [("dense", 24, 40), ("fp8_block", 70, 100), ("fp8_block", 64, 64),
                                     ("mxfp4", 20, 96)])
def test_linear_matches_naive(fmt, O, I):
    g = torch.Generator().manual_seed(10)
    w, s, Wd = _weights(fmt, O, I, g)
    x = torch.randn(5, I, generator=g)
    y = linear(x, w, s, fmt=fmt)
    assert y.shape == (5, O) and y.dtype == torch.float32
    ref = naive_matvec(x, Wd)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_linear_fp8_block_128():
    # V4-style 128×128 blocks inferred from the scale shape (ragged last block)
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(200, 130, generator=g) * 40).to(torch.float8_e4m3fn)
    s = random_e8m0((2, 2), gen=g)
    x = torch.randn(3, 130, generator=g).to(torch.bfloat16)
    y = linear(x, w, s, fmt="fp8_block")
    assert y.dtype == torch.bfloat16
    ref = naive_matvec(x.float(), naive_dequant_fp8_block(w, s, 128))
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "mxfp4"])
def test_grouped_linear_matches_per_group(fmt):
    g = torch.Generator().manual_seed(12)
    G, O, I = 4, 32, 64
    w, s, Wd = _weights(fmt, G * O, I, g)
    x = torch.randn(6, G * I, generator=g)
    y = grouped_linear(x, w, s, groups=G, fmt=fmt)
    assert y.shape == (6, G * O)
    ref = torch.cat([naive_matvec(x[:, k * I:(k + 1) * I], Wd[k * O:(k + 1) * O]) for k in range(G)], dim=1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
