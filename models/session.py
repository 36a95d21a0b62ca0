"""A reference session: runs a step graph over successive steps, owning the state and metadata.

This is the smallest correct "engine": it turns a batch description (slot, new tokens) into the
step's metadata tensors (docs/step-convention.md), keeps every state value between steps, and
interprets the graph with the reference kernels. Tests use it to check prefill == incremental
decode == mixed batches; the runtime checks itself against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from megagraph.graph.interp import Impl, interpret
from megagraph.graph.ir import Graph
from megagraph.graph.types import TORCH_DTYPES, eval_dim

from .checkpoint.spec import WeightSpec


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one request in one step."""

    slot: int  # state slot of the request
    tokens: tuple[int, ...]  # new token ids (prefill chunk, one decode token, or verify rows)


def weight_specs(g: Graph) -> list[WeightSpec]:
    """What the graph reads from a checkpoint (stacked expert banks keep their '*')."""
    out = []
    for w in g.weights:
        t = g.types[w]
        if any(isinstance(d, str) for d in t.shape):
            raise ValueError(f"weight @{w} has a symbolic shape {t}")
        out.append(WeightSpec(w, tuple(t.shape), t.dtype))
    return out


def step_metadata(chunks: Sequence[SeqChunk], cached: Mapping[int, int]) -> dict[str, torch.Tensor]:
    """The per-step metadata inputs for requests laid out contiguously in `chunks` order."""
    ids, pos, req = [], [], []
    for r, c in enumerate(chunks):
        if not c.tokens:
            raise ValueError(f"request in slot {c.slot} has no new tokens")
        start = cached.get(c.slot, 0)
        ids += list(c.tokens)
        pos += range(start, start + len(c.tokens))
        req += [r] * len(c.tokens)
    slots = [c.slot for c in chunks]
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one step: {slots}")
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return {"token_ids": i64(ids), "positions": i64(pos), "token_req": i64(req),
            "seq_slots": i64(slots), "seq_cached": i64([cached.get(s, 0) for s in slots]),
            "seq_new": i64([len(c.tokens) for c in chunks])}


def initial_state(g: Graph, *, slots: int, capacity: int) -> dict[str, torch.Tensor]:
    """Zeroed state for every state input (ids that mean 'none' start at -1)."""
    env = {"S": slots, "N": capacity}
    out = {}
    for name in g.state_labels:
        t = g.types[name]
        shape = tuple(eval_dim(d, env) for d in t.shape)
        fill = -1 if t.dtype == "i64" else 0
        out[name] = torch.full(shape, fill, dtype=TORCH_DTYPES[t.dtype])
    return out


class ReferenceSession:
    """Holds state for `slots` requests of up to `capacity` tokens and runs steps."""

    def __init__(self, g: Graph, weights: Mapping[str, torch.Tensor], *, slots: int, capacity: int,
                 constants: Mapping[str, torch.Tensor] | None = None,
                 impls: Mapping[str, Impl] | None = None):
        if impls is None:  # the reference kernels: the model's meaning
            from megagraph.kernels.reference_table import reference_impls

            impls = reference_impls()
        self.graph, self.weights, self.impls = g, weights, impls
        self.slots, self.capacity = slots, capacity
        self.constants = dict(constants or {})
        self.state = initial_state(g, slots=slots, capacity=capacity)
        self.cached: dict[int, int] = {}

    def step(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Run one step; returns the logits output and advances every request's state."""
        for c in chunks:
            if not 0 <= c.slot < self.slots:
                raise ValueError(f"slot {c.slot} out of range 0..{self.slots - 1}")
            if self.cached.get(c.slot, 0) + len(c.tokens) > self.capacity:
                raise ValueError(f"slot {c.slot}: {self.cached.get(c.slot, 0)} cached + "
                                 f"{len(c.tokens)} new tokens exceed the capacity {self.capacity}")
        inputs = {**step_metadata(chunks, self.cached), **self.state, **self.constants}
        out = interpret(self.graph, inputs, self.weights, self.impls)
        for name in self.state:
            self.state[name] = out[name]
        for c in chunks:
            self.cached[c.slot] = self.cached.get(c.slot, 0) + len(c.tokens)
        return out["logits"]

    def release(self, slot: int) -> None:
        """Forget a request: its slot's state is treated as empty from now on."""
        self.cached.pop(slot, None)
