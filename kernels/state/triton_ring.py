"""Sliding-window ring updates on the GPU (Triton): `ring_update` and `ring_update_batched`, the
step's window-KV copies of every layer in ceil(layers / 8) launches (rings grouped by shape and
dtype, up to 8 (ring, kv) pairs per launch), no host synchronization.

Semantics of kernels.attention.reference.ring_update: each request's last (up to) W new rows land at
ring[slot, p % W], cast to the ring's dtype. inplace=True writes into the given rings (a CUDA-graph
runtime's static state); otherwise they are copied first.
"""
from __future__ import annotations

from torch import Tensor

from megagraph.kernels.common.triton import available, on_device as _on_device

BLOCK_D = 512


def _copy_group(rings: list[Tensor], kvs: list[Tensor], positions: Tensor, token_req: Tensor,
                seq_slots: Tensor, last: Tensor, window: int) -> None:
    from megagraph.kernels.state.triton_ring_jit import MAX_PAIRS, ring_copy

    T = positions.shape[0]
    _, W, D = rings[0].shape
    for i in range(0, len(rings), MAX_PAIRS):
        rs, ks = rings[i:i + MAX_PAIRS], kvs[i:i + MAX_PAIRS]
        n = len(rs)
        args = []
        for j in range(MAX_PAIRS):
            args += [rs[min(j, n - 1)], ks[min(j, n - 1)]]
        ring_copy[(T,)](positions, token_req, seq_slots, last, *args,
                        rs[0].stride(0), rs[0].stride(1), ks[0].stride(0),
                        D=D, W=W, NP=n, BD=min(BLOCK_D, 1 << (D - 1).bit_length()), num_warps=4)


def _supported(rings, kvs) -> bool:
    return available() and all(_on_device(r) and r.is_contiguous() for r in rings) and all(
        k.dim() == 2 and k.stride(-1) == 1 and k.stride(0) == kvs[0].stride(0) for k in kvs)


def ring_update_batched(positions: Tensor, token_req: Tensor, seq_slots: Tensor, *operands: Tensor,
                        window: int, layers=None, inplace: bool = False) -> tuple[Tensor, ...]:
    rings, kvs = list(operands[0::2]), list(operands[1::2])
    for r in rings:
        if r.shape[1] != window:
            raise ValueError(f"ring has {r.shape[1]} rows, window is {window}")
    if not _supported(rings, kvs):
        from megagraph.kernels.attention.capturable import ring_update_batched as fallback

        return fallback(positions, token_req, seq_slots, *operands, window=window, inplace=inplace)
    from megagraph.kernels.common.capturable import first_last_positions

    out = rings if inplace else [r.clone() for r in rings]
    if positions.shape[0] == 0:
        return tuple(out)
    _, last = first_last_positions(positions, token_req, seq_slots.shape[0])
    groups: dict = {}
    for r, k in zip(out, kvs):
        groups.setdefault((tuple(r.shape), r.dtype, k.dtype, k.stride(0)), []).append((r, k))
    for pairs in groups.values():
        _copy_group([r for r, _ in pairs], [k for _, k in pairs], positions, token_req, seq_slots,
                    last, window)
    return tuple(out)


def ring_update(ring: Tensor, kv: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor, *,
                window: int, inplace: bool = False) -> Tensor:
    return ring_update_batched(positions, token_req, seq_slots, ring, kv, window=window,
                               inplace=inplace)[0]


ring_update.capturable = True
ring_update_batched.capturable = True

__all__ = ["ring_update", "ring_update_batched"]
