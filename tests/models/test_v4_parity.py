"""V4 parity with an independent implementation: megagraph's V4-Flash step graph, run by the
reference interpreter, against transformers' `DeepseekV4ForCausalLM` (same random weights, fp32).

The tiny config keeps every V4 feature: window-only layers, CSA (ratio 4: overlapping compressor
with APE, its own indexer with top-k 8 < entries), HCA (ratio 128: sequence > 2*128 so two entries
exist), hash-routed and score-routed MoE with the SwiGLU clamp active, hc_head. Weights travel
through the official checkpoint names (transformers' names -> official -> our graph), so the name
mapping is tested too. Tolerance: 1e-4 relative to max |logit| (both fp32; observed ~1e-6); 16
index heads keep indexer scores free of exact ties (docs/transformers-v4.md §0.2).
"""

import pytest
import torch

from megagraph.models.build import build_step
from megagraph.models.checkpoint.hf_v4 import hf_state_dict_to_official
from megagraph.models.config import load_model_config
from megagraph.models.session import ReferenceSession, SeqChunk, weight_specs
from tests.v4_weights import randomize_model

tfm = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def hf_config(cfg) -> DeepseekV4Config:
    """The transformers config equal to our ModelConfig (explicit layer types and YaRN: the
    transformers defaults are V4-Pro's, docs/transformers-v4.md §0.3)."""
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_head_dim, q_lora_rank=cfg.q_lora_rank,
        o_lora_rank=cfg.o_lora_rank, o_groups=cfg.o_groups, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.experts_per_token, layer_types=[LAYER_TYPE[r] for r in cfg.compress_ratios],
        mlp_layer_types=["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(cfg.num_layers)],
        sliding_window=cfg.sliding_window, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": cfg.yarn_factor,
                         "original_max_position_embeddings": cfg.yarn_original,
                         "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow},
        max_position_embeddings=int(cfg.yarn_factor * cfg.yarn_original),
        routed_scaling_factor=cfg.route_scale, swiglu_limit=cfg.swiglu_limit,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps)


def randomized_model(hf_cfg, seed: int):
    """transformers model with every parameter random (its _init_weights leaves zeros and ones)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = tfm.DeepseekV4ForCausalLM(hf_cfg).float().eval()
    randomize_model(m, g)
    return m


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def pair(request):
    cfg = load_model_config("v4-flash-tiny").replace(weight_format="dense", act_dtype="f32")
    model = randomized_model(hf_config(cfg), seed=request.param)
    state = {k: v for k, v in model.state_dict().items()}
    official = hf_state_dict_to_official(state, stacked=True)
    g = build_step(cfg)
    weights = {}
    for spec in weight_specs(g):
        t = official[spec.name]
        assert tuple(t.shape) == spec.shape, spec.name
        weights[spec.name] = t.to(spec.torch_dtype)
    return cfg, g, weights, model


def test_every_graph_weight_comes_from_the_transformers_model(pair):
    cfg, g, weights, model = pair
    official = hf_state_dict_to_official(dict(model.state_dict()), stacked=True)
    assert set(weights) == set(official)  # nothing unused, nothing missing


def test_prefill_logits_match_transformers(pair):
    cfg, g, weights, model = pair
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg.vocab_size, (300,), generator=gen)  # > 2*128 HCA, >> window 16
    with torch.no_grad():
        ref = model(ids[None], use_cache=False).logits[0].float()
    ours = ReferenceSession(g, weights, slots=1, capacity=512).step([SeqChunk(0, tuple(ids.tolist()))])
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    print(f"relative error {err:.2e}")
    assert err < 1e-4, f"max |diff| / max |logit| = {err:.2e}"


def test_incremental_decode_matches_prefill(pair):
    """Prefill 250 tokens, then decode one token at a time across the second HCA group boundary
    (position 255) and many CSA groups: every position equals the one-shot prefill."""
    cfg, g, weights, _ = pair
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(3, cfg.vocab_size, (270,), generator=gen).tolist()
    full = ReferenceSession(g, weights, slots=2, capacity=512).step([SeqChunk(0, tuple(ids))])
    s = ReferenceSession(g, weights, slots=2, capacity=512)
    head = s.step([SeqChunk(1, tuple(ids[:250]))])
    tail = torch.cat([s.step([SeqChunk(1, (t,))]) for t in ids[250:]])
    inc = torch.cat([head, tail])
    err = (inc - full).abs().max().item() / full.abs().max().item()
    print(f"relative error {err:.2e}")
    assert err < 1e-4, f"max |diff| / max |logit| = {err:.2e}"
