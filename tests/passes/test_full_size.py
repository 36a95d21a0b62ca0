"""The full-size models compile for every profile; the op-count summary per stage is snapshotted
(not the 40-layer dumps), and the final graphs round-trip through the text format."""

import pytest

from megagraph.passes.inspect import op_count_table
from megagraph.graph.text import parse_graph, print_graph
from tests.passes.helpers import HW, compiled, model_params


def _summary(c) -> str:
    stages = [{"file": f"graph/{stem}.mgir", "nodes": len(g.nodes), "ops": g.op_counts()}
              for stem, g in c.stages]
    lines = [f"{c.cfg.name} for {c.hw.name}"]
    lines += [f"{r.index:02d} {r.name}: {r.status}: {r.note}" for r in c.records]
    lines += op_count_table({"stages": stages})
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("hw", HW)
@pytest.mark.parametrize("model", model_params(("v4.1-flash", "v4-flash")))
def test_full_size_op_counts(model, hw, text_snapshot):
    c = compiled(model, hw)
    assert _summary(c) == text_snapshot


@pytest.mark.parametrize("model", model_params(("v4.1-flash", "v4-flash")))
def test_full_size_round_trip(model):
    c = compiled(model, "gb300")
    text = print_graph(c.graph)
    assert print_graph(parse_graph(text)) == text


def test_v41_full_size_fusions_fire_everywhere_on_blackwell():
    c = compiled("v4.1-flash", "gb300")
    ops = c.graph.op_counts()
    assert ops["mega_moe"] == 40 and ops["mega_mhc"] == 80  # FFN sites + attention sites
    assert "hc_mixer" not in ops and ops["hc_collapse"] == 1  # only the final collapse is left
    assert ops["sparse_attn_q"] == 40 and "sparse_attn" not in ops
    assert ops["compressor"] == 4 and ops["ring_update_batched"] == 1
    assert "moe_experts" not in ops and "route" not in ops
