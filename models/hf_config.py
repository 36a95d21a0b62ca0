"""HF `config.json` -> ModelConfig fields (V4 flat, V4.1 nested under `text_config`).

Accepts the official release spelling (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`)
and transformers' (`layer_types`, `mlp_layer_types`, `partial_rotary_factor`). Keys we do not use
(vision, training knobs) are ignored; keys we need and cannot find raise a ConfigError naming them.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError

# HF key -> our field (same value, no transformation)
DIRECT = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "head_dim": "head_dim", "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank", "o_groups": "o_groups", "moe_intermediate_size": "moe_intermediate_size",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "experts_per_token", "sliding_window": "sliding_window",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "rms_norm_eps": "rms_norm_eps", "swiglu_limit": "swiglu_limit", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "norm_topk_prob": "norm_topk", "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta", "max_position_embeddings": "max_position_embeddings",
    "num_hash_layers": "num_hash_layers", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks", "candidate_block_size": "candidate_block_size",
    "engram_layer_ids": "engram_layers", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram", "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads", "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "num_nextn_predict_layers": "num_mtp_layers", "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id", "dspark_target_layer_ids": "dspark_target_layers",
    "dspark_markov_rank": "dspark_markov_rank", "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_experts_per_token", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id",
}
REQUIRED_HF = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
               "q_lora_rank", "o_lora_rank", "moe_intermediate_size", "n_routed_experts")
LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                    "heavily_compressed_attention": 128}


def hf_to_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    nested = "text_config" in raw
    text = raw["text_config"] if nested else raw
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' must be an object")
    model_type = text.get("model_type", raw.get("model_type", ""))
    family = "v4.1" if nested or "v41" in str(model_type) or "kv_source_layer_ids" in text else "v4"
    missing = [k for k in REQUIRED_HF if k not in text]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {missing}"
                          + (" under 'text_config'" if nested else ""))
    out: dict[str, Any] = {"family": family, "name": str(raw.get("_name_or_path") or model_type or family)}
    for k, ours in DIRECT.items():
        if k in text and text[k] is not None:
            v = text[k]
            if ours in ("eos_token_id",) and isinstance(v, list):
                v = v[0]
            out[ours] = v
    n = text["num_hidden_layers"]
    out.update(_layer_schedule(text, n, family, source))
    out.update(_rope(text, source))
    out.update(_quant(raw.get("quantization_config") or text.get("quantization_config")))
    if "qk_rope_head_dim" in text:
        out["rope_head_dim"] = text["qk_rope_head_dim"]
    elif text.get("partial_rotary_factor"):
        out["rope_head_dim"] = int(text["head_dim"] * text["partial_rotary_factor"])
    else:
        out["rope_head_dim"] = 64
    if "o_groups" not in out:
        out["o_groups"] = 8
    for k in ("index_n_heads", "index_head_dim", "index_topk", "sliding_window"):
        out.setdefault(k, {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
                           "sliding_window": 128}[k])
    out.setdefault("n_shared_experts", 1)
    out.setdefault("experts_per_token", 6)
    return out


def _layer_schedule(text: dict, n: int, family: str, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "compress_ratios" in text:
        ratios = list(text["compress_ratios"])
        if len(ratios) < n:
            raise ConfigError(f"{source}: field 'compress_ratios' has {len(ratios)} entries for "
                              f"{n} layers")
        out["compress_ratios"] = ratios[:n]  # trailing entries belong to the MTP/DSpark stages
    elif "layer_types" in text:
        bad = sorted({t for t in text["layer_types"] if t not in LAYER_TYPE_RATIO})
        if bad:
            raise ConfigError(f"{source}: field 'layer_types': unknown layer type(s) {bad}; "
                              f"known: {sorted(LAYER_TYPE_RATIO)}")
        rates = text.get("compress_rates") or {}
        out["compress_ratios"] = [rates.get(t, LAYER_TYPE_RATIO[t]) for t in text["layer_types"][:n]]
    else:
        raise ConfigError(f"{source}: needs 'compress_ratios' or 'layer_types'")
    if "mlp_layer_types" in text and "num_hash_layers" not in text:
        out["num_hash_layers"] = sum(1 for t in text["mlp_layer_types"] if t == "hash_moe")
    return out


def _rope(text: dict, source: str) -> dict[str, Any]:
    rs = text.get("rope_scaling")
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "compress" in params:
        rs = params["compress"]
    out: dict[str, Any] = {}
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "yarn":
        out["yarn_factor"] = float(rs.get("factor", 16.0))
        out["yarn_original"] = int(rs.get("original_max_position_embeddings", 65536))
        out["yarn_beta_fast"] = float(rs.get("beta_fast", 32.0))
        out["yarn_beta_slow"] = float(rs.get("beta_slow", 1.0))
    return out


def _quant(q: dict | None) -> dict[str, Any]:
    if not q:
        return {"weight_format": "dense"}
    block = q.get("weight_block_size") or [128, 128]
    return {"weight_format": "release", "fp8_block": int(block[0])}
