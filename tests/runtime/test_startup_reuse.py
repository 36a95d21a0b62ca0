"""A second start with the same artifacts reuses torch.compile's caches and says so (CPU).

Inductor on CPU compiles the whole tiny step for minutes, so the plan here marks only the first
few nodes as a `graph` segment: the mechanism (cache dir, FX graph cache, mega-cache, report) is
the same one the GPU uses for whole segments. No timing is asserted."""

from __future__ import annotations

import dataclasses

import torch

from megagraph.runtime.engine import Engine, EngineConfig
from megagraph.runtime.plan import RunPlan, SegmentPlan


def test_second_start_hits_the_compile_cache(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAGRAPH_CACHE", str(tmp_path / "cache"))
    plan = RunPlan.from_artifacts(compiled("v4.1-flash-tiny"))
    n = len(plan.graph.nodes)
    plan = dataclasses.replace(plan, segments=(
        SegmentPlan(0, "graph", tuple(range(4))),
        SegmentPlan(1, "eager", tuple(range(4, n)), "the rest, uncompiled (test)")))
    conf = EngineConfig(max_slots=2, capacity=64, buckets=(4,), compile="inductor", progress=False)
    reports = []
    for _ in range(2):
        torch._dynamo.reset()  # as a new process would: only the on-disk caches survive
        reports.append(Engine(plan, None, conf).report)
    first, second = reports
    assert first.cache["fxgraph_cache_miss"] >= 1 and first.previous_total is None
    assert second.cache["fxgraph_cache_hit"] >= 1 and second.previous_total == first.total
    assert second.megacache_loaded and second.cache_dir == first.cache_dir
    text = "\n".join(second.lines())
    assert "torch.compile backend inductor (numerics: " in text and "caches in" in text
    assert "previous start" in text
