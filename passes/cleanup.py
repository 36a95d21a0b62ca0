"""The ordinary clean-ups: dead code, folding of no-op shape/dtype arithmetic, common
subexpressions. They never change what the graph computes, only how many nodes compute it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph

from .base import Pass, PassResult, Rewrite, dead_code, register_pass


@register_pass
@dataclass(frozen=True)
class DeadCode(Pass):
    """Remove nodes whose results nobody reads (graph outputs, incl. state updates, are reads).

    before:
      %a = rope(%x, %positions) {rope_dim=16, theta=10000.0} : bf16[T, 32]   # %a unused
    after:
      (gone)
    """

    name: ClassVar[str] = "dead-code"

    def run(self, g: Graph) -> PassResult:
        out = dead_code(g)
        n = len(g.nodes) - len(out.nodes)
        return PassResult(out, f"removed {n} dead node(s)" if n else "no dead nodes", {"removed": n})


@register_pass
@dataclass(frozen=True)
class FoldConstants(Pass):
    """Fold shape and dtype arithmetic whose result is known at compile time.

    before:
      %x32 = cast(%xn) {dtype="f32"} : f32[T, 64]          # %xn is already f32
      %h = split_heads(%flat) {heads=4} : f32[T, 4, 16]
      %f = merge_heads(%h) : f32[T, 64]
    after:
      (uses of %x32 read %xn; uses of %f read %flat)

    Rules: a cast to the value's own dtype is the value; merge_heads(split_heads(x)) is x, and
    split_heads(merge_heads(x)) with the same head count is x.
    """

    name: ClassVar[str] = "fold-constants"

    def run(self, g: Graph) -> PassResult:
        rw = Rewrite(g, self.name)
        prod = g.producers()
        folded = 0
        for n in g.nodes:
            src = None
            if n.op == "cast" and g.types[n.inputs[0]].dtype == n.attr("dtype"):
                src = n.inputs[0]
            elif n.op in ("merge_heads", "split_heads"):
                p = prod.get(n.inputs[0])
                inverse = "split_heads" if n.op == "merge_heads" else "merge_heads"
                if p is not None and p.op == inverse and g.types[p.inputs[0]] == g.types[n.outputs[0]]:
                    src = p.inputs[0]
            if src is not None:
                rw.replace_uses(n.outputs[0], src)
                rw.remove(n)
                folded += 1
        if not folded:
            return PassResult(g, "nothing to fold (no identity casts or view round trips)", {"folded": 0})
        return PassResult(rw.apply(), f"folded {folded} no-op cast/view node(s)", {"folded": folded})


@register_pass
@dataclass(frozen=True)
class CommonSubexpressions(Pass):
    """Merge nodes that apply the same op with the same attributes to the same inputs.

    before:
      %a = rope(%kv, %positions) {rope_dim=16, theta=10000.0} : bf16[T, 32]
      %b = rope(%kv, %positions) {rope_dim=16, theta=10000.0} : bf16[T, 32]
    after:
      %a = rope(%kv, %positions) {rope_dim=16, theta=10000.0} : bf16[T, 32]   # uses of %b read %a
    """

    name: ClassVar[str] = "cse"

    def run(self, g: Graph) -> PassResult:
        rw = Rewrite(g, self.name)
        seen: dict[tuple, tuple[str, ...]] = {}
        merged = 0
        renames: dict[str, str] = {}
        for n in g.nodes:
            key = (n.op, tuple(renames.get(i, i) for i in n.inputs), n.attrs)
            if key in seen:
                for old, new in zip(n.outputs, seen[key]):
                    renames[old] = new
                    rw.replace_uses(old, new)
                rw.remove(n)
                merged += 1
            else:
                seen[key] = n.outputs
        if not merged:
            return PassResult(g, "no common subexpressions", {"merged": 0})
        return PassResult(rw.apply(), f"merged {merged} duplicate node(s)", {"merged": merged})
