"""Sparse attention with sink (window ring + this step's rows + selected / all compressed entries)
and the ring update, without host syncs.

sparse_attn runs over request-aligned query tiles (_common.segment_tiles): the tokens of one tile
belong to one request, so the ring rows of its slot, the step rows before it (one contiguous span
of kv) and, with attend_all_compressed, the slot's compressed rows are gathered once per tile; top-k
compressed rows are gathered per token. Decode steps (T == R) get tiles of one token. Tiles are
processed in static chunks bounded by _common.CHUNK_ELEMS.

Masks follow the reference exactly: a ring row is a key iff it holds a position q >= 0 with
p-W+1 <= q < seq_cached; a step row iff it belongs to the same request row with a position in
[p-W+1, p]; a compressed entry g iff g < (p+1)//ratio (and listed in topk; duplicates count once).
Keys come only from the token's own request row and slot, so pad requests (the scratch slot,
possibly repeated) and empty request rows cannot change real rows.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.capturable import I64, chunk_ranges, final_writer_update, first_last_positions, request_tiles, \
    ring_writers, scatter_rows


def sparse_attn(q: Tensor, kv: Tensor, ring: Tensor, ckv: Tensor | None, topk: Tensor | None,
                sink: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                seq_cached: Tensor, *, window: int, scale: float, ratio: int = 0,
                attend_all_compressed: bool = False) -> Tensor:
    T, H, D = q.shape
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    use_comp = ckv is not None and (topk is not None or bool(attend_all_compressed))
    if use_comp and ratio <= 0:
        raise ValueError("compressed keys need ratio >= 1")
    R = seq_slots.shape[0]
    dev = q.device
    out = torch.empty(T + 1, H, D, dtype=torch.float32, device=dev)
    if T == 0:
        return out[:0].to(q.dtype)
    tiles = request_tiles(token_req, R)
    B = tiles.tile
    Wm = min(W - 1, T - 1)  # step keys before a tile's first token
    Ls = Wm + B
    C = ckv.shape[1] if use_comp else 0
    K = topk.shape[1] if (use_comp and topk is not None) else 0
    per_tile = (W + Ls + (B * K if K else C)) * D + 4 * B * H * (W + Ls + (K or C))
    sinkf = sink.float()
    jw = torch.arange(W, dtype=I64, device=dev)
    js = torch.arange(-Wm, B, dtype=I64, device=dev)
    for b0, b1 in chunk_ranges(tiles.count, per_tile):
        r_b = tiles.seg[b0:b1]  # [n]
        slot_b = seq_slots[r_b]
        c_b = seq_cached[r_b]
        tok = tiles.items[b0:b1]  # [n, B]
        p = positions[tok]  # [n, B]
        lo = p - (W - 1)
        qb = q[tok].float()  # [n, B, H, D]
        # ring rows (slot's earlier tokens): position held by row j
        rp = (c_b - 1)[:, None] - torch.remainder((c_b - 1)[:, None] - jw[None, :], W)  # [n, W]
        m_ring = (rp >= 0)[:, None, :] & (rp[:, None, :] >= lo[:, :, None]) \
            & (rp < c_b[:, None])[:, None, :]  # [n, B, W]
        k_ring = ring[slot_b].float()  # [n, W, D]
        # this step's rows: one contiguous span of kv ending at the tile's last token
        ks = tiles.start[b0:b1, None] + js[None, :]  # [n, Ls]
        ks_ok = (ks >= 0) & (ks < T)
        ks = ks.clamp(0, T - 1)
        kp = positions[ks]
        same = ks_ok & (token_req[ks] == r_b[:, None])
        m_step = same[:, None, :] & (kp[:, None, :] <= p[:, :, None]) & (kp[:, None, :] >= lo[:, :, None])
        k_step = kv[ks].float()  # [n, Ls, D]
        s_ring = torch.einsum("nbhd,nwd->nbhw", qb, k_ring) * scale
        s_step = torch.einsum("nbhd,nld->nbhl", qb, k_step) * scale
        s_ring = s_ring.masked_fill(~m_ring[:, :, None, :], float("-inf"))
        s_step = s_step.masked_fill(~m_step[:, :, None, :], float("-inf"))
        m = torch.maximum(s_ring.amax(dim=-1), s_step.amax(dim=-1))
        any_key = m_ring.any(dim=-1) | m_step.any(dim=-1)  # [n, B]
        if use_comp:
            vis = torch.div(p + 1, ratio, rounding_mode="floor")  # [n, B]
            if topk is not None:
                idx = topk[tok].sort(dim=-1).values  # [n, B, K]
                dup = torch.zeros_like(idx, dtype=torch.bool)
                dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
                m_comp = (idx >= 0) & (idx < vis[..., None]) & (idx < C) & ~dup
                k_comp = ckv[slot_b[:, None, None], idx.clamp(0, C - 1)].float()  # [n, B, K, D]
                s_comp = torch.einsum("nbhd,nbkd->nbhk", qb, k_comp) * scale
            else:
                m_comp = torch.arange(C, dtype=I64, device=dev)[None, None, :] < vis[..., None]
                k_comp = ckv[slot_b].float()  # [n, C, D]
                s_comp = torch.einsum("nbhd,ncd->nbhc", qb, k_comp) * scale
            s_comp = s_comp.masked_fill(~m_comp[:, :, None, :], float("-inf"))
            m = torch.maximum(m, s_comp.amax(dim=-1))
            any_key = any_key | m_comp.any(dim=-1)
        m = m.clamp(min=-1e30)[..., None]  # [n, B, H, 1]
        e_ring = torch.exp(s_ring - m)
        e_step = torch.exp(s_step - m)
        den = torch.exp(sinkf[None, None, :, None] - m) + e_ring.sum(-1, keepdim=True) \
            + e_step.sum(-1, keepdim=True)
        o = torch.einsum("nbhw,nwd->nbhd", e_ring, k_ring) + torch.einsum("nbhl,nld->nbhd", e_step, k_step)
        if use_comp:
            e_comp = torch.exp(s_comp - m)
            den = den + e_comp.sum(-1, keepdim=True)
            if topk is not None:
                o = o + torch.einsum("nbhk,nbkd->nbhd", e_comp, k_comp)
            else:
                o = o + torch.einsum("nbhc,ncd->nbhd", e_comp, k_comp)
        o = o / den
        o = torch.where(any_key[:, :, None, None], o, torch.zeros_like(o))
        scatter_rows(out, tok, tiles.item_valid[b0:b1], o)
    return out[:T].to(q.dtype)


def ring_update(ring: Tensor, kv: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor, *,
                window: int, inplace: bool = False) -> Tensor:
    """Each request's last (up to) W rows land at ring[slot, p % W]. Every token writes its row
    with the value of the request's latest token of the same residue (the one the reference keeps),
    so duplicate targets carry equal values."""
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    _, last = first_last_positions(positions, token_req, seq_slots.shape[0])
    row, shift = ring_writers(positions, last[token_req], W)
    t = torch.arange(positions.shape[0], dtype=I64, device=positions.device)
    return final_writer_update(ring, seq_slots[token_req], row, t + shift,
                               torch.ones_like(row, dtype=torch.bool), kv, inplace=inplace)


def ring_update_batched(positions: Tensor, token_req: Tensor, seq_slots: Tensor, *operands: Tensor,
                        window: int, layers=None, inplace: bool = False) -> tuple[Tensor, ...]:
    """ring_update for every (ring, kv) pair of operands, in order (`layers` is accepted for
    graphs built before the attribute was dropped)."""
    return tuple(ring_update(r, kv, positions, token_req, seq_slots, window=window, inplace=inplace)
                 for r, kv in zip(operands[0::2], operands[1::2]))
