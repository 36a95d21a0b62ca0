"""DSpark drafter ops (graph/ops/dspark.py) without host syncs.

block_attn: every row of a request sees the same keys (the slot's ring rows holding positions
c-W .. c-1 and all of the request's rows in this step), so queries run over request-aligned tiles
(one ring gather per tile) against the whole step's kv under a same-request mask: exact and
static-shaped, O(T^2) in the step's rows, which draft steps keep small (T = R * block).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.capturable import I64, chunk_ranges, request_tiles, scatter_rows


def stream_mean(streams: Tensor) -> Tensor:
    return streams.float().mean(dim=1).to(streams.dtype)


def concat(*xs: Tensor) -> Tensor:
    return torch.cat(xs, dim=-1)


def draft_rows(anchor_ids: Tensor, seq_cached: Tensor, *, block: int, noise_id: int):
    R = anchor_ids.shape[0]
    dev = anchor_ids.device
    i = torch.arange(block, dtype=I64, device=dev)
    ids = torch.where(i[None, :] == 0, anchor_ids[:, None], noise_id)
    pos = seq_cached[:, None] + i[None, :]
    req = torch.arange(R, dtype=I64, device=dev)[:, None].expand(R, block)
    return ids.reshape(-1), pos.reshape(-1), req.reshape(-1).contiguous()


def block_attn(q: Tensor, kv: Tensor, ring: Tensor, sink: Tensor, positions: Tensor,
               token_req: Tensor, seq_slots: Tensor, seq_cached: Tensor, *, window: int,
               scale: float) -> Tensor:
    T, H, D = q.shape
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    dev = q.device
    out = torch.empty(T + 1, H, D, dtype=torch.float32, device=dev)
    if T == 0:
        return out[:0].to(q.dtype)
    tiles = request_tiles(token_req, seq_slots.shape[0])
    B = tiles.tile
    jw = torch.arange(W, dtype=I64, device=dev)
    k_step = kv.float()  # [T, D], shared by every tile
    sinkf = sink.float()
    for b0, b1 in chunk_ranges(tiles.count, W * D + 4 * B * H * (W + T)):
        r_b = tiles.seg[b0:b1]
        slot_b, c_b = seq_slots[r_b], seq_cached[r_b]
        tok = tiles.items[b0:b1]
        qb = q[tok].float()  # [n, B, H, D]
        rp = (c_b - 1)[:, None] - torch.remainder((c_b - 1)[:, None] - jw[None, :], W)
        m_ring = rp >= 0  # [n, W]
        m_step = token_req[None, :] == r_b[:, None]  # [n, T]
        k_ring = ring[slot_b].float()
        s_ring = (torch.einsum("nbhd,nwd->nbhw", qb, k_ring) * scale).masked_fill(
            ~m_ring[:, None, None, :], float("-inf"))
        s_step = (torch.einsum("nbhd,td->nbht", qb, k_step) * scale).masked_fill(
            ~m_step[:, None, None, :], float("-inf"))
        m = torch.maximum(s_ring.amax(-1), s_step.amax(-1)).clamp(min=-1e30)[..., None]
        e_ring, e_step = torch.exp(s_ring - m), torch.exp(s_step - m)
        den = torch.exp(sinkf[None, None, :, None] - m) + e_ring.sum(-1, keepdim=True) \
            + e_step.sum(-1, keepdim=True)
        o = (torch.einsum("nbhw,nwd->nbhd", e_ring, k_ring)
             + torch.einsum("nbht,td->nbhd", e_step, k_step)) / den
        scatter_rows(out, tok, tiles.item_valid[b0:b1], o)
    return out[:T].to(q.dtype)


def markov_draft(base_logits: Tensor, z: Tensor, anchor_ids: Tensor, embed: Tensor, head: Tensor,
                 conf_w: Tensor, *, block: int) -> tuple[Tensor, Tensor, Tensor]:
    R = anchor_ids.shape[0]
    V = base_logits.shape[1]
    u = base_logits.float().reshape(R, block, V)
    zf = z.float().reshape(R, block, -1)
    E, Hm, cw = embed.float(), head.float(), conf_w.float()[0]
    drafts, conf, logits = [], [], []
    prev = anchor_ids
    for i in range(block):
        mu = E.index_select(0, prev)
        li = u[:, i] + mu @ Hm.t()
        logits.append(li)
        prev = li.argmax(dim=-1)
        drafts.append(prev)
        conf.append(torch.sigmoid(torch.cat([zf[:, i], mu], dim=-1) @ cw))
    return (torch.stack(drafts, dim=1), torch.stack(conf, dim=1),
            torch.stack(logits, dim=1).reshape(R * block, V))
