"""Capturable versions of the pass-created ops (graph/ops/fused.py): kernels/fused/compose.py over
the capturable kernels, the chain the reference table runs. The only new numerics are
quantize_act / dequant_act, which here avoid formats.f32_to_e8m0's host-side validity check."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.attention.capturable import ring_update, sparse_attn
from megagraph.kernels.common.capturable import I64, e8m0_ceil_div, e8m0_to_f32, seg_counts
from megagraph.kernels.dense.capturable import (add, fake_quant, grouped_linear, hc_collapse,
                                                hc_expand, hc_mixer, linear, rms_norm, rope)
from megagraph.kernels.moe.capturable import hash_route, moe_experts, route, swiglu_mlp
from megagraph.kernels.state.capturable import cache_write, compress_pool, v4_compress_pool

from .compose import ACT_BLOCKS, COMPOSED, FP8_MAX, act_blocks, compose, table_from

def _quantize_blocks(xb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """xb f32[..., nb, block] -> (E4M3 codes, e8m0 scales, f32 scales) with power-of-two scales."""
    amax = xb.abs().amax(dim=-1).clamp(min=1e-4)
    e8 = e8m0_ceil_div(amax, FP8_MAX)
    s = e8m0_to_f32(e8)
    return (xb / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), e8, s


def quantize_act(x: Tensor, *, act_fmt: str) -> tuple[Tensor, Tensor]:
    """Full blocks and a trailing partial block are quantized as two pieces rather than through a
    zero-padded copy: torch.compile (Inductor's CPU code, torch 2.13) miscompiles the fused
    pad -> scale -> E4M3 cast -> slice chain into NaN codes (tests/runtime/test_compile_parity.py
    compiles this op)."""
    block = ACT_BLOCKS[act_fmt]
    d = x.shape[-1]
    full = d // block * block
    xf = x.float()
    lead = x.shape[:-1]
    parts = []
    if full:
        parts.append(_quantize_blocks(xf[..., :full].reshape(*lead, full // block, block)))
    if d > full:
        parts.append(_quantize_blocks(xf[..., full:].reshape(*lead, 1, d - full)))
    q = torch.cat([p[0].reshape(*lead, p[0].shape[-2] * p[0].shape[-1]) for p in parts], dim=-1)
    e8 = torch.cat([p[1] for p in parts], dim=-1) if len(parts) > 1 else parts[0][1]
    s = torch.cat([p[2] for p in parts], dim=-1) if len(parts) > 1 else parts[0][2]
    return q, (e8 if act_fmt == "mxfp8" else s)


def dequant_act(q: Tensor, s: Tensor, *, act_fmt: str) -> Tensor:
    sf = e8m0_to_f32(s) if s.dtype == torch.float8_e8m0fnu else s.float()
    qb, d = act_blocks(q.float(), ACT_BLOCKS[act_fmt])
    return (qb * sf[..., None]).reshape(*q.shape[:-1], qb.shape[-2] * qb.shape[-1])[..., :d]


# the kernels imported above are the table, read from this module's names
_COMPOSED = compose(table_from(globals()))
(linear_q, grouped_linear_q, moe_experts_q, swiglu_mlp_q, sparse_attn_q, mega_mhc, mega_moe,
 compressor, v4_compressor) = (_COMPOSED[n] for n in COMPOSED)


def suffix_meta(keep_rows, positions, token_req, seq_new, *, keep):
    req = token_req.index_select(0, keep_rows)
    new = seg_counts(req, seq_new.shape[0]).to(seq_new.dtype)
    return positions.index_select(0, keep_rows), req, new


__all__ = ["quantize_act", "dequant_act", "linear_q", "grouped_linear_q", "moe_experts_q",
           "swiglu_mlp_q", "sparse_attn_q", "mega_mhc", "mega_moe", "compressor", "v4_compressor",
           "suffix_meta",
           "ring_update", "I64"]
