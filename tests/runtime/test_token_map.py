"""The Engram token map is never a silent stand-in (runtime/token_map.py): derived from the
checkpoint's tokenizer.json or `--tokenizer PATH`, given by the caller, the stand-in only for
random weights and named in the start-up report; a checkpoint or given tensors with no tokenizer
refuse to start, before any weight is read, saying what to pass.

Real files: checkpoints from the project's writer, a real tokenizer.json (tests/checkpoints.py
write_tiny_tokenizer) whose map has the tiny model's 400 classes."""

from __future__ import annotations

import shutil

import pytest
import torch

from megagraph.main import main as cli
from megagraph.models.checkpoint import random_weights, write_checkpoint
from megagraph.models.engram import tiny_token_map
from megagraph.runtime.engine import Engine, EngineConfig
from megagraph.runtime.plan import RunPlan
from megagraph.runtime.token_map import TokenMapError, token_map_from_tokenizer
from megagraph.runtime.weights import graph_weight_specs
from tests.checkpoints import write_tiny_tokenizer
from tests.tiny import SeqChunk, random_tokens, tiny

MODEL = "v4.1-flash-tiny"
CONF = dict(max_slots=2, capacity=64, progress=False)
SEED = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh weights and prompts every run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny V4.1 checkpoint without a tokenizer beside it."""
    cfg, g, _, _ = tiny(MODEL, act_dtype="f32")
    w = random_weights(graph_weight_specs([g]), seed=SEED, init_std=cfg.hidden_size ** -0.5)
    return write_checkpoint(tmp_path_factory.mktemp("tm") / "ckpt", w, max_shard_bytes=8 << 20)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), tiny(MODEL)[0])


def report(eng) -> str:
    return "\n".join(eng.report.lines())


def test_checkpoint_without_tokenizer_refuses_before_reading_weights(compiled, ckpt, tmp_path):
    with pytest.raises(TokenMapError, match=r"(?s)has no tokenizer.json beside it.*--tokenizer PATH") as e:
        Engine.from_artifacts(compiled(MODEL), ckpt, **CONF)
    assert str(ckpt) in str(e.value) and "token_map=" in str(e.value)
    # a damaged checkpoint still gets the token-map error: it comes before the shards are read
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(TokenMapError):
        Engine.from_artifacts(compiled(MODEL), bad, **CONF)


def test_tokenizer_beside_the_checkpoint_gives_the_map(compiled, ckpt, tokenizer, tmp_path):
    beside = tmp_path / "with-tok"
    shutil.copytree(ckpt, beside)
    shutil.copy(tokenizer, beside / "tokenizer.json")
    eng = Engine.from_artifacts(compiled(MODEL), beside, **CONF)
    m = eng.constants["engram_token_map"]
    assert f"engram token map: derived from {beside / 'tokenizer.json'}" in report(eng)
    assert torch.equal(m, token_map_from_tokenizer(tokenizer, eng.cfg))
    assert len(set(m.tolist())) == eng.cfg.engram_compressed_vocab_size  # 400 classes
    assert torch.equal(m[399:499], m[3:103])  # W<i> folds into w<i>'s class (Lowercase)
    assert not torch.equal(m, tiny_token_map(eng.cfg))
    # and the map is what the step reads: the same engine given that map computes the same
    toks = random_tokens(12, SEED)
    given = Engine.from_artifacts(compiled(MODEL), ckpt, token_map=m, **CONF)
    assert "engram token map: given by the caller" in report(given)
    torch.testing.assert_close(eng.step([SeqChunk(0, toks)]), given.step([SeqChunk(0, toks)]),
                               rtol=0, atol=0)


def test_tokenizer_option_and_a_wrong_tokenizer(compiled, ckpt, tokenizer, tmp_path):
    eng = Engine.from_artifacts(compiled(MODEL), ckpt, tokenizer=str(tokenizer.parent), **CONF)
    assert f"derived from {tokenizer}" in report(eng) and eng.tokenizer.path == tokenizer
    with pytest.raises(FileNotFoundError, match=r"--tokenizer .*nope.json: no such file"):
        Engine.from_artifacts(compiled(MODEL), ckpt, tokenizer=str(tmp_path / "nope.json"), **CONF)
    other = tmp_path / "other.json"  # a real tokenizer of another model: the class count says so
    write_tiny_tokenizer(other, tiny(MODEL)[0].replace(engram_compressed_vocab_size=300))
    with pytest.raises(ValueError, match=r"other.json: the compressed token map has 300 classes.*"
                                         r"expects engram_compressed_vocab_size = 400"):
        Engine.from_artifacts(compiled(MODEL), ckpt, tokenizer=str(other), **CONF)


def test_random_weights_get_the_stand_in_named_in_the_report(compiled):
    eng = Engine.from_artifacts(compiled(MODEL), **CONF)
    assert "engram token map: stand-in (models.engram.tiny_token_map" in report(eng)
    assert torch.equal(eng.constants["engram_token_map"], tiny_token_map(eng.cfg))
    v4 = Engine.from_artifacts(compiled("v4-flash-tiny"), **{**CONF, "capacity": 128})  # no Engram
    assert "engram token map" not in report(v4) and not v4.constants


def test_given_tensors_need_a_map_and_a_bad_map_is_refused(compiled):
    cfg, _, w, consts = tiny(MODEL, act_dtype="f32")
    plan = RunPlan.from_artifacts(compiled(MODEL))
    with pytest.raises(TokenMapError, match="given as tensors and no tokenizer is named"):
        Engine(plan, dict(w), EngineConfig(**CONF))
    good = consts["engram_token_map"]
    bad_pad = good.clone()
    bad_pad[cfg.engram_pad_token_id] = 7
    for m, msg in ((good[:-1], r"expected shape \[129408\]"), (good.float(), "integer class ids"),
                   (good + 1000, r"class ids must lie in 0\.\.399"),
                   (bad_pad, r"token 2 \(engram_pad_token_id\) must be its own class 2")):
        with pytest.raises(TokenMapError, match=msg):
            Engine(plan, dict(w), EngineConfig(**CONF), token_map=m)


def test_cli_generate_and_serve_say_what_to_pass(compiled, ckpt, tokenizer, capsys):
    art = str(compiled(MODEL))
    args = ["runtime", "generate", art, "--weights", str(ckpt), "--prompt-ids", "0,5,6,7",
            "--max-tokens", "2", "--temperature", "0", "--max-slots", "2", "--capacity", "64"]
    assert cli(args) == 2
    assert "--tokenizer PATH" in capsys.readouterr().err
    assert cli([*args, "--tokenizer", str(tokenizer)]) == 0
    assert f"engram token map: derived from {tokenizer}" in capsys.readouterr().err
    serve = ["runtime", "serve", art, "--weights", str(ckpt), "--port", "0", "--capacity", "64",
             "--max-running", "2"]
    assert cli(serve) == 2  # refused at start-up, before the HTTP server
    err = capsys.readouterr().err
    assert "megagraph runtime serve: error:" in err and "--tokenizer PATH" in err


def test_serve_flag_reaches_the_engine(tokenizer):
    import argparse

    from megagraph.runtime.cli import add_arguments
    from megagraph.runtime.server.cli import config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["serve", "art", "--tokenizer", str(tokenizer)])
    assert config_from_args(args).engine_config(2).tokenizer == str(tokenizer)
