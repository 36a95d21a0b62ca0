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
# the balanced-routing layer row (prefill sizes only in device_rows): 4 tokens x top-2 of 8
from megagraph.kernels.fused import reference as rf
from megagraph.kernels.moe import triton as tm
cpu = torch.device("cpu")
w = m.make_weights(m.TINY, cpu)
streams, (x, xq, xs, _pre, post, comb) = m.layer_inputs(m.TINY, w, 4, cpu, seed=5)
args = (x, xq, xs, streams, post, comb, w["gate"], w["bias"], *w["routed"], *w["shared"])
rows += m.balanced_row(m.TINY, w, 4, cpu, tm, rf, args, dict(topk=2, **m.MOE_KW), 1.0)
# layer_call (moe_ab.py / ncu_moe.py's call) on the same inputs (seed T + 1) and routing
ref = rf.mega_moe(*args, *m.balanced_routing(4, 8, 2, cpu), topk=2, **m.MOE_KW)
rows[-2]["layer_call_rel_err"] = kernel_rows.rel_err(m.layer_call(m.TINY, w, 4, cpu, "balanced")(),
                                                     ref)
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
            "triton.moe_experts_q fp8-H"} <= kernels
    balanced = [r for r in rows if r["case"].endswith("balanced routing")]
    assert len(balanced) == 1 and "8 experts x 1 rows" in balanced[0]["notes"], balanced
    assert balanced[0]["layer_call_rel_err"] < 1e-2, balanced
    fp16 = [r for r in rows if r["case"].endswith("balanced routing, fp16 H")]
    # on the CPU both rows run the reference kernels: the same layer, the same bits
    assert len(fp16) == 1 and "rel diff to it 0.00e+00" in fp16[0]["notes"], fp16
    for r in rows:
        if r["kernel"] == "triton.moe_experts_q fp8-H":  # H rounded to E4M3: ~2-3% (moe.py)
            assert 0.005 < r["rel_err"] < 2.0 ** -4 and r["rel_err_q"] < 1e-2, r
        elif "rel_err" in r:
            assert r["rel_err"] < 1e-2, r


@pytest.mark.parametrize("T,E,k", [(8192, 384, 6), (4, 8, 2), (96, 48, 3)])
def test_balanced_routing_fills_every_expert_equally(T, E, k):
    """The routing of #7's prefill target: every expert exactly T k / E rows, k distinct experts
    per token (what tid2eid must hold for the hash-routed top-k)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from kernel_rows.moe import balanced_routing

    tid2eid, tok = balanced_routing(T, E, k, "cpu")
    assert tid2eid.shape == (T, k) and tid2eid.dtype == torch.int32
    assert torch.equal(tok, torch.arange(T, dtype=torch.int32))
    assert torch.equal(torch.bincount(tid2eid.flatten().long(), minlength=E),
                       torch.full((E,), T * k // E))
    assert all(len(set(r.tolist())) == k for r in tid2eid)
