"""Lightning indexer without host syncs: scores over request-aligned query tiles (one gather of the
slot's index keys per tile, chunked over tiles and over the compressed axis), the two-level
candidate mask and top-k selection (already sync-free in the reference; same algorithm here)."""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common
from ._common import I64, chunk_ranges, request_tiles, scatter_rows


def index_scores(qi: Tensor, w: Tensor, ikey: Tensor, positions: Tensor, token_req: Tensor,
                 seq_slots: Tensor, *, ratio: int, weight_scale: float) -> Tensor:
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


def candidate_mask(scores: Tensor, *, block: int, topk_blocks: int) -> Tensor:
    T, C = scores.shape
    nb = -(-C // block)
    vis = scores > float("-inf")
    sp = torch.nn.functional.pad(scores.float(), (0, nb * block - C), value=float("-inf"))
    bscore = sp.reshape(T, nb, block).amax(dim=-1)
    n_vis = vis.sum(dim=-1)
    newest = ((n_vis - 1).clamp(min=0) // block)[:, None]
    force = torch.zeros(T, nb, dtype=torch.bool, device=scores.device)
    force = force.scatter(1, newest, (n_vis > 0)[:, None])
    bscore = torch.where(force, float("inf"), bscore)
    kb = min(topk_blocks, nb)
    keep = torch.zeros(T, nb, dtype=torch.bool, device=scores.device)
    if kb > 0:
        vals, idx = bscore.topk(kb, dim=-1)
        keep = keep.scatter(1, idx, vals > float("-inf"))
    keep = keep[:, :, None].expand(T, nb, block).reshape(T, nb * block)[:, :C]
    return keep & vis


def topk_select(scores: Tensor, mask: Tensor | None = None, *, k: int) -> Tensor:
    T, C = scores.shape
    s = scores.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    kk = min(k, C)
    if kk == 0:
        return torch.full((T, k), -1, dtype=I64, device=scores.device)
    vals, idx = s.topk(kk, dim=-1)
    big = torch.iinfo(I64).max
    idx = torch.where(vals > float("-inf"), idx, big).sort(dim=-1).values
    idx = torch.where(idx == big, -1, idx)
    if kk < k:
        idx = torch.cat([idx, torch.full((T, k - kk), -1, dtype=I64, device=scores.device)], dim=1)
    return idx


__all__ = ["index_scores", "candidate_mask", "topk_select"]
