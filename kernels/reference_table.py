"""Pure-torch reference implementations: the semantics of every op (CPU, fp32 or bf16).

Calling convention: ``fn(*tensor_inputs, **attrs)``; ``REFERENCE`` maps op name → function.
"""
from __future__ import annotations

from typing import Callable

from megagraph.kernels.attention.reference import ring_update, sparse_attn
from megagraph.kernels.state.reference import cache_write, compress_pool
from megagraph.kernels.dense.elementwise import add, embed
from megagraph.kernels.engram.reference import (engram_gate, engram_hash, engram_hist_update, engram_layout, engram_lookup,
                     token_map)
from megagraph.kernels.indexer.reference import candidate_mask, index_scores, published_scores, topk_select
from megagraph.kernels.gemm.reference import grouped_linear, linear
from megagraph.kernels.mhc.reference import hc_collapse, hc_embed, hc_expand, hc_mixer
from megagraph.kernels.moe.reference import moe_experts, route, swiglu_mlp
from megagraph.kernels.dense.norm import rms_norm
from megagraph.kernels.dense.quant import fake_quant
from megagraph.kernels.dense.rope import rope, rope_frequencies

REFERENCE: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "linear": linear,
    "grouped_linear": grouped_linear,
    "rope": rope,
    "fake_quant": fake_quant,
    "hc_embed": hc_embed,
    "hc_mixer": hc_mixer,
    "hc_collapse": hc_collapse,
    "hc_expand": hc_expand,
    "embed": embed,
    "sparse_attn": sparse_attn,
    "ring_update": ring_update,
    "compress_pool": compress_pool,
    "cache_write": cache_write,
    "index_scores": index_scores,
    "published_scores": published_scores,
    "candidate_mask": candidate_mask,
    "topk_select": topk_select,
    "route": route,
    "moe_experts": moe_experts,
    "swiglu_mlp": swiglu_mlp,
    "add": add,
    "token_map": token_map,
    "engram_hash": engram_hash,
    "engram_hist_update": engram_hist_update,
    "engram_lookup": engram_lookup,
    "engram_gate": engram_gate,
}



def reference_impls() -> dict[str, Callable]:
    """The whole reference table the interpreter runs by default: the op kernels above plus the
    structural, V4, fused, DSpark and parallel ones (each family's reference module)."""
    from megagraph.kernels.dense.structural import STRUCTURAL
    from megagraph.kernels.dspark.reference import DSPARK
    from megagraph.kernels.fused.reference import FUSED
    from megagraph.kernels.parallel.reference import PARALLEL
    from megagraph.kernels.v4.reference import V4_REFERENCE

    return {**REFERENCE, **STRUCTURAL, **V4_REFERENCE, **FUSED, **DSPARK, **PARALLEL}


__all__ = ["REFERENCE", "reference_impls", "engram_layout", "rope_frequencies", *REFERENCE]
