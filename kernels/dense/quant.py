"""Activation fake-quantization (quantize → dequantize) along the last axis (spec §3.4.1, §3.4.3)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0


def ceil_log2_div(y: Tensor, c: float) -> Tensor:
    """``ceil(log2(y / c))`` (int32) for positive finite fp32 y and a constant c > 0, from y's
    frexp alone: no division, so every compiler gets the same exponent. (torch.compile's Triton
    code divides with div.full, approximate, on CUDA: a quotient one ulp above an exact power of
    two doubles the scale; quant_jit.ceil_log2_div uses div_rn for the same reason.)

    With c = mc·2^ec and y = m·2^e (mc, m in [0.5, 1)): y/c = (m/mc)·2^(e-ec), where m/mc lies in
    (1/2, 1] for m <= mc and in (1, 2) for m > mc. For normal quotients this equals the frexp of
    the correctly rounded y / c (m > mc by one ulp puts the quotient more than half an ulp above 1
    whenever mc < 1): tests/kernels/dense/test_reference_quant.py checks it against the division."""
    mc, ec = math.frexp(c)
    m, e = torch.frexp(y)
    return e - ec + (m > mc).to(e.dtype)


def _pow2_ceil_div(y: Tensor, c: float) -> Tensor:
    """Exact ``2^ceil(log2(y / c))`` for positive finite fp32 y (no log, no division)."""
    return torch.ldexp(torch.ones_like(y), ceil_log2_div(y, c))


def round_e2m1(v: Tensor) -> Tensor:
    """Round fp32 values to the E2M1 grid {0, ±.5, ±1, ±1.5, ±2, ±3, ±4, ±6}: nearest, ties to even
    code, saturating at ±6."""
    from megagraph.kernels import formats  # lazy: written in parallel by a colleague

    v = v.clamp(-E2M1_MAX, E2M1_MAX)
    return formats.e2m1_to_f32(formats.f32_to_e2m1_codes(v, ties="even")).float()


def fake_quant(x: Tensor, *, fmt: str, block: int) -> Tensor:
    """Quantize-dequantize x (see :func:`fake_quant_with`)."""
    return fake_quant_with(x, fmt=fmt, block=block, round_e2m1=round_e2m1)


def fake_quant_with(x: Tensor, *, fmt: str, block: int, round_e2m1=round_e2m1) -> Tensor:
    """Quantize-dequantize x [..., D] in blocks of ``block`` channels of the last axis (D % block == 0).

    * ``fp8_e4m3``: scale = 2^ceil(log2(amax/448)) (UE8M0), amax floored at 1e-4; values rounded to
      E4M3 (nearest-even).
    * ``mxfp4``: scale = 2^ceil(log2(amax/6)) (UE8M0), amax floored at 1e-4; values rounded to E2M1
      (nearest, ties-to-even).
    * ``nvfp4``: scale = E4M3(amax/6) (nearest-even), amax floored at 6·2⁻⁹, no global scale; values
      E2M1(x/scale).
    Result = q · scale, fp32 math, returned in x.dtype. `round_e2m1` is the E2M1 rounding used
    (kernels/capturable passes a device-table version so the op stays host-sync free).
    """
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"last dim {d} not divisible by block {block}")
    xb = x.float().reshape(*x.shape[:-1], d // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp8_e4m3":
        scale = _pow2_ceil_div(amax.clamp(min=1e-4), FP8_E4M3_MAX)
        q = (xb / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    elif fmt == "mxfp4":
        scale = _pow2_ceil_div(amax.clamp(min=1e-4), E2M1_MAX)
        q = round_e2m1(xb / scale)
    elif fmt == "nvfp4":
        s = (amax.clamp(min=E2M1_MAX * 2.0**-9) / E2M1_MAX).clamp(max=FP8_E4M3_MAX)
        scale = s.to(torch.float8_e4m3fn).float()
        q = round_e2m1(xb / scale)
    else:
        raise ValueError(f"unknown fake-quant format {fmt!r}")
    return (q * scale).reshape(x.shape).to(x.dtype)
