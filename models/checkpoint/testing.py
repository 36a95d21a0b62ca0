"""A tiny V4.1-shaped spec list (every storage format of the real checkpoint) for tests and demos."""

from __future__ import annotations

from .spec import WeightSpec, fp4_expert_specs, fp8_linear_specs

__all__ = ["tiny_v41_specs"]


def tiny_v41_specs(
    *,
    n_layers: int = 2,
    dim: int = 64,
    vocab: int = 96,
    n_heads: int = 2,
    head_dim: int = 32,
    q_lora: int = 48,
    o_groups: int = 2,
    o_lora: int = 32,
    n_experts: int = 4,
    moe_inter: int = 64,
    hc: int = 4,
    engram_layer: int | None = 1,
    engram_rows: int = 40,
    block: int = 32,
    stacked: bool = True,
) -> list[WeightSpec]:
    """Specs in the official naming and formats of V4.1 (fp8 32x32 block linears with scales, mxfp4
    routed experts - stacked ``experts.*`` unless ``stacked=False`` -, bf16 norms/router, f32 ``hc_*``,
    ``attn_sink`` and router bias, an fp8-rows Engram table).  Dimensions are deliberately not all
    multiples of the block so ragged scale edges occur (``q_lora=48``)."""
    S: list[WeightSpec] = [
        WeightSpec("embed.weight", (vocab, dim), "bf16"),
        WeightSpec("head.weight", (vocab, dim), "bf16"),
        WeightSpec("norm.weight", (dim,), "bf16"),
    ]
    mix = (2 + hc) * hc
    for L in range(n_layers):
        p = f"layers.{L}."
        S += [WeightSpec(p + "attn_norm.weight", (dim,), "bf16"), WeightSpec(p + "ffn_norm.weight", (dim,), "bf16")]
        for site in ("attn", "ffn"):
            S += [
                WeightSpec(p + f"hc_{site}_fn", (mix, hc * dim), "f32"),
                WeightSpec(p + f"hc_{site}_base", (mix,), "f32"),
                WeightSpec(p + f"hc_{site}_scale", (3,), "f32"),
            ]
        S += fp8_linear_specs(p + "attn.wq_a", q_lora, dim, block=block)
        S += [WeightSpec(p + "attn.q_norm.weight", (q_lora,), "bf16")]
        S += fp8_linear_specs(p + "attn.wq_b", n_heads * head_dim, q_lora, block=block)
        S += fp8_linear_specs(p + "attn.wkv", head_dim, dim, block=block)
        S += [WeightSpec(p + "attn.kv_norm.weight", (head_dim,), "bf16")]
        S += fp8_linear_specs(p + "attn.wo_a", o_groups * o_lora, n_heads * head_dim // o_groups, block=block)
        S += fp8_linear_specs(p + "attn.wo_b", dim, o_groups * o_lora, block=block)
        S += [WeightSpec(p + "attn.attn_sink", (n_heads,), "f32")]
        S += [
            WeightSpec(p + "ffn.gate.weight", (n_experts, dim), "bf16"),
            WeightSpec(p + "ffn.gate.bias", (n_experts,), "f32"),
        ]
        for w, (o, i) in (("w1", (moe_inter, dim)), ("w3", (moe_inter, dim)), ("w2", (dim, moe_inter))):
            S += fp8_linear_specs(p + f"ffn.shared_experts.{w}", o, i, block=block)
        for w, (o, i) in (("w1", (moe_inter, dim)), ("w3", (moe_inter, dim)), ("w2", (dim, moe_inter))):
            if stacked:
                S += fp4_expert_specs(p + f"ffn.experts.*.{w}", n_experts, o, i)
            else:
                for e in range(n_experts):
                    S += fp4_expert_specs(p + f"ffn.experts.{e}.{w}", None, o, i)
        if engram_layer == L:
            S += [
                WeightSpec(p + "engram.embed.weight", (engram_rows, 64), "fp8e4m3"),
                WeightSpec(p + "engram.embed.scale", (engram_rows, 2), "e8m0"),
                WeightSpec(p + "engram.q_weight", (hc, dim), "bf16"),
            ]
    return S
