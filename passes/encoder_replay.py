"""Encoder replay: the graph a prefix-cache hit runs to rebuild the sliding windows it did not keep.

A cached prefix keeps what is stable in its content (compressed KV and index keys per owner,
addressed by position), the compressor pending rows and the Engram history at its end. Its
sliding-window rings are large (a window of rows per layer) and the prefix cache may drop them
from branches not used recently. Resuming such a branch re-runs its last `window` tokens through
this graph: every sparse attention sees an empty ring (the replayed tokens attend to each other
and to the compressed rows, so the first of them see a truncated window: approximate), no
compressed or pending state is written (the cached rows stay exact), and only the rings come out.
The request then continues on the exact step graph. SGLang's `--enable-encoder-swa-bounded-replay`
and vLLM's V4 prefix caching rebuild the window the same way (serving-anchors.md).

The graph is emitted by default, so every plan can resume a cached branch either way; the runtime
(runtime/prefix_cache.py) decides per hit and `--prefix-cache-mode exact` never replays.

  %seq_cached.empty_ring = fill(%seq_cached) {value=0}
  %L0.attn.o = sparse_attn(..., %seq_cached.empty_ring) ...   (every sparse attention)
  (no cache_write; compressor / compress_pool outputs renamed to their input pools)
  outputs: every `*.ring`
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from megagraph.graph.errors import IRError
from megagraph.graph.ir import Graph, Node, freeze_attrs
from megagraph.graph.verify import verify_graph

from .base import Pass, PassResult, dead_code, register_pass

ENCODER = "encoder-replay"


@register_pass
@dataclass(frozen=True)
class EncoderReplay(Pass):
    """Emit the encoder-replay graph (the step is unchanged)."""

    name: ClassVar[str] = "encoder-replay"

    def run(self, g: Graph) -> PassResult:
        if "ep_dispatch" in g.op_counts():
            return self.skip(g, "expert-parallel steps need every rank in each step; a replay "
                                "step of one rank would stall the others")
        try:
            e = encoder_replay(g)
        except IRError as err:
            return self.skip(g, str(err))
        rings = len(e.outputs)
        return PassResult(g, f"emitted {ENCODER} ({rings} rings rebuilt from replayed tokens)",
                          {"rings": rings}, {ENCODER: e})


def encoder_replay(g: Graph) -> Graph:
    """The ring-rebuild graph: attention with an empty ring, no compressed-state writes, rings
    out."""
    renames: dict[str, str] = {}
    nodes: list[Node] = []
    fill = Node("fill", ("seq_cached",), ("seq_cached.empty_ring",), freeze_attrs({"value": 0}))
    for n in g.nodes:
        if n.op == "cache_write":
            renames[n.outputs[0]] = n.inputs[0]
        elif n.op == "compress_pool":
            renames[n.outputs[1]], renames[n.outputs[2]] = n.inputs[2], n.inputs[3]
            nodes.append(n)  # its latent output dies with the cache writes
        elif n.op == "compressor":
            for o, i in zip(n.outputs, (n.inputs[8], n.inputs[9], n.inputs[3], n.inputs[4])):
                renames[o] = i
        elif n.op in ("sparse_attn", "sparse_attn_q"):
            nodes.append(replace(n, inputs=(*n.inputs[:9], fill.outputs[0])))
        else:
            nodes.append(n)
    if not any(n.inputs[-1] == fill.outputs[0] for n in nodes if n.op.startswith("sparse_attn")):
        raise IRError("no sparse attention to replay")
    nodes = [replace(n, inputs=tuple(renames.get(i, i) for i in n.inputs)) for n in nodes]
    nodes.insert(0, fill)
    rings = tuple((lab, renames.get(v, v)) for lab, v in g.outputs if lab.endswith(".ring"))
    types = {**g.types, fill.outputs[0]: g.types["seq_cached"]}
    e = dead_code(g.with_nodes(nodes, types=types, outputs=rings))
    used = {i for n in e.nodes for i in n.inputs}
    e = replace(e, name=g.name.replace("/step", "") + f"/{ENCODER}",
                inputs=tuple(i for i in g.inputs if i in used))
    e = e.with_nodes(e.nodes).with_meta(step=ENCODER)
    return verify_graph(e)
