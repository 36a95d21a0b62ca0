"""Reference kernels of the ops passes create (graph/ops/fused.py).

Fused ops compose the existing reference functions in the order the unfused graph runs them, so a
structural fusion is bit-exact against the graph it replaced. The only new numerics are the
activation quantizers (`quantize_act`) and the GEMMs that dequantize their input (`*_q`).

Error bound of `quantize_act` (tested in tests/passes/test_quantize_epilogues.py): per element,
|x - dequant(q, s)| <= 2^-4 |x| + 2^-10 s, with s the block's scale (E4M3 keeps 3 mantissa bits:
half an ulp is 2^-4 relative for normal values, and the subnormal step is 2^-9 s). A GEMM on the
dequantized input therefore differs from the unquantized one by at most
sum_k |W_jk| (2^-4 |x_k| + 2^-10 s_k) plus fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagraph.graph.interp import TORCH_DTYPES

from megagraph.kernels.attention.reference import ring_update, sparse_attn
from megagraph.kernels.state.reference import cache_write, compress_pool
from megagraph.kernels.dense.elementwise import add
from megagraph.kernels.gemm.reference import grouped_linear, linear
from megagraph.kernels.mhc.reference import hc_collapse, hc_expand, hc_mixer
from megagraph.kernels.moe.reference import moe_experts, route, swiglu_mlp
from megagraph.kernels.dense.norm import rms_norm
from megagraph.kernels.dense.quant import fake_quant
from megagraph.kernels.dense.rope import rope

FP8_MAX = 448.0
ACT_BLOCKS = {"mxfp8": 32, "fp8_1x128": 128}


def _blocks(x: Tensor, block: int) -> tuple[Tensor, int]:
    d = x.shape[-1]
    nb = -(-d // block)
    xf = torch.nn.functional.pad(x.float(), (0, nb * block - d))
    return xf.reshape(*x.shape[:-1], nb, block), d


def quantize_act(x: Tensor, *, act_fmt: str) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (q float8_e4m3fn [..., D], scales [..., ceil(D/b)]): e8m0 for mxfp8 (b=32),
    power-of-two f32 for fp8_1x128 (b=128). scale = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    from megagraph.kernels import formats

    xb, d = _blocks(x, ACT_BLOCKS[act_fmt])
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
    qb, d = _blocks(q.float(), ACT_BLOCKS[act_fmt])
    return (qb * sf[..., None]).reshape(*q.shape[:-1], qb.shape[-2] * qb.shape[-1])[..., :d]


def linear_q(x_q, x_scale, weight, scale=None, *, fmt, act_fmt, out_dtype):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    return linear(x, weight, scale, fmt=fmt).to(TORCH_DTYPES[out_dtype])


def grouped_linear_q(x_q, x_scale, weight, scale=None, *, groups, fmt, act_fmt, out_dtype):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    return grouped_linear(x, weight, scale, groups=groups, fmt=fmt).to(TORCH_DTYPES[out_dtype])


def moe_experts_q(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt,
                  swiglu_limit, act_fmt, out_dtype, h_fmt=None):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    y = moe_experts(x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt,
                    swiglu_limit=swiglu_limit, h_fmt=h_fmt)
    return y.to(TORCH_DTYPES[out_dtype])


def swiglu_mlp_q(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt, swiglu_limit,
                 act_fmt, out_dtype, h_fmt=None):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    y = swiglu_mlp(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt, swiglu_limit=swiglu_limit,
                   h_fmt=h_fmt)
    return y.to(TORCH_DTYPES[out_dtype])


def sparse_attn_q(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached, *,
                  window, scale, ratio, attend_all_compressed, rope_dim, theta, yarn_factor,
                  yarn_original, yarn_beta_fast, yarn_beta_slow, act_fmt):
    """sparse_attn -> rope(inverse) -> merge_heads -> quantize_act."""
    o = sparse_attn(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                    window=window, scale=scale, ratio=ratio,
                    attend_all_compressed=attend_all_compressed)
    o = rope(o, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
             yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
             yarn_beta_slow=yarn_beta_slow, inverse=True)
    return quantize_act(o.reshape(o.shape[0], -1), act_fmt=act_fmt)


def mega_mhc(streams, fn, base, scale, mix, norm_weight, *, eps, hc_eps, sinkhorn_iters, norm_eps,
             act_fmt):
    """hc_mixer -> hc_collapse(mix, or this site's pre) -> rms_norm -> quantize_act."""
    pre, post, comb = hc_mixer(streams, fn, base, scale, eps=eps, hc_eps=hc_eps,
                               sinkhorn_iters=sinkhorn_iters)
    x = hc_collapse(streams, pre if mix is None else mix)
    x = rms_norm(x, norm_weight, eps=norm_eps)
    x_q, x_scale = quantize_act(x, act_fmt=act_fmt)
    return x, x_q, x_scale, pre, post, comb


def mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3, w3_scale,
             w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale, tid2eid=None,
             token_ids=None, *, topk, route_scale, norm_topk, score_func, fmt, shared_fmt,
             swiglu_limit, act_fmt):
    """route (or hash_route) -> moe_experts_q (+ swiglu_mlp_q, add) -> hc_expand."""
    if tid2eid is not None:
        from megagraph.kernels.v4.reference import hash_route

        ids, wts = hash_route(x, gate_w, tid2eid, token_ids, topk=topk, route_scale=route_scale,
                              score_func=score_func, norm_topk=norm_topk)
    else:
        ids, wts = route(x, gate_w, gate_bias, topk=topk, route_scale=route_scale,
                         norm_topk=norm_topk, score_func=score_func)
    out_dtype = _ir_dtype(x.dtype)
    y = moe_experts_q(x_q, x_scale, ids, wts, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt,
                      swiglu_limit=swiglu_limit, act_fmt=act_fmt, out_dtype=out_dtype)
    if sw1 is not None:
        shared = swiglu_mlp_q(x_q, x_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                              fmt=shared_fmt, swiglu_limit=swiglu_limit, act_fmt=act_fmt,
                              out_dtype=out_dtype)
        y = add(y, shared)
    return hc_expand(streams, y, post, comb)


def compressor(x, wkv, wgate, pend_kv, pend_gate, norm_weight, wk, k_norm_weight, ikey, ckv,
               positions, token_req, seq_slots, *, ratio, eps, rope_dim, theta, yarn_factor,
               yarn_original, yarn_beta_fast, yarn_beta_slow, offset, ikey_fmt, ckv_fmt):
    """cast -> linear(s) -> compress_pool -> rms_norm -> {index key, compressed KV} -> cache_write."""
    rope_kw = dict(rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                   yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                   yarn_beta_slow=yarn_beta_slow, offset=offset)
    meta = (positions, token_req, seq_slots)
    x32 = x.float()
    latent = linear(x32, wkv, None, fmt="dense")
    if ratio > 1:
        gate = linear(x32, wgate, None, fmt="dense")
        latent, pend_kv, pend_gate = compress_pool(latent, gate, pend_kv, pend_gate, *meta, ratio=ratio)
    latent = rms_norm(latent, norm_weight, eps=eps)
    ik = rms_norm(linear(latent, wk, None, fmt="dense"), k_norm_weight, eps=eps)
    ik = rope(ik, positions, **rope_kw)
    if ikey_fmt != "none":
        ik = fake_quant(ik, fmt=ikey_fmt, block=_FQ_BLOCK[ikey_fmt])
    ikey = cache_write(ikey, ik, *meta, ratio=ratio)
    c = rope(latent, positions, **rope_kw)
    if ckv_fmt != "none":
        c = fake_quant(c, fmt=ckv_fmt, block=_FQ_BLOCK[ckv_fmt])
    ckv = cache_write(ckv, c.to(ckv.dtype), *meta, ratio=ratio)
    return (ikey, ckv, pend_kv, pend_gate) if ratio > 1 else (ikey, ckv)


_FQ_BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8_e4m3": 32}


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


def _ir_dtype(dt: torch.dtype) -> str:
    return next(k for k, v in TORCH_DTYPES.items() if v == dt and k != "fp4x2")


FUSED = {
    "quantize_act": quantize_act, "linear_q": linear_q, "grouped_linear_q": grouped_linear_q,
    "moe_experts_q": moe_experts_q, "swiglu_mlp_q": swiglu_mlp_q, "sparse_attn_q": sparse_attn_q,
    "mega_mhc": mega_mhc, "mega_moe": mega_moe, "compressor": compressor,
    "ring_update_batched": ring_update_batched, "select_rows": select_rows,
    "suffix_meta": suffix_meta, "fill": fill,
}


def v4_compressor(x, wkv, wgate, ape, pend_kv, pend_gate, norm_weight, cache, positions, token_req,
                  seq_slots, *, ratio, overlap, eps, rope_dim, theta, yarn_factor, yarn_original,
                  yarn_beta_fast, yarn_beta_slow, offset):
    """cast -> linear x2 -> v4_compress_pool -> rms_norm -> rope -> cache_write (V4 chain)."""
    from megagraph.kernels.v4.reference import v4_compress_pool

    x32 = x.float()
    kv, gate = linear(x32, wkv, None, fmt="dense"), linear(x32, wgate, None, fmt="dense")
    meta = (positions, token_req, seq_slots)
    latent, pend_kv, pend_gate = v4_compress_pool(kv, gate, ape, pend_kv, pend_gate, *meta,
                                                  ratio=ratio, overlap=overlap)
    latent = rms_norm(latent, norm_weight, eps=eps)
    rows = rope(latent, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                yarn_beta_slow=yarn_beta_slow, offset=offset)
    return cache_write(cache, rows.to(cache.dtype), *meta, ratio=ratio), pend_kv, pend_gate


FUSED["v4_compressor"] = v4_compressor
