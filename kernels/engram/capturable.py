"""Engram ops without host syncs or host constants: the hash uses the primes / offsets /
multipliers attributes as Python scalars (the reference builds device tensors from Python lists,
a host-to-device copy per call). The history update, the lookup and the gate are the reference's
own: they take no host value and sync on none."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.capturable import I64
from megagraph.kernels.engram.reference import engram_gate, engram_hist_update, engram_lookup


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
