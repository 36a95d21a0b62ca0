"""Mark the indexer's score products as exact in bf16 where its operands are fake-quantized.

V4.1 fake-quantizes index queries and index keys (MXFP4, block 32: an E2M1 value times a power of
two). Such a value has at most 2 significant bits, an NVFP4 one at most 6 (E2M1 times an E4M3
scale), an FP8-E4M3 one with a power-of-two scale 4; bf16 holds 8, with fp32's exponent range. So
both operands are exact in bf16 and a product of two has at most 16 significant bits: exact in
fp32. Multiplying in bf16 then gives the fp32 products, and only the fp32 summation order can
differ, as between any two fp32 GEMMs. Kernels that multiply on tensor cores read the attr (the
Hopper Triton indexer: bf16 instead of tf32x3, 1.5-2.9x faster on the H200); the reference
computes in fp32 either way.

Hardware-independent: it states a property of the values, each kernel decides what to do with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph, Node

from .base import Pass, PassResult, layer_of, register_pass
from .hw import HwProfile

EXACT_FMTS = ("mxfp4", "nvfp4", "fp8_e4m3")  # fake-quant formats whose values are exact in bf16
# ops that move values without changing them (casts only to dtypes that hold every bf16 value)
VALUE_PRESERVING = {"split_heads", "merge_heads"}
WIDE_DTYPES = ("f32", "bf16")


@register_pass
@dataclass(frozen=True)
class IndexerProducts(Pass):
    """Set products="bf16" on index_scores whose qi and ikey hold bf16-exact values.

    before:
      %L2.attn.indexer.qi = fake_quant(%L2.attn.indexer.qi_rot) {block=32, fmt="mxfp4"}
      %L2.attn.compressor.ikey.next, ... = compressor(...) {ikey_fmt="mxfp4", ...}
      %L2.attn.indexer.scores = index_scores(%L2.attn.indexer.qi, ..., %L2.attn.compressor.ikey.next, ...)
          {ratio=2, weight_scale=...}
    after:
      %L2.attn.indexer.scores = index_scores(...) {products="bf16", ratio=2, weight_scale=...}

    An ikey operand counts as exact when it is the update of its own state pool (every row of the
    pool was written by that op, zeros before) by a `cache_write` of an exact value or a fused
    `compressor` with an exact `ikey_fmt`, or that pool itself as the step found it (the vendor
    index-key reading scores against a later layer's pool before its update).
    """

    name: ClassVar[str] = "indexer-products"
    hw: HwProfile

    def run(self, g: Graph) -> PassResult:
        prod = g.producers()
        marked, held = [], []
        nodes = []
        for n in g.nodes:
            if n.op == "index_scores" and n.attr("products", "fp32") != "bf16":
                why = self._why_not(g, prod, n)
                if why is None:
                    n = n.with_attrs(products="bf16")
                    marked.append(n.outputs[0])
                else:
                    held.append(f"L{layer_of(n.outputs[0])} ({why})")
            nodes.append(n)
        if not marked:
            return self.skip(g, "no indexer with bf16-exact operands" +
                             (f"; held back: {', '.join(held)}" if held else ""))
        layers = list(dict.fromkeys(f"L{layer_of(v)}" for v in marked))  # vendor reading: 2 per layer
        note = (f"bf16 products (exact for fake-quantized operands) on {len(layers)} indexer(s): "
                + ", ".join(layers))
        if held:
            note += f"; held back: {', '.join(held)}"
        return PassResult(g.with_nodes(nodes), note, {"marked": len(marked), "held": len(held)})

    def _why_not(self, g: Graph, prod: dict[str, Node], n: Node) -> str | None:
        """None when both operands are bf16-exact, else what is not."""
        if not _exact_value(prod, n.inputs[0]):
            return "index queries not fake-quantized"
        if not _exact_pool(g, prod, n.inputs[2]):
            return "index keys not fake-quantized"
        return None


def _exact_value(prod: dict[str, Node], v: str) -> bool:
    """v is a fake-quantized value in an exact format, possibly moved by value-preserving ops."""
    n = prod.get(v)
    while n is not None and (n.op in VALUE_PRESERVING or
                             (n.op == "cast" and n.attr("dtype") in WIDE_DTYPES)):
        n = prod.get(n.inputs[0])
    return n is not None and n.op == "fake_quant" and n.attr("fmt") in EXACT_FMTS


def _exact_pool(g: Graph, prod: dict[str, Node], v: str) -> bool:
    """v is a state pool's update whose every write is an exact value, or such a pool as the step
    found it (a state input whose update is one; see the class doc)."""
    if v in g.state_labels:
        update = dict(g.outputs)[v]
        return update != v and _exact_pool(g, prod, update)
    n = prod.get(v)
    if n is None:
        return False
    if n.op == "cache_write":
        pool, written = n.inputs[0], n.inputs[1]
        ok = _exact_value(prod, written)
    elif n.op == "compressor" and n.outputs[0] == v:
        pool, ok = n.inputs[8], n.attr("ikey_fmt", "none") in EXACT_FMTS
    else:
        return False
    return ok and pool in g.inputs and (pool, v) in g.outputs
