"""Model-level checkpoint loading: real safetensors files in the official layout (written by our own
writer) and a transformers `save_pretrained` V4 checkpoint, through the step graph."""

import pytest
import torch

from megagraph.models.build import build_step
from megagraph.models.checkpoint import CheckpointError
from megagraph.models.checkpoint.synthetic import random_weights, write_random_checkpoint
from megagraph.models.config import load_model_config
from megagraph.models.load import checkpoint_layout, load_weights
from megagraph.models.session import weight_specs
from tests.tiny import SeqChunk, constants_for, random_tokens, session

STD = 64 ** -0.5


@pytest.fixture(scope="module")
def tiny41(tmp_path_factory):
    cfg = load_model_config("v4.1-flash-tiny").replace(act_dtype="f32")
    g = build_step(cfg)
    path = tmp_path_factory.mktemp("ckpt") / "v41"
    write_random_checkpoint(path, weight_specs(g), seed=3, init_std=STD, max_shard_bytes=200_000)
    return cfg, g, path


def test_official_layout_round_trip_runs_identically(tiny41):
    cfg, g, path = tiny41
    assert len(list(path.glob("model-*.safetensors"))) > 1 and checkpoint_layout(path) == "official"
    loaded = load_weights(cfg, g, path, progress=False)
    in_memory = random_weights(weight_specs(g), seed=3, init_std=STD, stacked=True)
    toks = random_tokens(20, 1)
    a = session(cfg, g, loaded, constants_for(cfg)).step([SeqChunk(0, toks)])
    b = session(cfg, g, in_memory, constants_for(cfg)).step([SeqChunk(0, toks)])
    assert torch.equal(a, b)


def test_dequantized_reference_path_matches_storage_format(tiny41):
    """The dense graph on dequantized weights computes what the release graph computes (the
    reference kernels dequantize the same way); differences are fp32 reassociation only."""
    cfg, g, path = tiny41
    dense_cfg = cfg.replace(weight_format="dense")
    dense_g = build_step(dense_cfg)
    dense_w = load_weights(dense_cfg, dense_g, path, dequantize=True, progress=False)
    assert dense_w["layers.0.attn.wq_a.weight"].dtype == torch.float32
    toks = random_tokens(15, 2)
    a = session(dense_cfg, dense_g, dense_w, constants_for(cfg)).step([SeqChunk(0, toks)])
    b = session(cfg, g, load_weights(cfg, g, path, progress=False), constants_for(cfg)).step([SeqChunk(0, toks)])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_mismatched_checkpoint_names_the_tensor(tiny41, tmp_path):
    cfg, g, path = tiny41
    other = cfg.replace(hidden_size=96)  # a checkpoint of another model
    with pytest.raises(CheckpointError, match="embed.weight") as e:
        load_weights(other, build_step(other), path, progress=False)
    assert str(path) in str(e.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(cfg, g, tmp_path / "nope", progress=False)


def test_truncated_shard_is_detected_before_running(tiny41, tmp_path):
    import shutil

    cfg, g, path = tiny41
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        load_weights(cfg, g, bad, progress=False)


def test_transformers_layout_v4_checkpoint(tmp_path):
    """A `save_pretrained` DeepseekV4ForCausalLM loads into our V4 graph and gives its logits."""
    from tests.models.test_v4_parity import hf_config, randomized_model

    cfg = load_model_config("v4-flash-tiny").replace(weight_format="dense", act_dtype="f32")
    model = randomized_model(hf_config(cfg), seed=5)
    model.save_pretrained(tmp_path / "hf")
    assert checkpoint_layout(tmp_path / "hf") == "transformers"
    g = build_step(cfg)
    w = load_weights(cfg, g, tmp_path / "hf", progress=False)
    ids = random_tokens(40, 3, vocab=cfg.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits[0]
    ours = session(cfg, g, w, {}).step([SeqChunk(0, ids)])
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
