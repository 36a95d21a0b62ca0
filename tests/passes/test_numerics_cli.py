"""`megagraph compile --numerics reference`: any checkpoint (or shipped model) in fp32 without
writing YAML, through the real CLI (megagraph.main), recorded in model.yaml and the manifest.

The engine over reference artifacts and a real checkpoint (project writer + release config.json)
is checked against the dense f32 reference path on the same checkpoint (weights dequantized on
load, models/load.py) to 1e-4: both compute in f32 from the same dequantized values, so only
fp32 reassociation differs (~1e-6), and any bf16 or FP8 rounding left in would show as ~1e-2."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from megagraph.main import main as cli
from megagraph.models.build import build_step
from megagraph.models.config import ModelConfig, load_model_config
from megagraph.models.load import load_weights
from megagraph.runtime.engine import Engine
from tests.checkpoints import write_model_checkpoint
from tests.tiny import SeqChunk, constants_for, random_tokens, session

SEED = int(torch.randint(0, 2**31 - 1, ()).item())
TINY = "v4.1-flash-tiny"


def compile_(tmp_path, model: str, hw: str, *extra: str, out: str = "art"):
    assert cli(["compile", "--model", model, "--hw", hw, "--out", str(tmp_path / out), *extra]) == 0
    art = tmp_path / out
    y = lambda f: yaml.safe_load((art / f).read_text())  # noqa: E731
    return art, y("model.yaml"), y("manifest.yaml")


def input_dtypes(mgir: str) -> set[str]:
    """dtypes of a graph dump's inputs (metadata, the token map, every state)."""
    return {m.group(1) for m in re.finditer(r"^\s*input %\S+ : (\w+)\[", mgir, re.M)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny V4.1 checkpoint dir as released: config.json (bf16 + QAT numerics) + shards."""
    cfg = load_model_config(TINY)
    return write_model_checkpoint(tmp_path_factory.mktemp("num") / "ckpt", cfg, [build_step(cfg)],
                                  seed=SEED)


def test_reference_numerics_from_a_checkpoint_dir_run_in_fp32(tmp_path, ckpt, capsys):
    art, model, manifest = compile_(tmp_path, str(ckpt), "cpu", "--numerics", "reference")
    assert "with reference numerics" in capsys.readouterr().out
    assert (model["act_dtype"], model["quantize_kv"]) == ("f32", False)
    assert manifest["options"]["numerics"] == "reference"
    built = (art / "graph" / "00-built.mgir").read_text()
    assert "fake_quant" not in built  # no QAT rounding of KV / index rows
    assert input_dtypes(built) == {"i64", "f32"}  # every cache (rings, compressed KV, index keys) f32
    # the same checkpoint without the flag: the config's own numerics
    _, model_d, manifest_d = compile_(tmp_path, str(ckpt), "cpu", out="default")
    assert (model_d["act_dtype"], model_d["quantize_kv"], manifest_d["options"]["numerics"]) == \
        ("bf16", True, "default")
    assert "bf16" in input_dtypes((tmp_path / "default" / "graph" / "00-built.mgir").read_text())
    assert {k: v for k, v in model.items() if k not in ("act_dtype", "quantize_kv")} == \
        {k: v for k, v in model_d.items() if k not in ("act_dtype", "quantize_kv")}

    cfg = ModelConfig.from_hf(ckpt)
    token_map = constants_for(cfg)["engram_token_map"]  # the checkpoint has no tokenizer
    eng = Engine.from_artifacts(art, ckpt, token_map=token_map, max_slots=2, capacity=64, progress=False)
    dense_cfg = cfg.replace(act_dtype="f32", quantize_kv=False, weight_format="dense")
    dense_g = build_step(dense_cfg)
    ref = session(dense_cfg, dense_g, load_weights(dense_cfg, dense_g, ckpt, dequantize=True,
                                                   progress=False), constants_for(cfg))
    toks = random_tokens(14, SEED, vocab=cfg.vocab_size)
    got, want = eng.step([SeqChunk(0, toks)]), ref.step([SeqChunk(0, toks)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"SEED {SEED}")
    nxt = (int(want[-1].argmax()),)
    torch.testing.assert_close(eng.step([SeqChunk(0, nxt)]), ref.step([SeqChunk(0, nxt)]),
                               rtol=1e-4, atol=1e-4, msg=f"SEED {SEED}")


def test_reference_numerics_by_name_skip_activation_quantization_on_gpu_profiles(tmp_path):
    art, model, manifest = compile_(tmp_path, "v4-flash-tiny", "h200", "--numerics", "reference")
    assert (model["act_dtype"], model["quantize_kv"]) == ("f32", False)
    (rec,) = [p for p in manifest["passes"] if p["name"] == "quantize-epilogues"]
    assert rec["status"] == "skipped" and "reference numerics" in rec["note"]
    final = (art / manifest["graphs"]["step"]).read_text()
    assert "quantize_act" not in final and "linear_q" not in final
    _, _, default = compile_(tmp_path, "v4-flash-tiny", "h200", out="default")
    (rec,) = [p for p in default["passes"] if p["name"] == "quantize-epilogues"]
    assert rec["status"] == "changed"  # what the flag turns off


def test_unknown_numerics_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["compile", "--model", TINY, "--hw", "cpu", "--out", str(tmp_path / "x"), "--numerics", "fp16"])
    assert e.value.code == 2 and "invalid choice: 'fp16'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
