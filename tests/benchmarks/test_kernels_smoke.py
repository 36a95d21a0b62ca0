"""benchmarks/kernels.py: the --smoke CPU mode end to end (every provider in
benchmarks/kernel_rows/, ceilings, kernels.md + kernels.json), and a dry run of the MoE provider's
GPU rows on the CPU under the Triton interpreter (tiny dims, one token count), so the code the
device runs is exercised before a lease."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "kernels.py"


def test_kernels_smoke_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=600, env=env,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "kernels.md").read_text()
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert "| group | kernel | case |" in md and "Ceilings measured" in md
    assert {"bf16_tflops", "copy_tbps"} <= set(data["ceilings"])
    moe = [r for r in data["rows"] if r.get("group") == "moe"]
    assert moe and not [r for r in data["rows"] if "error" in r]
    for r in moe:
        assert r["ms"] > 0 and r["rel_err"] < 1e-4, r  # capturable vs reference
    assert md.count("\n| moe |") == len(moe)


DRY = r"""
import json, sys, torch
sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
import kernel_rows
import kernel_rows.moe as m
m.COMPILE = False
m.time_ms = lambda fn, **kw: kernel_rows.time_once_ms(fn, device="cpu")
m.time_once_ms = m.time_ms
rows = m.device_rows(torch.device("cpu"), m.TINY, (3,), 600.0, sweep=False)
print(json.dumps(rows, default=str))
"""


@pytest.mark.slow
def test_moe_rows_dry_run_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", DRY], capture_output=True, text=True, timeout=900,
                       env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert rows and not [r for r in rows if "error" in r], rows
    kernels = {r["kernel"] for r in rows}
    assert {"triton.mega_mhc", "triton.mega_moe", "triton.moe_experts_q",
            "triton.fp8_block_gemm", "triton.grouped_fp8_gemm", "triton.quantize_act",
            "triton.moe_experts_q persistent", "triton.moe_experts_q fp8-H"} <= kernels
    for r in rows:
        if r["kernel"] == "triton.moe_experts_q fp8-H":  # H rounded to E4M3: ~2-3% (moe.py)
            assert 0.005 < r["rel_err"] < 2.0 ** -4 and r["rel_err_q"] < 1e-2, r
        elif "rel_err" in r:
            assert r["rel_err"] < 1e-2, r
