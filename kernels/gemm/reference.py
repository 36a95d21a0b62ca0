"""Linear layers on dense, FP8-block (E4M3 + UE8M0) and MXFP4 weights (spec §2.2, §3.4.6).

Weights are dequantized to fp32 with ``megagraph.kernels.formats`` and multiplied in fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.capturable import WEIGHT_FORMATS as FORMATS, dequantize


def dequantize_weight(weight: Tensor, scale: Tensor | None, fmt: str) -> Tensor:
    """Dequantize one 2-D weight to fp32 [O, I].

    fmt ``dense``: float [O, I] (scale must be None); ``fp8_block``: float8_e4m3fn [O, I] with
    float8_e8m0fnu scale [ceil(O/b), ceil(I/b)] (b inferred from the shapes); ``mxfp4``: int8
    [O, I/2] (two E2M1 nibbles per byte, low nibble = even column) with e8m0 scale [O, I/32].
    """
    from megagraph.kernels import formats  # lazy: written in parallel by a colleague

    return dequantize(weight, scale, fmt,
                      mxfp4=lambda w, sc: formats.unpack_mxfp4(w, sc).float())


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, *, fmt: str) -> Tensor:
    """``y = x @ Wᵀ`` in fp32, cast to x.dtype.

    x: [..., I]; weight: [O, I] (``dense``/``fp8_block``) or int8 [O, I/2] (``mxfp4``); scale as in
    :func:`dequantize_weight`. Returns [..., O].
    """
    w = dequantize_weight(weight, scale, fmt)
    return (x.float() @ w.t()).to(x.dtype)


def grouped_linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, *, groups: int,
                   fmt: str) -> Tensor:
    """Block-diagonal grouped projection (spec §3.4.6, ``wo_a``).

    x: [T, G·I] (group g = columns g·I … g·I+I−1); weight: [G·O, I] (group g uses rows g·O …
    g·O+O−1; quantized layouts as in :func:`linear`, dequantized as one matrix).
    Returns [T, G·O] with ``y[:, gO:(g+1)O] = x[:, gI:(g+1)I] @ W_gᵀ`` (fp32 math, x.dtype).
    """
    w = dequantize_weight(weight, scale, fmt)
    go, i = w.shape
    if go % groups:
        raise ValueError(f"weight rows {go} not divisible by groups={groups}")
    o = go // groups
    if x.shape[-1] != groups * i:
        raise ValueError(f"x last dim {x.shape[-1]} != groups·I = {groups * i}")
    xg = x.float().reshape(*x.shape[:-1], groups, i)
    y = torch.einsum("...gi,goi->...go", xg, w.reshape(groups, o, i))
    return y.reshape(*x.shape[:-1], groups * o).to(x.dtype)
