"""benchmarks/prefix_cache_bench.py --smoke end to end on the CPU: compiles the tiny model, runs
3 conversations x 2 turns of streaming chat (the openai client) on three servers (cache off, on,
on + host tier), writes the report; checks the configurations, the hits and the end states."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("openai")


def test_prefix_cache_bench_smoke(tmp_path, run_bench):
    run_bench("prefix_cache_bench.py", "--smoke", "--out", str(tmp_path))
    res = json.loads((tmp_path / "prefix-cache.json").read_text())
    assert res["ok"] and not res["problems"], res["problems"]
    cs = {c["config"]["name"]: c for c in res["configs"]}
    assert list(cs) == ["off", "on", "host"]
    for c in cs.values():  # every turn ran, with every token; nothing held afterwards
        cl = c["client"]
        assert cl["completed"] == cl["turns"] == 6 and cl["output_tokens"] == 6 * 4
        assert c["state_zero"] and c["flush"]["kept_nodes"] == 0
        assert cl["ttft_ms"]["n"] == 6 and cl["ttft_ms"]["p50"] > 0
    # the same prompts reach every server (same words, greedy replies re-sent as text)
    assert len({c["client"]["prompt_tokens"] for c in cs.values()}) == 1
    off, on, host = cs["off"], cs["on"], cs["host"]
    assert off["client"]["cached_tokens"] == 0 and off["prefix"]["lookups"] == 0
    for c in (on, host):
        px = c["prefix"]
        assert px["hit_tokens"] > 0 and px["lookups"] == 6
        # the responses' cached_tokens add up to the hit tokens /metrics counted
        assert c["client"]["cached_tokens"] == px["hit_tokens"]
        assert 0 < px["hit_rate"] <= 1 and px["exact_hits"] + px["replay_hits"] > 0
        # second turns resume past the shared system prompt: a larger share than first turns
        t1, t2 = (p["cached_share"] for p in c["client"]["per_turn"])
        assert t2 > t1 > 0
        same = c["client"]["same_as_off"]  # greedy replies set against cache off's, per turn
        assert same["compared"] == 6 and sum(same["same_by_turn"]) == same["same"] <= 6
    # the host config's budgets come from the on run's bytes, and the host tier was used
    held = on["prefix"]["bytes"]["device"]
    assert host["prefix"]["capacity_bytes"] == {"device": held // 4, "host": 2 * held}
    assert host["prefix"]["evictions"]["device"] > 0 and host["prefix"]["host_loads"] > 0
    md = (tmp_path / "prefix-cache.md").read_text()
    for name in ("| off |", "| on |", "| host |", "TTFT p50 vs off", "**Problems:** none"):
        assert name in md
