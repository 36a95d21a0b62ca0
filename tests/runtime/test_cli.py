"""`megagraph runtime generate` end to end, as a real subprocess over `megagraph compile` output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def megagraph(*args: str, env=None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "megagraph"
    cmd = [str(exe)] if exe.exists() else [shutil.which("megagraph") or "megagraph"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-cpu"
    r = megagraph("compile", "--model", "v4.1-flash-tiny", "--hw", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


GEN = ("--max-tokens", "4", "--temperature", "0", "--max-slots", "2", "--capacity", "64")


def test_generate_streams_text_and_reports_startup(artifacts):
    r = megagraph("runtime", "generate", str(artifacts), "--prompt", "Hello world", *GEN, "--json")
    assert r.returncode == 0, r.stderr
    assert "[megagraph] start-up" in r.stderr and "weights: random (seeded" in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out) == 1 and len(out[0]["token_ids"]) == 4
    again = megagraph("runtime", "generate", str(artifacts), "--prompt", "Hello world", *GEN, "--json")
    assert again.stdout == r.stdout  # greedy + seeded weights: deterministic


def test_generate_token_id_prompts_and_n(artifacts):
    r = megagraph("runtime", "generate", str(artifacts), "--prompt-ids", "0,5,6,7", "--n", "2",
                  "--temperature", "1", *GEN[:2], "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    assert [(o["request"], o["index"]) for o in json.loads(r.stdout.strip().splitlines()[-1])] == \
        [(0, 0), (0, 1)]


def test_bad_inputs_exit_2_with_a_message(artifacts, tmp_path):
    r = megagraph("runtime", "generate", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and "no such directory" in r.stderr
    r = megagraph("runtime", "generate", str(artifacts), "--prompt", "x", "--top-p", "0")
    assert r.returncode == 2 and "SamplingParams.top_p" in r.stderr
    r = megagraph("runtime", "generate", str(artifacts), "--prompt", "x", "--weights", str(tmp_path))
    assert r.returncode == 2 and "model.safetensors" in r.stderr


def test_other_hardware_needs_allow_fallback(tmp_path):
    out = tmp_path / "tiny-h200"
    assert megagraph("compile", "--model", "v4.1-flash-tiny", "--hw", "h200", "--out", str(out)).returncode == 0
    r = megagraph("runtime", "generate", str(out), "--prompt", "Hi", *GEN)
    assert r.returncode == 2 and "compiled for hardware profile 'h200'" in r.stderr
    r = megagraph("runtime", "generate", str(out), "--prompt", "Hi", *GEN, "--allow-fallback")
    assert r.returncode == 0, r.stderr
    assert "artifacts for h200 (sm_90) on cpu" in r.stderr
