"""Batch every layer's request-window copy into the sliding-window rings into one op per step.

Each `ring_update` copies the last (up to) W new kv rows of every request into its slot's ring.
Nothing in the step reads an updated ring (attention reads the ring as it was before the step plus
the step's own rows), so all copies can wait until the last layer and run as one batched kernel:
one launch instead of one per layer. Cost: every layer's kv rows stay live until then (the plan's
graph memory shows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph

from .base import FusionPass, PassResult, Rewrite, layer_of, register_pass


@register_pass
@dataclass(frozen=True)
class BatchWindowCopies(FusionPass):
    """Replace the per-layer ring updates by one ring_update_batched (per window size).

    before:
      %L0.attn.ring.next = ring_update(%L0.ring, %L0.attn.kv, %positions, %token_req, %seq_slots) {window=8}
      ...
      %L8.attn.ring.next = ring_update(%L8.ring, %L8.attn.kv, %positions, %token_req, %seq_slots) {window=8}
    after (at the last layer's former ring_update):
      %L0.attn.ring.next, ..., %L8.attn.ring.next = ring_update_batched(%positions, %token_req,
          %seq_slots, %L0.ring, %L0.attn.kv, ..., %L8.ring, %L8.attn.kv) {window=8}

    Requires: no node reads an updated ring (each ring_update result is only a state output).
    """

    name: ClassVar[str] = "batch-window-copies"
    fusion: ClassVar[str] = "window_copies"
    kernel: ClassVar[str] = "batched window-copy kernel"

    def fuse(self, g: Graph, how) -> PassResult:
        users = g.users()
        groups: dict[tuple, list] = {}
        held = []
        for n in g.nodes:
            if n.op != "ring_update":
                continue
            if users.get(n.outputs[0]):
                held.append(f"L{layer_of(n.outputs[0])} (its updated ring is read in the step)")
                continue
            groups.setdefault((n.attr("window"), n.inputs[2:5]), []).append(n)
        groups = {k: v for k, v in groups.items() if len(v) > 1}
        if not groups:
            return self.skip(g, "fewer than two ring updates can be batched" +
                             (f"; held back: {', '.join(held)}" if held else ""))
        rw = Rewrite(g, self.name)
        batched = 0
        for (window, meta), nodes in groups.items():
            operands = [v for n in nodes for v in n.inputs[:2]]
            fused = rw.node("ring_update_batched", [*meta, *operands],
                            [n.outputs[0] for n in nodes], window=window)
            rw.remove(*nodes)
            rw.insert_after(nodes[-1], fused)
            batched += len(nodes)
        note = f"batched {batched} ring updates into {len(groups)} op(s) ({how})"
        if held:
            note += f"; held back: {', '.join(held)}"
        return PassResult(rw.apply(), note, {"batched": batched, "ops": len(groups)})
