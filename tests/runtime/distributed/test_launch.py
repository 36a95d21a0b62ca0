"""Launching: torchrun command lines (one node, several nodes), the re-exec decision, the
environment contract, and `python -m megagraph.runtime.distributed generate --nproc 2` end to end
(re-executed under torchrun) against one-process generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from megagraph.runtime.distributed.group import init_from_env
from megagraph.runtime.distributed.launch import (
    relaunch_under_torchrun,
    strip_flags,
    torchrun_argv,
)

from tests.runtime.distributed.common import compile_artifacts


def test_torchrun_command_lines():
    one = torchrun_argv(4, ["runtime", "serve", "art/", "--nproc", "4"], python="py")
    assert one == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                   "-m", "megagraph.main", "runtime", "serve", "art/"]  # launcher flags stay here
    assert strip_flags(["a", "--nproc=2", "--nnodes", "3", "--rdzv-endpoint", "h:1", "--x", "1"]) == \
        ["a", "--x", "1"]
    multi = torchrun_argv(8, ["x"], nnodes=2, rdzv_endpoint="node0:29400", python="py")
    assert multi[5:13] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "node0:29400", "--rdzv-id", "megagraph"]
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        torchrun_argv(8, ["x"], nnodes=2)


def test_relaunch_only_when_needed(monkeypatch):
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"re-exec {a}"))
    assert relaunch_under_torchrun(1, ["x"]) is False  # one rank: nothing to do
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert relaunch_under_torchrun(2, ["x"]) is False  # already a rank of the job


def test_environment_contract(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_from_env(device="cpu")
    assert (ctx.rank, ctx.world, ctx.backend, ctx.distributed) == (0, 1, "none", False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_from_env(device="cpu")


def test_generate_under_torchrun(tmp_path):
    from megagraph.runtime.engine import Engine
    from megagraph.runtime.sampling import SamplingParams

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    art2 = compile_artifacts("v4.1-flash-tiny", tmp_path / "dp2", dp=2, ep=2)
    cmd = [sys.executable, "-m", "megagraph.runtime.distributed", "generate", str(art2), "--nproc", "2",
           "--device", "cpu", "--max-tokens", "3", "--ignore-eos", "--json", "--timeout", "60"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = {row["prompt"]: row["token_ids"] for row in json.loads(run.stdout.strip().splitlines()[-1])}
    assert "rank 1:" in run.stderr and "rank 0:" in run.stderr
    # the same seeded weights and greedy decoding on one process
    art1 = compile_artifacts("v4.1-flash-tiny", tmp_path / "dp1", dp=1, ep=1)
    eng = Engine.from_artifacts(art1, device="cpu", seed=0, progress=False)
    want = eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, seed=0))
    assert [got[i] for i in range(3)] == [o.token_ids for o in want]
