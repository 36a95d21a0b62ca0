"""Attention over a sliding-window ring plus selected compressed entries, with an attention sink."""

from ..registry import REQUIRED, expect, op
from ..types import TensorType
from ._util import expect_meta, expect_mqa, expect_rows


@op("sparse_attn",
    ("q", "kv", "ring", "ckv?", "topk?", "sink", "positions", "token_req", "seq_slots", "seq_cached"),
    attrs={"window": REQUIRED, "scale": REQUIRED, "ratio": 0, "attend_all_compressed": False},
    cost="attention")
def sparse_attn(q, kv, ring, ckv, topk, sink, pos, req, slots, cached, *, window, scale, ratio,
                attend_all_compressed) -> TensorType:
    """MQA (K = V = one latent) over window keys (ring rows of earlier steps + this step's rows of the
    same request within `window`) and the compressed entries listed in topk (or all visible ones),
    softmax with exp(sink[h]) added to the denominator only."""
    d = expect_mqa(q, kv, ring, sink, pos, req, slots, window)
    if ratio:
        expect(ckv is not None and ckv.rank == 3 and ckv.shape[2] == d, f"ckv must be [S, C, {d}], got {ckv}")
        expect(topk is not None or attend_all_compressed, "compressed attention needs topk or attend_all_compressed")
    if topk is not None:
        expect(topk.dtype == "i64" and topk.rank == 2 and topk.shape[0] == q.shape[0], f"topk must be i64[T, K], got {topk}")
    return q


@op("ring_update", ("ring", "kv", "positions", "token_req", "seq_slots"),
    attrs={"window": REQUIRED}, cost="memory")
def ring_update(ring, kv, pos, req, slots, *, window) -> TensorType:
    """Write each new row at ring row position % window of its request's slot."""
    expect_meta(pos, req, slots)
    expect(ring.rank == 3 and ring.shape[1] == window and ring.shape[2] == kv.shape[-1],
           f"ring must be [S, {window}, {kv.shape[-1]}], got {ring}")
    return ring


@op("compress_pool",
    ("kv_proj", "gate_proj", "pend_kv", "pend_gate", "positions", "token_req", "seq_slots"),
    ("latent", "pend_kv", "pend_gate"), attrs={"ratio": REQUIRED}, cost="memory")
def compress_pool(kv, gate, pend_kv, pend_gate, pos, req, slots, *, ratio):
    """Non-overlapping group pooling: at a token that completes a group of `ratio` tokens, the
    channel-wise softmax(gate)-weighted sum of the group's kv rows (rows of incomplete groups wait
    in the pending state; other output rows are zero)."""
    expect_meta(pos, req, slots)
    expect(kv.dtype == "f32" and kv.rank == 2, f"kv_proj must be f32[T, D], got {kv}")
    expect(gate == kv, f"gate_proj must equal kv_proj's type {kv}, got {gate}")
    expect(pend_kv.rank == 3 and pend_kv.shape[1:] == (ratio, kv.shape[1]),
           f"pend_kv must be f32[S, {ratio}, {kv.shape[1]}], got {pend_kv}")
    expect(pend_gate == pend_kv, f"pend_gate must equal pend_kv's type, got {pend_gate}")
    return kv, pend_kv, pend_gate


@op("cache_write", ("cache", "rows", "positions", "token_req", "seq_slots"),
    attrs={"ratio": REQUIRED}, cost="memory")
def cache_write(cache, rows, pos, req, slots, *, ratio) -> TensorType:
    """Store the row of every token that completes a group ((p+1) % ratio == 0) at entry
    (p+1)//ratio - 1 of its request's slot, converted to the cache's dtype (round to nearest even;
    exact for fake-quantized rows in a narrower cache that holds the format, e.g. V4.1's MXFP4
    index keys in a bf16 ikey cache)."""
    expect_meta(pos, req, slots)
    expect(cache.rank == 3 and cache.shape[2] == rows.shape[-1], f"cache must be [S, C, {rows.shape[-1]}], got {cache}")
    expect_rows(rows, pos, "rows")
    return cache
