"""Lightning indexer: scores over compressed entries, two-level candidate blocks and top-k selection
(spec §3.4.4)."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.chunks import by_rows, row_slices
from megagraph.kernels.common.meta import live_requests


def index_scores(qi: Tensor, w: Tensor, ikey: Tensor, positions: Tensor, token_req: Tensor,
                 seq_slots: Tensor, *, ratio: int, weight_scale: float,
                 products: str = "fp32") -> Tensor:
    """Indexer scores f32[T, C].

    qi [T, Hi, Di]; w [T, Hi] (raw weights_proj output); ikey [S, C, Di] (index-key cache).
    ``S[t, j] = Σ_h (w[t,h]·weight_scale) · ReLU(qi[t,h]·ikey[slot, j])`` for visible j
    (j < (p+1)//ratio), −inf otherwise. fp32 math whatever `products` says (bf16 products of the
    values the indexer-products pass allows are exact, so the result is the same), in row chunks (the [rows, Hi, C] dot products
    are 66 GiB for 4K tokens x 64 heads x 66K entries at once).
    """
    T, Hi, _ = qi.shape
    C = ikey.shape[1]
    out = torch.full((T, C), float("-inf"), dtype=torch.float32, device=qi.device)
    for start, n, slot, _ in live_requests(token_req, seq_slots):
        keys = ikey[slot].float()  # [C, Di]
        for sl in row_slices(start, start + n, Hi * C):
            out[sl] = _index_rows(qi[sl], w[sl], keys, positions[sl], ratio, weight_scale)
    return out


def _index_rows(qi: Tensor, w: Tensor, keys: Tensor, positions: Tensor, ratio: int,
                weight_scale: float) -> Tensor:
    """index_scores of some rows of one request against its slot's keys f32[C, Di]."""
    C = keys.shape[0]
    dots = torch.einsum("nhd,cd->nhc", qi.float(), keys).relu_()
    sc = torch.einsum("nh,nhc->nc", w.float() * weight_scale, dots)
    vis = torch.arange(C, device=qi.device)[None, :] < ((positions + 1) // ratio)[:, None]
    return torch.where(vis, sc, torch.full_like(sc, float("-inf")))


def published_scores(scores: Tensor, published: Tensor, positions: Tensor, token_req: Tensor,
                     seq_cached: Tensor, *, ratio: int, published_ratio: int) -> Tensor:
    """The vendor index-key reading per row: f32[T, C] (docs/index-key-reading.md).

    scores f32[T, C]: against the owner's index keys; published f32[T, Cp]: the same queries against
    the last published pool (ratio ``published_ratio``) as the step found it. A row whose request had
    cached tokens (c > 0) at a position p with (p+1) % ratio != 0 (its owner's group still open)
    takes ``published`` (first min(C, Cp) columns, −inf beyond) restricted to j < c // published_ratio;
    other rows keep ``scores``. Sync-free (one select per element).
    """
    C = scores.shape[1]
    n = min(C, published.shape[1])
    c = seq_cached[token_req]
    pub = torch.cat([published[:, :n], scores.new_full((scores.shape[0], C - n), float("-inf"))], dim=1)
    col = torch.arange(C, device=scores.device)
    pub = torch.where(col[None, :] < torch.div(c, published_ratio, rounding_mode="floor")[:, None], pub,
                      float("-inf"))
    use = (c > 0) & (torch.remainder(positions + 1, ratio) != 0)
    return torch.where(use[:, None], pub, scores)


def take_topk(s: Tensor, k: int) -> Tensor:
    """bool mask of the top-k finite entries of each row of s [T, C] (k <= C), ties at the k-th
    value broken toward the lower index.

    torch.topk leaves the order of equal values to the device: CPU and CUDA pick different entries
    among ties, and ties are common here (a ReLU-weighted index score is exactly 0 wherever every
    head's dot product is negative; blocks share a max). Deciding them by index makes the selection
    the same on every device. Sync-free: the k-th value, two comparisons, one cumulative sum."""
    kth = s.topk(k, dim=-1).values[:, -1:]
    gt = s > kth
    eq = (s == kth) & (kth > float("-inf"))
    need = k - gt.sum(dim=-1, keepdim=True, dtype=torch.int32)
    return gt | (eq & (eq.cumsum(dim=-1, dtype=torch.int32) <= need))


def candidate_mask(scores: Tensor, *, block: int, topk_blocks: int) -> Tensor:
    """Two-level candidate mask bool[T, C] from indexer scores f32[T, C] (in row chunks).

    Visible entries are the finite scores (a prefix, as produced by :func:`index_scores`). Entries are
    grouped in blocks of ``block``; block score = max of its entries (−inf if none visible); the block
    of the newest visible entry is forced to +inf; the top min(topk_blocks, n_blocks) blocks with
    score > −inf are kept (ties toward the older block, :func:`take_topk`); the result is the block
    mask expanded to entries ∧ visibility.
    """
    return by_rows(lambda sc: _candidate_mask(sc, block, topk_blocks), scores.shape[1], scores)


def _candidate_mask(scores: Tensor, block: int, topk_blocks: int) -> Tensor:
    T, C = scores.shape
    nb = -(-C // block)
    vis = scores > float("-inf")
    pad = nb * block - C
    sp = torch.nn.functional.pad(scores.float(), (0, pad), value=float("-inf"))
    bscore = sp.reshape(T, nb, block).amax(dim=-1)  # [T, nb]
    n_vis = vis.sum(dim=-1)  # [T]
    newest = ((n_vis - 1).clamp(min=0) // block)[:, None]
    force = torch.zeros(T, nb, dtype=torch.bool, device=scores.device)
    force = force.scatter(1, newest, (n_vis > 0)[:, None])
    bscore = torch.where(force, torch.full_like(bscore, float("inf")), bscore)
    kb = min(topk_blocks, nb)
    if kb == 0:
        return torch.zeros(T, C, dtype=torch.bool, device=scores.device)
    keep = take_topk(bscore, kb)
    return keep[:, :, None].expand(T, nb, block).reshape(T, nb * block)[:, :C] & vis


def topk_select(scores: Tensor, mask: Tensor | None = None, *, k: int) -> Tensor:
    """Top-k compressed entries per token: i64[T, k] (in row chunks).

    Scores outside ``mask`` (bool[T, C], optional) become −inf; take the top min(k, C) entries (ties
    at the k-th value toward the lower index, as in :func:`take_topk`); those with score −inf are
    dropped (−1). Row layout: the selected indices in ascending order, then −1 padding up to
    exactly k columns.

    One torch.topk, as without the tie rule: the entries above the k-th value are its result; the
    ones equal to it are re-chosen as the lowest indices through one cumulative count and a batched
    binary search (k lookups per row), not a second pass of top-k over every entry.
    """
    return by_rows(lambda sc, m: _topk_select(sc, m, k), scores.shape[1], scores, mask)


def _topk_select(scores: Tensor, mask: Tensor | None, k: int) -> Tensor:
    T, C = scores.shape
    s = scores.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    kk = min(k, C)
    out = torch.full((T, k), -1, dtype=torch.int64, device=scores.device)
    if kk == 0 or T == 0:
        return out
    vals, idx = s.topk(kk, dim=-1)
    kth = vals[:, -1:]
    above = vals > kth
    eq_count = ((s == kth) & (kth > float("-inf"))).cumsum(dim=-1, dtype=torch.int32)  # [T, C]
    need = torch.minimum(kk - above.sum(dim=-1, keepdim=True, dtype=torch.int32), eq_count[:, -1:])
    j = torch.arange(1, kk + 1, dtype=torch.int32, device=scores.device).expand(T, kk).contiguous()
    eq_idx = torch.searchsorted(eq_count, j)  # index of the j-th entry equal to the k-th value
    big = torch.iinfo(torch.int64).max
    both = torch.cat([torch.where(above, idx, big), torch.where(j <= need, eq_idx, big)], dim=-1)
    both = both.sort(dim=-1).values[:, :kk]
    out[:, :kk] = torch.where(both == big, -1, both)
    return out
