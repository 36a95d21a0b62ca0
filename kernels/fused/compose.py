"""The pass-created ops (graph/ops/fused.py) as one composition over a table of unfused kernels.

A fused op runs the kernels of the ops it replaced, in the order the unfused graph runs them, so
a structural fusion is bit-exact against the graph it replaced under any table: the reference
table gives kernels/fused/reference.py, the capturable one kernels/fused/capturable.py. Writing
the chain once keeps the two from drifting apart; a table differs only in its kernels (and in
`quantize_act` / `dequant_act`, the one new numerics, which each table brings itself).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from megagraph.graph.types import TORCH_DTYPES

# activation quantization (quantize_act / dequant_act): the E4M3 range, the block of each format
FP8_MAX = 448.0
ACT_BLOCKS = {"mxfp8": 32, "fp8_1x128": 128}
# fake-quant block of each cache format the compressor writes
FQ_BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8_e4m3": 32}
# the unfused kernels a composition needs from its table
NEEDS = ("linear", "grouped_linear", "moe_experts", "swiglu_mlp", "sparse_attn", "rope",
         "hc_mixer", "hc_collapse", "hc_expand", "rms_norm", "route", "hash_route", "add",
         "compress_pool", "v4_compress_pool", "cache_write", "fake_quant", "quantize_act",
         "dequant_act")
# the fused ops a composition returns, in the order a table module binds them
COMPOSED = ("linear_q", "grouped_linear_q", "moe_experts_q", "swiglu_mlp_q", "sparse_attn_q",
            "mega_mhc", "mega_moe", "compressor", "v4_compressor")


def act_blocks(x: Tensor, block: int) -> tuple[Tensor, int]:
    """x [..., D] -> (f32 [..., ceil(D/block), block], zero-padded, D)."""
    d = x.shape[-1]
    nb = -(-d // block)
    xf = torch.nn.functional.pad(x.float(), (0, nb * block - d))
    return xf.reshape(*x.shape[:-1], nb, block), d


def ir_dtype(dt: torch.dtype) -> str:
    """The IR dtype name of a torch dtype (int8 is i8, never the packed fp4x2)."""
    return next(k for k, v in TORCH_DTYPES.items() if v == dt and k != "fp4x2")


def table_from(ns: Mapping[str, Callable], **overrides: Callable) -> dict[str, Callable]:
    """The NEEDS kernels of namespace `ns` (a kernel table module's globals), `overrides` in place
    of the ones that module imports only on first use."""
    return {n: overrides[n] if n in overrides else ns[n] for n in NEEDS}


def compose(k: Mapping[str, Callable]) -> dict[str, Callable]:
    """The fused ops over table `k` (op name -> kernel, holding every name in NEEDS). State
    kernels of `k` take `inplace=True` where the table writes state in place (the capturable
    one); the composed compressors pass it on only when asked, so a table without it works."""
    missing = [n for n in NEEDS if n not in k]
    if missing:
        raise KeyError(f"fused composition: the table lacks {', '.join(missing)}")
    linear, rope, rms_norm, cache_write = k["linear"], k["rope"], k["rms_norm"], k["cache_write"]
    quantize_act, dequant_act = k["quantize_act"], k["dequant_act"]

    def linear_q(x_q, x_scale, weight, scale=None, *, fmt, act_fmt, out_dtype):
        """dequant_act -> linear -> cast."""
        x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
        return linear(x, weight, scale, fmt=fmt).to(TORCH_DTYPES[out_dtype])

    def grouped_linear_q(x_q, x_scale, weight, scale=None, *, groups, fmt, act_fmt, out_dtype):
        """dequant_act -> grouped_linear -> cast."""
        x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
        y = k["grouped_linear"](x, weight, scale, groups=groups, fmt=fmt)
        return y.to(TORCH_DTYPES[out_dtype])

    def moe_experts_q(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, *,
                      fmt, swiglu_limit, act_fmt, out_dtype, h_fmt=None):
        """dequant_act -> moe_experts -> cast (`h_fmt`: the reference's quantized hidden, for
        kernel tests; passed on only when set)."""
        x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
        hk = {} if h_fmt is None else {"h_fmt": h_fmt}
        y = k["moe_experts"](x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt,
                             swiglu_limit=swiglu_limit, **hk)
        return y.to(TORCH_DTYPES[out_dtype])

    def swiglu_mlp_q(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt,
                     swiglu_limit, act_fmt, out_dtype, h_fmt=None):
        """dequant_act -> swiglu_mlp -> cast."""
        x = dequant_act(x_q, x_scale, act_fmt=act_fmt)
        hk = {} if h_fmt is None else {"h_fmt": h_fmt}
        y = k["swiglu_mlp"](x, w1, w1_scale, w3, w3_scale, w2, w2_scale, fmt=fmt,
                            swiglu_limit=swiglu_limit, **hk)
        return y.to(TORCH_DTYPES[out_dtype])

    def sparse_attn_q(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                      *, window, scale, ratio, attend_all_compressed, rope_dim, theta,
                      yarn_factor, yarn_original, yarn_beta_fast, yarn_beta_slow, act_fmt):
        """sparse_attn -> rope(inverse) -> merge_heads -> quantize_act."""
        o = k["sparse_attn"](q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots,
                             seq_cached, window=window, scale=scale, ratio=ratio,
                             attend_all_compressed=attend_all_compressed)
        o = rope(o, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                 yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                 yarn_beta_slow=yarn_beta_slow, inverse=True)
        return quantize_act(o.reshape(o.shape[0], -1), act_fmt=act_fmt)

    def mega_mhc(streams, fn, base, scale, mix, norm_weight, *, eps, hc_eps, sinkhorn_iters,
                 norm_eps, act_fmt):
        """hc_mixer -> hc_collapse(mix, or this site's pre) -> rms_norm -> quantize_act."""
        pre, post, comb = k["hc_mixer"](streams, fn, base, scale, eps=eps, hc_eps=hc_eps,
                                        sinkhorn_iters=sinkhorn_iters)
        x = k["hc_collapse"](streams, pre if mix is None else mix)
        x = rms_norm(x, norm_weight, eps=norm_eps)
        x_q, x_scale = quantize_act(x, act_fmt=act_fmt)
        return x, x_q, x_scale, pre, post, comb

    def mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
                 w3_scale, w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                 tid2eid=None, token_ids=None, *, topk, route_scale, norm_topk, score_func, fmt,
                 shared_fmt, swiglu_limit, act_fmt):
        """route (or, on hash-routed layers, hash_route by the token ids) -> moe_experts_q
        (+ swiglu_mlp_q, add) -> hc_expand."""
        if tid2eid is not None:
            ids, wts = k["hash_route"](x, gate_w, tid2eid, token_ids, topk=topk,
                                       route_scale=route_scale, score_func=score_func,
                                       norm_topk=norm_topk)
        else:
            ids, wts = k["route"](x, gate_w, gate_bias, topk=topk, route_scale=route_scale,
                                  norm_topk=norm_topk, score_func=score_func)
        out_dtype = ir_dtype(x.dtype)
        y = moe_experts_q(x_q, x_scale, ids, wts, w1, w1_scale, w3, w3_scale, w2, w2_scale,
                          fmt=fmt, swiglu_limit=swiglu_limit, act_fmt=act_fmt,
                          out_dtype=out_dtype)
        if sw1 is not None:
            shared = swiglu_mlp_q(x_q, x_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                                  fmt=shared_fmt, swiglu_limit=swiglu_limit, act_fmt=act_fmt,
                                  out_dtype=out_dtype)
            y = k["add"](y, shared)
        return k["hc_expand"](streams, y, post, comb)

    def compressor(x, wkv, wgate, pend_kv, pend_gate, norm_weight, wk, k_norm_weight, ikey, ckv,
                   positions, token_req, seq_slots, *, ratio, eps, rope_dim, theta, yarn_factor,
                   yarn_original, yarn_beta_fast, yarn_beta_slow, offset, ikey_fmt, ckv_fmt,
                   inplace: bool = False):
        """cast -> linear(s) -> compress_pool -> rms_norm -> {index key, compressed KV} ->
        cache_write."""
        ip = {"inplace": True} if inplace else {}
        rope_kw = dict(rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                       yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                       yarn_beta_slow=yarn_beta_slow, offset=offset)
        meta = (positions, token_req, seq_slots)
        x32 = x.float()
        latent = linear(x32, wkv, None, fmt="dense")
        if ratio > 1:
            gate = linear(x32, wgate, None, fmt="dense")
            latent, pend_kv, pend_gate = k["compress_pool"](latent, gate, pend_kv, pend_gate,
                                                            *meta, ratio=ratio, **ip)
        latent = rms_norm(latent, norm_weight, eps=eps)
        ik = rms_norm(linear(latent, wk, None, fmt="dense"), k_norm_weight, eps=eps)
        ik = rope(ik, positions, **rope_kw)
        if ikey_fmt != "none":
            ik = k["fake_quant"](ik, fmt=ikey_fmt, block=FQ_BLOCK[ikey_fmt])
        ikey = cache_write(ikey, ik, *meta, ratio=ratio, **ip)
        c = rope(latent, positions, **rope_kw)
        if ckv_fmt != "none":
            c = k["fake_quant"](c, fmt=ckv_fmt, block=FQ_BLOCK[ckv_fmt])
        ckv = cache_write(ckv, c.to(ckv.dtype), *meta, ratio=ratio, **ip)
        return (ikey, ckv, pend_kv, pend_gate) if ratio > 1 else (ikey, ckv)

    def v4_compressor(x, wkv, wgate, ape, pend_kv, pend_gate, norm_weight, cache, positions,
                      token_req, seq_slots, *, ratio, overlap, eps, rope_dim, theta, yarn_factor,
                      yarn_original, yarn_beta_fast, yarn_beta_slow, offset,
                      inplace: bool = False):
        """cast -> linear x2 -> v4_compress_pool -> rms_norm -> rope -> cache_write (V4)."""
        ip = {"inplace": True} if inplace else {}
        x32 = x.float()
        kv, gate = linear(x32, wkv, None, fmt="dense"), linear(x32, wgate, None, fmt="dense")
        meta = (positions, token_req, seq_slots)
        latent, pend_kv, pend_gate = k["v4_compress_pool"](kv, gate, ape, pend_kv, pend_gate,
                                                           *meta, ratio=ratio, overlap=overlap,
                                                           **ip)
        latent = rms_norm(latent, norm_weight, eps=eps)
        rows = rope(latent, positions, rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                    yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                    yarn_beta_slow=yarn_beta_slow, offset=offset)
        return (cache_write(cache, rows.to(cache.dtype), *meta, ratio=ratio, **ip), pend_kv,
                pend_gate)

    return {"quantize_act": quantize_act, "linear_q": linear_q,
            "grouped_linear_q": grouped_linear_q, "moe_experts_q": moe_experts_q,
            "swiglu_mlp_q": swiglu_mlp_q, "sparse_attn_q": sparse_attn_q, "mega_mhc": mega_mhc,
            "mega_moe": mega_moe, "compressor": compressor, "v4_compressor": v4_compressor}
