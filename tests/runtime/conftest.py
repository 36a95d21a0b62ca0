"""Fixtures: tiny models compiled to real artifact dirs (once per session), engines over them."""

from __future__ import annotations

import pytest

from megagraph.models.config import load_model_config
from megagraph.passes import compile_model, load_hw_profile
from megagraph.passes.artifacts import write_artifacts
from megagraph.runtime.engine import Engine, EngineConfig
from megagraph.runtime.plan import RunPlan

from tests.tiny import tiny


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """compiled(model, hw="cpu", act="f32") -> artifacts dir (compiled once per arguments)."""
    cache = {}

    def get(model: str, hw: str = "cpu", act: str = "f32"):
        key = (model, hw, act)
        if key not in cache:
            cfg = load_model_config(model).replace(act_dtype=act)
            out = tmp_path_factory.mktemp("artifacts") / f"{model}-{hw}-{act}"
            write_artifacts(compile_model(cfg, load_hw_profile(hw)), out)
            cache[key] = out
        return cache[key]

    return get


def make_engine(path, model: str, *, act: str = "f32", **config) -> Engine:
    """An engine over compiled artifacts with the tests' seeded weights (tests/tiny.py)."""
    _, _, w, consts = tiny(model, act_dtype=act)
    config.setdefault("max_slots", 4)
    config.setdefault("capacity", 128)
    config.setdefault("progress", False)
    return Engine(RunPlan.from_artifacts(path), dict(w), EngineConfig(**config),
                  token_map=consts.get("engram_token_map"))


@pytest.fixture(scope="session")
def compiled_replay(tmp_path_factory):
    """The tiny V4.1 (f32) compiled for cpu with the bounded-replay graphs."""
    from megagraph.passes import CompileOptions

    cfg = load_model_config("v4.1-flash-tiny").replace(act_dtype="f32")
    out = tmp_path_factory.mktemp("artifacts") / "tiny-replay"
    write_artifacts(compile_model(cfg, load_hw_profile("cpu"), CompileOptions(bounded_replay=True)), out)
    return out
