"""DSpark block drafter (spec §3.9): target features, draft rows, non-causal block attention
with sink over a draft context ring, and the sequential Markov draft chain with confidence."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from megagraph.kernels.common.meta import live_requests
from megagraph.kernels.attention.reference import attend_rows, ring_positions


def stream_mean(streams: Tensor) -> Tensor:
    """Mean over the hc streams: streams [T, n, d] → [T, d], ``out[t] = (1/n)·Σ_c streams[t, c]``
    (fp32 accumulate, streams.dtype out). The DSpark target feature f_ℓ(t) of one layer."""
    return streams.float().mean(dim=1).to(streams.dtype)


def concat(*xs: Tensor) -> Tensor:
    """Concatenate along the last axis (inputs share leading dims and dtype)."""
    return torch.cat(xs, dim=-1)


def draft_rows(anchor_ids: Tensor, seq_cached: Tensor, *, block: int,
               noise_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Metadata of the draft rows, request-major (row r·B + i, B = block).

    anchor_ids i64[R] (x0, the token the main model produced for position P+1); seq_cached i64[R]
    (= P+1). Returns (token_ids, positions, token_req), each i64[R·B]: token x0 for i = 0 and
    noise_id for i > 0, position P+1+i, request row r.
    """
    R = anchor_ids.shape[0]
    i = torch.arange(block, dtype=torch.int64, device=anchor_ids.device)
    ids = torch.full((R, block), noise_id, dtype=torch.int64, device=anchor_ids.device)
    ids[:, 0] = anchor_ids
    pos = seq_cached[:, None] + i[None, :]
    req = torch.arange(R, dtype=torch.int64, device=anchor_ids.device)[:, None].expand(R, block)
    return ids.reshape(-1), pos.reshape(-1), req.reshape(-1).contiguous()


def block_attn(q: Tensor, kv: Tensor, ring: Tensor, sink: Tensor, positions: Tensor,
               token_req: Tensor, seq_slots: Tensor, seq_cached: Tensor, *, window: int,
               scale: float) -> Tensor:
    """Non-causal draft-block MQA (K = V) with an attention sink.

    q [T, H, D] (rotated); kv [T, D] this step's rows (rotated); ring [S, W, D] (W = window,
    docs/step-convention.md layout); sink f32[H]. Keys of EVERY row of request r (slot s,
    c = seq_cached[r]): ring rows of slot s holding positions c−W … c−1 that are ≥ 0 (all of them,
    independent of the row's own position), plus all of this step's rows of request r (every row
    sees every row of its block, itself included). ``s_k = scale·q_h·k``, ``m = max(max_k s_k,
    −1e30)``, ``o_h = Σ_k e^(s_k−m)·k / (e^(sink_h−m) + Σ_k e^(s_k−m))``. Not de-rotated; fp32
    math, returns [T, H, D] in q.dtype.
    """
    T, H, D = q.shape
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    sinkf = sink.float()
    for start, n, slot, c in live_requests(token_req, seq_slots, seq_cached):
        sl = slice(start, start + n)
        rp = ring_positions(c, W).to(q.device)
        m_ring = (rp >= 0)[None, :].expand(n, W)
        m_new = torch.ones(n, n, dtype=torch.bool, device=q.device)
        K = torch.cat([ring[slot].float(), kv[sl].float()], dim=0)  # [W + n, D]
        M = torch.cat([m_ring, m_new], dim=1)  # [n, W + n]
        out[sl] = attend_rows(q[sl], K, M, sinkf, scale)  # every row sees itself: never empty
    return out.to(q.dtype)


def markov_draft(base_logits: Tensor, z: Tensor, anchor_ids: Tensor, embed: Tensor, head: Tensor,
                 conf_w: Tensor, *, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sequential Markov draft chain + confidence per request (rows request-major, B = block).

    base_logits f32[R·B, V] (U); z [R·B, d] (pre-norm collapse of the last stage); anchor_ids
    i64[R]; embed, head [V, rank] (markov_head); conf_w [1, d + rank] (confidence_head.proj).
    For i = 0..B−1 (prev_0 = anchor): ``μ_i = embed[prev_i]``, ``logits_i = U_i + head·μ_i``,
    ``d_{i+1} = argmax(logits_i)`` (first index on ties), ``prev_{i+1} = d_{i+1}``,
    ``conf_i = sigmoid(conf_w·[z_i ; μ_i])``. fp32 math. Returns (drafts i64[R, B],
    confidence f32[R, B], logits f32[R·B, V]).
    """
    R = anchor_ids.shape[0]
    V = base_logits.shape[1]
    u = base_logits.float().reshape(R, block, V)
    zf = z.float().reshape(R, block, -1)
    E, Hm, cw = embed.float(), head.float(), conf_w.float()[0]
    drafts = torch.empty(R, block, dtype=torch.int64, device=u.device)
    conf = torch.empty(R, block, dtype=torch.float32, device=u.device)
    logits = torch.empty(R, block, V, dtype=torch.float32, device=u.device)
    prev = anchor_ids
    for i in range(block):
        mu = E[prev]  # [R, rank]
        li = u[:, i] + mu @ Hm.t()
        logits[:, i] = li
        drafts[:, i] = li.argmax(dim=-1)
        conf[:, i] = torch.sigmoid(torch.cat([zf[:, i], mu], dim=-1) @ cw)
        prev = drafts[:, i]
    return drafts, conf, logits.reshape(R * block, V)


DSPARK: dict[str, Callable] = {
    "stream_mean": stream_mean,
    "concat": concat,
    "draft_rows": draft_rows,
    "block_attn": block_attn,
    "markov_draft": markov_draft,
}
