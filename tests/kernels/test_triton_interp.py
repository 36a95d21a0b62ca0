"""Runs the Triton kernel tests that cover their logic on the CPU under the Triton interpreter,
each file in a child pytest, when there is no CUDA device: TRITON_INTERPRET must be set before
triton is first imported (its library functions are built at import), which a shared pytest
process cannot promise.

The children are independent, so they run side by side, as many at once as the machine has cores
(the CI machine: 2), the longest first; the top-k file runs as two halves (-k shards whose union
is the file). The interpreter's cost is per program step, so the kernel tests keep their rows and
steps few while still reaching every branch (the top-k file puts one row per data kind in one
launch). Each test below asserts on its own file's children."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megagraph.configs.process import triton_interpret

pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent
# longest first (child CPU times: top-k ~135 s in its two shards, mhc ~90, moe ~45, decode ~30,
# fp8h ~20, quant ~12, the rest a few seconds)
FILES = ["indexer/test_triton_topk.py", "mhc/test_triton_mhc.py", "moe/test_triton_moe.py",
         "moe/test_triton_moe_decode.py", "moe/test_triton_moe_fp8h.py", "dense/test_triton_quant.py",
         "moe/test_moe_grouped_cublas.py", "dense/test_triton_dense.py", "dense/test_triton_norm.py"]
# a file run as several children: pytest -k expressions that together select every test once
SHARDS = {"indexer/test_triton_topk.py": ["stream", "not stream"]}
JOBS = [(name, k) for name in FILES for k in SHARDS.get(name, [None])]


def _child(job: tuple[str, str | None]):
    name, k = job
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / name)]
    return job, subprocess.run(cmd + (["-k", k] if k else []), capture_output=True, text=True,
                               timeout=1800, env=env, cwd=HERE.parent.parent)


@pytest.fixture(scope="module")
def children() -> dict:
    """Every child's CompletedProcess by (file, -k shard), run at most os.cpu_count() at once in
    JOBS' order (the pool takes them longest first)."""
    with ThreadPoolExecutor(max(1, min(len(JOBS), os.cpu_count() or 1))) as pool:
        return dict(pool.map(_child, JOBS))


@pytest.mark.skipif(torch.cuda.is_available() or triton_interpret(),
                    reason="the file runs in this process")
@pytest.mark.parametrize("name", FILES)
def test_under_interpreter(name, children):
    for k in SHARDS.get(name, [None]):
        p = children[(name, k)]
        where = f"{name}{f' -k {k!r}' if k else ''}"
        assert p.returncode == 0, where + "\n" + p.stdout[-6000:] + p.stderr[-3000:]
        assert " passed" in p.stdout and " failed" not in p.stdout, where


def test_shards_cover_each_file_once():
    """The -k shards of a file are complementary (k and "not k"), so their union is the file and
    no test runs twice."""
    for name, ks in SHARDS.items():
        assert name in FILES and len(ks) == 2 and ks[1] == f"not {ks[0]}", (name, ks)
