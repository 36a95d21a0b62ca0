"""rms_norm, add, embed vs naive per-row formulations. Tolerance: fp32 ops vs fp64 naive, 1e-5 rel."""
import math

import pytest
import torch

from megagraph.kernels.reference_table import add, embed, rms_norm


def naive_rms(x, w, eps):
    rows = x.double().reshape(-1, x.shape[-1])
    out = []
    for r in rows.tolist():
        inv = 1.0 / math.sqrt(sum(v * v for v in r) / len(r) + eps)
        out.append([v * inv * (1.0 if w is None else float(w[i])) for i, v in enumerate(r)])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("shape,weighted", [((7, 48), True), ((5, 3, 16), False), ((4, 2, 32), True)])
def test_rms_norm_matches_naive(shape, weighted):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3 + 0.5
    w = torch.randn(shape[-1], generator=g) if weighted else None
    y = rms_norm(x, w, eps=1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), naive_rms(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_norm_bf16_and_tiny_eps():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 64, generator=g) * 1e-8).to(torch.bfloat16)  # tiny values: eps 1e-20 must not dominate
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    y = rms_norm(x, w, eps=1e-20)
    assert y.dtype == torch.bfloat16
    ref = naive_rms(x.float(), w.float(), 1e-20)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    assert ref.abs().mean() > 0.3


def test_add_and_embed():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 8, generator=g).to(torch.bfloat16)
    b = torch.randn(5, 8, generator=g)
    s = add(a, b)
    assert s.dtype == torch.bfloat16
    torch.testing.assert_close(s, (a.float() + b).to(torch.bfloat16))
    table = torch.randn(11, 6, generator=g).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 10, 3])
    e = embed(ids, table)
    assert e.dtype == torch.bfloat16
    for t, i in enumerate(ids.tolist()):
        assert torch.equal(e[t], table[i])
