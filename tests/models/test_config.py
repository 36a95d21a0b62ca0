"""Model configs: shipped YAML, HF config.json (V4 flat, V4.1 nested), and errors that name the field."""

import json

import pytest

from megagraph.models.config import ConfigError, ModelConfig, known_models, load_model_config


def test_shipped_models_load():
    assert {"v4.1-flash", "v4.1-flash-tiny"} <= set(known_models())
    c = load_model_config("v4.1-flash")
    assert (c.hidden_size, c.num_layers, c.n_routed_experts, c.rms_norm_eps) == (5120, 40, 384, 1e-20)
    assert c.compress_ratios[:3] == (0, 0, 2) and c.compress_ratios[20] == 1


def test_unknown_model_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown model 'v9'.*v4.1-flash"):
        load_model_config("v9")


def v41_hf_config() -> dict:
    """A V4.1 config.json in the release's nested layout (values from the spec §1.1)."""
    c = load_model_config("v4.1-flash")
    text = {
        "model_type": "deepseek_v41", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": 1,
        "head_dim": c.head_dim, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024,
        "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": list(c.compress_ratios) + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": text, "vision_config": {"hidden_size": 1024}, "image_token_id": 129264,
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                    "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}


def test_v41_nested_config_json_equals_shipped_yaml(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_hf_config()))
    from_hf = ModelConfig.from_hf(tmp_path, name="v4.1-flash")
    assert from_hf == load_model_config("v4.1-flash")


def test_v4_flat_transformers_config_json(tmp_path):
    from transformers import DeepseekV4Config

    DeepseekV4Config(num_hidden_layers=5, hidden_size=256, vocab_size=1000).save_pretrained(tmp_path)
    c = ModelConfig.from_hf(tmp_path)
    assert c.family == "v4" and c.num_layers == 5 and c.hidden_size == 256
    assert len(c.compress_ratios) == 5 and set(c.compress_ratios) <= {0, 4, 128}


@pytest.mark.parametrize("text,match", [
    ("name: x\nfamily: [unclosed", "malformed YAML"),
    ("- just\n- a list\n", "expected a mapping"),
])
def test_malformed_yaml(tmp_path, text, match):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_yaml(p)
    assert str(p) in str(e.value)


def _yaml_with(tmp_path, **changes):
    import yaml

    d = load_model_config("v4.1-flash-tiny").to_dict()
    d.update(changes)
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


@pytest.mark.parametrize("changes,field", [
    ({"compress_ratios": [0, 0, 2, 2, 3, 1, 1, 1, 1]}, "compress_ratios"),  # unknown layer type
    ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),  # wrong length
    ({"hidden_size": "64"}, "hidden_size"),
    ({"kv_source_layers": [3, 4, 5]}, "kv_source_layers"),
    ({"o_groups": 3}, "o_groups"),
    ({"family": "v5"}, "family"),
    ({"nonsense_key": 1}, "nonsense_key"),
])
def test_bad_fields_are_named(tmp_path, changes, field):
    p = _yaml_with(tmp_path, **changes)
    with pytest.raises(ConfigError, match=field) as e:
        ModelConfig.from_yaml(p)
    assert str(p) in str(e.value)


def test_unknown_layer_type_message(tmp_path):
    p = _yaml_with(tmp_path, compress_ratios=[0, 0, 2, 2, 3, 1, 1, 1, 1])
    with pytest.raises(ConfigError, match=r"unknown layer type\(s\) \[3\]"):
        ModelConfig.from_yaml(p)


def test_malformed_and_incomplete_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        ModelConfig.from_hf(tmp_path)
    bad = v41_hf_config()
    del bad["text_config"]["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"missing required field\(s\) \['hidden_size'\] under 'text_config'"):
        ModelConfig.from_hf(tmp_path)
    bad = v41_hf_config()
    bad["text_config"]["compress_ratios"] = [0, 0, 7] + [1] * 40
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="unknown layer type"):
        ModelConfig.from_hf(tmp_path)
