"""route / moe_experts / swiglu_mlp vs naive per-token loops (naive dequant, fp64), and the spec §8.8
router self-checks. Tolerance: fp32 op vs fp64 naive, rtol 1e-5 / atol 1e-5·max|y|."""
import math

import pytest
import torch
from _reference_helpers import (naive_dequant_fp8_block, naive_unpack_mxfp4, random_e8m0,
                                random_mxfp4)

from megagraph.kernels.reference_table import moe_experts, route, swiglu_mlp


def naive_route(x, gw, bias, k, route_scale, norm, func):
    ids, wts = [], []
    for t in range(x.shape[0]):
        l = [float(x[t].double() @ gw[e].double()) for e in range(gw.shape[0])]
        if func == "sqrtsoftplus":
            sc = [math.sqrt(math.log1p(math.exp(v))) for v in l]
        elif func == "sigmoid":
            sc = [1 / (1 + math.exp(-v)) for v in l]
        else:
            mx = max(l)
            ex = [math.exp(v - mx) for v in l]
            sc = [v / sum(ex) for v in ex]
        sel = [sc[e] + (0.0 if bias is None else bias[e].item()) for e in range(len(sc))]
        top = sorted(range(len(sc)), key=lambda e: -sel[e])[:k]
        w = [sc[e] for e in top]
        if norm:
            tot = sum(w) + 1e-20
            w = [v / tot for v in w]
        ids.append(top)
        wts.append([v * route_scale for v in w])
    return torch.tensor(ids), torch.tensor(wts, dtype=torch.float64)


@pytest.mark.parametrize("func,norm", [("sqrtsoftplus", True), ("softmax", False), ("sigmoid", True)])
def test_route_matches_naive(func, norm):
    g = torch.Generator().manual_seed(80)
    x = torch.randn(7, 16, generator=g)
    gw = torch.randn(12, 16, generator=g).to(torch.bfloat16)
    bias = torch.randn(12, generator=g) * 0.5
    ids, w = route(x, gw, bias, topk=3, route_scale=1.5, norm_topk=norm, score_func=func)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (7, 3)
    rid, rw = naive_route(x, gw, bias, 3, 1.5, norm, func)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w.double(), rw, rtol=1e-5, atol=1e-6)
    if norm:  # §8.8: weights sum to route_scale
        torch.testing.assert_close(w.sum(dim=1), torch.full((7,), 1.5), rtol=1e-6, atol=1e-6)


def test_route_bias_selects_but_does_not_weight():
    g = torch.Generator().manual_seed(81)
    x = torch.randn(5, 16, generator=g)
    gw = torch.randn(8, 16, generator=g)
    bias = torch.zeros(8)
    bias[6] = 100.0  # always selected
    ids, w = route(x, gw, bias, topk=2, route_scale=1.5)
    ids0, _ = route(x, gw, None, topk=2, route_scale=1.5)
    assert (ids[:, 0] == 6).all()
    assert not torch.equal(ids, ids0)
    sc = torch.sqrt(torch.nn.functional.softplus(x @ gw.t()))
    chosen = sc.gather(1, ids)
    torch.testing.assert_close(w, 1.5 * chosen / chosen.sum(1, keepdim=True))


def naive_expert(x, W1, W3, W2, lim):
    """One token, fp64: W2(silu(min(W1x, lim)) ⊙ clamp(W3x, ±lim))."""
    g = W1 @ x
    u = W3 @ x
    if lim:
        u = u.clamp(-lim, lim)
        g = g.clamp(max=lim)
    return W2 @ (g / (1 + torch.exp(-g)) * u)


def _expert_bank(fmt, E, F, d, g):
    """Returns op inputs (w1, s1, w3, s3, w2, s2) and fp64 naive-dequantized [E] lists."""
    if fmt == "dense":
        ws = [torch.randn(E, F, d, generator=g), torch.randn(E, F, d, generator=g),
              torch.randn(E, d, F, generator=g) * 0.3]
        return [ws[0], None, ws[1], None, ws[2], None], [[w[e].double() for e in range(E)] for w in ws]
    if fmt == "mxfp4":
        raw = [(random_mxfp4((E, F, d // 2), gen=g), random_e8m0((E, F, d // 32), 124, 128, gen=g)),
               (random_mxfp4((E, F, d // 2), gen=g), random_e8m0((E, F, d // 32), 124, 128, gen=g)),
               (random_mxfp4((E, d, F // 2), gen=g), random_e8m0((E, d, F // 32), 122, 126, gen=g))]
        deq = [[naive_unpack_mxfp4(w[e], s[e]) for e in range(E)] for w, s in raw]
    else:
        raw = []
        for O, I in ((F, d), (F, d), (d, F)):
            raw.append(((torch.randn(E, O, I, generator=g) * 30).to(torch.float8_e4m3fn),
                        random_e8m0((E, O // 32, I // 32), 118, 122, gen=g)))
        deq = [[naive_dequant_fp8_block(w[e], s[e], 32) for e in range(E)] for w, s in raw]
    return [raw[0][0], raw[0][1], raw[1][0], raw[1][1], raw[2][0], raw[2][1]], deq


@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "fp8_block"])
def test_moe_experts_matches_naive(fmt):
    g = torch.Generator().manual_seed(82)
    E, F, d, T, k, lim = 5, 32, 64, 6, 2, 4.0
    args, (W1, W3, W2) = _expert_bank(fmt, E, F, d, g)
    x = torch.randn(T, d, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    y = moe_experts(x, ids, wts, *args, fmt=fmt, swiglu_limit=lim)
    assert y.dtype == x.dtype and y.shape == (T, d)
    ref = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            ref[t] += wts[t, j].item() * naive_expert(x[t].double(), W1[e], W3[e], W2[e], lim)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the clamp is active for these inputs
    y_nolim = moe_experts(x, ids, wts, *args, fmt=fmt, swiglu_limit=None)
    assert not torch.allclose(y_nolim, y)
    # shared expert = a single unstacked expert with weight 1
    e0 = [a if a is None else a[0] for a in args]
    ys = swiglu_mlp(x.to(torch.bfloat16), *e0, fmt=fmt, swiglu_limit=lim)
    assert ys.dtype == torch.bfloat16
    refs = torch.stack([naive_expert(x[t].to(torch.bfloat16).double(), W1[0], W3[0], W2[0], lim) for t in range(T)])
    torch.testing.assert_close(ys.double(), refs, rtol=2e-2, atol=2e-2 * refs.abs().max().item())
