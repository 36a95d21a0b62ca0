"""fake_quant vs a naive per-block formulation that rounds by exhaustive nearest-grid search
(ties → even code). Expected exact equality (the ops are deterministic roundings)."""
import math

import numpy as np
import pytest
import torch

from megagraph.kernels.reference_table import fake_quant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# all non-negative finite e4m3fn values, indexed by code (code parity = mantissa LSB)
E4M3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def nearest_even(v, grid):
    """Nearest grid magnitude (grid sorted, index parity = code parity), ties to even index; sign kept."""
    a = abs(v)
    best = min(range(len(grid)), key=lambda k: (abs(grid[k] - a), k % 2))
    return math.copysign(grid[best], v)


def pow2_ceil(y):
    e = -200
    while 2.0 ** e < y:
        e += 1
    return 2.0 ** e


def naive_fake_quant(x, fmt, block):
    xs = x.float().reshape(-1, block).tolist()
    out = []
    for blk in xs:
        amax = max(abs(v) for v in blk)
        if fmt == "fp8_e4m3":
            s = pow2_ceil(float(np.float32(max(amax, np.float32(1e-4))) / np.float32(448)))
            out.append([nearest_even(min(max(float(np.float32(v / s)), -448), 448), E4M3) * s for v in blk])
        elif fmt == "mxfp4":
            s = pow2_ceil(float(np.float32(max(amax, np.float32(1e-4))) / np.float32(6)))
            out.append([nearest_even(min(max(v / s, -6), 6), E2M1) * s for v in blk])
        else:
            sv = float(np.float32(max(amax, 6 * 2.0**-9)) / np.float32(6))
            s = nearest_even(sv, E4M3)
            out.append([nearest_even(min(max(float(np.float32(v) / np.float32(s)), -6), 6), E2M1) * s for v in blk])
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


@pytest.mark.parametrize("fmt,block", [("fp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16), ("fp8_e4m3", 16)])
def test_fake_quant_matches_naive(fmt, block):
    g = torch.Generator().manual_seed(30)
    x = torch.randn(3, 4, 64, generator=g) * torch.logspace(-4, 2, 64)  # many scales per row
    x[0, 0, :block] *= 1e-6  # a block below the amax floor
    y = fake_quant(x, fmt=fmt, block=block)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, naive_fake_quant(x, fmt, block), rtol=0, atol=0)


def test_fake_quant_e2m1_ties_to_even_and_pow2_boundaries():
    # block amax = 6 → mxfp4 scale exactly 1 (amax/6 = 2^0 is not rounded up)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -0.25, 0.5]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, -0.0, 0.5]  # 0.5 would flush to 0 at scale 2
    x = torch.tensor([6.0] + mids + [0.1] * (32 - 1 - len(mids)))
    y = fake_quant(x[None], fmt="mxfp4", block=32)[0]
    assert y[1:1 + len(mids)].tolist() == expect
    assert y[0].item() == 6.0
    # fp8: amax = 448·2^-3 → scale 2^-3 exactly; the max is representable
    x8 = torch.full((32,), 0.3)
    x8[5] = 56.0
    x8[7] = 2.0**-12  # = min e4m3 subnormal · scale; would round to 0 at scale 2^-2
    y8 = fake_quant(x8[None], fmt="fp8_e4m3", block=32)[0]
    assert y8[5].item() == 56.0 and y8[7].item() == 2.0**-12
    # nvfp4: amax 6·1.1 → scale e4m3(1.1) = 1.125; 6.6/1.125 = 5.87 → 6 → 6.75
    xn = torch.zeros(16) + 0.01
    xn[3] = 6.6
    assert fake_quant(xn[None], fmt="nvfp4", block=16)[0, 3].item() == 6.75


def test_fake_quant_bf16_dtype():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    for fmt, b in [("fp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16)]:
        y = fake_quant(x, fmt=fmt, block=b)
        assert y.dtype == torch.bfloat16
        assert (y.float() - x.float()).abs().max() <= x.float().abs().max() / 4 + 1e-6


@pytest.mark.parametrize("c", [448.0, 6.0, 1.0, 0.75, 3.0, 2.0**-9 * 6.0])
def test_ceil_log2_div_equals_the_correctly_rounded_quotient(c):
    """The division-free exponent (what capturable quantizers use, so that torch.compile's
    approximate CUDA division cannot change a scale) equals frexp of torch's correctly rounded
    y / c: random magnitudes, and the f32 neighbours of every c·2^k (where an approximate quotient
    one ulp off would move the exponent)."""
    from megagraph.kernels.dense.quant import ceil_log2_div

    g = torch.Generator().manual_seed(11)
    rand = torch.exp2(torch.empty(20000).uniform_(-20, 20, generator=g)) * (
        1 + torch.rand(20000, generator=g))
    edges = torch.tensor([c * 2.0**k for k in range(-20, 21)], dtype=torch.float32)
    up = torch.nextafter(edges, torch.full_like(edges, math.inf))
    down = torch.nextafter(edges, torch.zeros_like(edges))
    y = torch.cat([rand.float(), edges, up, down, up.nextafter(up * 2)])
    m, e = torch.frexp(y / c)
    want = e - (m == 0.5).to(e.dtype)
    got = ceil_log2_div(y, c)
    assert got.dtype == torch.int32
    assert torch.equal(got, want), y[got != want][:5]
