"""The serving benchmark's arithmetic and its server handling, without a load: the anchors'
metric definitions on hand-made request timings, the start-up report parser on the server's own
lines, the soak's memory verdict, the step mix behind the same-mix engine baseline, and a server
that dies at start-up ending the wait at once."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_step  # noqa: E402
import serve_bench  # noqa: E402
import serve_server  # noqa: E402
from serve_load import LoadRun, Result, fixed_requests, mixed_requests  # noqa: E402
from serve_stats import is_zero, step_mix, summarize  # noqa: E402


def _result(inp, out, ttft, gaps, *, ok=True, usage=None):
    r = Result(inp, out, ok=ok, ttft=ttft, itls=list(gaps), chunks=1 + len(gaps))
    r.latency = ttft + sum(gaps)
    r.output_tokens = usage if usage is not None else 1 + len(gaps)
    r.prompt_tokens = inp
    return r


def test_summary_uses_the_anchors_definitions():
    a = _result(100, 4, 0.5, [0.1, 0.1, 0.1])  # TPOT (0.8 - 0.5) / 3 = 0.1
    b = _result(300, 3, 1.0, [0.2, 0.4])  # TPOT 0.6 / 2 = 0.3
    failed = Result(50, 4, error="HTTP 500: boom")
    s = summarize(LoadRun([a, b, failed], wall_s=2.0, not_issued=1, peak_in_flight=2,
                          client_cpu_s=0.5))
    assert (s["issued"], s["completed"], s["failed"], s["hung"], s["not_issued"]) == (3, 2, 1, 0, 1)
    assert s["total_input_tokens"] == 400 and s["total_output_tokens"] == 7  # completed only
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_tok_s"] == pytest.approx(3.5) and s["input_tok_s"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(200.0)
    itl = [100, 100, 100, 200, 400]  # every gap of every completed request, pooled
    assert s["itl_ms"]["p50"] == pytest.approx(float(np.percentile(itl, 50)))
    assert s["itl_ms"]["p99"] == pytest.approx(float(np.percentile(itl, 99)))
    assert s["ttft_ms"]["mean"] == pytest.approx(750.0)
    assert s["e2e_ms"]["max"] == pytest.approx(1600)
    assert s["concurrency"] == pytest.approx((0.8 + 1.6) / 2.0)
    assert s["error_samples"] == ["HTTP 500: boom"] and s["lost_tokens"] == 0


def test_tokens_short_of_max_tokens_are_lost():
    r = _result(10, 8, 0.1, [0.1] * 5, usage=6)  # ignore_eos asked for 8
    assert r.lost_tokens == 2
    s = summarize(LoadRun([r], 1.0, 0, 1, 0.0))
    assert s["lost_tokens"] == 2


def test_request_lengths():
    fixed = fixed_requests(20, 64, 16, vocab=1000, range_ratio=0.5, seed=1)
    assert all(32 <= len(r.prompt_ids) <= 64 and 8 <= r.output_len <= 16 for r in fixed)
    assert len({len(r.prompt_ids) for r in fixed}) > 1
    assert all(100 <= t < 700 for r in fixed for t in r.prompt_ids)
    exact = fixed_requests(3, 64, 16, vocab=1000)
    assert [(len(r.prompt_ids), r.output_len) for r in exact] == [(64, 16)] * 3
    mixed = mixed_requests(50, (4, 9), (2, 3), vocab=1000, seed=2)
    assert {len(r.prompt_ids) for r in mixed} <= set(range(4, 10))
    assert mixed == mixed_requests(50, (4, 9), (2, 3), vocab=1000, seed=2)  # seeded


def test_state_zero_allows_only_the_scrape():
    zero = {"cache_slots_used": 0, "cache_tokens_used": 0, "num_requests_running": 0,
            "num_requests_waiting": 0, "http_requests_active": 1}
    assert is_zero(zero)
    assert not is_zero({**zero, "cache_tokens_used": 12})
    assert not is_zero({**zero, "http_requests_active": 2})


def test_startup_report_parsing():
    log = "\n".join([
        "INFO: something else",
        "[megagraph] start-up 51.20s: kernels 0.10s, weights 3.40s, state 0.70s, "
        "warm-up+capture 47.00s",
        "[megagraph] buckets [1, 2, 4]; captured segments [0, 2]; graph memory 8176.0 MiB",
        "[megagraph] state cache: 256 slots x 16640 tokens, 31.10 MiB/slot; budget 80 GiB",
        "[megagraph] scheduler: prefill cap 4096 tokens/step, overlap on"])
    st = serve_server.parse_startup(log, ready_s=70.5)
    assert st["engine_s"] == 51.2 and st["ready_s"] == 70.5
    assert st["phases_s"] == {"kernels": 0.1, "weights": 3.4, "state": 0.7,
                              "warm-up+capture": 47.0}
    assert st["graph_memory_mib"] == 8176.0 and st["prefill_cap"] == 4096
    assert st["state_cache"].startswith("256 slots x 16640 tokens")
    assert len(st["lines"]) == 4


def test_memory_flatness():
    flat = [{"rss_mib": 1000.0 + i, "gpu_mib": 90_000.0} for i in range(8)]
    assert serve_bench.flatness(flat)["flat"] == "yes"
    growing = [{"rss_mib": 1000.0 + 100 * i} for i in range(8)]
    v = serve_bench.flatness(growing)
    assert v["flat"] == "no" and v["rss_mib"]["last"] == 1700.0
    assert serve_bench.flatness([{}])["flat"] == "-"
    # live tensors growing under a flat nvidia-smi figure (the allocator's cache shrinking)
    leak = [{"gpu_mib": 90_000.0, "allocated_mib": 40_000.0 + 500 * i} for i in range(8)]
    assert serve_bench.flatness(leak)["flat"] == "no"


def test_step_mix_and_the_same_mix_shapes():
    """Counters over a point -> the mean rows of its decode-only steps and the mean rows and
    prompt tokens of its mixed ones -> the two steps engine_step.py runs, within the slots."""
    d = {"megagraph_scheduler_decode_only_steps_total": 90.0,
         "megagraph_scheduler_mixed_steps_total": 10.0,
         "megagraph_scheduler_decode_tokens_total": 90 * 255.0 + 10 * 254.6,
         "megagraph_scheduler_mixed_decode_tokens_total": 10 * 254.6,
         "megagraph_scheduler_mixed_prefill_tokens_total": 10 * 1500.0}
    mx = step_mix(d)
    assert mx["decode_only_steps"] == 90 and mx["mixed_steps"] == 10
    assert mx["decode_only_rows"] == pytest.approx(255.0)
    assert mx["mixed_rows"] == pytest.approx(254.6)
    assert mx["mixed_prompt_tokens"] == pytest.approx(1500.0)
    p = {"kind": "sweep", "input_len": 1024, "server": {"mix": mx}}
    # 1500 prompt tokens are two chunks (<= 1024): 255 rows + 2 chunks would need 257 slots
    assert serve_bench.mix_specs(p, 4096, 256) == [(255, 0, 1024), (254, 1500, 1024)]
    assert serve_bench.mix_specs(p, 512, 512) == [(255, 0, 512), (255, 1500, 512)]
    assert engine_step.mix_chunks(2, 1500, 1024) == [1, 1, 1024, 476]
    idle = step_mix({k: 0.0 for k in d})
    assert idle["mixed_rows"] is None and idle["decode_only_rows"] is None
    soak = {"kind": "soak", "input_range": [64, 1024], "server": {"mix": idle}}
    assert serve_bench.mix_specs(soak, 4096, 128) == [(0, 0, 544), (0, 0, 544)]
    assert engine_step.parse_mixes("3:0, 2:40:16") == [(3, 0), (2, 40, 16)]
    with pytest.raises(ValueError):
        engine_step.parse_mixes("3")


def test_a_server_that_dies_ends_the_wait_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(serve_server.ServerFailed, match="exited with code 2") as e:
        serve_server.start_server(tmp_path / "no-such-artifacts", device="cpu",
                                  log_path=tmp_path / "server.log", timeout=300)
    assert "runtime serve: error" in str(e.value)  # the log's tail comes with it
    assert time.monotonic() - t0 < 120  # the process exit, not the 300 s limit
