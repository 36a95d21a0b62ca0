"""What a cached prefix keeps of a slot's state, and the copies between slots and cached nodes.

A slot's state (runtime/state.py) holds three kinds of tensors, and a prefix cache treats each
by what its content depends on:

* **by position** (`N` or `N/r` rows: compressed KV, index keys): row k holds positions
  [k*r, (k+1)*r) and never changes once its group is complete. A cached node keeps the complete
  rows of its token span; a resume at position e restores rows [0, e // r) from the nodes on the
  path. These are exact whatever happened later in the slot.
* **at the end** (compressor pending rows, the Engram history): the state of the last tokens
  before e. A snapshot of the node's end keeps them. V4.1's compressors keep only the current
  group's rows, so at a position that is a multiple of every ratio (`align`) the pending rows are
  never read and the Engram history is a function of the token ids: any aligned position on a
  cached path is a resume point without a snapshot. V4's overlapping compressors (ratio 4 keeps
  the previous group too) need the snapshot.
* **the window tail** (every layer's sliding-window ring, the DSpark draft rings): W rows per
  layer, addressed by position mod W. A snapshot keeps it (exact resume); without it the
  encoder-replay graph (passes/encoder_replay.py) rebuilds the rings from the last W cached
  tokens (approximate: the first replayed tokens see a truncated window).

Everything here runs where steps run (the step worker thread, or the scheduler thread while no
step is in flight): the copies are ordered with the steps that write the slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from megagraph.graph.ir import Graph
from megagraph.graph.types import TORCH_DTYPES

from .batch import SeqChunk, make_batch


@dataclass(frozen=True)
class StateLayout:
    """The state labels of a step graph by how a cached prefix keeps them."""

    by_position: dict[str, int]  # label -> ratio (row k holds positions [k*r, (k+1)*r))
    at_end: tuple[str, ...]  # pending rows, Engram history: a snapshot of the node's end
    window: tuple[str, ...]  # rings (incl. draft rings): the window tail
    align: int  # lcm of the ratios: resume points without a snapshot are multiples of it
    aligned_resume: bool  # pending rows unread at aligned positions (no overlapping compressor)
    engram_hist: str | None  # label of the Engram history (rebuilt from token ids), if any

    @classmethod
    def from_graph(cls, g: Graph) -> "StateLayout":
        by_pos, at_end, window = {}, [], []
        for name in g.state_labels:
            dims = g.types[name].shape[1:]
            d = dims[0] if dims else None
            if isinstance(d, str) and d.startswith("N"):
                by_pos[name] = int(d.split("/")[1]) if "/" in d else 1
            elif name.endswith(".ring"):
                window.append(name)
            else:
                at_end.append(name)
        overlap = False
        for name in at_end:
            if ".pend_" not in name:
                continue
            owner = name.split(".pend_")[0]
            cache = owner if owner in by_pos else f"{owner}.ckv"
            rows = g.types[name].shape[1]
            if cache not in by_pos or rows != by_pos[cache]:
                overlap = True  # keeps more than the current group (V4's ratio-4 compressors)
        align = math.lcm(*by_pos.values()) if by_pos else 1
        hist = "engram_hist" if "engram_hist" in at_end else None
        return cls(by_pos, tuple(at_end), tuple(window), align, not overlap, hist)

    def row_bytes(self, state: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Bytes of one row of each by-position tensor."""
        return {k: state[k][0, 0].numel() * state[k].element_size() for k in self.by_position}

    def rows_of(self, label: str, start: int, end: int) -> tuple[int, int]:
        """Complete rows of `label` for the token span [start, end): the span's share of the
        partition of rows by floor(position / ratio)."""
        r = self.by_position[label]
        return start // r, end // r


@dataclass
class Snapshot:
    """A slot's state as a cached node keeps it: rows of its span, and optionally its end."""

    start: int  # first position of the span
    end: int  # tokens of state the snapshot describes
    rows: dict[str, torch.Tensor]  # by-position label -> rows [start//r, end//r)
    at_end: dict[str, torch.Tensor] | None  # label -> the slot's tensor (None: not captured)
    window: dict[str, torch.Tensor] | None  # ring label -> the slot's ring (None: not kept)
    approx: bool = False  # the slot's state descends from an encoder replay (not a cold prefill)

    def nbytes(self) -> int:
        parts = [self.rows, self.at_end or {}, self.window or {}]
        return sum(t.numel() * t.element_size() for p in parts for t in p.values())


def capture(state: Mapping[str, torch.Tensor], layout: StateLayout, slot: int, start: int,
            end: int, *, ends: bool = True) -> Snapshot:
    """Copy `slot`'s rows for [start, end) and (with `ends`) its end state and window tail.
    The slot must hold exactly `end` tokens of state (no later token written)."""
    rows = {}
    for lab in layout.by_position:
        a, b = layout.rows_of(lab, start, end)
        rows[lab] = state[lab][slot, a:b].clone()
    at_end = {lab: state[lab][slot].clone() for lab in layout.at_end} if ends else None
    window = {lab: state[lab][slot].clone() for lab in layout.window} if ends else None
    return Snapshot(start, end, rows, at_end, window)


def restore_rows(state: dict[str, torch.Tensor], layout: StateLayout, slot: int,
                 parts: list[tuple[int, int, dict[str, torch.Tensor]]], upto: int) -> None:
    """Write the by-position rows of the spans `parts` ((start, end, rows) in order from 0) into
    `slot`, up to position `upto` (rows of groups complete before it)."""
    for start, end, rows in parts:
        for lab, t in rows.items():
            a, b = layout.rows_of(lab, start, end)
            stop = min(b, upto // layout.by_position[lab])
            if stop > a:
                state[lab][slot, a:stop].copy_(t[: stop - a], non_blocking=True)


def restore_end(state: dict[str, torch.Tensor], slot: int,
                tensors: Mapping[str, torch.Tensor]) -> None:
    for lab, t in tensors.items():
        state[lab][slot].copy_(t, non_blocking=True)


def clear(state: dict[str, torch.Tensor], slot: int, labels) -> None:
    """Initial values (zeros, -1 for ids) for `labels` of `slot`: nothing stale survives."""
    for lab in labels:
        t = state[lab]
        t[slot].fill_(-1 if t.dtype == TORCH_DTYPES["i64"] else 0)


def engram_history(token_map: torch.Tensor, tokens: list[int], at: int, width: int) -> torch.Tensor:
    """The Engram history after `at` tokens: the compressed ids of positions at-width .. at-1
    (most recent last), -1 before position 0 (models/engram.py `engram_hist_update`)."""
    ids = [tokens[p] if p >= 0 else -1 for p in range(at - width, at)]
    t = torch.tensor(ids, dtype=torch.int64, device=token_map.device)  # gather where the map is
    return torch.where(t >= 0, token_map[t.clamp(min=0)], torch.full_like(t, -1))


class EncoderReplayer:
    """Runs the plan's encoder-replay graph over the engine's pools: rebuilds one slot's rings
    from the `len(tokens)` tokens that end at position `end` (the rest of the state restored)."""

    def __init__(self, engine):
        from .kernels import resolve_kernels
        from .plan import ArtifactsError, SegmentPlan
        from .step import StepProgram

        plan = engine.plan
        g = plan.extra_graphs.get("encoder-replay")
        if g is None:
            raise ArtifactsError(f"{plan.source or 'artifacts'}: no encoder-replay graph; compile "
                                 "again (the pass is on by default) or serve with "
                                 "--prefix-cache-mode exact")
        from .weights import host_resident

        ks = resolve_kernels(plan, [g], engine.device, allow_fallback=engine.config.allow_fallback,
                             override=engine.config.kernels)
        if engine.device.type == "cuda":  # nodes over host-resident weights run where they are
            ks.run_on_host(g, host_resident(plan.graph))
        seg = (SegmentPlan(0, "eager", tuple(range(len(g.nodes))), "encoder replay runs eagerly"),)
        self.engine = engine
        self.program = StepProgram(g, seg, ks, engine.weights, engine.constants, engine.state)

    def run(self, slot: int, tokens: list[int], end: int) -> None:
        batch = make_batch([SeqChunk(slot, tuple(tokens))], {slot: end - len(tokens)})
        dev = self.engine.device
        self.program.run({k: v.to(dev) for k, v in batch.meta.items()})


def apply_resume(engine, layout: StateLayout, replayer: EncoderReplayer | None, slot: int,
                 resume, tokens: list[int]) -> None:
    """Start `slot` from a prefix-cache hit (runtime/prefix_cache.py `Resume`): its rows, end
    state and window tail restored, or the window rebuilt by encoder replay; then the engine
    counts `resume.end` tokens in the slot."""
    state, end = engine.state, resume.end
    if resume.events:
        stream = torch.cuda.current_stream(engine.device)
        for ev in resume.events:
            stream.wait_event(ev)
    restore_rows(state, layout, slot, resume.parts, end)
    clear(state, slot, layout.at_end)
    if resume.at_end is not None:
        restore_end(state, slot, resume.at_end)
    hist = layout.engram_hist
    token_map = engine.constants.get("engram_token_map")
    if resume.kind == "exact":
        restore_end(state, slot, resume.window)
    else:
        clear(state, slot, layout.window)
        start = end - resume.replay
        width = state[hist].shape[1] if hist else 0
        if hist:
            state[hist][slot] = engram_history(token_map, tokens, start, width)
        replayer.run(slot, tokens[start:end], end)
        if hist and resume.at_end is None:
            state[hist][slot] = engram_history(token_map, tokens, end, width)
        elif hist:
            restore_end(state, slot, {hist: resume.at_end[hist]})
    engine.cached[slot] = end


class SlotCache:
    """The prefix cache's hands on the engine's pools: ops to run where steps run."""

    def __init__(self, engine, layout: StateLayout, replayer: EncoderReplayer | None):
        self.engine, self.layout, self.replayer = engine, layout, replayer

    def restore(self, slot: int, resume, tokens: list[int]):
        return lambda: apply_resume(self.engine, self.layout, self.replayer, slot, resume, tokens)

    def capture(self, slot: int, start: int, end: int, approx: bool = False):
        def op():
            snap = capture(self.engine.state, self.layout, slot, start, end)
            snap.approx = approx
            return snap
        return op
