"""Ops that only compiler passes create (never model descriptions): quantize epilogues and the
GEMMs that consume them, the Mega-mHC / MegaMoE pair, the fused compressor, the batched ring copy,
and the row selection of bounded-suffix replay graphs.

Each fused op's reference kernel (kernels/fused/reference.py) composes the reference kernels of
the ops listed in `fused_from`, so structural fusions are bit-exact against the unfused graph.
"""

from ..registry import REQUIRED, expect, op
from ..types import TensorType, scale_dim
from ._util import expect_meta, expect_rows, is_float
from .core import _check_scale, _weight_in_features
from .moe import SCORE_FUNCS, _expert_bank

# activation formats a quantize epilogue can produce: name -> (block, scale dtype)
ACT_FORMATS = {
    "mxfp8": (32, "e8m0"),  # OCP MX: E4M3 values, one E8M0 scale per 32 (Blackwell tensor cores)
    "fp8_1x128": (128, "f32"),  # E4M3 values, one power-of-two f32 scale per 128 (Hopper, DeepGEMM)
}


def act_scale_type(x: TensorType, act_fmt: str) -> TensorType:
    """Type of the scales of x quantized as act_fmt (a ragged last block gets its own scale)."""
    expect(act_fmt in ACT_FORMATS, f"act_fmt must be one of {sorted(ACT_FORMATS)}, got {act_fmt!r}")
    block, sdt = ACT_FORMATS[act_fmt]
    d = x.shape[-1]
    expect(isinstance(d, int), f"the quantized dim must be constant, got {x}")
    if act_fmt == "mxfp8":
        expect(d % block == 0, f"mxfp8 needs the last dim to be a multiple of 32, got {x}")
    return TensorType(sdt, (*x.shape[:-1], -(-d // block)))


def _expect_q(xq: TensorType, xs: TensorType, act_fmt: str) -> None:
    expect(xq.dtype == "fp8e4m3", f"x_q must be fp8e4m3, got {xq}")
    expect(xs == act_scale_type(xq, act_fmt), f"x_scale must be {act_scale_type(xq, act_fmt)}, got {xs}")


# -- quantize epilogues and their consumers -------------------------------------------------------
@op("quantize_act", ("x",), ("q", "scale"), attrs={"act_fmt": REQUIRED}, cost="memory")
def quantize_act(x, *, act_fmt):
    """Quantize activations along the last dim to E4M3 with one power-of-two scale per block
    (mxfp8: 32 elements, e8m0 scales; fp8_1x128: 128 elements, f32 scales): scale =
    2^ceil(log2(max(amax, 1e-4) / 448)), q = rne_e4m3(x / scale)."""
    expect(is_float(x), f"x must be float, got {x}")
    return x.with_dtype("fp8e4m3"), act_scale_type(x, act_fmt)


@op("linear_q", ("x_q", "x_scale", "weight", "scale?"),
    attrs={"fmt": "dense", "act_fmt": REQUIRED, "out_dtype": REQUIRED}, cost="gemm",
    fused_from=("linear",))
def linear_q(xq, xs, w, scale, *, fmt, act_fmt, out_dtype) -> TensorType:
    """linear on a quantized activation: y = dequant(x_q, x_scale) @ dequant(weight)^T (fp32
    accumulate, out_dtype out)."""
    _expect_q(xq, xs, act_fmt)
    i = _weight_in_features(w, fmt)
    _check_scale(w, scale, fmt)
    expect(xq.shape[-1] == i, f"x's last dim {xq.shape[-1]} != weight's in-features {i}")
    return TensorType(out_dtype, (*xq.shape[:-1], w.shape[0]))


@op("grouped_linear_q", ("x_q", "x_scale", "weight", "scale?"),
    attrs={"groups": REQUIRED, "fmt": "dense", "act_fmt": REQUIRED, "out_dtype": REQUIRED},
    cost="gemm", fused_from=("grouped_linear",))
def grouped_linear_q(xq, xs, w, scale, *, groups, fmt, act_fmt, out_dtype) -> TensorType:
    """grouped_linear on a quantized activation (block-diagonal, G groups)."""
    _expect_q(xq, xs, act_fmt)
    i = _weight_in_features(w, fmt)
    _check_scale(w, scale, fmt)
    expect(xq.rank == 2 and xq.shape[1] == scale_dim(i, groups), f"x must be [T, {groups}*{i}], got {xq}")
    return TensorType(out_dtype, (xq.shape[0], w.shape[0]))


@op("moe_experts_q",
    ("x_q", "x_scale", "ids", "weights", "w1", "w1_scale?", "w3", "w3_scale?", "w2", "w2_scale?"),
    attrs={"fmt": "dense", "swiglu_limit": 0.0, "act_fmt": REQUIRED, "out_dtype": REQUIRED},
    cost="gemm", fused_from=("moe_experts",))
def moe_experts_q(xq, xs, ids, weights, w1, s1, w3, s3, w2, s2, *, fmt, swiglu_limit, act_fmt,
                  out_dtype) -> TensorType:
    """moe_experts on a quantized activation (the L1 GEMMs read x_q/x_scale; the SwiGLU output
    feeding L2 stays fp32 in the reference)."""
    _expect_q(xq, xs, act_fmt)
    expect(xq.rank == 2 and ids.shape == weights.shape and ids.shape[0] == xq.shape[0],
           f"ids/weights must be [T, k], got {ids} / {weights}")
    _expert_bank(w1, s1, w3, s3, w2, s2, fmt, xq.shape[1], stacked=True)
    return xq.with_dtype(out_dtype)


@op("swiglu_mlp_q", ("x_q", "x_scale", "w1", "w1_scale?", "w3", "w3_scale?", "w2", "w2_scale?"),
    attrs={"fmt": "dense", "swiglu_limit": 0.0, "act_fmt": REQUIRED, "out_dtype": REQUIRED},
    cost="gemm", fused_from=("swiglu_mlp",))
def swiglu_mlp_q(xq, xs, w1, s1, w3, s3, w2, s2, *, fmt, swiglu_limit, act_fmt, out_dtype):
    """swiglu_mlp (the shared expert) on a quantized activation."""
    _expect_q(xq, xs, act_fmt)
    _expert_bank(w1, s1, w3, s3, w2, s2, fmt, xq.shape[-1], stacked=False)
    return xq.with_dtype(out_dtype)


@op("sparse_attn_q",
    ("q", "kv", "ring", "ckv?", "topk?", "sink", "positions", "token_req", "seq_slots", "seq_cached"),
    ("o_q", "o_scale"),
    attrs={"window": REQUIRED, "scale": REQUIRED, "ratio": 0, "attend_all_compressed": False,
           "rope_dim": REQUIRED, "theta": REQUIRED, "yarn_factor": 1.0, "yarn_original": 0,
           "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "act_fmt": REQUIRED},
    cost="attention", fused_from=("sparse_attn", "rope", "merge_heads", "quantize_act"))
def sparse_attn_q(q, kv, ring, ckv, topk, sink, pos, req, slots, cached, *, window, scale, ratio,
                  attend_all_compressed, rope_dim, theta, yarn_factor, yarn_original,
                  yarn_beta_fast, yarn_beta_slow, act_fmt):
    """sparse_attn with its epilogue: inverse RoPE of the output, head merge and quantization to
    act_fmt, so attention writes the grouped output projection's low-precision input directly.
    Returns o_q [T, H*D] fp8e4m3 and its scales."""
    from .attention import sparse_attn

    o = sparse_attn(q, kv, ring, ckv, topk, sink, pos, req, slots, cached, window=window,
                    scale=scale, ratio=ratio, attend_all_compressed=attend_all_compressed)
    flat = TensorType(o.dtype, (o.shape[0], scale_dim(o.shape[2], o.shape[1])))
    return flat.with_dtype("fp8e4m3"), act_scale_type(flat, act_fmt)


# -- Mega-mHC -> MegaMoE -------------------------------------------------------------------------
@op("mega_mhc", ("streams", "fn", "base", "scale", "mix?", "norm_weight?"),
    ("x", "x_q", "x_scale", "pre", "post", "comb"),
    attrs={"eps": REQUIRED, "hc_eps": REQUIRED, "sinkhorn_iters": REQUIRED, "norm_eps": REQUIRED,
           "act_fmt": REQUIRED}, cost="gemm",
    fused_from=("hc_mixer", "hc_collapse", "rms_norm", "quantize_act"))
def mega_mhc(h, fn, base, scale, mix, w, *, eps, hc_eps, sinkhorn_iters, norm_eps, act_fmt):
    """The FFN site's mHC front half in one kernel: mixer (projection + Sinkhorn) -> pre, post,
    comb; collapse of the streams with `mix` (the carried pre of the previous site; absent = this
    site's own pre); RMSNorm; quantization for the expert GEMMs. x (act dtype) crosses only for
    the router GEMM; the experts read x_q/x_scale; pre goes to the next layer, post/comb to
    mega_moe's residual expand."""
    from .mhc import hc_collapse, hc_mixer

    pre, post, comb = hc_mixer(h, fn, base, scale, eps=eps, hc_eps=hc_eps,
                               sinkhorn_iters=sinkhorn_iters)
    if mix is not None:
        expect(mix == pre, f"mix must be {pre}, got {mix}")
    x = hc_collapse(h, pre)
    if w is not None:
        expect(w.shape == x.shape[-1:], f"norm_weight must be [{x.shape[-1]}], got {w}")
    return x, x.with_dtype("fp8e4m3"), act_scale_type(x, act_fmt), pre, post, comb


@op("mega_moe",
    ("x", "x_q", "x_scale", "streams", "post", "comb", "gate_w", "gate_bias?",
     "w1", "w1_scale?", "w3", "w3_scale?", "w2", "w2_scale?",
     "sw1?", "sw1_scale?", "sw3?", "sw3_scale?", "sw2?", "sw2_scale?", "tid2eid?", "token_ids?"),
    ("streams",),
    attrs={"topk": REQUIRED, "route_scale": REQUIRED, "norm_topk": True,
           "score_func": "sqrtsoftplus", "fmt": "dense", "shared_fmt": "dense",
           "swiglu_limit": 0.0, "act_fmt": REQUIRED}, cost="gemm",
    fused_from=("route", "moe_experts_q", "swiglu_mlp_q", "add", "hc_expand"))
def mega_moe(x, xq, xs, h, post, comb, gate_w, bias, w1, s1, w3, s3, w2, s2, sw1, ss1, sw3, ss3,
             sw2, ss2, tid2eid, token_ids, *, topk, route_scale, norm_topk, score_func, fmt,
             shared_fmt, swiglu_limit, act_fmt) -> TensorType:
    """The whole MoE of one FFN site plus its residual expand: router (gate GEMM on x, top-k; or,
    with tid2eid/token_ids, V4's hash routing: experts from the table, weights from the gate),
    dispatch, expert GEMMs on x_q/x_scale, SwiGLU, combine, shared expert, and
    streams' = post * y + comb^T streams. Only the new streams leave it."""
    expect(score_func in SCORE_FUNCS, f"score_func must be one of {SCORE_FUNCS}")
    expect((tid2eid is None) == (token_ids is None), "hash routing needs both tid2eid and token_ids")
    if tid2eid is not None:
        expect(bias is None, "hash routing takes no selection bias")
        expect(tid2eid.rank == 2 and tid2eid.shape[1] == topk and token_ids.shape == x.shape[:1],
               f"tid2eid must be [V, {topk}] and token_ids [T], got {tid2eid} / {token_ids}")
    _expect_q(xq, xs, act_fmt)
    expect(x.shape == xq.shape, f"x and x_q must have one shape, got {x} / {xq}")
    expect(gate_w.rank == 2 and gate_w.shape[1] == x.shape[-1],
           f"gate_w must be [E, {x.shape[-1]}], got {gate_w}")
    _expert_bank(w1, s1, w3, s3, w2, s2, fmt, x.shape[1], stacked=True)
    if sw1 is not None:
        _expert_bank(sw1, ss1, sw3, ss3, sw2, ss2, shared_fmt, x.shape[1], stacked=False)
    expect(h.rank == 3 and h.shape[0] == x.shape[0] and h.shape[2] == x.shape[1] and h.dtype == x.dtype,
           f"streams must be {x.dtype}[T, n, {x.shape[1]}], got {h}")
    expect(post.shape == h.shape[:2] and comb.shape == (*h.shape[:2], h.shape[1]),
           f"post/comb must be [T, n] / [T, n, n], got {post} / {comb}")
    return h


# -- fused compressor and batched window copies ------------------------------------------------
@op("compressor",
    ("x", "wkv", "wgate?", "pend_kv?", "pend_gate?", "norm_weight", "wk", "k_norm_weight",
     "ikey", "ckv", "positions", "token_req", "seq_slots"),
    ("caches*",),
    attrs={"ratio": REQUIRED, "eps": REQUIRED, "rope_dim": REQUIRED, "theta": REQUIRED,
           "yarn_factor": 1.0, "yarn_original": 0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
           "offset": 0, "ikey_fmt": "none", "ckv_fmt": "none"},
    cost="memory",
    fused_from=("cast", "linear", "compress_pool", "rms_norm", "rope", "fake_quant", "cache_write"))
def compressor(x, wkv, wgate, pend_kv, pend_gate, norm_w, wk, knorm_w, ikey, ckv, pos, req, slots,
               *, ratio, eps, rope_dim, theta, yarn_factor, yarn_original, yarn_beta_fast,
               yarn_beta_slow, offset, ikey_fmt, ckv_fmt):
    """A KV source's whole compressor in one op: kv/gate projections (fp32), softmax-gated pooling
    of `ratio` tokens (pending rows of incomplete groups in state), norm, then the index key
    (wk, k_norm, RoPE, ikey_fmt fake-quant) and the compressed KV row (RoPE, ckv_fmt fake-quant),
    each written into its cache at the group's entry, converted to the cache's dtype after the
    fake-quant (V4.1's bf16 ikey cache holds MXFP4 keys exactly). Returns (ikey', ckv'[, pend_kv',
    pend_gate'])."""
    expect_meta(pos, req, slots)
    expect_rows(x, pos, "x")
    expect(wkv.rank == 2 and wkv.shape[1] == x.shape[-1], f"wkv must be [Dc, {x.shape[-1]}], got {wkv}")
    dc = wkv.shape[0]
    for fmt_name, f in (("ikey_fmt", ikey_fmt), ("ckv_fmt", ckv_fmt)):
        expect(f in ("none", "mxfp4", "nvfp4", "fp8_e4m3"), f"{fmt_name} {f!r} is not a fake_quant fmt")
    expect(norm_w.shape == (dc,), f"norm_weight must be [{dc}], got {norm_w}")
    expect(wk.rank == 2 and wk.shape[1] == dc, f"wk must be [Di, {dc}], got {wk}")
    expect(knorm_w.shape == wk.shape[:1], f"k_norm_weight must be [{wk.shape[0]}], got {knorm_w}")
    expect(ikey.rank == 3 and ikey.shape[2] == wk.shape[0], f"ikey must be [S, C, {wk.shape[0]}], got {ikey}")
    expect(ckv.rank == 3 and ckv.shape[2] == dc, f"ckv must be [S, C, {dc}], got {ckv}")
    if ratio > 1:
        expect(wgate == wkv and pend_kv is not None and pend_gate == pend_kv,
               "ratio > 1 needs wgate (like wkv) and pend_kv / pend_gate state")
        expect(pend_kv.shape[1:] == (ratio, dc), f"pend_kv must be f32[S, {ratio}, {dc}], got {pend_kv}")
        return ikey, ckv, pend_kv, pend_gate
    expect(wgate is None and pend_kv is None and pend_gate is None, "ratio 1 takes no gate or pending state")
    return ikey, ckv


@op("ring_update_batched", ("positions", "token_req", "seq_slots", "operands*"), ("rings*",),
    attrs={"window": REQUIRED}, cost="memory", fused_from=("ring_update",))
def ring_update_batched(pos, req, slots, operands, *, window):
    """Every sliding-window ring update of the step in one batched copy: operands are
    (ring_0, kv_0, ring_1, kv_1, ...); returns the new rings in that order."""
    expect_meta(pos, req, slots)
    expect(len(operands) >= 2 and len(operands) % 2 == 0,
           f"need (ring, kv) pairs, got {len(operands)} operands")
    rings = operands[0::2]
    for ring, kv in zip(rings, operands[1::2]):
        expect(ring.rank == 3 and ring.shape[1] == window and ring.shape[2] == kv.shape[-1],
               f"ring must be [S, {window}, {kv.shape[-1]}], got {ring}")
        expect_rows(kv, pos, "kv")
    return tuple(rings)


# -- bounded-suffix replay -----------------------------------------------------------------------
@op("select_rows", ("x", "rows"), cost="memory")
def select_rows(x, rows) -> TensorType:
    """Gather rows: out[k] = x[rows[k]] ([T, ...] -> [K, ...]); rows come from the runtime (each
    request's last `keep` rows, requests contiguous)."""
    expect(rows.dtype == "i64" and rows.rank == 1, f"rows must be i64[K], got {rows}")
    expect(x.rank >= 1, f"x must have a row dim, got {x}")
    return TensorType(x.dtype, (rows.shape[0], *x.shape[1:]))


@op("suffix_meta", ("keep_rows", "positions", "token_req", "seq_new"),
    ("positions", "token_req", "seq_new"), attrs={"keep": REQUIRED}, cost="memory")
def suffix_meta(rows, pos, req, new, *, keep):
    """Step metadata of the kept rows: their positions and request rows, and each request's kept
    count min(seq_new, keep). seq_slots / seq_cached stay those of the full step."""
    expect(rows.dtype == "i64" and rows.rank == 1, f"keep_rows must be i64[K], got {rows}")
    expect(pos.dtype == "i64" and req == pos, f"positions/token_req must be i64[T], got {pos} / {req}")
    expect(new.dtype == "i64" and new.rank == 1, f"seq_new must be i64[R], got {new}")
    k = TensorType("i64", rows.shape)
    return k, k, new


@op("fill", ("x",), attrs={"value": REQUIRED}, cost="memory")
def fill(x, *, value) -> TensorType:
    """A tensor of x's type filled with `value` (encoder replay: an all-invalid ring view)."""
    return x


@op("v4_compressor",
    ("x", "wkv", "wgate", "ape", "pend_kv", "pend_gate", "norm_weight", "cache", "positions",
     "token_req", "seq_slots"),
    ("cache", "pend_kv", "pend_gate"),
    attrs={"ratio": REQUIRED, "overlap": REQUIRED, "eps": REQUIRED, "rope_dim": REQUIRED,
           "theta": REQUIRED, "yarn_factor": 1.0, "yarn_original": 0, "yarn_beta_fast": 32.0,
           "yarn_beta_slow": 1.0, "offset": 0},
    cost="memory",
    fused_from=("cast", "linear", "v4_compress_pool", "rms_norm", "rope", "cache_write"))
def v4_compressor(x, wkv, wgate, ape, pend_kv, pend_gate, norm_w, cache, pos, req, slots, *, ratio,
                  overlap, eps, rope_dim, theta, yarn_factor, yarn_original, yarn_beta_fast,
                  yarn_beta_slow, offset):
    """One V4 compressor (CSA overlapping ratio 4 or HCA ratio 128, for the compressed KV or the
    index keys) in one op: fp32 kv/gate projections, APE-biased gated pooling with the pending ring,
    norm, RoPE at the group's first position, cache write. Returns (cache', pend_kv', pend_gate')."""
    from .v4 import v4_compress_pool

    expect_rows(x, pos, "x")
    expect(wkv.rank == 2 and wkv.shape[1] == x.shape[-1] and wgate == wkv,
           f"wkv/wgate must be [c*D, {x.shape[-1]}], got {wkv} / {wgate}")
    proj = TensorType("f32", (x.shape[0], wkv.shape[0]))
    latent, pk, pg = v4_compress_pool(proj, proj, ape, pend_kv, pend_gate, pos, req, slots,
                                      ratio=ratio, overlap=overlap)
    expect(norm_w.shape == latent.shape[1:], f"norm_weight must be [{latent.shape[1]}], got {norm_w}")
    expect(cache.rank == 3 and cache.shape[2] == latent.shape[1],
           f"cache must be [S, C, {latent.shape[1]}], got {cache}")
    return cache, pk, pg
