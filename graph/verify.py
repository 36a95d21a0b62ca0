"""The verifier: small named checks, each raising an IRError that names the node and the fix.

Run after every pass (passes/pipeline.py) and after parsing.
"""

from __future__ import annotations

from .errors import IRError
from .ir import Graph
from .registry import get_op
from .types import dim_symbol


def check_single_definition(g: Graph) -> None:
    seen = set()
    for name in (*g.inputs, *g.weights, *(o for n in g.nodes for o in n.outputs)):
        if name in seen:
            raise IRError(f"graph {g.name}: value %{name} is defined twice")
        seen.add(name)


def check_defined_before_use(g: Graph) -> None:
    defined = set(g.inputs) | set(g.weights)
    for n in g.nodes:
        for i in n.inputs:
            if i is not None and i not in defined:
                raise IRError(f"graph {g.name}: {n.op} -> %{n.outputs[0]} uses %{i} before it is "
                              "defined (nodes must be in topological order)")
        defined.update(n.outputs)
    for lab, v in g.outputs:
        if v not in defined:
            raise IRError(f"graph {g.name}: output {lab} refers to undefined %{v}")


def check_types(g: Graph) -> None:
    """Every node's declared output types equal what its op's type rule infers."""
    for n in g.nodes:
        where = f"graph {g.name}, node %{n.outputs[0]}"
        d = get_op(n.op)
        if len(n.outputs) != len(d.outputs) and not d.variadic_outputs:
            raise IRError(f"{where}: {n.op} defines {len(d.outputs)} outputs "
                          f"({', '.join(d.outputs)}), node has {len(n.outputs)}")
        in_types = [None if i is None else g.type_of(i) for i in n.inputs]
        inferred = d.infer(in_types, n.attr_dict, where)
        for o, t in zip(n.outputs, inferred):
            if g.types.get(o) != t:
                raise IRError(f"{where}: {n.op} output %{o} is declared {g.types.get(o)} but its "
                              f"type rule gives {t}")


def check_dims_declared(g: Graph) -> None:
    declared = set(g.dims)
    for name, t in g.types.items():
        for d in t.shape:
            s = dim_symbol(d)
            if s is not None and s not in declared:
                raise IRError(f"graph {g.name}: %{name} : {t} uses dim {s!r}, which is not in "
                              f"'dims {', '.join(g.dims)}'")


def check_state_pairs(g: Graph) -> None:
    """A state output has exactly its input's type (it becomes that input next step)."""
    for lab, v in g.outputs:
        if lab in g.types and lab in g.inputs and g.types[lab] != g.type_of(v):
            raise IRError(f"graph {g.name}: state {lab} enters as {g.types[lab]} but leaves as "
                          f"{g.type_of(v)} (%{v})")


CHECKS = [check_single_definition, check_defined_before_use, check_dims_declared, check_types,
          check_state_pairs]


def verify_graph(g: Graph, *, after_pass: str | None = None) -> Graph:
    for check in CHECKS:
        try:
            check(g)
        except IRError as e:
            if after_pass:
                raise IRError(f"{e}\n  (after pass {after_pass})") from None
            raise
    return g
