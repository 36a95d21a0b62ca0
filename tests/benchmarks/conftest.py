"""Helpers of the benchmark smoke tests: run a benchmarks/ script on the CPU, check its rows."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_bench():
    """run_bench("prefill.py", *args): the script in a subprocess (one thread, the plan's default
    kernels); fails the test with its output when it exits non-zero."""

    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("MEGAGRAPH_UNVALIDATED_KERNELS", None)
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                           capture_output=True, text=True, check=False, timeout=300, env=env,
                           cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    return run


@pytest.fixture
def measured_rows():
    """measured_rows(res, modes, requests_of_B) -> {(mode, B): row}, asserting every (mode, B)
    ran (positive time, B tokens in the expected number of requests)."""

    def check(res: dict, modes, requests) -> dict:
        rows = {(r["mode"], r["B"]): r for r in res["rows"]}
        for mode in modes:
            for B in res["args"]["batches"]:
                r = rows[(mode, B)]
                assert "error" not in r and "skipped" not in r, r
                assert r["ms"] > 0 and r["tokens"] == B and r["requests"] == requests(B), r
        return rows

    return check


def png_written(md: str, path: Path) -> None:
    """The plot exists where matplotlib does, else the report says why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "Plot not written" in md
    else:
        data = path.read_bytes()
        assert len(data) > 10_000 and data[:4] == b"\x89PNG"


@pytest.fixture
def check_png():
    return png_written
