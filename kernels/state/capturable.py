"""Compressor pooling (V4.1 non-overlapping, V4 overlapping / APE) and the compressed-cache write,
without host syncs.

Pooling is computed only for tokens that complete a group ((p+1) % ratio == 0): they are
compacted into a static buffer of min(T, T // ratio + R) rows (a bound that holds for any step of
consecutive positions per request), so a 128-token HCA group costs one [ratio, D] gather per
completed group instead of one per token. Group members before the request's first new position
come from the pending state of the token's own slot.

State writes (pending rows, cache entries) use _common.final_writer_update: each token writes the
row its request's *final* writer for that row would write (or the row's old value), so all
duplicates carry equal values and no boolean selection is needed. Tokens of pad requests only
touch their own (scratch) slot.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.capturable import I64, chunk_ranges, compact, final_writer_update, first_last_positions, \
    ring_writers
from megagraph.kernels.state.shapes import pool_passthrough, v4_pool_dims


def _completing(positions: Tensor, ratio: int, num_requests: int) -> tuple[Tensor, Tensor]:
    T = positions.shape[0]
    cap = min(T, T // ratio + num_requests)
    return compact(torch.remainder(positions + 1, ratio) == 0, cap)


def _member_rows(qpos: Tensor, t: Tensor, p: Tensor, first: Tensor, slot: Tensor, P: int,
                 src: Tensor, pend: Tensor) -> Tensor:
    """Raw rows [G, k, D] of positions qpos [G, k] for tokens t [G] (at position p, request first
    position first, slot slot): from this step if >= first, else pending row qpos % P."""
    T = src.shape[0]
    from_step = qpos >= first[:, None]
    step_idx = (t[:, None] - (p[:, None] - qpos)).clamp(0, max(T - 1, 0))
    prow = torch.remainder(qpos, P)
    return torch.where(from_step[..., None], src[step_idx], pend[slot[:, None], prow])


def compress_pool(kv_proj: Tensor, gate_proj: Tensor | None, pend_kv: Tensor | None,
                  pend_gate: Tensor | None, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                  *, ratio: int, inplace: bool = False):
    if (out := pool_passthrough(kv_proj, gate_proj, pend_kv, pend_gate, ratio)) is not None:
        return out
    T, Dc = kv_proj.shape
    R = seq_slots.shape[0]
    dev = positions.device
    u, s = kv_proj.float(), gate_proj.float()
    first, last = first_last_positions(positions, token_req, R)
    slots = seq_slots[token_req]
    latent = torch.zeros(T + 1, Dc, dtype=torch.float32, device=dev)
    rows, valid = _completing(positions, ratio, R)
    k = torch.arange(ratio, dtype=I64, device=dev)
    pkf, pgf = pend_kv.float(), pend_gate.float()
    for a, b in chunk_ranges(rows.shape[0], 3 * ratio * Dc):
        t = rows[a:b]
        p = positions[t]
        f, sl = first[token_req[t]], slots[t]
        qpos = (torch.div(p, ratio, rounding_mode="floor") * ratio)[:, None] + k[None, :]
        gu = _member_rows(qpos, t, p, f, sl, ratio, u, pkf)
        gs = _member_rows(qpos, t, p, f, sl, ratio, s, pgf)
        lat = (torch.softmax(gs, dim=1) * gu).sum(dim=1)
        latent.index_copy_(0, torch.where(valid[a:b], t, torch.full_like(t, T)), lat)
    # pending: the request's trailing incomplete group (rows p % ratio); other rows keep their value
    last_t = last[token_req]
    row, shift = ring_writers(positions, last_t, ratio)
    tail0 = torch.div(last_t + 1, ratio, rounding_mode="floor") * ratio
    use_new = positions + shift >= tail0
    tt = torch.arange(T, dtype=I64, device=dev) + shift
    pk = final_writer_update(pend_kv, slots, row, tt, use_new, u, inplace=inplace)
    pg = final_writer_update(pend_gate, slots, row, tt, use_new, s, inplace=inplace)
    return latent[:T], pk, pg


def v4_compress_pool(kv_proj: Tensor, gate_proj: Tensor, ape: Tensor, pend_kv: Tensor, pend_gate: Tensor,
                     positions: Tensor, token_req: Tensor, seq_slots: Tensor, *, ratio: int,
                     overlap: bool, inplace: bool = False):
    r, c, T, width, D, P = v4_pool_dims(kv_proj, gate_proj, ape, pend_kv, pend_gate,
                                        ratio=ratio, overlap=overlap)
    R = seq_slots.shape[0]
    dev = positions.device
    u, s = kv_proj.float(), gate_proj.float()
    pk, pg = pend_kv.float(), pend_gate.float()
    apef = ape.float()
    first, last = first_last_positions(positions, token_req, R)
    slots = seq_slots[token_req]
    latent = torch.zeros(T + 1, D, dtype=torch.float32, device=dev)
    rows, valid = _completing(positions, r, R)
    k = torch.arange(r, dtype=I64, device=dev)
    for a, b in chunk_ranges(rows.shape[0], 4 * c * P * width):
        t = rows[a:b]
        p = positions[t]
        f, sl = first[token_req[t]], slots[t]
        g0 = torch.div(p, r, rounding_mode="floor") * r
        qcur = g0[:, None] + k[None, :]
        cu = _member_rows(qcur, t, p, f, sl, P, u, pk)
        cs = _member_rows(qcur, t, p, f, sl, P, s, pg)
        if overlap:
            qprev = qcur - r
            pvalid = (qprev >= 0)[..., None]
            pu = _member_rows(qprev, t, p, f, sl, P, u, pk)
            ps = _member_rows(qprev, t, p, f, sl, P, s, pg)
            kv_slots = torch.cat([torch.where(pvalid, pu[..., :D], torch.zeros_like(pu[..., :D])),
                                  cu[..., D:]], dim=1)
            gate_prev = torch.where(pvalid, ps[..., :D] + apef[None, :, :D], float("-inf"))
            gate_slots = torch.cat([gate_prev, cs[..., D:] + apef[None, :, D:]], dim=1)
        else:
            kv_slots, gate_slots = cu, cs + apef[None]
        lat = (torch.softmax(gate_slots, dim=1) * kv_slots).sum(dim=1)
        latent.index_copy_(0, torch.where(valid[a:b], t, torch.full_like(t, T)), lat)
    # pending: a ring of the last P raw rows
    row, shift = ring_writers(positions, last[token_req], P)
    tt = torch.arange(T, dtype=I64, device=dev) + shift
    always = torch.ones_like(row, dtype=torch.bool)
    nk = final_writer_update(pend_kv, slots, row, tt, always, kv_proj, inplace=inplace)
    ng = final_writer_update(pend_gate, slots, row, tt, always, gate_proj, inplace=inplace)
    return latent[:T], nk, ng


def cache_write(cache: Tensor, rows: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                *, ratio: int, inplace: bool = False) -> Tensor:
    """Entry p // ratio of each token's slot gets the row of the token completing that group when
    it is in this step, else keeps its value (so only completed groups change)."""
    C = cache.shape[1]
    T = positions.shape[0]
    _, last = first_last_positions(positions, token_req, seq_slots.shape[0])
    to_end = (ratio - 1) - torch.remainder(positions, ratio)
    entry = torch.div(positions, ratio, rounding_mode="floor").clamp(0, C - 1)
    use_new = positions + to_end <= last[token_req]
    writer = torch.arange(T, dtype=I64, device=positions.device) + to_end
    return final_writer_update(cache, seq_slots[token_req], entry, writer, use_new, rows, inplace=inplace)
