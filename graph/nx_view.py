"""A networkx view of a graph, for analyses that want graph algorithms (reachability, depth,
dominators) without re-implementing them over the IR.

Vertices are op nodes (keyed by their first output, e.g. `L3.attn.q`) plus the graph's inputs and
weights (keyed `%name` / `@name`); an edge producer -> consumer carries the value name. The view is
read-only: passes rewrite the IR, never this.
"""

from __future__ import annotations

import networkx as nx

from .ir import Graph


def to_networkx(g: Graph) -> nx.DiGraph:
    dg = nx.DiGraph(name=g.name)
    source = {}
    for name in g.inputs:
        dg.add_node(f"%{name}", kind="input", type=str(g.types[name]))
        source[name] = f"%{name}"
    for name in g.weights:
        dg.add_node(f"@{name}", kind="weight", type=str(g.types[name]))
        source[name] = f"@{name}"
    for n in g.nodes:
        key = n.outputs[0]
        dg.add_node(key, kind="op", op=n.op)
        for i in n.inputs:
            if i is not None:
                dg.add_edge(source[i], key, value=i)
        for o in n.outputs:
            source[o] = key
    return dg


def depends_on(g: Graph, value: str, dg: nx.DiGraph | None = None) -> set[str]:
    """Op nodes (first outputs) the value `value` depends on, transitively."""
    dg = dg or to_networkx(g)
    producer = {o: n.outputs[0] for n in g.nodes for o in n.outputs}
    return {v for v in nx.ancestors(dg, producer[value]) if dg.nodes[v]["kind"] == "op"}


def op_depth(g: Graph, dg: nx.DiGraph | None = None) -> int:
    """Length (in ops) of the longest dependency chain: a lower bound on sequential launches."""
    dg = dg or to_networkx(g)
    ops = dg.subgraph(v for v, d in dg.nodes(data=True) if d["kind"] == "op")
    return nx.dag_longest_path_length(ops) + 1 if len(ops) else 0
