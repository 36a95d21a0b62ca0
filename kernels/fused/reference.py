"""Reference kernels of the ops passes create (graph/ops/fused.py).

Fused ops compose the existing reference functions in the order the unfused graph runs them
(kernels/fused/compose.py, shared with the capturable table), so a structural fusion is bit-exact
against the graph it replaced. The only new numerics are the activation quantizers
(`quantize_act`) and the GEMMs that dequantize their input (`*_q`).

Error bound of `quantize_act` (tested in tests/passes/test_quantize_epilogues.py): per element,
|x - dequant(q, s)| <= 2^-4 |x| + 2^-10 s, with s the block's scale (E4M3 keeps 3 mantissa bits:
half an ulp is 2^-4 relative for normal values, and the subnormal step is 2^-9 s). A GEMM on the
dequantized input therefore differs from the unquantized one by at most
sum_k |W_jk| (2^-4 |x_k| + 2^-10 s_k) plus fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.attention.reference import ring_update, sparse_attn
from megagraph.kernels.dense.elementwise import add
from megagraph.kernels.dense.norm import rms_norm
from megagraph.kernels.dense.quant import fake_quant
from megagraph.kernels.dense.rope import rope
from megagraph.kernels.gemm.reference import grouped_linear, linear
from megagraph.kernels.mhc.reference import hc_collapse, hc_expand, hc_mixer
from megagraph.kernels.moe.reference import moe_experts, route, swiglu_mlp
from megagraph.kernels.state.reference import cache_write, compress_pool

from .compose import ACT_BLOCKS, COMPOSED, FP8_MAX, act_blocks, compose, table_from

def quantize_act(x: Tensor, *, act_fmt: str) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (q float8_e4m3fn [..., D], scales [..., ceil(D/b)]): e8m0 for mxfp8 (b=32),
    power-of-two f32 for fp8_1x128 (b=128). scale = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    from megagraph.kernels import formats

    xb, d = act_blocks(x, ACT_BLOCKS[act_fmt])
    amax = xb.abs().amax(dim=-1).clamp(min=1e-4)
    e8 = formats.f32_to_e8m0(amax / FP8_MAX, rounding="ceil")
    s = formats.e8m0_to_f32(e8)
    q = (xb / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*x.shape[:-1], xb.shape[-2] * xb.shape[-1])[..., :d].contiguous()
    return q, (e8 if act_fmt == "mxfp8" else s)


def dequant_act(q: Tensor, s: Tensor, *, act_fmt: str) -> Tensor:
    """(q, scales) of :func:`quantize_act` -> f32 [..., D]."""
    from megagraph.kernels import formats

    sf = formats.e8m0_to_f32(s) if s.dtype == torch.float8_e8m0fnu else s.float()
    qb, d = act_blocks(q.float(), ACT_BLOCKS[act_fmt])
    return (qb * sf[..., None]).reshape(*q.shape[:-1], qb.shape[-2] * qb.shape[-1])[..., :d]


def ring_update_batched(positions, token_req, seq_slots, *operands, window):
    """ring_update for every (ring, kv) pair, in order."""
    return tuple(ring_update(r, kv, positions, token_req, seq_slots, window=window)
                 for r, kv in zip(operands[0::2], operands[1::2]))


def select_rows(x: Tensor, rows: Tensor) -> Tensor:
    return x.index_select(0, rows)


def suffix_meta(keep_rows, positions, token_req, seq_new, *, keep):
    req = token_req.index_select(0, keep_rows)
    new = torch.bincount(req, minlength=seq_new.shape[0]).to(seq_new.dtype)
    return positions.index_select(0, keep_rows), req, new


def fill(x: Tensor, *, value) -> Tensor:
    return torch.full_like(x, value)


def _hash_route(*args, **attrs):
    from megagraph.kernels.v4.reference import hash_route

    return hash_route(*args, **attrs)


def _v4_compress_pool(*args, **attrs):
    from megagraph.kernels.v4.reference import v4_compress_pool

    return v4_compress_pool(*args, **attrs)


# kernels/v4/reference.py is imported on first use (it imports the MoE reference kernels)
_COMPOSED = compose(table_from(globals(), hash_route=_hash_route,
                                  v4_compress_pool=_v4_compress_pool))
(linear_q, grouped_linear_q, moe_experts_q, swiglu_mlp_q, sparse_attn_q, mega_mhc, mega_moe,
 compressor, v4_compressor) = (_COMPOSED[n] for n in COMPOSED)

FUSED = {**_COMPOSED, "ring_update_batched": ring_update_batched, "select_rows": select_rows,
         "suffix_meta": suffix_meta, "fill": fill}
