"""DeepSeek-V4(-Flash) reference ops that the common (V4.1) op set cannot express.

Semantics follow what transformers' ``DeepseekV4ForCausalLM`` computes (transformers 5.24.0,
``models/deepseek_v4/modeling_deepseek_v4.py``; see docs/transformers-v4.md for the full account and
line references). Everything else a V4 forward needs is an existing common op (rms_norm, linear,
grouped_linear, rope, hc_mixer/hc_collapse/hc_expand, index_scores, topk_select, sparse_attn,
ring_update, cache_write, route, moe_experts, swiglu_mlp).

Calling convention: ``fn(*tensor_inputs, **attrs)``; per-step metadata and state as in
docs/step-convention.md. All math fp32.

Ops
---
* :func:`v4_compress_pool` — gated pooling of the V4 compressors: ratio 4 *overlapping* windows
  (CSA main compressor and the indexer's own compressor) and ratio 128 non-overlapping (HCA), both
  with the learned absolute-position bias ``ape`` added to the gate logits.
* :func:`hash_route` — hash-routed MoE layers: experts from ``tid2eid[token_id]``, weights from the
  router scores of those experts.
* :func:`hc_head_mix` — the final mHC collapse weights (``hc_head``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.meta import first_positions, last_positions
from megagraph.kernels.moe.reference import router_scores
from megagraph.kernels.state.shapes import v4_pool_dims

__all__ = ["v4_compress_pool", "hash_route", "hc_head_mix", "V4_REFERENCE"]


def v4_compress_pool(kv_proj: Tensor, gate_proj: Tensor, ape: Tensor, pend_kv: Tensor, pend_gate: Tensor,
                     positions: Tensor, token_req: Tensor, seq_slots: Tensor, *, ratio: int,
                     overlap: bool) -> tuple[Tensor, Tensor, Tensor]:
    """V4 compressor pooling (before the compressor's RMSNorm and RoPE).

    Shapes (``c = 2`` if overlap else 1, ``D`` = compressed width, ``P = c·ratio``):
    kv_proj, gate_proj [T, c·D] (per-token ``wkv·x`` / ``wgate·x``); ape f32[ratio, c·D];
    pend_kv, pend_gate f32[S, P, c·D] — raw (APE-free) projections of the slot's last ``P``
    positions: row ``q % P`` holds the latest position ``q < seq_cached`` with that residue
    (invalid if no such ``q >= 0``), like the sliding-window ring.

    Group ``g`` covers positions ``g·r … g·r+r−1`` and completes at the token ``p = g·r+r−1``
    (``(p+1) % r == 0``). For member ``q`` let ``k = q − g·r`` (its slot in the group).

    * overlap=False (HCA, r = 128): ``latent_g = Σ_q softmax_q(gate[q] + ape[k])[ch] · kv[q][ch]``
      over the r members (channel-wise softmax).
    * overlap=True (CSA r = 4, and the indexer's compressor): the softmax runs over ``2r`` slots:
      the r members of group g with their **second** half ``[D:2D]`` (gate + ``ape[k, D:]``) and the r
      members of group g−1 with their **first** half ``[0:D]`` (gate + ``ape[k, :D]``); for g = 0 the
      previous-group slots are absent (weight 0). So entry g pools positions ``(g−1)·r … g·r+r−1``.

    Members before the request's first new position come from the pending rows, the rest from this
    step. The latent of a completing token is returned in its row, other rows are 0. The caller then
    applies ``rms_norm(·, norm_w)``, ``rope(·, positions, offset=1−r)`` (the entry's RoPE position is
    the group's first position ``g·r``, compress-rope table) and ``cache_write(ratio=r)``.

    Pending update: each request's last (up to) ``P`` new rows are written raw to row ``p % P`` of
    its slot (cast to the pending dtype); other rows are unchanged.
    Returns (latent f32[T, D], pend_kv' [S, P, c·D], pend_gate' [S, P, c·D]).
    """
    r, c, T, width, D, P = v4_pool_dims(kv_proj, gate_proj, ape, pend_kv, pend_gate,
                                        ratio=ratio, overlap=overlap)
    dev = positions.device
    R = seq_slots.shape[0]
    first = first_positions(positions, token_req, R)[token_req]  # [T]
    last = last_positions(positions, token_req, R)[token_req]  # [T]
    slots = seq_slots[token_req]  # [T]
    u, s = kv_proj.float(), gate_proj.float()
    pk, pg = pend_kv.float(), pend_gate.float()
    apef = ape.float()
    tidx = torch.arange(T, device=dev)

    def gather(qpos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Raw rows (kv, gate) [T, r, c·D] of positions qpos [T, r] and their validity [T, r]."""
        from_step = qpos >= first[:, None]
        step_idx = (tidx[:, None] - (positions[:, None] - qpos)).clamp(0, max(T - 1, 0))
        prow = torch.remainder(qpos, P)
        gu = torch.where(from_step[..., None], u[step_idx], pk[slots[:, None], prow])
        gs = torch.where(from_step[..., None], s[step_idx], pg[slots[:, None], prow])
        return gu, gs, qpos >= 0

    g0 = positions // r * r  # first position of each token's group
    k = torch.arange(r, device=dev)
    cu, cs, _ = gather(g0[:, None] + k[None, :])
    if overlap:
        pu, ps, pvalid = gather(g0[:, None] - r + k[None, :])
        neg = torch.tensor(float("-inf"), device=dev)
        kv_slots = torch.cat([pu[..., :D], cu[..., D:]], dim=1)  # [T, 2r, D]
        gate_prev = torch.where(pvalid[..., None], ps[..., :D] + apef[None, :, :D], neg)
        gate_slots = torch.cat([gate_prev, cs[..., D:] + apef[None, :, D:]], dim=1)
        kv_slots = torch.where(torch.cat([pvalid, torch.ones_like(pvalid)], dim=1)[..., None], kv_slots,
                               torch.zeros_like(kv_slots))
    else:
        kv_slots, gate_slots = cu, cs + apef[None]
    latent = (torch.softmax(gate_slots, dim=1) * kv_slots).sum(dim=1)
    complete = (positions + 1) % r == 0
    latent = torch.where(complete[:, None], latent, torch.zeros_like(latent))

    keep = positions > last - P
    nk, ng = pend_kv.clone(), pend_gate.clone()
    rows = torch.remainder(positions[keep], P)
    nk[slots[keep], rows] = kv_proj[keep].to(nk.dtype)
    ng[slots[keep], rows] = gate_proj[keep].to(ng.dtype)
    return latent, nk, ng




def hash_route(x: Tensor, gate_w: Tensor, tid2eid: Tensor, token_ids: Tensor, *, topk: int,
               route_scale: float, score_func: str = "sqrtsoftplus",
               norm_topk: bool = True) -> tuple[Tensor, Tensor]:
    """Hash routing of V4's first MoE layers (``mlp_layer_types == "hash_moe"``).

    x [T, d]; gate_w [E, d]; tid2eid int[V, topk] (frozen token-id → expert-ids table);
    token_ids i64[T]. Logits ``l = x·gate_wᵀ`` (fp32), scores σ = score_func(l)
    (``sqrtsoftplus`` = sqrt(softplus)). Experts ``ids = tid2eid[token_ids]`` in table order (no
    selection bias, no top-k); weights = σ at those experts, divided by (their sum + 1e-20) when
    norm_topk (transformers always normalizes), times route_scale.
    Returns (ids i64[T, topk], weights f32[T, topk]).
    """
    if tid2eid.shape[1] != topk:
        raise ValueError(f"tid2eid has {tid2eid.shape[1]} columns, topk is {topk}")
    sc = router_scores(x.float() @ gate_w.float().t(), score_func)
    ids = tid2eid[token_ids].to(torch.int64)
    wts = sc.gather(1, ids)
    if norm_topk:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, wts * route_scale


def hc_head_mix(H: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, eps: float, hc_eps: float) -> Tensor:
    """Final mHC collapse weights (``hc_head``), applied after the last block.

    H [T, n, d]; fn [n, n·d]; base [n]; scale [1]. With h = flatten(H[t]) (stream-major):
    ``pre = sigmoid((fn·h)·rsqrt(mean(h²)+eps)·scale + base) + hc_eps`` (fp32).
    The model then does ``hc_collapse(H, pre)`` → final ``rms_norm`` → lm head.
    Returns f32[T, n].
    """
    t, n, d = H.shape
    h = H.float().reshape(t, n * d)
    m = (h @ fn.float().t()) * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return torch.sigmoid(m * scale.float().reshape(-1)[0] + base.float()) + hc_eps


V4_REFERENCE = {
    "v4_compress_pool": v4_compress_pool,
    "hash_route": hash_route,
    "hc_head_mix": hc_head_mix,
}
