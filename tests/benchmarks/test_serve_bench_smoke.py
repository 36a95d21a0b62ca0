"""benchmarks/serve_bench.py --smoke end to end on the CPU: compiles the tiny model, times its
engine step, starts `megagraph runtime serve` as its own process, runs the sweep, a prefill-heavy
point and a short soak over streaming /v1/completions, stops the server, times the engine alone
at each point's step mix, writes the report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def test_serve_bench_smoke(tmp_path, check_png):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = json.loads((tmp_path / "serve.json").read_text())["runs"][0]
    assert run["ok"] and not run["problems"] and not run["skipped"], run["problems"]
    kinds = [(x["kind"], x["concurrency"]) for x in run["points"]]
    assert kinds == [("sweep", 1), ("sweep", 2), ("prefill", 2), ("soak", 4)]
    for x in run["points"]:
        m = x["metrics"]
        assert m["completed"] == m["issued"] > 0 and m["failed"] == m["hung"] == 0
        assert m["lost_tokens"] == 0 and x["state_zero"], x
        assert x["server"]["steps"] > 0 and x["server"]["responses"] == {
            "completions 200": m["issued"]}
    sweep = [x for x in run["points"] if x["kind"] == "sweep"]
    for x in sweep:  # every request generated exactly max_tokens (ignore_eos)
        assert x["metrics"]["total_output_tokens"] == 6 * x["metrics"]["completed"]
        assert x["metrics"]["itl_ms"]["n"] == 5 * x["metrics"]["completed"]
        assert x["overhead"]["engine_step_ms"] > 0 and x["overhead"]["ratio"] > 0
    pre = next(x for x in run["points"] if x["kind"] == "prefill")
    assert pre["prefill_cap"] == 32  # --max-prefill-tokens 32: 96-token prompts in 3 chunks
    assert 0 < pre["server"]["prefill_tokens_per_step"] <= 32
    assert run["points"][-1]["memory"]["flat"] in ("yes", "no")
    for x in sweep + [run["points"][-1]]:  # the step counters add up; same-mix baseline ran
        mx, sv = x["server"]["mix"], x["server"]
        assert mx["decode_only_steps"] + mx["mixed_steps"] <= sv["steps"]
        assert x["overhead"]["same_mix_step_ms"] > 0 and x["overhead"]["same_mix_ratio"] > 0
    mixes = {tuple(r[k] for k in ("decode", "prompt", "chunk")) for r in run["engine_mix"]
             ["mix_rows"]}
    assert {tuple(m) for x in sweep for m in x["overhead"]["mixes"] if m[0]} <= mixes
    eng = run["engine_step"]
    assert [r["B"] for r in eng["rows"]] == [1, 2] and all(r["ms"] > 0 for r in eng["rows"])
    srv = run["server"]
    assert srv["startup"]["ready_s"] > 0 and "weights" in srv["startup"]["phases_s"]
    assert srv["alive_at_end"] and srv["memory_start"]["rss_mib"] > 0
    md = (tmp_path / "serve.md").read_text()
    assert "| concurrency | done/issued |" in md and "### Soak" in md
    assert "| ITL p50 / same-mix |" in md and "Step composition" in md
    check_png(md, tmp_path / "serve.png")
