"""The networkx view of a step graph: a DAG with one vertex per op, usable for dependency analyses."""

import networkx as nx

from megagraph.graph.nx_view import depends_on, op_depth, to_networkx
from megagraph.models.build import build_step
from megagraph.models.config import load_model_config


def test_view_of_the_tiny_v41_step():
    g = build_step(load_model_config("v4.1-flash-tiny"))
    dg = to_networkx(g)
    assert nx.is_directed_acyclic_graph(dg)
    assert sum(1 for _, d in dg.nodes(data=True) if d["kind"] == "op") == len(g.nodes)
    logits = g.output_value("logits")
    deps = depends_on(g, logits, dg)
    assert "emb" in deps and "L8.attn.o" in deps
    # the ring update of layer 0 is state bookkeeping, not on the path to the logits
    assert "L0.attn.ring.next" not in deps
    # a reuse layer's attention depends on its KV source's compressor and its index source's top-k
    attn3 = depends_on(g, "L3.attn.o", dg)
    assert {"L2.attn.compressor.ckv.next", "L2.attn.indexer.topk"} <= attn3
    assert not any(v.startswith("L3.attn.compressor") for v in attn3)
    assert op_depth(g, dg) > 9 * 10  # at least ten dependent ops per layer
