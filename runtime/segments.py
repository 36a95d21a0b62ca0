"""Plan segments as callables: the interpreter's node loop, prepared once per segment.

A `Program` runs a contiguous run of the step graph's nodes with one implementation per op, the
way graph/interp.py does (same argument order, same attributes, values dropped after their last
use), but with attributes resolved and kernels looked up once, so a call does no registry work and
`torch.compile` can trace it. Weights are bound at construction; a call takes the segment's other
inputs (metadata, state, values from earlier segments) and returns the values later segments and
the step's outputs need.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from megagraph.graph.errors import IRError
from megagraph.graph.interp import Impl
from megagraph.graph.ir import Graph, Node
from megagraph.graph.registry import get_op


@dataclass(frozen=True)
class Call:
    """One prepared node: `outputs = fn(*inputs, **attrs)`, then drop dead values."""

    fn: Impl
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    attrs: dict
    drop: tuple[str, ...]  # values whose last use is this call
    label: str  # "op -> %out", for errors


@dataclass(frozen=True)
class SegmentIO:
    """Which values a run of nodes reads from outside and which it must hand on."""

    inputs: tuple[str, ...]  # graph inputs and values of earlier segments (weights excluded)
    weights: tuple[str, ...]
    outputs: tuple[str, ...]  # values used by later segments or named by the graph's outputs


def segment_io(g: Graph, segments: Sequence[Sequence[int]]) -> list[SegmentIO]:
    """Inputs/outputs of each segment (node index lists, in execution order)."""
    weights = set(g.weights)
    owner: dict[str, int] = {}
    for k, idx in enumerate(segments):
        for i in idx:
            for o in g.nodes[i].outputs:
                owner[o] = k
    needed_after: dict[str, int] = {v: len(segments) for _, v in g.outputs}  # value -> last reader
    for k, idx in enumerate(segments):
        for i in idx:
            for v in g.nodes[i].inputs:
                if v is not None:
                    needed_after[v] = max(needed_after.get(v, -1), k)
    out = []
    for k, idx in enumerate(segments):
        read: dict[str, None] = {}
        for i in idx:
            for v in g.nodes[i].inputs:
                if v is not None and owner.get(v, -1) != k:
                    read[v] = None
        defined = [o for i in idx for o in g.nodes[i].outputs]
        out.append(SegmentIO(tuple(v for v in read if v not in weights),
                             tuple(v for v in read if v in weights),
                             tuple(o for o in defined if needed_after.get(o, -1) > k)))
    return out


def _fit_inputs(fn: Impl, inputs: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """Drop trailing absent optional inputs a kernel does not take (an op that gained optional
    inputs, e.g. mega_moe's hash-routing tables, keeps working with kernels written before)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return inputs
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return inputs
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if len(inputs) > n and all(i is None for i in inputs[n:]):
        return inputs[:n]
    return inputs


class Program:
    """A run of graph nodes as one callable over a value dict."""

    def __init__(self, name: str, g: Graph, nodes: Sequence[int], io: SegmentIO,
                 impl_for: Callable[[Node], Impl | None], weights: Mapping[str, torch.Tensor]):
        self.name, self.io = name, io
        self.weights = {w: weights[w] for w in io.weights}
        keep = set(io.outputs) | set(io.inputs) | set(io.weights)
        last: dict[str, int] = {}
        for pos, i in enumerate(nodes):
            for v in g.nodes[i].inputs:
                if v is not None:
                    last[v] = pos
        calls = []
        for pos, i in enumerate(nodes):
            n = g.nodes[i]
            fn = impl_for(n)
            if fn is None:
                raise IRError(f"segment {name}: no implementation of op {n.op!r} (node %{n.outputs[0]})")
            attrs = get_op(n.op).resolve_attrs(n.attr_dict, f"node %{n.outputs[0]}")
            drop = tuple(v for v in dict.fromkeys(x for x in n.inputs if x is not None)
                         if last[v] == pos and v not in keep)
            calls.append(Call(fn, _fit_inputs(fn, n.inputs), n.outputs, attrs, drop,
                              f"{n.op} -> %{n.outputs[0]}"))
        self.calls = tuple(calls)
        self.ops = tuple(g.nodes[i].op for i in nodes)

    def with_weights(self, weights: Mapping[str, torch.Tensor]) -> "Program":
        """The same program over other tensors for (some of) its weights."""
        p = copy.copy(self)
        p.weights = {**self.weights, **weights}
        return p

    def with_wrapped(self, nodes: set[str], wrap: Callable[[Impl], Impl]) -> "Program":
        """The same program with the kernels of `nodes` (first outputs) passed through `wrap`."""
        p = copy.copy(self)
        p.calls = tuple(dataclasses.replace(c, fn=wrap(c.fn)) if c.outputs[0] in nodes else c
                        for c in self.calls)
        return p

    def __call__(self, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the nodes on `env` (metadata, state, earlier values); a failure names the node.

        This loop is also what torch.compile traces and what a CUDA graph captures."""
        vals = {**self.weights, **env}
        for c in self.calls:
            try:
                out = c.fn(*[None if i is None else vals[i] for i in c.inputs], **c.attrs)
            except Exception as e:
                raise RuntimeError(f"segment {self.name}: {c.label} failed: {e}") from e
            vals.update(zip(c.outputs, out if isinstance(out, tuple) else (out,)))
            for d in c.drop:
                del vals[d]
        return {o: vals[o] for o in self.io.outputs}
