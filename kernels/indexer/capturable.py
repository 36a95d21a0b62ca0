"""Lightning indexer without host syncs: scores over request-aligned query tiles (one gather of the
slot's index keys per tile, chunked over tiles and over the compressed axis); the candidate mask,
top-k selection and the vendor reading's row choice are the reference's (already sync-free)."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.indexer.reference import candidate_mask, published_scores, topk_select
from megagraph.kernels.common import capturable as _common
from megagraph.kernels.common.capturable import I64, chunk_ranges, request_tiles, scatter_rows


def index_scores(qi: Tensor, w: Tensor, ikey: Tensor, positions: Tensor, token_req: Tensor,
                 seq_slots: Tensor, *, ratio: int, weight_scale: float,
                 products: str = "fp32") -> Tensor:
    """The reference's scores; fp32 products whatever `products` says (same result)."""
    T, Hi, Di = qi.shape
    C = ikey.shape[1]
    dev = qi.device
    out = torch.empty(T + 1, C, dtype=torch.float32, device=dev)
    if T == 0 or C == 0:
        return out[:T].fill_(float("-inf"))
    tiles = request_tiles(token_req, seq_slots.shape[0])
    B = tiles.tile
    # columns per chunk: one tile's [B, Hi, cc] dots and [cc, Di] keys fit the budget
    cc = max(1, min(C, _common.CHUNK_ELEMS // (B * Hi + Di)))
    col_chunks = [(c0, min(C, c0 + cc)) for c0 in range(0, C, cc)]
    for b0, b1 in chunk_ranges(tiles.count, (B * Hi + Di) * min(C, cc)):
        tok = tiles.items[b0:b1]  # [n, B]
        slot_b = seq_slots[tiles.seg[b0:b1]]
        qb = qi[tok].float()  # [n, B, Hi, Di]
        wb = w[tok].float() * weight_scale  # [n, B, Hi]
        vis = torch.div(positions[tok] + 1, ratio, rounding_mode="floor")  # [n, B]
        for c0, c1 in col_chunks:
            keys = ikey[slot_b, c0:c1].float()  # [n, cc, Di]
            dots = torch.relu(torch.einsum("nbhd,ncd->nbhc", qb, keys))
            sc = torch.einsum("nbh,nbhc->nbc", wb, dots)
            col = torch.arange(c0, c1, dtype=I64, device=dev)
            sc = torch.where(col[None, None, :] < vis[..., None], sc, float("-inf"))
            scatter_rows(out[:, c0:c1], tok, tiles.item_valid[b0:b1], sc)
    return out[:T]


__all__ = ["candidate_mask", "index_scores", "published_scores", "topk_select"]
