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
