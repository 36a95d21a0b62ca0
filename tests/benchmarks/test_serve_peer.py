"""benchmarks/serve_peer.py reads each peer client's own output format (SGLang bench_serving's
JSONL, guidellm's JSON) and the server's /metrics scrapes around its run, and sets the figures
beside serve_bench.py's at the same concurrency."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_peer  # noqa: E402


def _prom(path: Path, steps: int, seconds: float) -> None:
    path.write_text(f"# TYPE megagraph_step_seconds histogram\nmegagraph_step_seconds_sum "
                    f"{seconds}\nmegagraph_step_seconds_count {steps}\n")


def test_peer_rows_and_ratios(tmp_path):
    dist = {"mean": 10.0, "p50": 9.0, "p99": 20.0}
    sb = {"runs": [{"points": [{"kind": "sweep", "concurrency": 4, "metrics": {
        "completed": 8, "total_input_tokens": 128, "request_throughput": 2.0,
        "output_tok_s": 32.0, "ttft_ms": dist, "itl_ms": dist, "tpot_ms": dist},
        "server": {"step_ms_mean": 10.0}}]}]}
    (tmp_path / "sb.json").write_text(json.dumps(sb))
    sg = tmp_path / "sg.jsonl"
    sg.write_text(json.dumps({
        "max_concurrency": 4, "completed": 8, "total_input_tokens": 128,
        "request_throughput": 1.0, "output_throughput": 16.0, "mean_ttft_ms": 20.0,
        "median_ttft_ms": 18.0, "p99_ttft_ms": 40.0, "mean_itl_ms": 24.0,
        "median_itl_ms": 22.0, "p99_itl_ms": 50.0, "median_tpot_ms": 23.0}) + "\n")
    _prom(Path(f"{sg}.before.prom"), 100, 1.0)
    _prom(Path(f"{sg}.after.prom"), 200, 3.0)  # 20 ms a step over the run
    rows = serve_peer.from_serve_bench(tmp_path / "sb.json") + serve_peer.from_sglang(sg)
    assert rows[1]["step_ms"] == pytest.approx(20.0)
    assert rows[0]["itl_over_step"] == pytest.approx(1.0)
    assert rows[1]["itl_over_step"] == pytest.approx(1.2)
    md = serve_peer.markdown(rows)
    ratio = next(ln for ln in md.splitlines() if ln.startswith("| sglang bench_serving | 4 |")
                 and "0.50" in ln)
    assert ratio.split(" | ")[-1] == "1.20 |"  # (24 / 20) / (10 / 10)


def test_guidellm_rows(tmp_path):
    def d(mean, p50, p99):
        return {"successful": {"mean": mean, "total_sum": 64.0,
                               "percentiles": {"p50": p50, "p99": p99}}}

    g = tmp_path / "g.json"
    g.write_text(json.dumps({"benchmarks": [{"duration": 4.0, "config": {
        "strategy": {"streams": 2}}, "metrics": {
        "request_totals": {"successful": 8}, "prompt_token_count": d(17.0, 17, 17),
        "output_token_count": d(8.0, 8, 8), "time_to_first_token_ms": d(30.0, 28.0, 60.0),
        "inter_token_latency_ms": d(12.0, 11.0, 15.0),
        "time_per_output_token_ms": d(14.0, 13.0, 16.0)}}]}))
    (r,) = serve_peer.from_guidellm(g)
    assert (r["concurrency"], r["completed"], r["prompt"]) == (2, 8, 17.0)
    assert r["req_s"] == 2.0 and r["out_tok_s"] == 16.0  # 64 tokens over 4 s
    assert (r["ttft_p50"], r["itl_mean"], r["tpot_p50"]) == (28.0, 12.0, 13.0)
    assert r["step_ms"] is None  # no scrapes beside it
