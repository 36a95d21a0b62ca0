"""Activation quantization on the GPU (Triton): kernels.fused.reference.quantize_act in one launch
(and kernels.dense.quant.fake_quant, the quantize-dequantize of the KV / index-key rows, below).

The capturable version is a chain of ~10 torch kernels per call (abs, amax, frexp, scale, divide,
clamp, cast, concatenations); on the H200's 5-layer slice the per-node split (an eager step,
launch gaps included) gave quantize_act 7.8 ms of a 69 ms decode step at 256 requests and 0.42 s
of a 7 s prefill step at 64K tokens (benchmarks/results/h200-decode.md, h200-prefill.md). Here each program reads NB blocks of one row
once and writes their E4M3 codes and scales: one pass over the activation, bitwise the reference
(power-of-two scales from the f32 bits, multiplication by the exact inverse, round-to-nearest-even
E4M3 after the +-448 clamp). For finite inputs: a block holding inf or NaN gets other scale bytes
than the reference's (whose frexp maps inf to exponent 0); its codes are garbage either way.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.attention.triton import ACT_BLOCKS
from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device

BLOCKS_PER_PROGRAM = 8


def quantize_act(x: Tensor, *, act_fmt: str) -> tuple[Tensor, Tensor]:
    block = ACT_BLOCKS[act_fmt]
    d = x.shape[-1]
    if not (available() and _on_device(x)) or x.numel() == 0 or block & (block - 1):
        from megagraph.kernels.fused.capturable import quantize_act as fallback

        return fallback(x, act_fmt=act_fmt)
    import triton

    from megagraph.kernels.dense.triton_quant_jit import quantize_act_fwd

    lead = x.shape[:-1]
    rows = x.reshape(-1, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, d)
    nblk = -(-d // block)
    q = torch.empty(rows.shape[0], d, dtype=torch.float8_e4m3fn, device=x.device)
    mx = act_fmt == "mxfp8"
    s = torch.empty(rows.shape[0], nblk, dtype=torch.uint8 if mx else torch.float32, device=x.device)
    nb = min(BLOCKS_PER_PROGRAM, triton.next_power_of_2(nblk))
    quantize_act_fwd[(rows.shape[0], triton.cdiv(nblk, nb))](
        rows, q, s, d, nblk, rows.stride(0), q.stride(0), s.stride(0),
        BLOCK=block, NB=nb, E8M0=mx, num_warps=1 if INTERPRET else 4)
    s = s.view(torch.float8_e8m0fnu) if mx else s
    return q.reshape(*lead, d), s.reshape(*lead, nblk)


quantize_act.capturable = True


FAKE_QUANT_FMTS = {"fp8_e4m3": 1, "mxfp4": 2, "nvfp4": 3}
FQ_TILE_ELEMS = 4096  # channels one fake_quant program holds (rows x blocks x block)


def fake_quant(x: Tensor, *, fmt: str, block: int) -> Tensor:
    """kernels.dense.capturable.fake_quant (quantize -> dequantize per `block` channels of the
    last axis; the activation fake quantization of the KV / index-key rows) in one pass per row:
    the capturable version is a chain of ~10 torch kernels (the H200 slice's eager decode step
    spent 6.7% in them). Bitwise the reference for finite inputs: power-of-two scales from the
    correctly rounded quotient's f32 bits, codes rounded to the E4M3 / E2M1 grids in f32 (ties to
    even, signs as bits), code * scale exact in f32 (and in bf16 / fp16 unless it under- or
    overflows there, rounded the same way as torch's cast then). Widths that are not a multiple of
    `block` go to the capturable version (which raises the reference's error), as do blocks that
    are not powers of two, unknown formats and other dtypes."""
    d = x.shape[-1] if x.dim() else 0
    code = FAKE_QUANT_FMTS.get(fmt)
    if (not (available() and _on_device(x)) or x.numel() == 0 or x.dim() == 0 or code is None
            or block < 1 or block & (block - 1) or d % block
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        from megagraph.kernels.dense.capturable import fake_quant as fallback

        return fallback(x, fmt=fmt, block=block)
    import triton

    from megagraph.kernels.dense.triton_quant_jit import fake_quant_fwd

    rows = x.reshape(-1, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, d)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n, nblk = rows.shape[0], d // block
    nb = min(triton.next_power_of_2(nblk), max(1, FQ_TILE_ELEMS // block))
    br = min(max(1, FQ_TILE_ELEMS // (nb * block)), triton.next_power_of_2(n))
    fake_quant_fwd[(triton.cdiv(n, br), triton.cdiv(nblk, nb))](
        rows, out, n, rows.stride(0), D=d, FMT=code, BLOCK=block, BR=br, NB=nb, MANUAL=INTERPRET,
        num_warps=1 if INTERPRET else 4, enable_fp_fusion=False)  # no a*b+c here; kept exact anyway
    return out.reshape(x.shape)


fake_quant.capturable = True
