"""State pools (one tensor per state input of the step graph) and the slot allocator.

Pools are allocated once at fixed addresses (captured CUDA graphs read and write them in place)
and initialised exactly as models/session.py does: zeros, and -1 for id tensors. The last slot is
reserved as scratch: padding requests of a bucket all point at it, so their writes never touch a
real request's state.
"""

from __future__ import annotations

import math

import torch

from megagraph.graph.types import TORCH_DTYPES
from megagraph.graph.ir import Graph
from megagraph.models.session import initial_state


def capacity_multiple(g: Graph) -> int:
    """Capacities must be multiples of this (compressed caches hold N/r rows)."""
    ks = {int(d.split("/")[1]) for n in g.state_labels for d in g.types[n].shape
          if isinstance(d, str) and "/" in d}
    return math.lcm(*ks) if ks else 1


def allocate_state(g: Graph, *, num_slots: int, capacity: int,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{state label: pool [S, ...]} for every state input of `g`, on `device`."""
    k = capacity_multiple(g)
    if capacity % k:
        raise ValueError(f"capacity {capacity} must be a multiple of {k} (the compressed caches "
                         f"of {g.name} hold N/{k} rows); use {capacity + k - capacity % k}")
    with torch.device(device):
        return initial_state(g, slots=num_slots, capacity=capacity)


def state_bytes_per_slot(g: Graph, capacity: int) -> int:
    """Bytes one slot of every state pool takes at `capacity` tokens (for the memory fit check)."""
    return sum(g.types[name].nbytes({"S": 1, "N": capacity}) for name in g.state_labels)


def reset_slot(state: dict[str, torch.Tensor], slot: int) -> None:
    """Put one slot back to its initial values (not needed for correctness: a request's
    `seq_cached` already hides stale rows; used when a slot is reused and tests compare pools)."""
    for t in state.values():
        t[slot].fill_(-1 if t.dtype == TORCH_DTYPES["i64"] else 0)


class SlotAllocator:
    """Hands out state slots 0..S-2; slot S-1 is the scratch slot for padding requests."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (one real slot + the scratch slot), got {num_slots}")
        self.scratch_slot = num_slots - 1
        self._free = list(range(num_slots - 2, -1, -1))  # pop() gives the lowest slot first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self.scratch_slot} real slots are in use)")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot == self.scratch_slot or slot in self._free or not 0 <= slot < self.scratch_slot:
            raise ValueError(f"slot {slot} is not an allocated slot")
        self._free.append(slot)
        self._free.sort(reverse=True)
