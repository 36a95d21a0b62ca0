"""Capturable implementations of every op: vectorized pure torch, no host synchronization, no
data-dependent shapes, no host-built constants, so a step runs inside a CUDA graph and under
``torch.compile(fullgraph=True)``.

Same calling convention, names, output shapes and dtypes as kernels/reference (fp32 math inside);
results agree with the reference up to fp32 summation order, integer results exactly.

``CAPTURABLE`` is functional like the reference (state ops return new tensors).
``capturable_impls(inplace_state=True)`` returns a table whose state ops (ring / pending / cache
writes) update their state input in place and return it - what a CUDA-graph runtime with static
state buffers wants, and the only way to avoid copying whole state pools every step. It is valid
for a graph only if no node reads a state value after the op that updates it;
:func:`inplace_hazards` lists violations (the engram history is read after its update in V4.1, so
``engram_hist_update`` stays functional in that table; its state is tiny).

Padding contract (docs/step-convention.md plus runtime padding): pad requests may share one
scratch slot (repeated in seq_slots) and must have consecutive positions like any request; request
rows may have zero tokens. Every op reads keys/state only from the token's own request row and
slot, and every state write of a token goes to its own slot, so real requests are unaffected.
Tunables (module attributes of ``_common``, read at call time): CHUNK_ELEMS, MAX_TOKEN_TILE,
MAX_EXPERT_TILE.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

from megagraph.kernels.common import capturable as _common
from megagraph.kernels.attention.capturable import ring_update, ring_update_batched, sparse_attn
from megagraph.kernels.state.capturable import cache_write, compress_pool, v4_compress_pool
from megagraph.kernels.dense.capturable import (add, cast, embed, fake_quant, fill, grouped_linear, hc_collapse, hc_embed,
                    hc_expand, hc_head_mix, hc_mixer, linear, merge_heads, rms_norm, rope,
                    select_last, select_rows, split_heads)
from megagraph.kernels.dspark.capturable import block_attn, concat, draft_rows, markov_draft, stream_mean
from megagraph.kernels.engram.capturable import engram_gate, engram_hash, engram_hist_update, engram_lookup, token_map
from megagraph.kernels.fused.capturable import (compressor, grouped_linear_q, linear_q, mega_mhc, mega_moe, moe_experts_q,
                    quantize_act, sparse_attn_q, suffix_meta, swiglu_mlp_q, v4_compressor)
from megagraph.kernels.indexer.capturable import candidate_mask, index_scores, published_scores, topk_select
from megagraph.kernels.moe.capturable import hash_route, moe_experts, route, swiglu_mlp
from megagraph.kernels.parallel.reference import PARALLEL  # expert parallelism: already sync-free, static shapes

CAPTURABLE: dict[str, Callable] = {
    # core
    "embed": embed, "linear": linear, "grouped_linear": grouped_linear, "rms_norm": rms_norm,
    "rope": rope, "fake_quant": fake_quant, "add": add,
    "split_heads": split_heads, "merge_heads": merge_heads, "cast": cast, "select_last": select_last,
    # attention, compressor, indexer
    "sparse_attn": sparse_attn, "ring_update": ring_update, "compress_pool": compress_pool,
    "cache_write": cache_write, "index_scores": index_scores, "candidate_mask": candidate_mask,
    "topk_select": topk_select, "published_scores": published_scores,
    # mHC
    "hc_embed": hc_embed, "hc_mixer": hc_mixer, "hc_collapse": hc_collapse, "hc_expand": hc_expand,
    # MoE
    "route": route, "moe_experts": moe_experts, "swiglu_mlp": swiglu_mlp,
    # Engram
    "token_map": token_map, "engram_hash": engram_hash, "engram_hist_update": engram_hist_update,
    "engram_lookup": engram_lookup, "engram_gate": engram_gate,
    # V4
    "v4_compress_pool": v4_compress_pool, "hash_route": hash_route, "hc_head_mix": hc_head_mix,
    # pass-created (graph/ops/fused.py)
    "quantize_act": quantize_act, "linear_q": linear_q, "grouped_linear_q": grouped_linear_q,
    "moe_experts_q": moe_experts_q, "swiglu_mlp_q": swiglu_mlp_q, "sparse_attn_q": sparse_attn_q,
    "mega_mhc": mega_mhc, "mega_moe": mega_moe, "compressor": compressor,
    "v4_compressor": v4_compressor,
    "ring_update_batched": ring_update_batched, "select_rows": select_rows,
    "suffix_meta": suffix_meta, "fill": fill,
    # expert parallelism (graph/ops/parallel.py): collectives over static blocks
    **PARALLEL,
    # DSpark drafter (graph/ops/dspark.py)
    "stream_mean": stream_mean, "concat": concat, "draft_rows": draft_rows,
    "block_attn": block_attn, "markov_draft": markov_draft,
}

# ops whose capturable kernel loops in Python over static tile chunks (_common.chunk_ranges, up to
# hundreds of chunks at V4.1 sizes): Dynamo unrolls every iteration, so torch.compile of them takes
# minutes per bucket (the slice's MoE alone did not finish in 170 s on the H200) for little gain,
# their work being batched GEMMs and gathers that Inductor calls as they are. runtime/compile.py
# leaves them untraced unless asked (EngineConfig.compile_tile_loops).
TILE_LOOP_OPS = frozenset({"sparse_attn", "sparse_attn_q", "index_scores", "moe_experts",
                           "moe_experts_q", "mega_moe", "block_attn"})

# ops torch.compile always leaves untraced: Inductor (torch 2.11, CUDA) fails on their torch code,
# op -> why. Both decide top-k ties by index through an int32 cumulative count over a whole row
# (kernels/indexer/reference.py): on the H200 Inductor's split scan of that count crashed its
# codegen ("list indices must be integers or slices, not NoneType") in the slice's decode
# (topk_select, 16K entries) and prefill (candidate_mask), and topk_select's batched
# torch.searchsorted fused with its neighbours failed to compile (its lowering is also known to
# read a sliced boundary at the wrong offset: pytorch/pytorch#182343). docs/compile.md.
INDUCTOR_UNSAFE_OPS = {
    "topk_select": "Inductor's CUDA split-scan / searchsorted code for its tie rule fails",
    "candidate_mask": "Inductor's CUDA split-scan code for its tie rule fails",
}

# ops whose state outputs can alias their state inputs: op -> indices of (input, output) pairs
INPLACE_STATE_OPS: dict[str, tuple[tuple[int, int], ...] | str] = {
    "ring_update": ((0, 0),),
    "cache_write": ((0, 0),),
    "compress_pool": ((2, 1), (3, 2)),
    "v4_compress_pool": ((3, 1), (4, 2)),
    "compressor": "compressor",  # ikey/ckv (8, 9) -> outputs 0, 1; pend (3, 4) -> 2, 3 when ratio > 1
    "v4_compressor": ((7, 0), (4, 1), (5, 2)),
    "ring_update_batched": "batched",  # operand 3 + 2i -> output i
}


def capturable_impls(*, inplace_state: bool = False) -> dict[str, Callable]:
    """The capturable table; with inplace_state, state ops write into their state inputs."""
    if not inplace_state:
        return dict(CAPTURABLE)
    table = dict(CAPTURABLE)
    for name in INPLACE_STATE_OPS:
        table[name] = partial(CAPTURABLE[name], inplace=True)
    return table


def _aliased_inputs(node) -> list[int]:
    how = INPLACE_STATE_OPS.get(node.op)
    if how is None:
        return []
    if how == "batched":
        return list(range(3, len(node.inputs), 2))
    if how == "compressor":
        return [8, 9] + ([3, 4] if node.inputs[3] is not None else [])
    return [i for i, _ in how]


def inplace_hazards(g) -> list[str]:
    """Nodes of graph g that would read a clobbered value under capturable_impls(inplace_state=True):
    a state op's aliased input that is read by a later node, is read twice by that node, or is
    also a graph output."""
    out = []
    outputs = {v for _, v in g.outputs}
    for idx, n in enumerate(g.nodes):
        for i in _aliased_inputs(n):
            v = n.inputs[i]
            if v is None:
                continue
            later = [m for m in g.nodes[idx + 1:] if v in m.inputs]
            if later or v in outputs or n.inputs.count(v) > 1:
                who = ", ".join(f"%{m.outputs[0]} ({m.op})" for m in later[:3]) or "a graph output"
                out.append(f"%{n.outputs[0]} ({n.op}) updates %{v} in place, but {who} reads it")
    return out


__all__ = ["CAPTURABLE", "capturable_impls", "inplace_hazards", "INPLACE_STATE_OPS", "_common"]
