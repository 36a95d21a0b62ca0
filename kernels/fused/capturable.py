"""Capturable versions of the pass-created ops (graph/ops/fused.py), composed from the capturable
kernels in the order kernels/fused/reference.py composes the reference ones. The only new numerics
are quantize_act / dequant_act, which here avoid formats.f32_to_e8m0's host-side validity check."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.graph.interp import TORCH_DTYPES

from megagraph.kernels.common.capturable import I64, e8m0_ceil_div, e8m0_to_f32, seg_counts
from megagraph.kernels.attention.capturable import ring_update, sparse_attn
from megagraph.kernels.state.capturable import cache_write, compress_pool, v4_compress_pool
from megagraph.kernels.dense.capturable import add, fake_quant, grouped_linear, hc_collapse, hc_expand, hc_mixer, linear, rms_norm, rope
from megagraph.kernels.moe.capturable import hash_route, moe_experts, route, swiglu_mlp

FP8_MAX = 448.0
ACT_BLOCKS = {"mxfp8": 32, "fp8_1x128": 128}
_FQ_BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8_e4m3": 32}


def _blocks(x: Tensor, block: int) -> tuple[Tensor, int]:
    d = x.shape[-1]
    nb = -(-d // block)
    xf = torch.nn.functional.pad(x.float(), (0, nb * block - d))
    return xf.reshape(*x.shape[:-1], nb, block), d


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
    qb, d = _blocks(q.float(), ACT_BLOCKS[act_fmt])
    return (qb * sf[..., None]).reshape(*q.shape[:-1], qb.shape[-2] * qb.shape[-1])[..., :d]


def linear_q(x_q, x_scale, weight, scale=None, *, fmt, act_fmt, out_dtype):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    return linear(x, weight, scale, fmt=fmt).to(TORCH_DTYPES[out_dtype])


def grouped_linear_q(x_q, x_scale, weight, scale=None, *, groups, fmt, act_fmt, out_dtype):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    return grouped_linear(x, weight, scale, groups=groups, fmt=fmt).to(TORCH_DTYPES[out_dtype])


def moe_experts_q(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt,
                  swiglu_limit, act_fmt, out_dtype):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    y = moe_experts(x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt,
                    swiglu_limit=swiglu_limit)
    return y.to(TORCH_DTYPES[out_dtype])


def swiglu_mlp_q(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt, swiglu_limit,
                 act_fmt, out_dtype):
    x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
    y = swiglu_mlp(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt, swiglu_limit=swiglu_limit)
    return y.to(TORCH_DTYPES[out_dtype])


def sparse_attn_q(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached, *,
                  window, scale, ratio, attend_all_compressed, rope_dim, theta, yarn_factor,
                  yarn_original, yarn_beta_fast, yarn_beta_slow, act_fmt):
    o = sparse_attn(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                    window=window, scale=scale, ratio=ratio,
                    attend_all_compressed=attend_all_compressed)
    o = rope(o, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
             yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
             yarn_beta_slow=yarn_beta_slow, inverse=True)
    return quantize_act(o.reshape(o.shape[0], -1), act_fmt=act_fmt)


def mega_mhc(streams, fn, base, scale, mix, norm_weight, *, eps, hc_eps, sinkhorn_iters, norm_eps,
             act_fmt):
    pre, post, comb = hc_mixer(streams, fn, base, scale, eps=eps, hc_eps=hc_eps,
                               sinkhorn_iters=sinkhorn_iters)
    x = hc_collapse(streams, pre if mix is None else mix)
    x = rms_norm(x, norm_weight, eps=norm_eps)
    x_q, x_scale = quantize_act(x, act_fmt=act_fmt)
    return x, x_q, x_scale, pre, post, comb


def _ir_dtype(dt: torch.dtype) -> str:
    return next(k for k, v in TORCH_DTYPES.items() if v == dt and k != "fp4x2")


def mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3, w3_scale,
             w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale, tid2eid=None,
             token_ids=None, *, topk, route_scale, norm_topk, score_func, fmt, shared_fmt,
             swiglu_limit, act_fmt):
    """kernels.fused.reference.mega_moe: route (or, on hash-routed layers, hash_route by the
    token ids) -> routed experts + shared expert -> hc_expand."""
    if tid2eid is not None:
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
               yarn_original, yarn_beta_fast, yarn_beta_slow, offset, ikey_fmt, ckv_fmt,
               inplace: bool = False):
    rope_kw = dict(rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                   yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                   yarn_beta_slow=yarn_beta_slow, offset=offset)
    meta = (positions, token_req, seq_slots)
    x32 = x.float()
    latent = linear(x32, wkv, None, fmt="dense")
    if ratio > 1:
        gate = linear(x32, wgate, None, fmt="dense")
        latent, pend_kv, pend_gate = compress_pool(latent, gate, pend_kv, pend_gate, *meta, ratio=ratio,
                                                   inplace=inplace)
    latent = rms_norm(latent, norm_weight, eps=eps)
    ik = rms_norm(linear(latent, wk, None, fmt="dense"), k_norm_weight, eps=eps)
    ik = rope(ik, positions, **rope_kw)
    if ikey_fmt != "none":
        ik = fake_quant(ik, fmt=ikey_fmt, block=_FQ_BLOCK[ikey_fmt])
    ikey = cache_write(ikey, ik, *meta, ratio=ratio, inplace=inplace)
    c = rope(latent, positions, **rope_kw)
    if ckv_fmt != "none":
        c = fake_quant(c, fmt=ckv_fmt, block=_FQ_BLOCK[ckv_fmt])
    ckv = cache_write(ckv, c.to(ckv.dtype), *meta, ratio=ratio, inplace=inplace)
    return (ikey, ckv, pend_kv, pend_gate) if ratio > 1 else (ikey, ckv)


def v4_compressor(x, wkv, wgate, ape, pend_kv, pend_gate, norm_weight, cache, positions, token_req,
                  seq_slots, *, ratio, overlap, eps, rope_dim, theta, yarn_factor, yarn_original,
                  yarn_beta_fast, yarn_beta_slow, offset, inplace: bool = False):
    x32 = x.float()
    kv, gate = linear(x32, wkv, None, fmt="dense"), linear(x32, wgate, None, fmt="dense")
    meta = (positions, token_req, seq_slots)
    latent, pend_kv, pend_gate = v4_compress_pool(kv, gate, ape, pend_kv, pend_gate, *meta,
                                                  ratio=ratio, overlap=overlap, inplace=inplace)
    latent = rms_norm(latent, norm_weight, eps=eps)
    rows = rope(latent, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                yarn_beta_slow=yarn_beta_slow, offset=offset)
    return cache_write(cache, rows.to(cache.dtype), *meta, ratio=ratio, inplace=inplace), pend_kv, pend_gate


def suffix_meta(keep_rows, positions, token_req, seq_new, *, keep):
    req = token_req.index_select(0, keep_rows)
    new = seg_counts(req, seq_new.shape[0]).to(seq_new.dtype)
    return positions.index_select(0, keep_rows), req, new


__all__ = ["quantize_act", "dequant_act", "linear_q", "grouped_linear_q", "moe_experts_q",
           "swiglu_mlp_q", "sparse_attn_q", "mega_mhc", "mega_moe", "compressor", "v4_compressor",
           "suffix_meta",
           "ring_update", "I64"]
