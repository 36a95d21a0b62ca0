"""Bounded load on loopback: 40 concurrent streaming requests of mixed lengths (chat with and
without thinking, completions), all sent at once. Every one completes or gets a clean error, none
hangs, and the state cache is empty afterwards (benchmarks/serving.py runs the 200-request version
and reports throughput and latency percentiles)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from .conftest import wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from serving import make_requests, run_load, summarize  # noqa: E402


def test_40_concurrent_streams_finish_and_free_their_state(server):
    before = server.metrics()
    reqs = make_requests(40, seed=1, max_out=16)
    outs, wall = asyncio.run(run_load(server.base_url, server.service.config.api_key, reqs,
                                      timeout=180))
    s = summarize(outs, wall)
    assert s["hangs"] == 0, s
    assert s["completed"] == 40, s  # nothing should fail at this load
    assert all(o.finish in ("length", "stop") for o in outs)
    assert s["output_tokens"] == sum(r["max_tokens"] for r in reqs)  # ignore_eos: all tokens
    m = wait_idle(server)
    assert m["megagraph_generation_tokens_total"] - before["megagraph_generation_tokens_total"] \
        >= s["output_tokens"]
    assert m["megagraph_num_requests_running"] == 0
