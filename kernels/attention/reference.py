"""Sparse attention with sink over sliding-window ring + selected compressed entries (spec §3.4.2,
§3.4.5), and the ring-buffer update (docs/step-convention.md)."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.chunks import row_slices
from megagraph.kernels.common.meta import last_positions, live_requests


def ring_positions(cached: int, ring_size: int) -> Tensor:
    """Position held by each ring row of a slot with ``cached`` tokens: the latest q < cached with
    q % W == j, or a negative number when no such q ≥ 0 exists. i64[W]."""
    j = torch.arange(ring_size, dtype=torch.int64)
    return (cached - 1) - torch.remainder(cached - 1 - j, ring_size)


def sparse_attn(q: Tensor, kv: Tensor, ring: Tensor, ckv: Tensor | None, topk: Tensor | None,
                sink: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                seq_cached: Tensor, *, window: int, scale: float, ratio: int,
                attend_all_compressed: bool = False) -> Tensor:
    """MQA attention (K = V) with an attention sink, for every new token.

    q [T, H, D]; kv [T, D] this step's rows; ring [S, W, D] (W = window; previous steps, layout per
    docs/step-convention.md); ckv [S, C, D] or None (compressed entries incl. those written this
    step); topk i64[T, K] or None (indices into ckv, −1 = empty); sink f32[H].
    Keys of a token at position p of request r (cached c, slot s):
    * ring rows of slot s holding positions in [p−W+1, p] (and < c),
    * this step's rows of request r with positions in [p−W+1, p],
    * compressed entries g of slot s with g < (p+1)//ratio that are listed in topk (duplicates count
      once), or — if topk is None and attend_all_compressed — all of them.
    ``s_k = scale·q_h·k``, ``m = max(max_k s_k, −1e30)``,
    ``o_h = Σ_k e^(s_k−m)·k / (e^(sink_h−m) + Σ_k e^(s_k−m))``; no valid key → 0.
    The output is NOT de-rotated (apply ``rope(..., inverse=True)`` afterwards). fp32 math;
    returns [T, H, D] in q.dtype. Runs over row chunks of each request: the [rows, H, keys] scores
    are 70 GiB for 4K new tokens x 64 heads x 72K keys at once.
    """
    T, H, D = q.shape
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    use_comp = ckv is not None and (topk is not None or attend_all_compressed)
    if use_comp and ratio <= 0:
        raise ValueError("compressed keys need ratio >= 1")
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    sinkf = sink.float()
    for start, n, slot, c in live_requests(token_req, seq_slots, seq_cached):
        sl = slice(start, start + n)
        rp = ring_positions(c, W).to(positions.device)
        keys = [ring[slot].float(), kv[sl].float()] + ([ckv[slot].float()] if use_comp else [])
        K = torch.cat(keys, dim=0)  # [L, D]
        for ch in row_slices(start, start + n, H * K.shape[0]):
            p = positions[ch]
            masks = [_window_mask(p, positions[sl], rp, c, window)]
            if use_comp:
                masks.append(_compressed_mask(p, None if topk is None else topk[ch], ckv.shape[1], ratio))
            out[ch] = attend_rows(q[ch], K, torch.cat(masks, dim=1), sinkf, scale)
    return out.to(q.dtype)


def _window_mask(p: Tensor, step_pos: Tensor, rp: Tensor, cached: int, window: int) -> Tensor:
    """Window keys of query positions p [n]: bool[n, W + len(step_pos)] over the ring rows (holding
    positions rp [W]) then this step's rows of the request (positions step_pos)."""
    lo = p - window + 1
    m_ring = (rp[None, :] >= 0) & (rp[None, :] >= lo[:, None]) & (rp[None, :] < cached)
    m_new = (step_pos[None, :] <= p[:, None]) & (step_pos[None, :] >= lo[:, None])
    return torch.cat([m_ring, m_new], dim=1)


def _compressed_mask(p: Tensor, idx: Tensor | None, C: int, ratio: int) -> Tensor:
    """Compressed keys of query positions p [n]: bool[n, C], the visible entries g < (p+1)//ratio
    that are listed in idx i64[n, K] (−1 = empty), or all visible ones when idx is None."""
    vis = torch.arange(C, device=p.device)[None, :] < ((p + 1) // ratio)[:, None]
    if idx is None:
        return vis
    idx = torch.where(idx >= 0, idx, torch.full_like(idx, C))  # −1 → dummy column C
    sel = torch.zeros(p.shape[0], C + 1, dtype=torch.bool, device=p.device)
    return sel.scatter_(1, idx, True)[:, :C] & vis


def attend_rows(q: Tensor, K: Tensor, M: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Sink attention of rows q [n, H, D] over keys K f32[L, D] where M bool[n, L]: f32[n, H, D].
    The [n, H, L] scores are the one large temporary; they are updated in place into the weights."""
    s = torch.einsum("nhd,ld->nhl", q.float(), K).mul_(scale)
    s.masked_fill_(~M[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True).clamp(min=-1e30)
    e = s.sub_(m).exp_()  # masked → 0
    den = torch.exp(sink[None, :, None] - m) + e.sum(dim=-1, keepdim=True)
    o = torch.einsum("nhl,ld->nhd", e, K) / den
    return torch.where(M.any(dim=-1)[:, None, None], o, torch.zeros_like(o))


def ring_update(ring: Tensor, kv: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor, *,
                window: int) -> Tensor:
    """Write this step's rows into the sliding-window ring.

    ring [S, W, D] (W = window); kv [T, D]. Each new row at position p of request r goes to
    ``ring'[seq_slots[r], p % W]``; only each request's last (up to) W new rows are written (older
    ones would be overwritten anyway). Rows are cast to ring.dtype; returns a new tensor.
    """
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    last = last_positions(positions, token_req, seq_slots.shape[0])
    keep = positions > (last[token_req] - W)
    slots = seq_slots[token_req]
    out = ring.clone()
    out[slots[keep], torch.remainder(positions[keep], W)] = kv[keep].to(ring.dtype)
    return out
