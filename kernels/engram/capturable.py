"""Engram ops without host syncs or host constants: the hash uses the primes / offsets /
multipliers attributes as Python scalars (the reference builds device tensors from Python lists,
a host-to-device copy per call), the history update is the reference's vectorized form."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.graph.types import TORCH_DTYPES

from megagraph.kernels.common.capturable import I64


def token_map(token_ids: Tensor, table: Tensor) -> Tensor:
    return table.index_select(0, token_ids)


def _flat(primes) -> list[int]:
    out: list[int] = []
    for p in primes:
        if isinstance(p, (list, tuple)):
            out.extend(int(v) for v in p)
        else:
            out.append(int(p))
    return out


def engram_hash(cids: Tensor, hist: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                seq_cached: Tensor, *, multipliers, primes, offsets, pad_id: int, max_ngram: int) -> Tensor:
    K = max_ngram
    P = _flat(primes)
    O = [int(o) for o in offsets]
    n_heads = len(P) // (K - 1)
    m = [int(v) for v in multipliers]
    dev = cids.device
    T = cids.shape[0]
    if T == 0:
        return torch.empty(0, len(O), dtype=I64, device=dev)
    slots = seq_slots[token_req]
    c = seq_cached[token_req]
    t_idx = torch.arange(T, dtype=I64, device=dev)
    blocked = torch.zeros(T, dtype=torch.bool, device=dev)
    cols = []
    h = None
    for s in range(K):
        q = positions - s
        src = cids[(t_idx - s).clamp(min=0)].to(I64)
        if s > 0:
            hidx = ((K - 1) - (c - q)).clamp(0, K - 2)
            src = torch.where(q >= c, src, hist[slots, hidx].to(I64))
        src = torch.where(q >= 0, src, -1)
        blocked = blocked | (src < 0)
        tok = torch.where(blocked, pad_id, src)
        term = tok * m[s]
        h = term if h is None else torch.bitwise_xor(h, term)
        if s >= 1:
            for j in range(n_heads):
                col = (s - 1) * n_heads + j
                cols.append(torch.remainder(h, P[col]) + O[col])
    return torch.stack(cols, dim=1)


def engram_hist_update(hist: Tensor, cids: Tensor, positions: Tensor, token_req: Tensor,
                       seq_slots: Tensor, seq_cached: Tensor, seq_new: Tensor) -> Tensor:
    """hist'[slot] = ids of positions c+n-K+1 .. c+n-1 (this step's where >= c, else the old
    history, -1 below 0). Request rows without tokens rewrite their own history unchanged; pad
    rows only write the scratch slot."""
    K1 = hist.shape[1]
    T = cids.shape[0]
    out = hist.clone()
    if K1 == 0 or T == 0:
        return out
    dev = hist.device
    c, n = seq_cached, seq_new
    start = torch.cumsum(n, 0) - n
    j = torch.arange(K1, dtype=I64, device=dev)
    q = (c + n - K1)[:, None] + j[None, :]
    step_idx = (start[:, None] + q - c[:, None]).clamp(0, T - 1)
    old_idx = (j[None, :] + n[:, None]).clamp(max=K1 - 1)
    val = torch.where(q >= c[:, None], cids[step_idx].to(hist.dtype), hist[seq_slots[:, None], old_idx])
    val = torch.where(q >= 0, val, -1)
    out.index_put_((seq_slots,), val)
    return out


def engram_lookup(table: Tensor, scale: Tensor | None, ids: Tensor, *, out_dtype: str = "bf16") -> Tensor:
    """Gather + dequantize into `out_dtype` (sync-free when table, scale and ids share a device; the
    op is a graph break in the IR because the real tables are host-resident)."""
    flat = ids.reshape(-1)
    rows = table.index_select(0, flat)
    if scale is None:
        vals = rows.float()
    else:
        from megagraph.kernels import formats

        vals = formats.dequantize_fp8_rows(rows, scale.index_select(0, flat))
    return vals.reshape(ids.shape[0], -1).to(TORCH_DTYPES[out_dtype])


def engram_gate(H: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, *, eps: float) -> Tensor:
    T, n, d = H.shape
    hf = H.float()
    kvf = kv.float()
    Kk = kvf[:, :n * d].reshape(T, n, d)
    val = kvf[:, n * d:]
    w = q_weight.float() * k_weight.float()
    rho = torch.rsqrt(hf.pow(2).mean(-1) + eps) * torch.rsqrt(Kk.pow(2).mean(-1) + eps)
    z = (hf * w[None] * Kk).sum(-1) * rho / (d ** 0.5)
    gate = torch.sigmoid(torch.sign(z) * torch.sqrt(z.abs().clamp(min=1e-6)))
    return (hf + gate[:, :, None] * val[:, None, :]).to(H.dtype)
