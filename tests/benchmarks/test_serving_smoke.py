"""benchmarks/serving.py --smoke end to end: compiles the tiny model, serves it in-process, runs a
few concurrent streams with and without overlap, writes the report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def test_serving_benchmark_smoke(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "serving-tiny-cpu-smoke.md").read_text()
    assert "| TTFT |" in md and "--no-overlap" in md
    data = json.loads((tmp_path / "serving-tiny-cpu-smoke.json").read_text())
    assert data["load"]["completed"] == 8 and data["load"]["hangs"] == 0
    assert data["state_after"]["megagraph_cache_slots_used"] == 0
