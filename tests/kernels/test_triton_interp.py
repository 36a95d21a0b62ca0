"""Runs the Triton kernel tests that cover their logic on the CPU (test_triton_moe.py,
test_triton_moe_persistent.py, test_triton_moe_fp8h.py, test_triton_moe_fused.py, test_triton_moe_decode.py, test_moe_grouped_cublas.py, test_triton_mhc.py, test_triton_quant.py,
test_triton_dense.py, test_triton_norm.py, test_triton_topk.py) under the Triton interpreter in a child pytest when there is no CUDA device: TRITON_INTERPRET must be set before triton is first imported (its library
functions are built at import), which a shared pytest process cannot promise."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the file runs in this process")
@pytest.mark.parametrize("name", ["test_triton_moe.py", "test_triton_moe_persistent.py", "test_triton_mhc.py",
                                  "test_triton_moe_fp8h.py", "test_triton_moe_fused.py",
                                  "test_triton_moe_decode.py", "test_moe_grouped_cublas.py",
                                  "test_triton_quant.py",
                                  "test_triton_dense.py", "test_triton_norm.py",
                                  "test_triton_topk.py"])
def test_under_interpreter(name):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(HERE / name)], capture_output=True, text=True,
                       timeout=1800, env=env, cwd=HERE.parent.parent)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and " failed" not in p.stdout
