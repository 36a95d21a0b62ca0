"""V4.1 KV compressor (non-overlapping groups of ``ratio`` tokens, spec §3.4.3) and the compressed
cache write (docs/step-convention.md)."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.meta import first_positions, last_positions
from megagraph.kernels.state.shapes import pool_passthrough


def compress_pool(kv_proj: Tensor, gate_proj: Tensor | None, pend_kv: Tensor | None,
                  pend_gate: Tensor | None, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                  *, ratio: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gated pooling of each complete group of ``ratio`` consecutive positions.

    kv_proj, gate_proj: [T, Dc] per-token projections (u, s); pend_kv, pend_gate: f32[S, ratio, Dc]
    raw rows of a slot's incomplete group (row p % ratio holds position p).
    The token at position p with (p+1) % ratio == 0 completes group g = p // ratio and gets
    ``latent[t] = Σ_{q=g·r}^{g·r+r−1} softmax_q(s_q)[ch] · u_q[ch]`` (channel-wise softmax over the
    group; members before the request's first new position come from pending, the rest from this
    step); other rows are 0. The pending rows of each request's trailing incomplete group are
    written (cast to the pending dtype). ratio 1: gate_proj None, latent = kv_proj, pending passed
    through unchanged. fp32 math.
    Returns (latent f32[T, Dc], pend_kv', pend_gate').
    """
    if (out := pool_passthrough(kv_proj, gate_proj, pend_kv, pend_gate, ratio)) is not None:
        return out
    T = kv_proj.shape[0]
    R = seq_slots.shape[0]
    dev = positions.device
    first = first_positions(positions, token_req, R)[token_req]  # [T]
    last = last_positions(positions, token_req, R)[token_req]  # [T]
    slots = seq_slots[token_req]  # [T]
    u, s = kv_proj.float(), gate_proj.float()

    qpos = (positions // ratio * ratio)[:, None] + torch.arange(ratio, device=dev)[None, :]  # [T, r]
    from_step = qpos >= first[:, None]
    step_idx = (torch.arange(T, device=dev)[:, None] - (positions[:, None] - qpos)).clamp(0, max(T - 1, 0))
    prow = torch.remainder(qpos, ratio)
    gu = torch.where(from_step[..., None], u[step_idx], pend_kv.float()[slots[:, None], prow])
    gs = torch.where(from_step[..., None], s[step_idx], pend_gate.float()[slots[:, None], prow])
    latent = (torch.softmax(gs, dim=1) * gu).sum(dim=1)
    complete = (positions + 1) % ratio == 0
    latent = torch.where(complete[:, None], latent, torch.zeros_like(latent))

    trailing = positions >= ((last + 1) // ratio * ratio)  # in the request's incomplete last group
    pk, pg = pend_kv.clone(), pend_gate.clone()
    rows = torch.remainder(positions[trailing], ratio)
    pk[slots[trailing], rows] = u[trailing].to(pk.dtype)
    pg[slots[trailing], rows] = s[trailing].to(pg.dtype)
    return latent, pk, pg


def cache_write(cache: Tensor, rows: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                *, ratio: int) -> Tensor:
    """Append completed compressed entries: cache [S, C, Dc]; rows [T, Dc].

    For every token with (p+1) % ratio == 0: ``cache'[seq_slots[r], (p+1)//ratio − 1] = rows[t]``
    (cast to cache.dtype); other rows are ignored. Returns a new tensor.
    """
    m = (positions + 1) % ratio == 0
    out = cache.clone()
    out[seq_slots[token_req][m], (positions[m] + 1) // ratio - 1] = rows[m].to(cache.dtype)
    return out
