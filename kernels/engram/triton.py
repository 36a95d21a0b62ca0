"""Engram hashing and the gated write on the GPU (Triton), kernels.engram.reference semantics.

engram_hash: one launch for all 24 columns (the capturable version is ~80 small torch kernels);
the multipliers / primes / offsets table is built on the device once per attribute set and cached
(a call that would have to build it inside CUDA-graph capture runs the capturable kernel instead).
engram_gate: one program per (token, stream), two passes over the 5120 channels (reductions, then
H + gate * value), fp32 math. The row gather (engram_lookup) stays a host-side break: the real
tables are memory-mapped on the host.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device

_TABLES: dict = {}


def _table(dev, multipliers, primes, offsets) -> Tensor | None:
    from megagraph.kernels.engram.capturable import _flat

    key = (dev, tuple(int(m) for m in multipliers), tuple(_flat(primes)), tuple(int(o) for o in offsets))
    tab = _TABLES.get(key)
    if tab is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        tab = torch.tensor(key[1] + key[2] + key[3], dtype=torch.int64, device=dev)
        _TABLES[key] = tab
    return tab


def engram_hash(cids: Tensor, hist: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                seq_cached: Tensor, *, multipliers, primes, offsets, pad_id: int, max_ngram: int) -> Tensor:
    tab = _table(cids.device, multipliers, primes, offsets) if (available() and _on_device(cids)) else None
    T = cids.shape[0]
    if tab is None or T == 0 or max_ngram < 2:
        from megagraph.kernels.engram.capturable import engram_hash as fallback

        return fallback(cids, hist, positions, token_req, seq_slots, seq_cached,
                        multipliers=multipliers, primes=primes, offsets=offsets, pad_id=pad_id,
                        max_ngram=max_ngram)
    import triton

    from megagraph.kernels.engram.triton_jit import engram_hash_fwd

    nc = len(offsets)
    out = torch.empty(T, nc, dtype=torch.int64, device=cids.device)
    bt = 64
    engram_hash_fwd[(triton.cdiv(T, bt),)](
        cids, hist, positions, token_req, seq_slots, seq_cached, tab, out, T, int(pad_id),
        hist.stride(0), K=max_ngram, NH=nc // (max_ngram - 1), BT=bt, num_warps=2)
    return out


def engram_gate(H: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, *, eps: float) -> Tensor:
    T, n, d = H.shape
    if not (available() and _on_device(H)) or kv.stride(-1) != 1 or H.stride(-1) != 1:
        from megagraph.kernels.engram.capturable import engram_gate as fallback

        return fallback(H, kv, q_weight, k_weight, eps=eps)
    from megagraph.kernels.engram.triton_jit import engram_gate_fwd

    out = torch.empty_like(H)
    if T == 0:
        return out
    engram_gate_fwd[(T, n)](
        H, kv, q_weight.contiguous(), k_weight.contiguous(), out, float(eps), 1.0 / d ** 0.5,
        H.stride(0), H.stride(1), kv.stride(0), out.stride(0), out.stride(1),
        N=n, D=d, BD=1024 if not INTERPRET else 256, MANUAL=INTERPRET, num_warps=4)
    return out


engram_hash.capturable = True
engram_gate.capturable = True

__all__ = ["engram_hash", "engram_gate"]
