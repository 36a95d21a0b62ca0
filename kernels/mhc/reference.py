"""mHC (manifold-constrained hyper-connections), single-pass variant (spec §3.1, §3.2).

The residual stream is H [T, n, d] (n parallel streams); mixer coefficients are fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor


def hc_embed(e: Tensor, *, n_hc: int) -> tuple[Tensor, Tensor]:
    """Expand embeddings e [T, d] to n_hc identical streams.

    Returns (H [T, n_hc, d] in e.dtype, pre_mix f32[T, n_hc] = (1, 0, …, 0) per token).
    """
    t = e.shape[0]
    h = e.unsqueeze(1).expand(t, n_hc, e.shape[-1]).contiguous()
    pre = torch.zeros(t, n_hc, dtype=torch.float32, device=e.device)
    pre[:, 0] = 1.0
    return h, pre


def hc_mixer(H: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, eps: float, hc_eps: float,
             sinkhorn_iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """mHC mixer (spec §3.2) per token.

    H [T, n, d]; fn [(2+n)·n, n·d]; base [(2+n)·n]; scale [3].
    ``m = (fn·h)·rsqrt(mean(h²)+eps)`` with h = flatten(H[t]) (stream-major), ``a = m⊙s + base``
    (s = scale0×n ‖ scale1×n ‖ scale2×n²); ``pre = σ(a[:n]) + hc_eps``, ``post = 2σ(a[n:2n])``,
    ``C[i,j] = a[2n + n·i + j]`` → softmax over j + hc_eps → column-normalize, then
    (sinkhorn_iters−1)× (row-normalize, column-normalize), each dividing by (sum + hc_eps).
    Returns (pre f32[T, n], post f32[T, n], comb f32[T, n, n]); all math fp32.
    """
    t, n, d = H.shape
    h = H.float().reshape(t, n * d)
    m = (h @ fn.float().t()) * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return hc_coefficients(m, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def hc_coefficients(m: Tensor, base: Tensor, scale: Tensor, *, hc_eps: float,
                    sinkhorn_iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pre, post, comb) from the projected, RMS-scaled logits m f32[T, (2+n)·n] (see hc_mixer)."""
    t = m.shape[0]
    n = int(round((1 + m.shape[1]) ** 0.5 - 1))  # (2+n)·n = m.shape[1]
    sc = scale.float()
    s = torch.cat([sc[0].expand(n), sc[1].expand(n), sc[2].expand(n * n)])
    a = m * s + base.float()
    pre = torch.sigmoid(a[:, :n]) + hc_eps
    post = 2.0 * torch.sigmoid(a[:, n:2 * n])
    c = a[:, 2 * n:].reshape(t, n, n)
    c = torch.softmax(c, dim=-1) + hc_eps
    c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + hc_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, c


def hc_collapse(H: Tensor, w: Tensor) -> Tensor:
    """Collapse the streams with a mix: ``x[t] = Σ_c w[t,c]·H[t,c]``.

    H [T, n, d]; w f32[T, n]. fp32 accumulate, returns [T, d] in H.dtype.
    """
    return torch.einsum("tc,tcd->td", w.float(), H.float()).to(H.dtype)


def hc_expand(H: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Residual update after a sub-layer: ``H'[t,j] = post[t,j]·y[t] + Σ_i comb[t,i,j]·H[t,i]``.

    H [T, n, d]; y [T, d]; post f32[T, n]; comb f32[T, n, n] (first index = source stream).
    fp32 math, returns [T, n, d] in H.dtype.
    """
    out = post.float()[:, :, None] * y.float()[:, None, :]
    out = out + torch.einsum("tij,tid->tjd", comb.float(), H.float())
    return out.to(H.dtype)
