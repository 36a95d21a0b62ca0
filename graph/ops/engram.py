"""Engram: n-gram hash memory read and gated write into every residual stream."""

from ..registry import REQUIRED, expect, op
from ..types import FLOAT_DTYPES, TensorType, scale_dim
from ._util import expect_meta


@op("token_map", ("token_ids", "table"), cost="memory")
def token_map(ids, table) -> TensorType:
    """Compressed token ids: out[t] = table[token_ids[t]] (tokenizer-derived class per token)."""
    expect(table.dtype == "i64" and table.rank == 1, f"table must be i64[V], got {table}")
    return TensorType("i64", ids.shape)


@op("engram_hash", ("cids", "hist", "positions", "token_req", "seq_slots", "seq_cached"),
    attrs={"multipliers": REQUIRED, "primes": REQUIRED, "offsets": REQUIRED, "pad_id": REQUIRED,
           "max_ngram": REQUIRED}, cost="memory")
def engram_hash(cids, hist, pos, req, slots, cached, *, multipliers, primes, offsets, pad_id,
                max_ngram) -> TensorType:
    """Row ids of the 2..max_ngram-grams ending at each token: XOR of cid * multiplier, mod a prime
    per (order, head), plus the column's table offset."""
    expect_meta(pos, req, slots)
    expect(hist.dtype == "i64" and hist.rank == 2 and hist.shape[1] == max_ngram - 1,
           f"hist must be i64[S, {max_ngram - 1}], got {hist}")
    cols = len(offsets)
    expect(len(multipliers) == max_ngram and len(primes) == max_ngram - 1 and
           sum(len(p) for p in primes) == cols, "multipliers/primes/offsets do not match max_ngram")
    return TensorType("i64", (cids.shape[0], cols))


@op("engram_hist_update", ("hist", "cids", "positions", "token_req", "seq_slots", "seq_cached", "seq_new"),
    cost="memory")
def engram_hist_update(hist, cids, pos, req, slots, cached, new) -> TensorType:
    """Keep the last max_ngram-1 compressed ids of each request for the next step."""
    expect_meta(pos, req, slots)
    return hist


@op("engram_lookup", ("table", "scale?", "ids"), attrs={"out_dtype": "bf16"}, cost="memory",
    capture="break: Engram tables are host-resident (memory-mapped, ~98 GB each); rows are gathered on the CPU")
def engram_lookup(table, scale, ids, *, out_dtype) -> TensorType:
    """Gather and dequantize the rows of every column's id, flattened: [T, cols * W] in `out_dtype`
    (the activation dtype; bf16 by default, the release's). Dequantized FP8 rows (E4M3 times a
    power-of-two scale) are exact in bf16 and f32 alike, so the dtype only decides what the rows
    feed: an f32 graph's wkv GEMM must get f32 rows, or its output is bf16 too."""
    expect(table.rank == 2 and ids.rank == 2 and ids.dtype == "i64", f"bad table/ids {table} / {ids}")
    expect(out_dtype in FLOAT_DTYPES, f"out_dtype must be one of {sorted(FLOAT_DTYPES)}, got {out_dtype!r}")
    if scale is not None:
        expect(scale.dtype == "e8m0" and scale.shape == (table.shape[0], scale_dim(table.shape[1], 1, 32)),
               f"scale must be e8m0[rows, W/32], got {scale}")
    return TensorType(out_dtype, (ids.shape[0], scale_dim(table.shape[1], ids.shape[1])))


@op("engram_gate", ("streams", "kv", "q_weight", "k_weight"), attrs={"eps": REQUIRED}, cost="memory")
def engram_gate(h, kv, qw, kw, *, eps) -> TensorType:
    """Per stream c: gate = sigmoid(signed_sqrt(<H_c * q_c * k_c, K_c> / rms / sqrt(d))),
    H_c += gate * value; keys K (n*d) come first in kv, the value (d) last."""
    expect(h.rank == 3, f"streams must be [T, n, d], got {h}")
    t, n, d = h.shape
    expect(kv.shape == (t, scale_dim(d, n + 1)), f"kv must be [T, {n + 1}*{d}], got {kv}")
    expect(qw.shape == (n, d) and kw.shape == (n, d), f"q/k weights must be [{n}, {d}], got {qw} / {kw}")
    return h
