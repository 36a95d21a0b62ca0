"""Ops only DeepSeek-V4(-Flash) needs: overlapping compressor pooling with APE, hash routing, and
the final hc_head collapse weights (semantics: docs/transformers-v4.md §4, §8)."""

from ..registry import REQUIRED, expect, op
from ..types import TensorType, scale_dim
from ._util import expect_meta


@op("v4_compress_pool",
    ("kv_proj", "gate_proj", "ape", "pend_kv", "pend_gate", "positions", "token_req", "seq_slots"),
    ("latent", "pend_kv", "pend_gate"), attrs={"ratio": REQUIRED, "overlap": REQUIRED}, cost="memory")
def v4_compress_pool(kv, gate, ape, pend_kv, pend_gate, pos, req, slots, *, ratio, overlap):
    """Gated pooling with a learned absolute-position bias on the gate logits. overlap (CSA, ratio 4):
    entry g pools the previous group's first half and its own group's second half of the 2D-wide
    projections (2r slots); otherwise (HCA, ratio 128) its own r tokens. Pending state = the slot's
    last c*ratio raw projections (a ring)."""
    expect_meta(pos, req, slots)
    c = 2 if overlap else 1
    expect(kv.dtype == "f32" and kv.rank == 2 and gate == kv, f"kv_proj/gate_proj must be f32[T, c*D], got {kv} / {gate}")
    expect(ape.shape == (ratio, kv.shape[1]), f"ape must be [{ratio}, {kv.shape[1]}], got {ape}")
    expect(pend_kv.rank == 3 and pend_kv.shape[1:] == (c * ratio, kv.shape[1]) and pend_gate == pend_kv,
           f"pend_kv/pend_gate must be f32[S, {c * ratio}, {kv.shape[1]}], got {pend_kv} / {pend_gate}")
    return TensorType("f32", (kv.shape[0], scale_dim(kv.shape[1], 1, c))), pend_kv, pend_gate


@op("hash_route", ("x", "gate_w", "tid2eid", "token_ids"), ("ids", "weights"),
    attrs={"topk": REQUIRED, "route_scale": REQUIRED, "score_func": "sqrtsoftplus", "norm_topk": True},
    cost="gemm")
def hash_route(x, gate_w, tid2eid, ids, *, topk, route_scale, score_func, norm_topk):
    """Hash-routed MoE: experts = tid2eid[token_id] (a fixed table), weights = router scores of those
    experts, normalized, times route_scale."""
    expect(tid2eid.rank == 2 and tid2eid.shape[1] == topk and tid2eid.dtype in ("i32", "i64"),
           f"tid2eid must be i64[V, {topk}], got {tid2eid}")
    expect(gate_w.rank == 2 and gate_w.shape[1] == x.shape[-1], f"gate_w must be [E, {x.shape[-1]}], got {gate_w}")
    return TensorType("i64", (x.shape[0], topk)), TensorType("f32", (x.shape[0], topk))


@op("hc_head_mix", ("streams", "fn", "base", "scale"), attrs={"eps": REQUIRED, "hc_eps": REQUIRED},
    cost="gemm")
def hc_head_mix(h, fn, base, scale, *, eps, hc_eps) -> TensorType:
    """Final collapse weights of standard mHC: sigmoid(scale * (fn . rms(flat streams)) + base) + eps."""
    expect(h.rank == 3, f"streams must be [T, n, d], got {h}")
    n = h.shape[1]
    expect(fn.shape == (n, scale_dim(h.shape[2], n)) and base.shape == (n,) and scale.shape == (1,),
           f"hc_head weights must be [{n}, {n}*d], [{n}], [1]; got {fn}, {base}, {scale}")
    return TensorType("f32", (h.shape[0], n))
