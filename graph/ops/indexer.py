"""The lightning indexer: scores over compressed index keys, candidate blocks, top-k selection."""

from ..registry import REQUIRED, expect, op
from ..types import TensorType
from ._util import expect_meta, expect_rows


@op("index_scores", ("qi", "w", "ikey", "positions", "token_req", "seq_slots"),
    attrs={"ratio": REQUIRED, "weight_scale": REQUIRED, "products": "fp32"}, cost="attention")
def index_scores(qi, w, ikey, pos, req, slots, *, ratio, weight_scale, products) -> TensorType:
    """S[t, j] = sum_h w[t, h] * weight_scale * relu(qi[t, h] . ikey[j]) for visible entries
    (j < (p+1)//ratio), -inf otherwise. `products="bf16"` (set by the indexer-products pass) says
    qi and ikey hold values exact in bf16, so the products may be taken in bf16 with the same
    result as fp32 (fp32 sums)."""
    expect(products in ("fp32", "bf16"), f"products must be fp32 or bf16, got {products!r}")
    expect_meta(pos, req, slots)
    expect(qi.rank == 3, f"qi must be [T, Hi, Di], got {qi}")
    expect_rows(qi, pos, "qi")
    expect(w.shape == qi.shape[:2], f"w must be [T, {qi.shape[1]}], got {w}")
    expect(ikey.rank == 3 and ikey.shape[2] == qi.shape[2], f"ikey must be [S, C, {qi.shape[2]}], got {ikey}")
    return TensorType("f32", (qi.shape[0], ikey.shape[1]))


@op("published_scores", ("scores", "published", "positions", "token_req", "seq_cached"),
    attrs={"ratio": REQUIRED, "published_ratio": REQUIRED}, cost="memory")
def published_scores(scores, published, pos, req, cached, *, ratio, published_ratio) -> TensorType:
    """The vendor index-key reading (docs/index-key-reading.md): a row of a request that had cached
    tokens before the step (c > 0), at a position p where its KV owner leaves a group open
    ((p+1) % ratio != 0), takes `published`: the same queries' scores against the index-key pool
    published last (a ratio-`published_ratio` layer's, as the step found it), restricted to the
    entries published before the step (j < c // published_ratio); every other row keeps the
    owner's `scores`. Columns past the owner's are dropped (never visible to it)."""
    for name, t in (("scores", scores), ("published", published)):
        expect(t.dtype == "f32" and t.rank == 2, f"{name} must be f32[T, C], got {t}")
    expect(published.shape[0] == scores.shape[0], f"published must have {scores.shape[0]} rows, got {published}")
    expect(pos.dtype == "i64" and pos.rank == 1, f"positions must be i64[T], got {pos}")
    expect(req.shape == pos.shape, f"token_req must be {pos}, got {req}")
    expect(cached.dtype == "i64" and cached.rank == 1, f"seq_cached must be i64[R], got {cached}")
    expect_rows(scores, pos, "scores")
    expect(isinstance(ratio, int) and ratio >= 1 and isinstance(published_ratio, int) and published_ratio >= 1,
           f"ratio and published_ratio must be ints >= 1, got {ratio!r} / {published_ratio!r}")
    return scores


@op("candidate_mask", ("scores",), attrs={"block": REQUIRED, "topk_blocks": REQUIRED}, cost="memory")
def candidate_mask(scores, *, block, topk_blocks) -> TensorType:
    """Two-level selection (V4.1 layer 20): keep the top blocks of `block` entries by max score
    (the newest visible block always kept), as a per-entry mask."""
    expect(scores.dtype == "f32" and scores.rank == 2, f"scores must be f32[T, C], got {scores}")
    return TensorType("bool", scores.shape)


@op("topk_select", ("scores", "mask?"), attrs={"k": REQUIRED}, cost="memory")
def topk_select(scores, mask, *, k) -> TensorType:
    """Indices of the k best visible entries (inside mask), ascending, -1 where fewer exist."""
    expect(scores.dtype == "f32" and scores.rank == 2, f"scores must be f32[T, C], got {scores}")
    if mask is not None:
        expect(mask.shape == scores.shape and mask.dtype == "bool", f"mask must be bool{list(scores.shape)}, got {mask}")
    return TensorType("i64", (scores.shape[0], k))
