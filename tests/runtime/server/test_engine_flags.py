"""`megagraph runtime serve` takes the engine choices `runtime generate` takes: torch.compile and
its numerics, CUDA graphs off, and artifacts of another hardware profile with --allow-fallback
(a real server on 127.0.0.1 answering the real `openai` client)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from megagraph.runtime.server.cli import add_serve_arguments, config_from_args, startup_lines
from megagraph.runtime.server.config import ServeConfig
from megagraph.runtime.server.service import ServingEngine

from .conftest import MODEL, free_port, fresh_config, start_server, wait_idle


def parse(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_arguments(p.add_subparsers(dest="cmd"))
    return config_from_args(p.parse_args(["serve", "art", *argv]))


def test_serve_flags_reach_the_engine_config():
    ec = parse("--compile", "inductor", "--compile-numerics", "fast", "--no-cuda-graphs",
               "--allow-fallback").engine_config(4)
    assert (ec.compile, ec.compile_numerics, ec.cuda_graphs, ec.allow_fallback) == \
        ("inductor", "fast", False, True)
    ec = parse().engine_config(4)
    assert (ec.compile, ec.compile_numerics, ec.cuda_graphs, ec.allow_fallback) == \
        ("none", "eager", True, False)


def test_thinking_default_and_edited_artifacts_flags():
    assert parse().default_thinking is False  # off unless asked, as SGLang serves V4.1
    assert parse("--thinking-default", "on").default_thinking is True
    assert parse("--thinking-default", "off").default_thinking is False
    with pytest.raises(SystemExit):
        parse("--thinking-default", "maybe")
    assert parse().allow_edited_artifacts is False
    assert parse("--allow-edited-artifacts").allow_edited_artifacts is True


@pytest.fixture(scope="module")
def h200_artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-h200") / "tiny-h200"
    subprocess.run([sys.executable, "-m", "megagraph.main", "compile", "--model", MODEL, "--hw",
                    "h200", "--out", str(out)], check=True, capture_output=True)
    return out


def test_other_hardware_is_refused_then_served_with_allow_fallback(h200_artifacts):
    conf = ServeConfig(artifacts=str(h200_artifacts), port=free_port(), capacity=256,
                       max_running=2, max_prefill_tokens=64, drain_timeout=5)
    with pytest.raises(ValueError, match="--allow-fallback"):
        ServingEngine.start(conf)
    srv = start_server(replace(conf, allow_fallback=True))
    try:
        assert any("artifacts for h200 (sm_90) on cpu" in line for line in startup_lines(srv.service))
        out = srv.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_max_mixed_prefill_tokens_reaches_the_scheduler_and_metrics(server_config):
    """With the bound at 0 no step mixes prompt tokens into decode rows, and /metrics counts
    the steps by composition (the like-for-like engine baseline reads these counters)."""
    assert parse().max_mixed_prefill_tokens is None
    assert parse("--max-mixed-prefill-tokens", "64").max_mixed_prefill_tokens == 64
    srv = start_server(fresh_config(server_config, max_mixed_prefill_tokens=0, api_key=None))
    try:
        assert srv.service.scheduler.config.max_mixed_prefill_tokens == 0
        assert any("0 beside decode rows" in line for line in startup_lines(srv.service))

        def one(i):
            return srv.client().completions.create(
                model=MODEL, prompt=list(range(10 + i, 60 + i)), max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}).usage.completion_tokens

        with ThreadPoolExecutor(4) as ex:
            assert list(ex.map(one, range(6))) == [8] * 6
        m = wait_idle(srv)
        assert m["megagraph_scheduler_mixed_steps_total"] == 0
        assert m["megagraph_scheduler_mixed_prefill_tokens_total"] == 0
        assert m["megagraph_scheduler_decode_only_steps_total"] > 0
        assert not any(k.startswith("megagraph_device_memory_") for k in m)  # CUDA only
    finally:
        srv.stop()
