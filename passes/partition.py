"""Breakable prefill partitioning: cut the step into CUDA-graph segments between eager breaks.

Whether an op can be captured is a property of the op (`capture` in its registry entry: host
synchronization, data-dependent shapes, host-resident tables, ...), never decided here. This pass
only orders and groups: it hoists the breaks (with the capturable nodes they need) to the front of
the step, so that all of them run in one eager island before one long captured segment, and writes
the resulting segments into the graph's meta. The plan (passes/plan.py) adds buckets and memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megagraph.graph.ir import Graph, Node
from megagraph.graph.registry import get_op

from .base import Pass, PassResult, register_pass
from .hw import HwProfile


@dataclass(frozen=True)
class Segment:
    """A run of nodes executed the same way: captured in a CUDA graph, or eagerly."""

    kind: str  # "graph" or "eager"
    nodes: tuple[Node, ...]
    reasons: tuple[str, ...] = field(default=())  # eager only: "op: why it cannot be captured"

    @property
    def first(self) -> str:
        return self.nodes[0].outputs[0]

    @property
    def last(self) -> str:
        return self.nodes[-1].outputs[0]

    def describe(self) -> str:
        span = self.first if len(self.nodes) == 1 else f"{self.first} .. {self.last}"
        text = f"{self.kind} {len(self.nodes)} node(s): {span}"
        return text + (f" ({'; '.join(self.reasons)})" if self.reasons else "")


def is_break(n: Node) -> bool:
    return get_op(n.op).is_break


def segments(g: Graph) -> list[Segment]:
    """Maximal runs of capturable nodes, separated by runs of breaks (in node order)."""
    out: list[Segment] = []
    run: list[Node] = []
    kind = None
    for n in g.nodes:
        k = "eager" if is_break(n) else "graph"
        if k != kind and run:
            out.append(_segment(kind, run))
            run = []
        kind = k
        run.append(n)
    if run:
        out.append(_segment(kind, run))
    return out


def _segment(kind: str, nodes: list[Node]) -> Segment:
    reasons = ()
    if kind == "eager":
        reasons = tuple(dict.fromkeys(f"{n.op}: {get_op(n.op).break_reason}" for n in nodes))
    return Segment(kind, tuple(nodes), reasons)


def hoist_breaks(g: Graph) -> tuple[Graph, int]:
    """Order = (capturable ancestors of the breaks) + (breaks) + (everything else); returns the
    graph unchanged when a break depends on another break (they cannot share one island)."""
    prod = g.producers()
    breaks = [n for n in g.nodes if is_break(n)]
    if not breaks:
        return g, 0
    need: set[str] = set()
    stack = [i for b in breaks for i in b.inputs if i is not None]
    while stack:
        v = stack.pop()
        p = prod.get(v)
        if p is None or p.outputs[0] in need:
            continue
        if is_break(p):
            return g, 0
        need.add(p.outputs[0])
        stack.extend(i for i in p.inputs if i is not None)
    b_ids = {b.outputs[0] for b in breaks}
    order = ([n for n in g.nodes if n.outputs[0] in need] + breaks
             + [n for n in g.nodes if n.outputs[0] not in need and n.outputs[0] not in b_ids])
    if order == list(g.nodes):
        return g, 0
    return g.with_nodes(order), len(need) + len(breaks)


@register_pass
@dataclass(frozen=True)
class PartitionPrefill(Pass):
    """Group the eager breaks into one island and record the CUDA-graph segments.

    before (V4.1 tiny: Engram row gathers from host tables inside layers 1 and 4):
      ... layer 0 ... | engram_lookup (L1) | layers 1-4 ... | engram_lookup (L4) | layers 4-8
    after:
      %engram.cids = token_map(...) ; %L1.engram.ids = engram_hash(...) ; %L4.engram.ids = ...
      %L1.engram.rows = engram_lookup(...) ; %L4.engram.rows = engram_lookup(...)     # eager
      %emb = embed(...) ... everything else ...                                        # captured
      meta segments=["graph 3 node(s): ...", "eager 2 node(s): ... (engram_lookup: ...)", ...]
    """

    name: ClassVar[str] = "partition-prefill"
    hw: HwProfile
    hoist: bool = True  # move the breaks (and what they need) to the front of the step

    def run(self, g: Graph) -> PassResult:
        if not self.hw.cuda_graphs:
            return self.skip(g, f"profile {self.hw.name} has no CUDA graphs: every step runs eagerly")
        moved = 0
        if self.hoist:
            g, moved = hoist_breaks(g)
        segs = segments(g)
        buckets = self.hw.prefill_token_buckets()
        n_eager = sum(s.kind == "eager" for s in segs)
        how = (f"hoisted {moved} node(s) to the front" if n_eager
               else "no op in this graph needs to run eagerly")
        note = (f"{len(segs)} segment(s), {n_eager} eager; {how}; prefill token buckets "
                f"{buckets[0]}..{buckets[-1]} ({len(buckets)}), steps above "
                f"{self.hw.graph_token_limit} tokens per GPU run eagerly")
        out = g.with_meta(segments=[s.describe() for s in segs])
        return PassResult(out, note, {"segments": len(segs), "eager": n_eager, "hoisted": moved})
