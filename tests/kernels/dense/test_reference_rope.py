"""rope / rope_frequencies: spec §1.3 YaRN numbers, naive per-token complex rotation, inverse,
offset. Tolerance: fp32 op vs fp64 naive with the same fp32 angles, 1e-5."""
import cmath
import math

import numpy as np
import torch

from megagraph.kernels.reference_table import rope_frequencies
from megagraph.kernels.dense.rope import rope
from megagraph.kernels.dense.rope import yarn_correction_range

YARN = dict(theta=160000.0, yarn_factor=16.0, yarn_original=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0)


def test_yarn_correction_range_spec_numbers():
    assert yarn_correction_range(64, 160000.0, 65536, 32.0, 1.0) == (15, 25)
    assert yarn_correction_range(64, 10000.0, 65536, 32.0, 1.0) == (20, 33)


def test_yarn_frequencies_spec_1_3():
    f = rope_frequencies(rope_dim=64, **YARN).double()
    base = torch.tensor([160000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(f[:16], base[:16], rtol=1e-6, atol=0)  # pairs 0–15 unscaled
    torch.testing.assert_close(f[25:], base[25:] / 16, rtol=1e-6, atol=0)  # 25–31 divided by 16
    for i in range(16, 25):  # interpolated
        ramp = (i - 15) / 10
        assert math.isclose(f[i].item(), base[i].item() / 16 * ramp + base[i].item() * (1 - ramp), rel_tol=1e-6)
        assert base[i] / 16 < f[i] < base[i]
    plain = rope_frequencies(rope_dim=64, theta=10000.0)
    torch.testing.assert_close(plain.double(), torch.tensor([1e4 ** (-2 * i / 64) for i in range(32)],
                                                            dtype=torch.float64), rtol=1e-6, atol=0)


def naive_rope(x, positions, rope_dim, freqs, inverse=False, offset=0):
    """Per token, per head, per pair: complex multiply by exp(±i·angle), angle = fp32(p)·fp32(f_k)."""
    x3 = x.double().reshape(x.shape[0], -1, x.shape[-1]).clone()
    D = x.shape[-1]
    fr = freqs.numpy().astype(np.float32)
    for t in range(x3.shape[0]):
        p = np.float32(int(positions[t]) + offset)
        for h in range(x3.shape[1]):
            for k in range(rope_dim // 2):
                ang = float(np.float32(p * fr[k]))
                a, b = x3[t, h, D - rope_dim + 2 * k].item(), x3[t, h, D - rope_dim + 2 * k + 1].item()
                z = complex(a, b) * cmath.exp(complex(0, -ang if inverse else ang))
                x3[t, h, D - rope_dim + 2 * k], x3[t, h, D - rope_dim + 2 * k + 1] = z.real, z.imag
    return x3.reshape(x.shape)


def test_rope_matches_naive_with_heads_and_yarn():
    g = torch.Generator().manual_seed(20)
    x = torch.randn(5, 3, 24, generator=g)
    pos = torch.tensor([0, 1, 7, 100, 3000])
    y = rope(x, pos, rope_dim=16, **YARN)
    ref = naive_rope(x, pos, 16, rope_frequencies(rope_dim=16, **YARN))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[..., :8], x[..., :8])  # untouched channels copied exactly
    assert not torch.allclose(y[1:, :, 8:], x[1:, :, 8:])


def test_rope_2d_plain_inverse_offset():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(6, 32, generator=g)
    pos = torch.tensor([5, 6, 7, 40, 41, 90])
    y = rope(x, pos, rope_dim=32, theta=10000.0)
    ref = naive_rope(x, pos, 32, rope_frequencies(rope_dim=32, theta=10000.0))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    yi = rope(x, pos, rope_dim=32, theta=10000.0, inverse=True)
    torch.testing.assert_close(yi.double(), naive_rope(x, pos, 32, rope_frequencies(rope_dim=32, theta=10000.0),
                                                       inverse=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(y, pos, rope_dim=32, theta=10000.0, inverse=True), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(x, pos, rope_dim=32, theta=10000.0, offset=3),
                               rope(x, pos + 3, rope_dim=32, theta=10000.0))
    xb = x.to(torch.bfloat16)
    assert rope(xb, pos, rope_dim=32, theta=10000.0).dtype == torch.bfloat16
