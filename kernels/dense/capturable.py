"""Token-parallel ops: norms, GEMMs, RoPE, fake quantization, mHC, embedding, views and casts.

These are row-independent (pad rows cannot affect real rows) and mostly identical to the
reference; the differences are only where the reference builds a host tensor (RoPE frequencies,
the E2M1 lookup table) that would be copied to the device on every call.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megagraph.kernels.mhc.reference import hc_coefficients
from megagraph.kernels.dense.quant import E2M1_MAX, fake_quant_with
from megagraph.kernels.dense.rope import rotate_tail
# the views and the cast are the reference's own: they move no data between devices
from megagraph.kernels.dense.structural import cast, merge_heads, split_heads

from megagraph.kernels.common.capturable import dequantize, e2m1_decode

# ---------------------------------------------------------------------------------------------
# elementwise, norm, GEMM
# ---------------------------------------------------------------------------------------------


def add(a: Tensor, b: Tensor) -> Tensor:
    return (a.float() + b.float()).to(a.dtype)


def embed(token_ids: Tensor, table: Tensor) -> Tensor:
    return table.index_select(0, token_ids)


def rms_norm(x: Tensor, weight: Tensor | None = None, *, eps: float) -> Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, *, fmt: str = "dense") -> Tensor:
    w = dequantize(weight, scale, fmt)
    return (x.float() @ w.t()).to(x.dtype)


def grouped_linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, *, groups: int,
                   fmt: str = "dense") -> Tensor:
    w = dequantize(weight, scale, fmt)
    go, i = w.shape
    o = go // groups
    xg = x.float().reshape(*x.shape[:-1], groups, i)
    y = torch.einsum("...gi,goi->...go", xg, w.reshape(groups, o, i))
    return y.reshape(*x.shape[:-1], groups * o).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def _yarn_range(rope_dim, theta, yarn_original, yarn_beta_fast, yarn_beta_slow):
    def corr_dim(beta: float) -> float:
        return rope_dim * math.log(yarn_original / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = math.floor(corr_dim(yarn_beta_fast))
    high = math.ceil(corr_dim(yarn_beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def rope_frequencies(device, *, rope_dim: int, theta: float, yarn_factor: float = 1.0,
                     yarn_original: int = 0, yarn_beta_fast: float = 32.0,
                     yarn_beta_slow: float = 1.0) -> Tensor:
    """kernels.dense.rope.rope_frequencies computed on `device` (same fp32 ops, same values)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    if yarn_factor > 1.0:
        low, high = _yarn_range(rope_dim, theta, yarn_original, yarn_beta_fast, yarn_beta_slow)
        if high == low:
            high = low + 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=device) - low)
                / (high - low)).clamp(0, 1)
        freqs = freqs / yarn_factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_table(positions: Tensor, freqs: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """(cos, sin) [T, rope_dim/2] of the angles float(p + offset) * f_k (kernels/dense/triton_rope.py
    uses this table too, so that its result is bitwise this module's rope)."""
    ang = (positions + offset).to(torch.float32)[:, None] * freqs[None, :]
    return torch.cos(ang), torch.sin(ang)


def rope(x: Tensor, positions: Tensor, *, rope_dim: int, theta: float, yarn_factor: float = 1.0,
         yarn_original: int = 0, yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0,
         offset: int = 0, inverse: bool = False) -> Tensor:
    d = x.shape[-1]
    if rope_dim > d or rope_dim % 2:
        raise ValueError(f"bad rope_dim {rope_dim} for last dim {d}")
    freqs = rope_frequencies(x.device, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                             yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                             yarn_beta_slow=yarn_beta_slow)
    cos, sin = rope_table(positions, freqs, offset)
    return rotate_tail(x, cos, sin, rope_dim=rope_dim, inverse=inverse)


# ---------------------------------------------------------------------------------------------
# activation fake quantization
# ---------------------------------------------------------------------------------------------

def round_e2m1(v: Tensor) -> Tensor:
    from megagraph.kernels import formats

    v = v.clamp(-E2M1_MAX, E2M1_MAX)
    return e2m1_decode(formats.f32_to_e2m1_codes(v, ties="even"))


def fake_quant(x: Tensor, *, fmt: str, block: int) -> Tensor:
    """The reference fake-quantization with the device-table E2M1 rounding (no host tensors)."""
    return fake_quant_with(x, fmt=fmt, block=block, round_e2m1=round_e2m1)


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def hc_embed(e: Tensor, *, n_hc: int) -> tuple[Tensor, Tensor]:
    t = e.shape[0]
    h = e.unsqueeze(1).expand(t, n_hc, e.shape[-1]).contiguous()
    col = torch.arange(n_hc, device=e.device)
    pre = (col == 0).to(torch.float32).expand(t, n_hc).contiguous()
    return h, pre


def _hc_logits(H: Tensor, fn: Tensor, eps: float) -> Tensor:
    t, n, d = H.shape
    h = H.float().reshape(t, n * d)
    return (h @ fn.float().t()) * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)


def hc_mixer(H: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, eps: float, hc_eps: float,
             sinkhorn_iters: int) -> tuple[Tensor, Tensor, Tensor]:
    t, n, _ = H.shape
    m = _hc_logits(H, fn, eps)
    return hc_coefficients(m, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def hc_collapse(H: Tensor, w: Tensor) -> Tensor:
    return torch.einsum("tc,tcd->td", w.float(), H.float()).to(H.dtype)


def hc_expand(H: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    out = post.float()[:, :, None] * y.float()[:, None, :]
    out = out + torch.einsum("tij,tid->tjd", comb.float(), H.float())
    return out.to(H.dtype)


def hc_head_mix(H: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, eps: float, hc_eps: float) -> Tensor:
    m = _hc_logits(H, fn, eps)
    return torch.sigmoid(m * scale.float().reshape(-1)[0] + base.float()) + hc_eps


# ---------------------------------------------------------------------------------------------
# structural
# ---------------------------------------------------------------------------------------------


def select_last(x: Tensor, seq_new: Tensor) -> Tensor:
    """Row of each request's last new token. A request row without tokens gets the row before its
    (empty) span, clamped into range: a defined but meaningless value (the reference would index
    row -1 for a leading empty request)."""
    last = (torch.cumsum(seq_new, 0) - 1).clamp(0, max(x.shape[0] - 1, 0))
    return x.index_select(0, last)


def select_rows(x: Tensor, rows: Tensor) -> Tensor:
    return x.index_select(0, rows)


def fill(x: Tensor, *, value) -> Tensor:
    return torch.full_like(x, value)
