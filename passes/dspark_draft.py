"""DSpark speculative decoding: the draft graph and the verify graph, emitted next to the step.

The draft graph is models/dspark.py `build_dspark_draft(cfg)`: per request a block of
`dspark_block_size` rows over the `mtp.S.ring` rings the step keeps up to date; outputs drafts,
confidence and the Markov logits; it writes no state.

The verify graph is the final step graph (verify = a multi-row decode over [anchor, d_1 .. d_k])
with one addition: the per-row pending inputs of every compressor become outputs, because a
rejected row that completes a compression group leaves the pending rows of the accepted tokens
of that group unwritten (the step writes pending rows only for the trailing incomplete group of
the rows it was fed), and runtime/speculative/rollback.py writes them back from these rows:

  %L2.attn.compressor.latent_raw, ... = compress_pool(%L2.attn.compressor.kv_proj,
      %L2.attn.compressor.gate_proj, %L2.pend_kv, %L2.pend_gate, ...) {ratio=2}
  outputs += (verify.L2.pend_kv_rows: %L2.attn.compressor.kv_proj,
              verify.L2.pend_gate_rows: %L2.attn.compressor.gate_proj)

and the per-row ids the Engram history keeps (`verify.engram_ids`, the input of
`engram_hist_update`), so the history is rebuilt from the accepted rows alone.

A fused `compressor` (fuse-compressor, GPU profiles) computes those rows inside its kernel; there
the verify graph recomputes them after the step's nodes (`verify.L<i>.kv_rows`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from megagraph.graph.errors import IRError
from megagraph.graph.ir import Graph, Node, freeze_attrs
from megagraph.graph.verify import verify_graph
from megagraph.models.config import ModelConfig

from .base import Pass, PassResult, layer_of, register_pass

DRAFT, VERIFY = "dspark-draft", "dspark-verify"


ENGRAM_IDS = "verify.engram_ids"  # the per-row ids the Engram history keeps


def pend_row_labels(layer: int) -> tuple[str, str]:
    """Output labels of a compressor layer's per-row pending inputs in the verify graph."""
    return f"verify.L{layer}.pend_kv_rows", f"verify.L{layer}.pend_gate_rows"


@register_pass
@dataclass(frozen=True)
class DSparkDraft(Pass):
    """Emit the DSpark draft and verify graphs (the step is unchanged).

    The verify graph, before (the step's outputs) and after:
      outputs (logits, engram_hist, L0.ring, ..., mtp.2.ring)
      outputs (logits, ..., mtp.2.ring, verify.engram_ids, verify.L2.pend_kv_rows,
               verify.L2.pend_gate_rows, ...)
    """

    name: ClassVar[str] = "dspark-draft"
    cfg: ModelConfig | None = None  # the model the step was built from (its draft head)

    def run(self, g: Graph) -> PassResult:
        cfg = self.cfg
        if cfg is None:
            return self.skip(g, "no model config given (compile_graph(..., cfg=) emits it)")
        if not cfg.is_v41 or cfg.num_mtp_layers <= 0:
            return self.skip(g, f"{cfg.name} has no DSpark draft head "
                                "(num_mtp_layers 0 or not V4.1)")
        if "ep_dispatch" in g.op_counts():
            return self.skip(g, "expert-parallel steps need every rank in each step")
        if cfg.dspark_block_size >= cfg.sliding_window:
            return self.skip(g, f"block {cfg.dspark_block_size} >= window {cfg.sliding_window}: "
                                "a rejected row would share a ring row with an accepted one")
        from megagraph.models.dspark import build_dspark_draft

        d = verify_graph(build_dspark_draft(cfg).with_meta(step=DRAFT))
        head = f"emitted {DRAFT} (block {cfg.dspark_block_size}, {cfg.num_mtp_layers} stages)"
        try:
            v = verify_step(g)
        except IRError as e:
            return PassResult(g, f"{head}; no {VERIFY}: {e}", {"block": cfg.dspark_block_size},
                              {DRAFT: d})
        rows = sum(lab.endswith(".pend_kv_rows") for lab, _ in v.outputs)
        return PassResult(g, f"{head} and {VERIFY} (the step + pending rows of {rows} "
                             "compressors)",
                          {"block": cfg.dspark_block_size, "pending_layers": rows},
                          {DRAFT: d, VERIFY: v})

def verify_step(g: Graph) -> Graph:
    """The step graph with each compressor's per-row pending inputs as extra outputs. The
    unfused `compress_pool` reads them as values; a fused `compressor` computes them inside its
    kernel, so the verify graph recomputes them after the step's nodes (the same cast + dense
    projections the unfused graph has: two [T, d] x [d, Dc] GEMMs per compressor, verify only)."""
    if "v4_compressor" in g.op_counts() or "v4_compress_pool" in g.op_counts():
        raise IRError("the V4 compressor's overlapping groups have no rollback rule")
    extra, added, types = [], [], {}
    for n in g.nodes:
        if n.op == "compress_pool" and n.inputs[1] is not None:
            extra += list(zip(pend_row_labels(layer_of(n.outputs[0])), n.inputs[:2]))
        elif n.op == "compressor" and n.inputs[2] is not None:
            layer = layer_of(n.outputs[0])
            x32, kv, gate = (f"verify.L{layer}.{v}" for v in ("x32", "kv_rows", "gate_rows"))
            x = g.types[n.inputs[0]]
            types[x32] = replace(x, dtype="f32")
            for out, w in ((kv, n.inputs[1]), (gate, n.inputs[2])):
                types[out] = replace(x, dtype="f32", shape=(x.shape[0], g.types[w].shape[0]))
            added += [Node("cast", (n.inputs[0],), (x32,), freeze_attrs({"dtype": "f32"})),
                      Node("linear", (x32, n.inputs[1], None), (kv,),
                           freeze_attrs({"fmt": "dense"})),
                      Node("linear", (x32, n.inputs[2], None), (gate,),
                           freeze_attrs({"fmt": "dense"}))]
            extra += list(zip(pend_row_labels(layer), (kv, gate)))
        if n.op == "engram_hist_update":
            extra.append((ENGRAM_IDS, n.inputs[1]))
    v = g.with_nodes((*g.nodes, *added), types=types, outputs=(*g.outputs, *extra))
    v = replace(v, name=g.name.replace("/step", "") + f"/{VERIFY}")
    return verify_graph(v.with_nodes(v.nodes).with_meta(step=VERIFY))
