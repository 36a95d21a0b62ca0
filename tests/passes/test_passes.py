"""Small cases per pass: a positive case and a must-not-fire case each, plus registry rules."""

import inspect
from dataclasses import replace

import pytest
import torch

from megagraph.graph.ir import Node, freeze_attrs
from megagraph.graph.registry import all_ops
from megagraph.graph.text import parse_graph
from megagraph.graph.verify import verify_graph
from megagraph.kernels.fused.reference import FUSED
from megagraph.passes import PASSES, PIPELINE, load_hw_profile
from megagraph.passes.batch_window_copies import BatchWindowCopies
from megagraph.passes.cleanup import CommonSubexpressions, DeadCode, FoldConstants
from megagraph.passes.fuse_compressor import FuseCompressor
from megagraph.passes.indexer_products import IndexerProducts
from megagraph.passes.mega_mhc import MegaMhcFusion
from megagraph.passes.mega_moe import MegaMoeFusion
from megagraph.passes.partition import PartitionPrefill, segments
from megagraph.passes.quantize_epilogues import QuantizeEpilogues
from tests.tiny import tiny

GB300, CPU = load_hw_profile("gb300"), load_hw_profile("cpu")

SMALL = """graph f {
  dims T
  input %x : f32[T, 64]
  input %positions : i64[T]
  %x32 = cast(%x) {dtype="f32"} : f32[T, 64]
  %h = split_heads(%x32) {heads=4} : f32[T, 4, 16]
  %flat = merge_heads(%h) : f32[T, 64]
  %a = rope(%flat, %positions) {rope_dim=16, theta=10000.0} : f32[T, 64]
  %b = rope(%flat, %positions) {rope_dim=16, theta=10000.0} : f32[T, 64]
  %c = add(%a, %b) : f32[T, 64]
  %dead = rope(%c, %positions) {rope_dim=16, theta=10000.0} : f32[T, 64]
  return y=%c
}
"""


def test_every_pass_is_registered_documented_and_in_the_pipeline():
    assert set(PIPELINE) == set(PASSES)
    for name, cls in PASSES.items():
        doc = inspect.getdoc(cls) or ""
        assert doc and name == cls.name
        if name not in ("bounded-replay", "encoder-replay"):  # emit side graphs only
            assert "before" in doc and "after" in doc, f"{name}: docstring needs before/after"
        assert cls.__dataclass_params__.frozen


def test_every_fused_op_has_a_reference_kernel():
    fused = [d for d in all_ops().values() if d.name in FUSED or d.fused_from]
    assert {d.name for d in fused if d.fused_from} <= set(FUSED)
    for d in fused:
        assert d.doc and d.capture == "graph"


def test_cleanups_fold_cse_and_dead_code():
    g = parse_graph(SMALL)
    assert DeadCode().run(g).graph.op_counts().get("rope") == 2
    f = FoldConstants().run(g)
    assert f.stats == {"folded": 2} and "cast" not in f.graph.op_counts()  # cast + merge(split)
    assert "merge_heads" not in f.graph.op_counts()
    c = CommonSubexpressions().run(f.graph)
    assert c.stats == {"merged": 1} and c.graph.op_counts()["rope"] == 1
    verify_graph(c.graph)
    again = FoldConstants().run(c.graph)
    assert again.graph is c.graph and "nothing to fold" in again.note


@pytest.mark.parametrize("cls", [FuseCompressor, QuantizeEpilogues, MegaMoeFusion, MegaMhcFusion,
                                 BatchWindowCopies, PartitionPrefill])
def test_profile_dependent_passes_do_not_fire_on_cpu(cls):
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    r = cls(hw=CPU).run(g)
    assert r.graph is g and r.skipped and "cpu" in r.note


def test_mega_moe_needs_quantized_ffn_input():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    r = MegaMoeFusion(GB300).run(g)  # quantize-epilogues has not run
    assert r.graph is g and r.skipped and "not quantized" in r.note
    q = QuantizeEpilogues(GB300).run(g).graph
    m = MegaMoeFusion(GB300).run(q)
    ops = m.graph.op_counts()
    assert ops["mega_mhc"] == ops["mega_moe"] == 9 and "route" not in ops and "add" not in ops
    assert ops["hc_expand"] == 9  # the attention sites' expands stay


def test_mega_moe_leaves_a_site_whose_intermediate_escapes():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    q = QuantizeEpilogues(GB300).run(g).graph
    # make layer 3's routed-expert output a graph output: it may no longer stay inside the site
    q = replace(q, outputs=q.outputs + (("debug", "L3.ffn.routed"),))
    m = MegaMoeFusion(GB300).run(q)
    assert m.stats == {"sites": 9, "fused": 8} and "L3:" in m.note and "L3.ffn.routed" in m.note


def test_mega_mhc_fuses_the_attention_sites_after_mega_moe():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    q = QuantizeEpilogues(GB300).run(g).graph
    assert MegaMhcFusion(GB300).run(g).skipped  # unquantized: no site has its quantize_act
    m = MegaMoeFusion(GB300).run(q).graph
    r = MegaMhcFusion(GB300).run(m)
    ops = r.graph.op_counts()
    assert r.stats == {"sites": 9, "fused": 9}
    assert ops["mega_mhc"] == 18 and ops["mega_moe"] == 9 and "hc_mixer" not in ops
    assert ops["hc_collapse"] == 1 and ops["hc_expand"] == 9  # the final collapse, attention expands
    verify_graph(r.graph)
    # an attention site keeps the values its readers need: the norm output feeds the compressor
    site = next(n for n in r.graph.nodes if n.op == "mega_mhc" and n.outputs[0] == "L1.attn.xn")
    assert site.outputs[1:3] == ("L1.attn.xn.q", "L1.attn.xn.qscale")
    assert site.inputs[4] == "L0.ffn.pre"  # collapsed with the previous site's pre
    # without mega-moe-fusion it takes the FFN sites' front halves too
    both = MegaMhcFusion(GB300).run(q)
    assert both.stats == {"sites": 18, "fused": 18} and "moe_experts_q" in both.graph.op_counts()


def test_mega_mhc_leaves_a_site_whose_collapse_escapes():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    m = MegaMoeFusion(GB300).run(QuantizeEpilogues(GB300).run(g).graph).graph
    m = replace(m, outputs=m.outputs + (("debug", "L2.attn.x"),))
    r = MegaMhcFusion(GB300).run(m)
    assert r.stats == {"sites": 9, "fused": 8} and "L2: the collapse is not read by" in r.note
    assert "hc_mixer" in r.graph.op_counts()


def test_fuse_compressor_leaves_a_layer_whose_latent_escapes():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    g2 = replace(g, outputs=g.outputs + (("debug", "L4.attn.compressor.latent"),))
    r = FuseCompressor(GB300).run(g2)
    assert r.stats == {"fused": 2, "left_alone": 1} and "L4:" in r.note


def test_batch_window_copies_holds_back_a_ring_read_in_the_step():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    reader = Node("rms_norm", ("L3.attn.ring.next", None), ("probe",), freeze_attrs({"eps": 1e-6}))
    g2 = g.with_nodes([*g.nodes, reader], types={"probe": g.types["L3.attn.ring.next"]},
                      outputs=g.outputs + (("probe", "probe"),))
    r = BatchWindowCopies(GB300).run(g2)
    assert "held back: L3" in r.note and r.graph.op_counts()["ring_update"] == 1


def test_indexer_products_marks_fake_quantized_operands_only():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    for graph in (g, FuseCompressor(GB300).run(g).graph):  # cache_write and fused compressor keys
        r = IndexerProducts(CPU).run(graph)
        scores = [n for n in r.graph.nodes if n.op == "index_scores"]
        assert scores and all(n.attr("products") == "bf16" for n in scores)
        assert r.stats == {"marked": len(scores), "held": 0}
        verify_graph(r.graph)
    # a second writer of L2's index-key pool (not fake-quantized): its pool is no longer exact
    w = next(n for n in g.nodes if n.op == "cache_write" and n.inputs[0] == "L2.ikey")
    raw = Node("cache_write", ("L2.ikey", "L2.attn.compressor.ik_rot", *w.inputs[2:]),
               ("L2.ikey.raw",), w.attrs)
    g2 = g.with_nodes([*g.nodes, raw], types={"L2.ikey.raw": g.types[w.outputs[0]]},
                      outputs=tuple((lab, "L2.ikey.raw" if lab == "L2.ikey" else v)
                                    for lab, v in g.outputs))
    r = IndexerProducts(CPU).run(g2)
    assert "held back: L2 (index keys not fake-quantized)" in r.note
    # V4 (no quantize_kv): nothing is marked
    _, g4, _, _ = tiny("v4-flash-tiny", "bf16")
    assert IndexerProducts(CPU).run(g4).skipped


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e4m3"])
def test_fake_quantized_values_and_their_products_are_exact_in_bf16(fmt):
    """The premise of indexer-products: fake-quantized values survive bf16, their products fp32."""
    from megagraph.kernels.dense.quant import fake_quant

    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-6, 6, 128)  # 12 decades per row
    a = fake_quant(x, fmt=fmt, block=32)
    b = fake_quant(x.flip(0).roll(7, 1), fmt=fmt, block=32)
    assert torch.equal(a.bfloat16().float(), a) and torch.equal(b.bfloat16().float(), b)
    p = a.bfloat16().float()[:, None, :] * b.bfloat16().float()[None, :, :]
    assert torch.equal(p, a.double()[:, None, :].mul(b.double()[None, :, :]).float())
    assert not torch.equal(x.bfloat16().float(), x)  # the raw values are not: the test can fail


def test_partition_hoists_host_breaks_into_one_island():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    assert [s.kind for s in segments(g)] == ["graph", "eager", "graph", "eager", "graph"]
    r = PartitionPrefill(GB300).run(g)
    segs = segments(r.graph)
    assert [s.kind for s in segs] == ["graph", "eager", "graph"]
    assert {n.op for n in segs[1].nodes} == {"engram_lookup"}
    assert "host-resident" in segs[1].reasons[0]
    assert r.graph.meta_value("segments")[1].startswith("eager 2 node(s)")
    verify_graph(r.graph)
    keep = PartitionPrefill(GB300, hoist=False).run(g)
    assert len(segments(keep.graph)) == 5


def test_disabled_passes_are_skipped_and_say_so():
    from megagraph.graph.errors import IRError
    from megagraph.passes import CompileOptions, compile_graph

    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    opt = CompileOptions(disable_passes=("mega-moe-fusion",))
    final, records = compile_graph(g, GB300, opt)
    rec = {r.name: r for r in records}["mega-moe-fusion"]
    assert rec.status == "skipped" and rec.note == "disabled by --disable-pass"
    assert "mega_moe" not in final.op_counts() and "moe_experts_q" in final.op_counts()
    assert "mega-moe-fusion: skipped: disabled by --disable-pass" in final.meta_value("notes")
    with pytest.raises(IRError, match="--disable-pass: unknown pass"):
        compile_graph(g, GB300, CompileOptions(disable_passes=("no-such-pass",)))
