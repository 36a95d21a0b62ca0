"""MoE without host syncs: routers (already sync-free in the reference), the shared SwiGLU expert,
and the routed experts as an expert-sorted grouped GEMM over static tiles.

moe_experts: the T*k (token, slot) pairs are sorted by expert id (stable) and cut into
expert-aligned tiles of M rows (M ~ 4 * T*k / E, at most MAX_EXPERT_TILE); there are at most
T*k // M + E tiles (static), so at most that many expert dequantizations (the reference does one
per distinct expert). Each tile dequantizes its expert's weights once and runs the SwiGLU
on its rows; results return to their pairs, are weighted and summed over k in slot order.
With T*k <= E there are at most T*k tiles: only selected experts' weights are read. Rows of
pad tokens are ordinary rows (their own pairs), so they cannot change real rows.
"""
from __future__ import annotations

import torch
from torch import Tensor

# route is the reference's own (sync-free as it is)
from megagraph.kernels.moe.reference import route, router_scores

from megagraph.kernels.common import capturable as _common
from megagraph.kernels.common.capturable import I64, chunk_ranges, dequantize, e2m1_pair_table, scatter_rows, segment_tiles


def hash_route(x: Tensor, gate_w: Tensor, tid2eid: Tensor, token_ids: Tensor, *, topk: int,
               route_scale: float, score_func: str = "sqrtsoftplus",
               norm_topk: bool = True) -> tuple[Tensor, Tensor]:
    if tid2eid.shape[1] != topk:
        raise ValueError(f"tid2eid has {tid2eid.shape[1]} columns, topk is {topk}")
    sc = router_scores(x.float() @ gate_w.float().t(), score_func)
    ids = tid2eid.index_select(0, token_ids).to(I64)
    wts = sc.gather(1, ids)
    if norm_topk:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, wts * route_scale


def _act(g: Tensor, u: Tensor, swiglu_limit: float | None) -> Tensor:
    if swiglu_limit is not None and swiglu_limit > 0:
        u = u.clamp(-swiglu_limit, swiglu_limit)
        g = g.clamp(max=swiglu_limit)
    return torch.nn.functional.silu(g) * u


def swiglu_mlp(x: Tensor, w1: Tensor, w1_scale: Tensor | None, w3: Tensor, w3_scale: Tensor | None,
               w2: Tensor, w2_scale: Tensor | None, *, fmt: str = "dense",
               swiglu_limit: float | None = 0.0) -> Tensor:
    xf = x.float()
    h = _act(xf @ dequantize(w1, w1_scale, fmt).t(), xf @ dequantize(w3, w3_scale, fmt).t(), swiglu_limit)
    return (h @ dequantize(w2, w2_scale, fmt).t()).to(x.dtype)


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, w1: Tensor, w1_scale: Tensor | None,
                w3: Tensor, w3_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, *,
                fmt: str = "dense", swiglu_limit: float | None = 0.0) -> Tensor:
    T, d = x.shape
    k = ids.shape[1]
    E, F = w1.shape[0], w1.shape[1]
    N = T * k
    dev = x.device
    if N == 0:
        return torch.zeros(T, d, dtype=x.dtype, device=dev)
    xf = x.float()
    flat = ids.reshape(-1).clamp(0, E - 1)
    sorted_ids, perm = torch.sort(flat, stable=True)  # perm[s] = pair at sorted position s
    fill = _common.EXPERT_TILE_FILL * -(-N // E)
    tiles = segment_tiles(sorted_ids, E, max(1, min(_common.MAX_EXPERT_TILE, fill)))
    M = tiles.tile
    pair_out = torch.empty(N + 1, d, dtype=torch.float32, device=dev)

    def sc(s: Tensor | None, e: Tensor) -> Tensor | None:
        return None if s is None else s[e]

    lut = e2m1_pair_table(dev) if fmt == "mxfp4" else None
    per_tile = 3 * F * d + M * (2 * d + 3 * F)
    for b0, b1 in chunk_ranges(tiles.count, per_tile):
        e = tiles.seg[b0:b1]
        pair = perm[tiles.items[b0:b1]]  # [n, M]
        xt = xf[torch.div(pair, k, rounding_mode="floor")]  # [n, M, d]
        W1 = dequantize(w1[e], sc(w1_scale, e), fmt, lut)  # [n, F, d]
        W3 = dequantize(w3[e], sc(w3_scale, e), fmt, lut)
        W2 = dequantize(w2[e], sc(w2_scale, e), fmt, lut)  # [n, d, F]
        h = _act(torch.bmm(xt, W1.transpose(1, 2)), torch.bmm(xt, W3.transpose(1, 2)), swiglu_limit)
        y = torch.bmm(h, W2.transpose(1, 2))  # [n, M, d]
        scatter_rows(pair_out, pair, tiles.item_valid[b0:b1], y)
    y = pair_out[:N].reshape(T, k, d) * weights.float()[:, :, None]
    return y.sum(dim=1).to(x.dtype)
