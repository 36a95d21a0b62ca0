"""Snapshots of what every pass does to the tiny models, per hardware profile.

Per model x profile: the built dump in full (`00-built`), then one snapshot per pass holding the
unified diff of the dump before and after it (so a reviewer reads each fusion as a diff; the dump
after pass N is 00-built plus diffs 01..N), and the final dump in full. The `meta` line carries
each pass's note: what it did, or why it did not fire on this profile.
"""

import pytest

from megagraph.graph.text import print_graph
from megagraph.passes.artifacts import dump_yaml
from tests.passes.helpers import HW, compiled, model_params, stage_diff


@pytest.mark.parametrize("hw", HW)
@pytest.mark.parametrize("model", model_params())
def test_stage_dumps(model, hw, text_snapshot):
    c = compiled(model, hw)
    prev = None
    for stem, g in c.stages:
        text = print_graph(g)
        if prev is None:
            assert text == text_snapshot(name=stem)
        else:
            assert stage_diff(prev, text, stem) == text_snapshot(name=stem)
        prev = text
    assert prev == text_snapshot(name="final")


@pytest.mark.parametrize("hw", HW)
@pytest.mark.parametrize("model", model_params())
def test_pass_notes(model, hw, text_snapshot):
    """One line per pass: status and note (the manifest's view of the pipeline)."""
    c = compiled(model, hw)
    text = "".join(f"{r.index:02d} {r.name}: {r.status}: {r.note}\n" for r in c.records)
    assert text == text_snapshot


@pytest.mark.parametrize("model", model_params())
def test_bounded_replay_graphs(model, text_snapshot):
    """The side graphs --bounded-replay emits (gb300), in full."""
    c = compiled(model, "gb300", bounded_replay=True)
    if not c.extra_graphs:
        rec = c.records[-1]
        assert rec.status == "skipped" and "KV-source" in rec.note
        assert f"{rec.name}: {rec.note}\n" == text_snapshot(name="skipped")
        return
    for name, g in sorted(c.extra_graphs.items()):
        assert print_graph(g) == text_snapshot(name=name)


@pytest.mark.parametrize("hw", ("gb300", "h200", "cpu"))
def test_tiny_plan(hw, text_snapshot):
    """plan.yaml of tiny V4.1 (segments, buckets, kernels, memory)."""
    from megagraph.passes.plan import build_plan

    c = compiled("v4.1-flash-tiny", hw, bounded_replay=True)
    plan = build_plan(c.graph, c.hw, context=c.options.context, extra=c.extra_graphs, cfg=c.cfg)
    assert dump_yaml(plan) == text_snapshot
