"""mHC ops vs naive per-token loops (fp64), plus the spec §8 self-checks (Sinkhorn column sums,
pre/post ranges). Tolerance: fp32 op vs fp64 naive, 1e-5."""
import math

import torch

from megagraph.kernels.reference_table import hc_collapse, hc_embed, hc_expand, hc_mixer


def naive_mixer(H, fn, base, scale, eps, hc_eps, iters):
    T, n, d = H.shape
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    pres, posts, combs = [], [], []
    for t in range(T):
        h = H[t].double().reshape(-1).tolist()
        inv = 1 / math.sqrt(sum(v * v for v in h) / len(h) + eps)
        fnl = fn.double().tolist()
        m = [sum(fnl[k][i] * h[i] for i in range(len(h))) * inv for k in range((2 + n) * n)]
        s = [scale[0].item()] * n + [scale[1].item()] * n + [scale[2].item()] * (n * n)
        a = [m[k] * s[k] + base[k].item() for k in range(len(m))]
        pres.append([sig(a[i]) + hc_eps for i in range(n)])
        posts.append([2 * sig(a[n + i]) for i in range(n)])
        C = [[a[2 * n + n * i + j] for j in range(n)] for i in range(n)]
        for i in range(n):  # softmax over j
            mx = max(C[i])
            ex = [math.exp(v - mx) for v in C[i]]
            C[i] = [e / sum(ex) + hc_eps for e in ex]

        def colnorm(C):
            cs = [sum(C[i][j] for i in range(n)) for j in range(n)]
            return [[C[i][j] / (cs[j] + hc_eps) for j in range(n)] for i in range(n)]

        def rownorm(C):
            return [[C[i][j] / (sum(C[i]) + hc_eps) for j in range(n)] for i in range(n)]

        C = colnorm(C)
        for _ in range(iters - 1):
            C = colnorm(rownorm(C))
        combs.append(C)
    f = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return f(pres), f(posts), f(combs)


def _mixer_inputs(T=3, n=4, d=8, seed=40):
    g = torch.Generator().manual_seed(seed)
    H = (torch.randn(T, n, d, generator=g) * 2).to(torch.bfloat16)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.3
    base = torch.randn((2 + n) * n, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return H, fn, base, scale


def test_hc_mixer_matches_naive_and_self_checks():
    H, fn, base, scale = _mixer_inputs()
    pre, post, comb = hc_mixer(H, fn, base, scale, eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert comb.shape == (3, 4, 4)
    npre, npost, ncomb = naive_mixer(H, fn, base, scale, 1e-20, 1e-6, 20)
    torch.testing.assert_close(pre.double(), npre, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post.double(), npost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), ncomb, rtol=1e-5, atol=1e-6)
    # §8.4: columns of comb sum to 1 after Sinkhorn (last pass is a column normalization)
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(3, 4), rtol=0, atol=1e-5)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()
    assert not torch.allclose(comb, comb.transpose(1, 2))  # asymmetric: transposition bugs are visible


def test_hc_mixer_iteration_count_matters():
    H, fn, base, scale = _mixer_inputs(seed=41)
    _, _, c3 = hc_mixer(H, fn, base, scale, eps=1e-20, hc_eps=1e-6, sinkhorn_iters=3)
    _, _, n3 = naive_mixer(H, fn, base, scale, 1e-20, 1e-6, 3)
    _, _, n4 = naive_mixer(H, fn, base, scale, 1e-20, 1e-6, 4)
    torch.testing.assert_close(c3.double(), n3, rtol=1e-5, atol=1e-6)
    assert (n3 - n4).abs().max() > 1e-5


def test_hc_embed_collapse_expand():
    g = torch.Generator().manual_seed(42)
    T, n, d = 4, 4, 6
    e = torch.randn(T, d, generator=g).to(torch.bfloat16)
    H, pre = hc_embed(e, n_hc=n)
    assert H.shape == (T, n, d) and H.dtype == torch.bfloat16
    assert all(torch.equal(H[:, c], e) for c in range(n))
    assert pre.dtype == torch.float32 and pre.tolist() == [[1.0, 0.0, 0.0, 0.0]] * T
    assert torch.equal(hc_collapse(H, pre), e)

    H = torch.randn(T, n, d, generator=g)
    w = torch.rand(T, n, generator=g)
    x = hc_collapse(H, w)
    for t in range(T):
        for k in range(d):
            ref = sum(w[t, c].item() * H[t, c, k].item() for c in range(n))
            assert math.isclose(x[t, k].item(), ref, rel_tol=1e-5, abs_tol=1e-6)

    y = torch.randn(T, d, generator=g)
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.rand(T, n, n, generator=g)
    out = hc_expand(H.to(torch.bfloat16), y, post, comb)
    assert out.dtype == torch.bfloat16
    out32 = hc_expand(H, y, post, comb)
    Hb = H.to(torch.bfloat16).float()
    for t in range(T):
        for j in range(n):
            for k in range(d):
                ref = post[t, j].item() * y[t, k].item() + sum(comb[t, i, j].item() * H[t, i, k].item()
                                                                for i in range(n))
                assert math.isclose(out32[t, j, k].item(), ref, rel_tol=1e-5, abs_tol=1e-5)
                refb = post[t, j].item() * y[t, k].item() + sum(comb[t, i, j].item() * Hb[t, i, k].item()
                                                                 for i in range(n))
                assert math.isclose(out[t, j, k].item(), refb, rel_tol=1e-2, abs_tol=1e-2)
