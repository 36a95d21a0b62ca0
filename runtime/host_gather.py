"""Row gathers from host-resident tables (Engram) into reused, pinned staging buffers.

Why: an Engram lookup at a prefill step gathers tokens x heads rows (8192 x 24 = 196,608 rows of
256 B: 50 MB) from a memory-mapped table. Gathering into a fresh tensor every step makes the OS
fault in 50 MB of new pages first: on 2 CPU cores 18-22 ms per gather against 3.5 ms into an
already-touched buffer, and on the H200 host the step's engram_lookup varied between 13 and 40 ms
from call to call. A fresh pageable tensor also makes the host-to-device copy a staged, synchronous
one. Here each (dtype, row width) has one staging buffer that grows to the largest gather seen and
is reused. For a CUDA destination it is pinned, so the copy is asynchronous on the current stream.
A CUDA event recorded after that copy is waited for before the buffer is written again, so a later
gather never overwrites rows that are still in flight.

A CPU destination gets its own tensor (a clone), never a view of the staging buffer, which the
next gather reuses. The runtime never asks for one: a step on the CPU reads the table in place
(runtime.kernels.gather_on_host).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class _Slot:
    """One staging buffer and the event of the last copy out of it (None: no copy in flight)."""

    buf: torch.Tensor
    done: object | None = None


@dataclass
class HostStaging:
    """Staging buffers per (dtype, row width, pinned). Thread-safe: one lock around every gather."""

    slots: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def gather(self, table: torch.Tensor, flat: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """table[flat] (flat: 1-D int64 on table's device) on `dev`: gathered into the staging
        buffer (index_select out=), then copied to dev (asynchronously from pinned memory for
        CUDA). Rows keep the table's dtype (its storage format)."""
        if table.device.type != "cpu":
            return table.index_select(0, flat).to(dev)  # not a host table: nothing to stage
        pin = dev.type == "cuda" and torch.cuda.is_available()
        with self.lock:
            slot, out = self.stage(table, flat, pin)
            # a CPU destination gets a copy of its own (the next gather reuses the buffer)
            moved = out.to(dev, non_blocking=pin) if dev.type != "cpu" else out.clone()
            if pin:
                slot.done = torch.cuda.Event()
                slot.done.record(torch.cuda.current_stream(dev))
            return moved

    def stage(self, table: torch.Tensor, flat: torch.Tensor, pin: bool):
        """(slot, table[flat] as a view of the slot's buffer): the host half of gather, without
        its lock (gather holds it; benchmarks/probes/host_gather.py times this alone). The view is
        valid until the next stage of the same (dtype, width, pin)."""
        n = flat.numel()
        width = tuple(table.shape[1:])
        key = (table.dtype, width, pin)
        slot = self.slots.get(key)
        if slot is not None and slot.done is not None:
            slot.done.synchronize()  # the last copy out of this buffer has landed
            slot.done = None
        if slot is None or slot.buf.shape[0] < n:
            rows = max(n, 0 if slot is None else 2 * slot.buf.shape[0])
            buf = torch.empty((rows, *width), dtype=table.dtype, pin_memory=pin)
            slot = self.slots[key] = _Slot(buf)
        out = slot.buf[:n]
        torch.index_select(table, 0, flat, out=out)
        return slot, out

    def nbytes(self) -> int:
        """Host memory held by the staging buffers."""
        return sum(s.buf.numel() * s.buf.element_size() for s in self.slots.values())


STAGING = HostStaging()


def host_rows(table: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor,
              dev: torch.device, staging: HostStaging = STAGING):
    """(rows, scales, local ids) on `dev`: the rows `ids` names, gathered where the table lives,
    in storage format, and ids renumbered 0..n-1 over them."""
    flat = ids.reshape(-1).to(table.device)
    rows = staging.gather(table, flat, dev)
    sc = None if scale is None else staging.gather(scale, flat, dev)
    return rows, sc, torch.arange(flat.numel(), device=dev).reshape(ids.shape)
