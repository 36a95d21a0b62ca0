"""DSpark block drafter ops (spec §3.9): target-feature capture, draft rows, non-causal block
attention over a draft context ring, and the Markov draft chain with confidence.

`stream_mean` and `concat` are generic glue the main step uses to build the target features
F(t); `draft_rows`, `block_attn` and `markov_draft` only appear in the draft graph
(models/dspark.py). Rows of a draft graph are laid out request-major: row r*B + i is block row i
of request r (B = block size), so the row dim is written `R*B`.
"""

from ..registry import REQUIRED, expect, op
from ..types import TensorType, scale_dim
from ._util import expect_mqa, is_float


@op("stream_mean", ("streams",), cost="memory")
def stream_mean(h: TensorType) -> TensorType:
    """Mean over the hc streams: out[t] = (1/n) sum_c streams[t, c] (fp32 accumulate, the streams'
    dtype out). The DSpark target feature of one layer, taken at the layer's input."""
    expect(h.rank == 3 and is_float(h), f"streams must be float [T, n, d], got {h}")
    return TensorType(h.dtype, (h.shape[0], h.shape[2]))


@op("concat", ("xs*",), cost="memory")
def concat(xs: tuple[TensorType, ...]) -> TensorType:
    """Concatenate along the last dim: out[..., o_k : o_k + d_k] = xs[k][...] with o_k the sum of
    the earlier widths (equal leading dims and dtypes, constant last dims)."""
    expect(len(xs) >= 1, "concat needs at least one input")
    first = xs[0]
    for x in xs:
        expect(x.dtype == first.dtype and x.shape[:-1] == first.shape[:-1],
               f"inputs must share dtype and leading dims, got {first} and {x}")
        expect(isinstance(x.shape[-1], int), f"concatenated dims must be constant, got {x}")
    return TensorType(first.dtype, (*first.shape[:-1], sum(x.shape[-1] for x in xs)))


@op("draft_rows", ("anchor_ids", "seq_cached"), ("token_ids", "positions", "token_req"),
    attrs={"block": REQUIRED, "noise_id": REQUIRED}, cost="memory")
def draft_rows(anchor: TensorType, cached: TensorType, *, block, noise_id):
    """Step metadata of the draft rows: request r gets `block` contiguous rows r*block + i with
    token anchor_ids[r] (i = 0) or noise_id (i > 0), position seq_cached[r] + i and request row r.
    (seq_cached = P+1 = the anchor's position: the draft rings hold positions <= P.)"""
    expect(anchor.dtype == "i64" and anchor.rank == 1, f"anchor_ids must be i64[R], got {anchor}")
    expect(cached == anchor, f"seq_cached must be {anchor}, got {cached}")
    expect(isinstance(block, int) and block >= 1, f"block must be a positive int, got {block!r}")
    rows = TensorType("i64", (scale_dim(anchor.shape[0], block),))
    return rows, rows, rows


@op("block_attn", ("q", "kv", "ring", "sink", "positions", "token_req", "seq_slots", "seq_cached"),
    attrs={"window": REQUIRED, "scale": REQUIRED}, cost="attention")
def block_attn(q, kv, ring, sink, pos, req, slots, cached, *, window, scale) -> TensorType:
    """Draft-block MQA (K = V) with an attention sink. Keys of every row of request r (slot s,
    c = seq_cached[r]): the ring rows of slot s holding positions c-window .. c-1 (those >= 0; all
    visible to every row, whatever its own position) plus ALL of this step's rows of request r
    (non-causal inside the block). softmax with exp(sink[h]) added to the denominator only; the
    output is not de-rotated."""
    d = expect_mqa(q, kv, ring, sink, pos, req, slots, window)
    expect(cached == slots, f"seq_cached must be {slots}, got {cached}")
    return q


@op("markov_draft", ("base_logits", "z", "anchor_ids", "embed", "head", "conf_w"),
    ("drafts", "confidence", "logits"), attrs={"block": REQUIRED}, cost="gemm")
def markov_draft(u, z, anchor, emb, head, conf_w, *, block):
    """The sequential rank-r Markov chain over each request's block rows i = 0..B-1 (B = block):
    prev_0 = anchor_ids[r]; mu_i = embed[prev_i]; logits_i = base_logits_i + head @ mu_i;
    d_{i+1} = argmax(logits_i) (lowest id on ties); prev_{i+1} = d_{i+1};
    confidence_i = sigmoid(conf_w @ [z_i ; mu_i]). fp32 math. Returns drafts i64[R, B],
    confidence f32[R, B] and the chain's logits f32[R*B, V] (row r*B + i)."""
    expect(anchor.dtype == "i64" and anchor.rank == 1, f"anchor_ids must be i64[R], got {anchor}")
    rows = scale_dim(anchor.shape[0], block)
    expect(u.dtype == "f32" and u.rank == 2 and u.shape[0] == rows,
           f"base_logits must be f32[{rows}, V], got {u}")
    v = u.shape[1]
    expect(z.rank == 2 and z.shape[0] == rows and is_float(z), f"z must be float [{rows}, d], got {z}")
    expect(emb.rank == 2 and emb.shape[0] == v and is_float(emb), f"embed must be [{v}, rank], got {emb}")
    expect(head.shape == emb.shape and is_float(head), f"head must be {emb.shape}, got {head}")
    width = z.shape[1] + emb.shape[1] if isinstance(z.shape[1], int) else None
    expect(conf_w.shape == (1, width) and is_float(conf_w), f"conf_w must be [1, {width}], got {conf_w}")
    r = anchor.shape[0]
    return (TensorType("i64", (r, block)), TensorType("f32", (r, block)), TensorType("f32", (rows, v)))
