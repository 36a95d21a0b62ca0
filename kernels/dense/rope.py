"""Interleaved-pair rotary embedding with optional YaRN frequency ramp (spec §1.3, §3.0, §3.4.5)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def yarn_correction_range(rope_dim: int, theta: float, yarn_original: int, yarn_beta_fast: float,
                          yarn_beta_slow: float) -> tuple[int, int]:
    """YaRN correction range (low, high) = floor/ceil of ``dim·ln(orig/(β·2π)) / (2·ln θ)``,
    clipped to [0, rope_dim−1] (θ=160000, orig 65536, β 32/1, dim 64 → (15, 25))."""

    def corr_dim(beta: float) -> float:
        return rope_dim * math.log(yarn_original / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = math.floor(corr_dim(yarn_beta_fast))
    high = math.ceil(corr_dim(yarn_beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def rope_frequencies(*, rope_dim: int, theta: float, yarn_factor: float = 1.0, yarn_original: int = 0,
                     yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0) -> Tensor:
    """Per-pair angular frequencies f32[rope_dim/2]: ``f_i = θ^(−2i/rope_dim)``.

    With yarn_factor > 1: ``ramp_i = clamp((i−low)/(high−low), 0, 1)``,
    ``f'_i = f_i/factor·ramp_i + f_i·(1−ramp_i)`` (no mscale), (low, high) from
    :func:`yarn_correction_range`.
    """
    if rope_dim % 2:
        raise ValueError("rope_dim must be even")
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn_factor > 1.0:
        low, high = yarn_correction_range(rope_dim, theta, yarn_original, yarn_beta_fast,
                                          yarn_beta_slow)
        if high == low:
            high = low + 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / yarn_factor * ramp + freqs * (1 - ramp)
    return freqs


def rotate_tail(x: Tensor, cos: Tensor, sin: Tensor, *, rope_dim: int, inverse: bool) -> Tensor:
    """x with its last rope_dim columns rotated pairwise by angle tables cos, sin [T, rope_dim/2]
    (backwards when inverse), in fp32 and cast back to x.dtype; the other columns are unchanged."""
    d = x.shape[-1]
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xr = x[..., d - rope_dim:].float()
    a, b = xr[..., 0::2], xr[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :d - rope_dim], rot), dim=-1)


def rope(x: Tensor, positions: Tensor, *, rope_dim: int, theta: float, yarn_factor: float = 1.0,
         yarn_original: int = 0, yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0,
         offset: int = 0, inverse: bool = False) -> Tensor:
    """Rotate the LAST ``rope_dim`` channels of x's last axis as interleaved pairs.

    x: [T, D] or [T, H, D] (positions broadcast over heads); positions: i64[T]. Pair k =
    (x[D−rope_dim+2k], x[D−rope_dim+2k+1]) is multiplied, as a complex number, by
    ``exp(±i·(p+offset)·f_k)`` (− when inverse=True, the conjugate). The angle is formed in fp32
    (``float(p+offset)·f_k``) as the vendor table does; other channels are copied unchanged.
    Returns x.dtype.
    """
    d = x.shape[-1]
    if rope_dim > d or rope_dim % 2:
        raise ValueError(f"bad rope_dim {rope_dim} for last dim {d}")
    freqs = rope_frequencies(rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                             yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                             yarn_beta_slow=yarn_beta_slow)
    freqs = freqs.to(positions.device)
    ang = (positions + offset).to(torch.float32)[:, None] * freqs[None, :]  # [T, rope_dim/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    return rotate_tail(x, cos, sin, rope_dim=rope_dim, inverse=inverse)
