"""transformers DeepseekV4ForCausalLM <-> official checkpoint names, with a real tiny model."""

import pytest
import torch
from safetensors.torch import save_file

from megagraph.kernels import formats as F
from megagraph.models.checkpoint import (
    CheckpointError,
    WeightSpec,
    hf_state_dict_to_official,
    hf_to_official,
    load_hf_layout,
    official_to_hf,
    official_to_hf_state_dict,
    open_checkpoint,
    write_checkpoint,
)

transformers = pytest.importorskip("transformers")

E, INTER, HID = 4, 16, 32


@pytest.fixture(scope="module")
def tiny():
    cfg = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=HID, moe_intermediate_size=INTER, num_hidden_layers=4,
        num_attention_heads=4, head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=E,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8,
        layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], partial_rotary_factor=0.5,
    )
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = transformers.DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():  # distinct values everywhere, so any swapped mapping shows up
        for p in model.parameters():
            p.normal_()
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.randint(0, E, b.shape))
            elif n.endswith("e_score_correction_bias"):
                b.normal_()
    return cfg, model


def test_every_parameter_maps_and_names_round_trip(tiny):
    _, model = tiny
    sd = model.state_dict()
    assert any(k.endswith("gate_up_proj") for k in sd) and any(k.endswith("tid2eid") for k in sd)
    for k in sd:
        offs = hf_to_official(k)
        assert offs and all(official_to_hf(o) == k for o in offs), k
        for o in offs:  # per-expert form maps to the same fused key
            assert official_to_hf(o.replace("*", "2")) == k
    assert hf_to_official("model.layers.1.mlp.experts.gate_up_proj") == (
        "layers.1.ffn.experts.*.w1.weight", "layers.1.ffn.experts.*.w3.weight")
    assert official_to_hf("layers.2.attn.indexer.wq_b.weight") == "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"
    assert official_to_hf("layers.2.attn.wq_a.scale") == "model.layers.2.self_attn.q_a_proj.weight_scale_inv"
    assert official_to_hf("layers.0.ffn.gate.tid2eid") == "model.layers.0.mlp.gate.tid2eid"
    assert official_to_hf("hc_head_fn") == "model.hc_head.hc_fn"
    for v41_only in ("layers.1.engram.embed.weight", "mtp.0.attn.wq_a.weight", "layers.2.attn.indexer.wk.weight"):
        with pytest.raises(KeyError):
            official_to_hf(v41_only)
    with pytest.raises(KeyError):
        hf_to_official("model.layers.0.self_attn.bogus.weight")


def test_state_dict_round_trip_exact(tiny):
    _, model = tiny
    sd = model.state_dict()
    off = hf_state_dict_to_official(sd)
    assert "layers.1.ffn.experts.3.w3.weight" in off and "layers.0.ffn.gate.tid2eid" in off
    # w1 = gate = first half of gate_up_proj's dim 1, w3 = up = second half
    gu = sd["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(off["layers.1.ffn.experts.3.w1.weight"], gu[3, :INTER])
    assert torch.equal(off["layers.1.ffn.experts.3.w3.weight"], gu[3, INTER:])
    assert torch.equal(off["layers.1.ffn.experts.3.w2.weight"], sd["model.layers.1.mlp.experts.down_proj"][3])
    for stacked in (False, True):
        back = official_to_hf_state_dict(hf_state_dict_to_official(sd, stacked=stacked))
        assert back.keys() == sd.keys()
        assert all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="not 0..") :
        official_to_hf_state_dict({k: v for k, v in off.items() if k != "layers.1.ffn.experts.0.w2.weight"})


def test_load_save_pretrained_dir(tiny, tmp_path):
    _, model = tiny
    model.save_pretrained(tmp_path / "hf")
    got = load_hf_layout(tmp_path / "hf")
    ref = hf_state_dict_to_official(model.state_dict())
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_load_raw_hf_state_dict_file(tiny, tmp_path):
    _, model = tiny
    (tmp_path / "raw").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "raw" / "model.safetensors"))
    got = load_hf_layout(tmp_path / "raw")
    ref = hf_state_dict_to_official(model.state_dict())
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_official_checkpoint_loads_into_transformers(tiny, tmp_path):
    cfg, model = tiny
    sd = model.state_dict()
    d = write_checkpoint(tmp_path / "off", hf_state_dict_to_official(sd), max_shard_bytes=64_000)
    assert len(open_checkpoint(d).files) > 1
    cfg.save_pretrained(d)
    m2, info = transformers.DeepseekV4ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    sd2 = m2.state_dict()
    assert all(torch.equal(sd2[k].to(sd[k].dtype), sd[k]) for k in sd)


def test_load_hf_layout_with_specs(tiny, tmp_path):
    _, model = tiny
    model.save_pretrained(tmp_path / "hf")
    sd = model.state_dict()
    gu = sd["model.layers.2.mlp.experts.gate_up_proj"]
    float_specs = [
        WeightSpec("layers.2.ffn.experts.*.w1.weight", (E, INTER, HID), "f32"),
        WeightSpec("layers.2.attn.wq_a.weight", (16, HID), "bf16"),
        WeightSpec("layers.0.ffn.gate.tid2eid", (64, 2), "i32"),
    ]
    got = load_hf_layout(tmp_path / "hf", float_specs)
    assert list(got) == [s.name for s in float_specs]
    assert torch.equal(got["layers.2.ffn.experts.*.w1.weight"], gu[:, :INTER])
    assert got["layers.2.attn.wq_a.weight"].dtype == torch.bfloat16
    assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    # quantized specs: quantize on request, else a clear error
    q_specs = [
        WeightSpec("layers.2.attn.wq_a.weight", (16, HID), "fp8e4m3"),
        WeightSpec("layers.2.attn.wq_a.scale", (1, 1), "e8m0"),
        WeightSpec("layers.2.ffn.experts.*.w2.weight", (E, HID, INTER // 2), "fp4x2"),
        WeightSpec("layers.2.ffn.experts.*.w2.scale", (E, HID, 1), "e8m0"),
    ]
    with pytest.raises(CheckpointError, match="quantize=True") as ei:
        load_hf_layout(tmp_path / "hf", q_specs)
    assert ei.value.tensor == "layers.2.attn.wq_a.weight" and ei.value.file.endswith("model.safetensors")
    q = load_hf_layout(tmp_path / "hf", q_specs, quantize=True)
    rq, rs = F.quantize_fp8_block(sd["model.layers.2.self_attn.q_a_proj.weight"])
    assert torch.equal(q["layers.2.attn.wq_a.weight"].view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(q["layers.2.attn.wq_a.scale"].view(torch.uint8), rs.view(torch.uint8))
    down = sd["model.layers.2.mlp.experts.down_proj"]
    for e in range(E):
        p, s = F.quantize_mxfp4(down[e], block=16)  # scale spec [.., 1] -> 16-wide blocks
        assert torch.equal(q["layers.2.ffn.experts.*.w2.weight"][e], p)
        assert torch.equal(q["layers.2.ffn.experts.*.w2.scale"][e].view(torch.uint8), s.view(torch.uint8))
    # missing and mis-shaped
    with pytest.raises(CheckpointError, match="missing") as ei:
        load_hf_layout(tmp_path / "hf", [WeightSpec("layers.7.attn_norm.weight", (HID,), "f32")])
    assert ei.value.tensor == "layers.7.attn_norm.weight"
    with pytest.raises(CheckpointError, match=r"expected \[33\], found \[32\]") as ei:
        load_hf_layout(tmp_path / "hf", [WeightSpec("layers.1.attn_norm.weight", (33,), "f32")])
    assert ei.value.tensor == "layers.1.attn_norm.weight" and "model.safetensors" in str(ei.value)
