"""Which implementations exist per op, what each needs, and which one a hardware profile gets.

Every op has a pure-torch `reference` kernel (any device) and most a `capturable` one (device
torch, no host sync). Fast kernels carry a status: `available` once they ran against their
references on their device (the Hopper Triton kernels: tests/kernels/<family>/test_triton_*.py
on an H200),
`unvalidated` while built but never run there (chosen only with `compile --allow-unvalidated`),
and `planned` with the capability they need, so the plan says what a profile would use and what
it actually gets. A fast kernel whose key a kernel family claims (kernel_config.py, `OPS`) takes
that family's config as its `kernel_config` keyword.
Capabilities are the strings of `HwProfile.capabilities`: arch (`sm_90`, `sm_100`, `sm_103`,
`sm_100f` = the Blackwell family), tensor-core formats (`mxfp8`, `mxfp4`, ...), libraries
(`deepgemm`, `flashmla`, `deepep`, `triton`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of one op."""

    name: str  # e.g. "deepgemm.fp8_fp4_mega_moe"
    needs: frozenset[str]  # capabilities the device must have
    status: str  # "available" (validated on its device), "unvalidated" (built, passes the CPU /
    #               interpreter tests, not yet run on its device: opt-in) or "planned"
    note: str = ""  # what it is / what it takes


def _k(name: str, needs: str, status: str = "planned", note: str = "") -> KernelImpl:
    return KernelImpl(name, frozenset(needs.split()), status, note)


REFERENCE = KernelImpl("reference", frozenset(), "available", "pure torch (kernels/reference)")
BLACKWELL_GEMM = "sm_100f deepgemm"
TRITON_ATTN = "kernels/attention/triton.py: split-K MQA over ring + step rows + top-k, sink"
TRITON_GEMM = "kernels/moe/triton.py: FP8-block weights, fp16 MMA with folded block scales"
TRITON_MOE = "kernels/moe/triton.py: grouped MXFP4 GEMMs, FP4 -> FP8 upcast, fused SwiGLU/combine"

# op (or "op[attr=value]" for a variant) -> implementations in order of preference
KERNELS: dict[str, list[KernelImpl]] = {
    "linear[fmt=fp8_block]": [_k("deepgemm.fp8_gemm_nt", "sm_90 deepgemm",
                                 note="1x128 act x 128x128 weight recipe; V4.1's 32x32 weight "
                                      "blocks need a re-blocked scale")],
    "linear_q[act_fmt=mxfp8]": [_k("deepgemm.fp8_fp4_gemm_nt", f"{BLACKWELL_GEMM} mxfp8",
                                   note="recipe (1,1,32)")],
    "linear_q[act_fmt=fp8_1x128]": [_k("deepgemm.fp8_gemm_nt", "sm_90 deepgemm",
                                       note="recipe (1,128,128)"),
                                    _k("triton.fp8_block_gemm", "sm_90 triton", "available",
                                       note=TRITON_GEMM)],
    "grouped_linear_q[act_fmt=mxfp8]": [_k("deepgemm.fp8_einsum", f"{BLACKWELL_GEMM} mxfp8")],
    "grouped_linear_q[act_fmt=fp8_1x128]": [_k("triton.grouped_fp8_gemm", "sm_90 triton",
                                               "available", note=f"{TRITON_GEMM}, batched")],
    "moe_experts": [_k("triton.moe_mxfp4", "cuda triton")],
    "moe_experts_q[act_fmt=mxfp8]": [_k("deepgemm.m_grouped_fp8_fp4_gemm_nt_masked",
                                        f"{BLACKWELL_GEMM} mxfp4")],
    "moe_experts_q[act_fmt=fp8_1x128]": [_k("triton.moe_fp8_mxfp4", "sm_90 triton", "available",
                                            note=TRITON_MOE)],
    "swiglu_mlp_q[act_fmt=fp8_1x128]": [_k("triton.swiglu_fp8_block", "sm_90 triton", "available",
                                           note=f"{TRITON_GEMM}, SwiGLU-clamp epilogue")],
    "mega_mhc": [_k("deepgemm.mega_mhc", f"{BLACKWELL_GEMM}"),
                 _k("triton.mega_mhc", "sm_90 triton", "available",
                    note="kernels/mhc/triton.py: one launch at <= 64 tokens (split-K, "
                         "last-arriver finish), else projection + ordered reduce + finish")],
    "mega_moe": [_k("deepgemm.fp8_fp4_mega_moe", f"{BLACKWELL_GEMM} mxfp4", "unvalidated",
                    note="kernels/moe/deepgemm_mega.py, tried first by triton.mega_moe: DeepGEMM "
                         "MegaMoE for the routed experts, router / shared expert / combine + "
                         "expand in Triton; not run on an sm_100 device with DeepGEMM; needs a "
                         "1-rank group (deepgemm_mega.init_single_rank_group) and a warm-up "
                         "call before capture"),
                 _k("triton.mega_moe", "sm_90 triton", "available",
                    note=f"{TRITON_MOE}; router, permutation, shared expert, combine + expand")],
    "linear": [_k("cublas.linear_split", "sm_90", "available",
                  note="kernels/gemm/cublas_dense.py: dense bf16 / fp16 weights on the "
                       "half-precision GEMM with fp32 accumulation (fp32 x split exactly in "
                       "three bf16 pieces, one GEMM); the LM head without a per-call fp32 "
                       "weight copy (decode step 18.07 -> 14.62 ms at B = 64 on the H200, with "
                       "triton.rms_norm)"),
               _k("cublas.linear_split", "cuda", "unvalidated")],
    "rms_norm": [_k("triton.rms_norm", "sm_90 triton", "available",
                    note="kernels/dense/triton_norm.py: one program per row (the q / kv latent "
                         "and final norms; the sites' norms are inside mega_mhc)")],
    "hc_mixer": [_k("deepgemm.tf32_hc_prenorm_gemm+triton.sinkhorn", "cuda deepgemm triton")],
    "hc_expand": [_k("triton.hc_expand", "sm_90 triton", "available",
                     note="kernels/mhc/triton.py: mega_moe's combine kernel with one slot (the "
                          "attention sites' residual expand; the FFN sites' is inside mega_moe; "
                          "tests/kernels/mhc/test_triton_mhc.py on the H200)")],
    "sparse_attn": [_k("flashmla.sparse_fwd", "cuda flashmla"),
                    _k("triton.sparse_attn", "sm_90 triton", "available", note=TRITON_ATTN)],
    "sparse_attn_q": [_k("flashmla.mega_attention", "sm_100f flashmla mxfp8"),
                      _k("triton.sparse_attn_q", "sm_90 triton", "available",
                         note=f"{TRITON_ATTN}; inverse RoPE + quantization epilogue")],
    "index_scores": [_k("deepgemm.fp8_fp4_mqa_logits", f"{BLACKWELL_GEMM} mxfp4"),
                     _k("deepgemm.fp8_mqa_logits", "sm_90 deepgemm"),
                     _k("triton.index_scores", "sm_90 triton", "available",
                        note="kernels/indexer/triton.py: request tiles, tf32x3 products "
                              "(bf16 where the node says products=bf16)")],
    "candidate_mask": [_k("triton.candidate_mask", "sm_90 triton", "available",
                          note="kernels/indexer/triton_topk.py: streaming select over the block "
                               "maxima (row read twice), bitwise the reference (5.4 ms against "
                               "26.2 for a radix select at 8192 x 135168 on the H200; "
                               "docs/kernels/topk.md)"),
                       _k("capturable", "sm_90", "available", note="device torch, no host sync")],
    "topk_select": [_k("triton.topk_select", "sm_90 triton", "available",
                       note="kernels/indexer/triton_topk.py: streaming select (row read once into "
                            "a candidate buffer, exact radix select over it), bitwise the "
                            "reference (top-512 at 8192 x 135168: 4.5 ms against 20.7 for a "
                            "radix select on the H200; docs/kernels/topk.md)"),
                    _k("capturable", "sm_90", "available", note="device torch.topk + sort")],
    "quantize_act": [_k("triton.quantize_act", "sm_90 triton", "available",
                        note="kernels/dense/triton_quant.py: one pass per row, bitwise the "
                             "reference (tests/kernels/dense/test_triton_quant.py)"),
                     _k("triton.quantize_act", "cuda triton", "unvalidated")],
    "rope": [_k("triton.rope", "sm_90 triton", "available",
                note="kernels/dense/triton_rope.py: one pass over x with the capturable "
                     "version's cos/sin table, no FMA contraction: bitwise the capturable rope "
                     "(tests/kernels/dense/test_triton_dense.py)"),
             _k("triton.rope", "cuda triton", "unvalidated")],
    "fake_quant": [_k("triton.fake_quant", "sm_90 triton", "available",
                      note="kernels/dense/triton_quant.py: one pass per row, fp8_e4m3 / mxfp4 / "
                           "nvfp4, bitwise the reference "
                           "(tests/kernels/dense/test_triton_dense.py)"),
                   _k("triton.fake_quant", "cuda triton", "unvalidated")],
    "compressor": [_k("triton.compressor", "sm_90 triton", "available",
                      note="kernels/state/triton_compressor.py: GEMM + pool / norm / RoPE / "
                           "fake-quant rows"),
                   _k("triton.compressor", "cuda triton")],
    "ring_update_batched": [_k("triton.ring_copy_batched", "sm_90 triton", "available",
                               note="kernels/state/triton_ring.py: 8 rings per launch"),
                            _k("triton.ring_copy_batched", "cuda triton")],
    "ring_update": [_k("triton.ring_update", "sm_90 triton", "available")],
    "engram_hash": [_k("triton.engram_hash", "sm_90 triton", "available")],
    "engram_gate": [_k("triton.engram_gate", "sm_90 triton", "available")],
    "engram_lookup": [_k("host.engram_gather", "", note="CPU gather from the memory-mapped table")],
    # expert parallelism (kernels/parallel/reference.py; docs/parallelism.md)
    "ep_place": [_k("torch.ep_place", "cuda", "available", note="sync-free torch, capturable")],
    "ep_dispatch": [_k("deepep.dispatch", "cuda deepep",
                       note="DeepEP V2 ElasticBuffer: low-latency for captured decode, normal for "
                            "prefill; adapter lands with the multi-GPU issue"),
                    _k("nccl.all_to_all_single", "cuda", "available",
                       note="torch.distributed over static worst-case blocks; capturable")],
    "ep_combine": [_k("deepep.combine", "cuda deepep", note="DeepEP V2 ElasticBuffer.combine"),
                   _k("nccl.all_to_all_single", "cuda", "available",
                      note="torch.distributed over static worst-case blocks; capturable")],
}
# available implementations other than the reference: name -> module defining a function per op
LOADABLE: dict[str, str] = {"cublas.linear_split": "megagraph.kernels.gemm.cublas_dense",
                            "torch.ep_place": "megagraph.kernels.parallel.reference",
                            "nccl.all_to_all_single": "megagraph.kernels.parallel.reference"}
# CSA2 attention path in Triton (Hopper; each falls back to kernels/capturable off the GPU).
# State ops (compressor, ring copies) are functional here; `inplace=True` updates the state inputs.
LOADABLE.update({
    "triton.sparse_attn": "megagraph.kernels.attention.triton",
    "triton.sparse_attn_q": "megagraph.kernels.attention.triton",
    "triton.index_scores": "megagraph.kernels.indexer.triton",
    "triton.compressor": "megagraph.kernels.state.triton_compressor",
    "triton.ring_copy_batched": "megagraph.kernels.state.triton_ring",
    "triton.ring_update": "megagraph.kernels.state.triton_ring",
    "triton.engram_hash": "megagraph.kernels.engram.triton",
    "triton.engram_gate": "megagraph.kernels.engram.triton",
})
# MegaMoE path, FP8-block GEMMs and Mega-mHC in Triton (Hopper; capturable fallbacks elsewhere)
LOADABLE.update({
    "triton.mega_moe": "megagraph.kernels.moe.triton",
    "deepgemm.fp8_fp4_mega_moe": "megagraph.kernels.moe.deepgemm_entry",  # DeepGEMM, else Triton
    "triton.moe_fp8_mxfp4": "megagraph.kernels.moe.triton",
    "triton.swiglu_fp8_block": "megagraph.kernels.moe.triton",
    "triton.fp8_block_gemm": "megagraph.kernels.moe.triton",
    "triton.grouped_fp8_gemm": "megagraph.kernels.moe.triton",
    "triton.mega_mhc": "megagraph.kernels.mhc.triton",
    "triton.hc_expand": "megagraph.kernels.mhc.triton",
    "triton.rms_norm": "megagraph.kernels.dense.triton_norm",
    "triton.topk_select": "megagraph.kernels.indexer.triton_topk",
    "triton.candidate_mask": "megagraph.kernels.indexer.triton_topk",
    "triton.quantize_act": "megagraph.kernels.dense.triton_quant",
    "triton.fake_quant": "megagraph.kernels.dense.triton_quant",
    "triton.rope": "megagraph.kernels.dense.triton_rope",
})


def load_impl(name: str, op: str):
    """The function implementing `op` as `name` (a KERNELS entry marked available), or None."""
    return try_load(name, op)[0]


def try_load(name: str, op: str):
    """(function, "") implementing `op` as `name`, or (None, why it cannot load): no module
    registered for the name, the module failing to import (e.g. no Triton), or no such function
    in it. The runtime states the reason at start-up."""
    mod = LOADABLE.get(name)
    if mod is None:
        return None, f"no module provides {name}"
    import importlib

    try:
        module = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report, not raise
        return None, f"{mod} does not import: {type(e).__name__}: {e}"
    fn = getattr(module, op, None)
    if fn is None:
        return None, f"{mod} defines no {op!r}"
    return fn, ""


def kernel_key(op: str, attrs: dict) -> str:
    """The variant key of a node: `op[attr=value]` for the attrs that select kernels."""
    for attr in ("act_fmt", "fmt"):
        key = f"{op}[{attr}={attrs.get(attr)}]"
        if key in KERNELS:
            return key
    return op


def _has_capturable(op: str) -> bool:
    try:
        from megagraph.kernels.capturable_table import CAPTURABLE
    except ImportError:
        return False
    return op in CAPTURABLE


def choose_kernel(op: str, attrs: dict, caps: frozenset[str], arch: str, *,
                  allow_unvalidated: bool = False) -> tuple[str, str]:
    """(implementation name, reason) for one op variant on a device with `caps`.

    Preference: a validated fast kernel; an unvalidated one only with `allow_unvalidated`
    (`compile --allow-unvalidated`, recorded in the manifest, so nobody runs a kernel that never
    ran on its device without asking for it); on a GPU the capturable torch kernel (host-sync
    free, CUDA-graph capturable); else the reference kernel."""
    key = kernel_key(op, attrs)
    impls = KERNELS.get(key, [])
    skipped = []
    for impl in impls:
        if impl.needs <= caps and impl.status == "available":
            return impl.name, f"{impl.name}: available, needs {sorted(impl.needs) or 'nothing'}"
        if impl.needs <= caps and impl.status == "unvalidated":
            if allow_unvalidated:
                return impl.name, (f"{impl.name}: not yet validated on {arch}, enabled by "
                                   "compile --allow-unvalidated")
            skipped.append(impl.name)
    fitting = [i.name for i in impls if i.needs <= caps and i.status == "planned"]
    if arch == "cpu":
        return "reference", "reference (the CPU target runs every op's reference kernel)"
    notes = []
    if skipped:
        notes.append(f"built, not yet validated on {arch}: {', '.join(skipped)} "
                     "(compile --allow-unvalidated to use)")
    if fitting:
        notes.append(f"planned: {', '.join(fitting)}")
    if _has_capturable(op):
        return "capturable", "; ".join(["capturable (device torch, no host sync)"] + notes)
    return "reference", "; ".join([f"reference (no {arch} kernel registered)"] + notes)
