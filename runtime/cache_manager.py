"""Decode-state cache: pool sizing from a memory budget, admission, preemption, usage metrics.

The engine's state pools (runtime/state.py) are slot-major: one slot holds every kind of decode
state the plan declares (sliding-window rings, compressed KV, index keys, compressor pending rows,
Engram history, DSpark draft rings) for up to `capacity` tokens. `size_cache` turns a byte budget
(a fraction of free device memory after weights, or `--state-bytes`) into a slot count, using the
per-slot and per-token bytes of the step graph's state types.

`CacheManager` is what the scheduler asks before running anything. It hands out slots and keeps a
token ledger against `max_total_tokens` (default: every slot full, so nothing can overcommit;
set lower, admission gets stricter and running requests are preempted by recompute when decode
growth does not fit, the way a paged pool behaves). A slot is reusable as soon as its sequence
will not be scheduled again: steps run in order, and the engine's count for the slot is reset by
the step worker right before the first step of the next owner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megagraph.graph.ir import Graph

#: state label pattern -> kind (first match wins; draft rings before the other rings)
STATE_KINDS = (("mtp.", "draft_state"), (".ring", "rings"), (".ckv", "compressed_kv"),
               (".ikey", "index_keys"), (".pend_", "pending_rows"),
               ("engram_hist", "engram_history"))


class CacheSizingError(ValueError):
    """The budget cannot hold even one request; the message names the flag to change."""


def state_kind(label: str) -> str:
    return next((k for pat, k in STATE_KINDS if pat in label), "other")


def state_bytes_by_kind(g: Graph, capacity: int) -> dict[str, int]:
    """Bytes one slot of each state kind takes at `capacity` tokens."""
    out: dict[str, int] = {}
    for name in g.state_labels:
        k = state_kind(name)
        out[k] = out.get(k, 0) + g.types[name].nbytes({"S": 1, "N": capacity})
    return dict(sorted(out.items()))


def free_device_bytes(device: str) -> int:
    """Free memory of `device`: CUDA's free bytes, MemAvailable on the host."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class CacheSizing:
    """How many request slots the state pools get, and why."""

    slots: int  # request slots (the engine adds one scratch slot)
    capacity: int  # tokens per slot (prompt + output)
    bytes_per_slot: int  # every state kind, at capacity
    bytes_by_kind: dict[str, int]  # per slot, at capacity
    budget_bytes: int  # bytes the pools may use
    limited_by: str  # "max_running" or "memory"

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {_mib(v)}" for k, v in self.bytes_by_kind.items())
        return (f"{self.slots} slots x {self.capacity} tokens, {_mib(self.bytes_per_slot)}/slot "
                f"({kinds}); budget {_mib(self.budget_bytes)}, limited by {self.limited_by}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def size_cache(g: Graph, *, capacity: int, max_running: int, weight_bytes: int = 0,
               mem_fraction: float = 0.9, state_bytes: int | None = None,
               device: str = "cpu", free_bytes: int | None = None) -> CacheSizing:
    """Slots = min(max_running, budget // bytes per slot).

    budget = `state_bytes` when given, else `mem_fraction` x (free device memory - weights).
    """
    if not 0 < mem_fraction <= 1:
        raise CacheSizingError(f"--mem-fraction must be in (0, 1], got {mem_fraction}")
    by_kind = state_bytes_by_kind(g, capacity)
    per_slot = max(sum(by_kind.values()), 1)
    if state_bytes is None:
        free = free_device_bytes(device) if free_bytes is None else free_bytes
        budget = int(mem_fraction * max(free - weight_bytes, 0))
    else:
        budget = int(state_bytes)
    fit = budget // per_slot - 1  # one slot is the engine's scratch slot
    if fit < 1:
        raise CacheSizingError(
            f"the state budget {_mib(budget)} holds no request: one slot needs {_mib(per_slot)} "
            f"at --capacity {capacity} (plus a scratch slot); lower --capacity, raise "
            f"--mem-fraction or pass --state-bytes")
    slots = min(max_running, fit)
    return CacheSizing(slots, capacity, per_slot, by_kind, budget,
                       "max_running" if slots == max_running else "memory")


@dataclass
class CacheUsage:
    """A snapshot for /metrics."""

    slots_used: int
    slots_total: int
    tokens_used: int
    tokens_total: int
    bytes_used: int
    bytes_total: int
    preemptions: int
    by_kind_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return max(self.slots_used / max(self.slots_total, 1),
                   self.tokens_used / max(self.tokens_total, 1))


class CacheManager:
    """Slots and a token ledger over the engine's pools (single-threaded: the scheduler's)."""

    def __init__(self, engine, sizing: CacheSizing, max_total_tokens: int | None = None):
        self.engine = engine
        self.sizing = sizing
        self.num_slots = engine.slots.scratch_slot
        full = self.num_slots * sizing.capacity
        self.max_total_tokens = full if max_total_tokens is None else int(max_total_tokens)
        if not sizing.capacity <= self.max_total_tokens <= full:
            raise CacheSizingError(f"--max-total-tokens must be in [{sizing.capacity}, {full}] "
                                   f"(one full request .. every slot full), got {max_total_tokens}")
        self._tokens: dict[int, int] = {}  # owner id -> tokens reserved
        self._slot_of: dict[int, int] = {}
        self._resets: list[int] = []
        self.tokens_used = 0
        self.preemptions = 0

    @property
    def tokens_free(self) -> int:
        return self.max_total_tokens - self.tokens_used

    @property
    def slots_free(self) -> int:
        return self.engine.slots.num_free

    def can_admit(self, tokens: int, headroom: int = 0) -> bool:
        """A slot is free and `tokens` (+ `headroom` for the running requests' next decode
        tokens) fit the ledger."""
        return self.slots_free > 0 and tokens + headroom <= self.tokens_free

    def admit(self, owner: int, tokens: int) -> int:
        if not self.can_admit(tokens):
            raise RuntimeError(f"cache: cannot admit {tokens} tokens ({self.tokens_free} free, "
                               f"{self.slots_free} slots free)")
        slot = self.engine.slots.allocate()
        self._slot_of[owner] = slot
        self._tokens[owner] = tokens
        self.tokens_used += tokens
        return slot

    def grow(self, owner: int, tokens: int) -> bool:
        """Reserve `tokens` more for `owner`; False (nothing reserved) when they do not fit."""
        if tokens > self.tokens_free:
            return False
        self._tokens[owner] += tokens
        self.tokens_used += tokens
        return True

    def unreserve(self, owner: int) -> None:
        """Give back `owner`'s tokens now (it is being preempted; its slot follows later)."""
        self.tokens_used -= self._tokens.get(owner, 0)
        self._tokens[owner] = 0

    def release(self, owner: int) -> None:
        """Free `owner`'s slot and tokens now; the slot may be handed out again at once.

        Steps run in submission order, so a step still in flight that writes the slot for its
        old owner runs before any step of the new owner; the engine's per-slot token count is
        reset between the two by the worker (`take_resets()` goes with the next step)."""
        self.unreserve(owner)
        self._tokens.pop(owner, None)
        slot = self._slot_of.pop(owner, None)
        if slot is not None:
            self.engine.slots.free(slot)
            self._resets.append(slot)

    def take_resets(self) -> list[int]:
        """Slots whose engine token count must be reset before the next step runs."""
        out, self._resets = self._resets, []
        return out

    def usage(self) -> CacheUsage:
        used_slots = len(self._slot_of)
        per_slot = self.sizing.bytes_per_slot
        per_token = per_slot / max(self.sizing.capacity, 1)
        return CacheUsage(used_slots, self.num_slots, self.tokens_used, self.max_total_tokens,
                          int(self.tokens_used * per_token), self.num_slots * per_slot,
                          self.preemptions,
                          {k: v * used_slots for k, v in self.sizing.bytes_by_kind.items()})
