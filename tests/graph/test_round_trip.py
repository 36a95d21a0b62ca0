"""Every graph the compiler writes parses back to the same text (and verifies)."""

import pytest

from megagraph.graph.text import parse_graph, print_graph
from tests.passes.helpers import HW, compiled, model_params


@pytest.mark.parametrize("hw", HW)
@pytest.mark.parametrize("model", model_params())
def test_every_stage_and_side_graph_round_trips(model, hw):
    c = compiled(model, hw, bounded_replay=True)
    graphs = [g for _, g in c.stages] + list(c.extra_graphs.values())
    for g in graphs:
        text = print_graph(g)
        assert print_graph(parse_graph(text)) == text
