"""The expert-parallel pass: what the dumps show, the ep-idle side graph, the layout in meta,
manifest and plan, option errors, and that single-rank compiles are untouched."""

from __future__ import annotations

from functools import lru_cache

import pytest
import yaml
from megagraph.graph.text import parse_graph, print_graph
from megagraph.models.config import load_model_config
from megagraph.passes.base import PassError
from megagraph.passes.expert_parallel import (
    IDLE_GRAPH,
    LayoutError,
    ParallelLayout,
    collective_signature,
    ep_sites,
    graph_placement,
)
from megagraph.passes.hw import load_hw_profile
from megagraph.passes.pipeline import PIPELINE, CompileOptions, compile_model
from megagraph.runtime.distributed.eplb import balance_ratio, check_placement


@lru_cache(maxsize=8)
def compiled(model="v4.1-flash-tiny", hw="cpu", **opt):
    return compile_model(load_model_config(model), load_hw_profile(hw), CompileOptions(**opt))


def lines(g) -> list[str]:
    return [ln.strip() for ln in print_graph(g).splitlines()]


def test_dump_shows_the_collectives():
    c = compiled(dp=2, ep=2, ep_max_tokens=16)
    text = lines(c.graph)
    # one site in full, exactly as the final dump prints it
    want = [
        "input %L3.ffn.ep_map : i64[8, 1]",
        "weight @layers.3.ffn.experts.local.w1.weight : fp4x2[4, 32, 32]",
        "%L3.ffn.ep_slots = ep_place(%L3.ffn.ids, %L3.ffn.ep_map) {ep_size=2, slots_per_rank=4} : i64[T, 2]",
        ("%L3.ffn.ep_recv_ids, %L3.ffn.ep_recv_w, %L3.ffn.ep_handle, %L3.ffn.ep_recv_x = "
         "ep_dispatch(%L3.ffn.ep_slots, %L3.ffn.xn) {ep_size=2, max_tokens=16, slots_per_rank=4} : "
         "i64[64, 1], f32[64, 1], i64[T, 2], bf16[64, 64]"),
        ("%L3.ffn.routed = ep_combine(%L3.ffn.ep_y, %L3.ffn.ep_recv_w, %L3.ffn.ep_handle, %L3.ffn.weights) "
         "{ep_size=2, max_tokens=16, slots_per_rank=4} : bf16[T, 64]"),
    ]
    for w in want:
        assert w in text, w
    moe = next(ln for ln in text if ln.startswith("%L3.ffn.ep_y = moe_experts("))
    assert moe.startswith("%L3.ffn.ep_y = moe_experts(%L3.ffn.ep_recv_x, %L3.ffn.ep_recv_ids, "
                          "%L3.ffn.ep_recv_w, @layers.3.ffn.experts.local.w1.weight")
    assert "L3.expert_slots=%L3.ffn.ep_slots" in text[-2]
    ops = c.graph.op_counts()
    assert ops["ep_place"] == ops["ep_dispatch"] == ops["ep_combine"] == 9
    assert not any("experts.*." in w for w in c.graph.weights)  # no rank holds the full bank
    rec = next(r for r in c.records if r.name == "expert-parallel")
    assert rec.status == "changed" and rec.note.startswith("DEP x2: 9 MoE sites")
    assert f"expert-parallel: {rec.note}" in c.graph.meta_value("notes")
    for g in (c.graph, c.extra_graphs[IDLE_GRAPH]):
        assert print_graph(parse_graph(print_graph(g))) == print_graph(g)


def test_idle_graph_issues_the_same_collectives():
    c = compiled(dp=2, ep=2, ep_max_tokens=16)
    idle = c.extra_graphs[IDLE_GRAPH]
    assert [n.op for n in idle.nodes] == ["ep_dispatch", "moe_experts", "ep_combine"] * 9
    assert collective_signature(idle) == collective_signature(c.graph)
    assert len(collective_signature(c.graph)) == 18
    assert idle.dims == ("T",) and set(idle.weights) <= set(c.graph.weights)


@pytest.mark.parametrize("model", ["v4.1-flash-tiny", "v4-flash-tiny"])
def test_gpu_profile_splits_mega_moe(model):
    """h200: mega_mhc stays fused; mega_moe becomes route -> collectives -> experts on FP8 bytes."""
    c = compiled(model, "h200", dp=4, ep=4, redundant_experts=4 if model.startswith("v4.1") else 0)
    ops = c.graph.op_counts()
    # every FFN site's mega_mhc stays, and each attention site has one too (mega-mhc-fusion)
    assert "mega_moe" not in ops and ops["mega_mhc"] == 2 * ops["ep_dispatch"]
    assert ops["moe_experts_q"] == ops["ep_combine"] == ops["hc_expand"] // 2
    if model == "v4-flash-tiny":  # hash-routed layers keep their table routing
        assert ops["hash_route"] == 3
    disp = next(ln for ln in lines(c.graph) if " = ep_dispatch(" in ln)
    assert "fp8e4m3[" in disp.split(" : ")[1]  # the FP8 activations and their scales travel
    assert c.graph.meta_value("ep_max_tokens") == 8192  # the profile's graph token limit
    assert "deepep" in c.graph.meta_value("ep_dispatch")


def test_layout_in_meta_and_initial_placement():
    c = compiled(dp=4, ep=4, redundant_experts=4, ep_max_tokens=16)
    g = c.graph
    lay = ParallelLayout.from_graph(g)
    assert (lay.dp, lay.ep, lay.experts, lay.topk, lay.redundant, lay.slots_per_rank) == (4, 4, 8, 2, 4, 3)
    placement = graph_placement(g)
    assert placement == [[0, 1, 6], [2, 3, 0], [4, 5, 2], [6, 7, 4]]
    check_placement(placement, 8, 3)
    assert all(len(set(row)) == len(row) for row in placement)  # replicas on other ranks
    assert balance_ratio([1] * 8, placement) == 1.0  # uniform load: balanced
    sites = ep_sites(g)
    assert [s.layer for s in sites] == list(range(9))
    assert sites[0].map_input == "L0.ffn.ep_map" and sites[0].slots_output == "L0.expert_slots"
    assert len(sites[0].local_weights) == 6


def test_single_rank_compile_is_untouched():
    one = compiled()
    assert [r.name for r in one.records] == [p for p in PIPELINE if p != "expert-parallel"]
    assert one.graph.meta_value("dp") is None and "ep_dispatch" not in one.graph.op_counts()
    dp = compiled(dp=4)  # plain data parallel: experts replicated, no collectives
    assert dp.graph.meta_value("dp") == 4 and "ep_dispatch" not in dp.graph.op_counts()
    assert [n for n in dp.graph.nodes] == [n for n in one.graph.nodes]


@pytest.mark.parametrize("opt, match", [
    (dict(dp=4, ep=2), "supported layouts are DEP"),
    (dict(dp=4, ep=4, redundant_experts=2), "use --redundant-experts 0 or 4"),
    (dict(dp=2, ep=1, redundant_experts=2), "needs expert parallelism"),
    (dict(dp=2, ep=2, bounded_replay=True), "bounded-replay"),
    (dict(dp=2, ep=2, passes=("fold-constants",)), "need the expert-parallel pass"),
    (dict(dp=2, ep=2, ep_max_tokens=-1), "--ep-max-tokens must be"),
    (dict(dp=2, balanced_routing=True), "needs expert parallelism"),
])
def test_layout_errors(opt, match):
    with pytest.raises((LayoutError, PassError), match=match):
        compile_model(load_model_config("v4.1-flash-tiny"), load_hw_profile("cpu"), CompileOptions(**opt))


def test_cli_artifacts_record_the_layout(tmp_path):
    from megagraph.main import main

    out = tmp_path / "a"
    assert main(["compile", "--model", "v4.1-flash-tiny", "--hw", "h200", "--out", str(out),
                 "--dp", "4", "--ep", "4", "--redundant-experts", "4", "--ep-max-tokens", "64"]) == 0
    man = yaml.safe_load((out / "manifest.yaml").read_text())
    rec = next(p for p in man["passes"] if p["name"] == "expert-parallel")
    assert rec["options"] == {"dp": 4, "ep": 4, "hw": "h200", "max_tokens": 64,
                              "redundant_experts": 4, "routing": "model"}
    st = rec["stats"]
    assert (st["slots_per_rank"], st["rows_per_peer"], st["collectives_per_step"]) == (3, 128, 18)
    assert st["placement"]["rank1"] == [2, 3, 0]
    assert man["graphs"][IDLE_GRAPH] == f"graph/{IDLE_GRAPH}.mgir"
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    k = plan["kernels"]
    assert k["ep_dispatch"]["kernel"] == k["ep_combine"]["kernel"] == "nccl.all_to_all_single"
    assert "available" in k["ep_dispatch"]["reason"] and k["ep_dispatch"]["graphs"] == ["step", IDLE_GRAPH]
    # the collectives are capturable: they sit inside the captured body, not in eager islands
    assert all("ep_" not in " ".join(s.get("breaks", [])) for s in plan["segments"])
    assert main(["compile", "--model", "v4.1-flash-tiny", "--hw", "cpu", "--out", str(tmp_path / "b"),
                 "--dp", "4", "--ep", "3"]) == 2


def test_balanced_routing_is_an_attribute():
    c = compiled(dp=2, ep=2, balanced_routing=True)
    places = [n for n in c.graph.nodes if n.op == "ep_place"]
    assert len(places) == 9 and all(n.attr("routing") == "balanced" for n in places)
    assert c.graph.meta_value("ep_routing") == "balanced"
