"""RMS normalization (spec §3.0): fp32 statistics, weight applied after normalization."""
from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor | None = None, *, eps: float) -> Tensor:
    """RMSNorm over the last axis: ``weight ⊙ x · rsqrt(mean(x²) + eps)``.

    x: [..., D] (e.g. [T, D] or [T, H, D]); weight: [D] or None (weightless).
    Computed in fp32 (the weight multiplies the normalized fp32 value), returned in x.dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)
