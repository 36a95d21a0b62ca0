"""The Triton CSA2 kernels (and the activation quantization, RoPE and fake quantization, the persistent and FP8-H MoE GEMMs) compile for sm_90 (Hopper) ahead of time, without a GPU, in the launch
shapes the wrappers use, with at most 64 bytes of stack per thread (no register-spill storm: the
shapes were picked from this build's resource usage) and on the tensor cores where they multiply.

Uses triton.compile with a GPUTarget and the cuobjdump that ships with Triton; skipped where
triton (or that API) is missing. Compiling takes a few seconds per kernel.
"""
from __future__ import annotations

import importlib.util
import inspect
import re

import pytest
from megagraph.configs.process import triton_interpret
from sm90_build import cuobjdump, last_loop

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or triton_interpret(),
    reason="needs triton (compiling, not the interpreter)")

ATTN = dict(q_ptr="*bf16", kv_ptr="*bf16", ring_ptr="*bf16", ckv_ptr="*bf16", topk_ptr="*i64",
            sink_ptr="*fp32", pos_ptr="*i64", req_ptr="*i64", slot_ptr="*i64", cached_ptr="*i64",
            freq_ptr="*fp32", o_ptr="*fp8e4nv", os_ptr="*fp32", po_ptr="*fp32", pml_ptr="*fp32",
            T="i32", H="i32", C="i32", ratio="i32", scale_log2="fp32", s_qt="i32", s_qh="i32",
            s_kvt="i32", s_rs="i32", s_rw="i32", s_cs="i32", s_cc="i32", s_tt="i32")
ATTN_C = dict(W=128, D=512, K=512, NT_STEP=4, BLOCK_H=16, BLOCK_N=32, NS=1, HAS_COMP=True,
              ALL_COMP=False, MODE=1, ROPE_DIM=64, QBLOCK=128, E8M0=False, MANUAL_FP8=False,
              DOT_F32=False)


# the cases name the jit modules by their short names
TRITON_MODULES = {
    "attention_jit": "megagraph.kernels.attention.triton_jit",
    "indexer_jit": "megagraph.kernels.indexer.triton_jit",
    "topk_jit": "megagraph.kernels.indexer.triton_topk_jit",
    "compressor_jit": "megagraph.kernels.state.triton_compressor_jit",
    "ring_jit": "megagraph.kernels.state.triton_ring_jit",
    "engram_jit": "megagraph.kernels.engram.triton_jit",
    "quant_jit": "megagraph.kernels.dense.triton_quant_jit",
    "rope_jit": "megagraph.kernels.dense.triton_rope_jit",
    "norm_jit": "megagraph.kernels.dense.triton_norm_jit",
    "moe_jit": "megagraph.kernels.moe.triton_jit",
    "mhc_jit": "megagraph.kernels.mhc.triton_jit",
    "moe_grouped_cublas_jit": "megagraph.kernels.moe.grouped_cublas_jit",
}


def stream_cases(idx: dict, I) -> dict:
    """The query-stationary indexer kernel at the launches stream_configs picks for a prefill
    bucket (long class) and decode (short class), bf16 and tf32x3 products."""
    types = {k: v for k, v in idx.items() if k not in ("items_ptr", "ivalid_ptr", "tslot_ptr")}
    types.update(req_ptr="*i64", slots_ptr="*i64", cls_ptr="*i8", T="i32", span="i32")
    # 16-divisible pointers, strides and span, as at the real shapes (the launch specializes on it)
    div = ("qi_ptr", "w_ptr", "ikey_ptr", "out_ptr", "s_qt", "s_qh", "s_ks", "s_kc", "s_ot", "span")
    out = {}
    for prec in ("bf16", "tf32x3"):
        for cls, cfg in zip(("long", "short"), I.stream_configs(8192, 8192, 135168, prec, 132)):
            consts = dict(HI=32, DI=128, BT=cfg.bt, BC=cfg.bc, PREC=prec, KEYS_M=cfg.keys_m,
                          STAGES=cfg.stages, CLS=int(cls == "long"))
            out[f"index stream {cls} {prec}"] = ("indexer_jit", "index_scores_stream", types, consts,
                                                 cfg.warps, "HGMMA", dict(stages=cfg.stages, div=div))
    return out


def cases():
    import triton.language as tl

    from megagraph.kernels.attention import triton as A
    from megagraph.kernels.attention.config import AttentionConfig
    from megagraph.kernels.indexer.config import IndexerConfig
    from megagraph.kernels.state import triton_compressor as C
    from megagraph.kernels.indexer import triton as I

    a = A.AttnLaunch()  # the shape whose build does not spill
    pre = A.pick_launch(AttentionConfig().prefill_tokens)
    combine_heads = AttentionConfig().combine_heads
    ic = IndexerConfig()
    idx = dict(qi_ptr="*bf16", w_ptr="*bf16", ikey_ptr="*fp32", out_ptr="*fp32", pos_ptr="*i64",
               items_ptr="*i64", ivalid_ptr="*i8", tslot_ptr="*i64", C="i32", ratio="i32",
               weight_scale="fp32", s_qt="i32", s_qh="i32", s_wt="i32", s_ks="i32", s_kc="i32",
               s_ot="i32")
    gemm = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32", M="i32", N="i32", Kd="i32",
                s_xm="i32", s_wn="i32", s_om="i32")
    rows = dict(proj_ptr="*fp32", pk_ptr="*fp32", pg_ptr="*fp32", normw_ptr="*fp32", wk_ptr="*bf16",
                knormw_ptr="*fp32", freq_ptr="*fp32", ikey_ptr="*fp32", ckv_ptr="*bf16",
                pos_ptr="*i64", req_ptr="*i64", slots_ptr="*i64", first_ptr="*i64", T="i32",
                eps="fp32", offset="i32", s_pr="i32", s_ps="i32", s_pp="i32", s_wk="i32",
                s_is="i32", s_ic="i32", s_cs="i32", s_cc="i32")
    comb = dict(po_ptr="*fp32", pml_ptr="*fp32", pos_ptr="*i64", sink_ptr="*fp32",
                freq_ptr="*fp32", o_ptr="*fp8e4nv", os_ptr="*fp32", H="i32")
    out = {
        "attn decode q-epilogue": ("attention_jit", "sparse_attn_fwd", ATTN,
                                   dict(ATTN_C, BLOCK_H=a.block_h, BLOCK_N=a.block_n), a.num_warps, "HMMA"),
        "attn decode split": ("attention_jit", "sparse_attn_fwd", ATTN,
                              dict(ATTN_C, NS=4, BLOCK_H=a.block_h, BLOCK_N=a.block_n), a.num_warps, "HMMA"),
        "attn prefill pipe": ("attention_jit", "sparse_attn_fwd", ATTN,
                              dict(ATTN_C, BLOCK_H=pre.block_h, BLOCK_N=pre.block_n,
                                   NS=1, PIPE=pre.pipe), pre.num_warps, "HMMA"),
        "attn plain": ("attention_jit", "sparse_attn_fwd", dict(ATTN, o_ptr="*bf16"),
                       dict(ATTN_C, MODE=0, BLOCK_H=a.block_h, BLOCK_N=a.block_n), a.num_warps, "HMMA"),
        "attn combine": ("attention_jit", "sparse_attn_combine", comb,
                         dict(D=512, BLOCK_H=combine_heads, NS=4, MODE=1, ROPE_DIM=64, QBLOCK=128,
                              E8M0=False, MANUAL_FP8=False, OUT_DT=tl.bfloat16), 4, None),
        "index decode": ("indexer_jit", "index_scores_fwd", idx,
                         dict(HI=32, DI=128, BT=1, BC=ic.index_block_c, PREC=ic.index_precision), 8,
                         "HMMA"),
        "index prefill": ("indexer_jit", "index_scores_fwd", idx,
                          dict(HI=32, DI=128, BT=4, BC=ic.index_block_c, PREC=ic.index_precision), 8,
                          "HGMMA"),
        **stream_cases(idx, I),
        "compressor gemm": ("compressor_jit", "proj_gemm", gemm,
                            dict(BM=64, BN=128, BK=64, DOT_F32=False), 8, "HGMMA"),
        "compressor gemm small": ("compressor_jit", "proj_gemm", gemm,
                                  dict(BM=16, BN=64, BK=64, DOT_F32=False), 4, "HMMA"),
    }
    for r in (1, 2):
        out[f"compressor rows r{r}"] = (
            "compressor_jit", "compress_rows", rows,
            dict(DC=512, DI=128, RATIO=r, ROPE_DIM=64, BT=C.ROW_TILE, CK=C.CHUNK, IK_FMT=2,
                 IK_BLOCK=32, CKV_FMT=3, CKV_BLOCK=16, MANUAL_FP8=False, PREC="tf32x3"), 8, "HMMA")
    ring = dict(pos_ptr="*i64", req_ptr="*i64", slots_ptr="*i64", last_ptr="*i64", s_rs="i32",
                s_rw="i32", s_kt="i32", **{f"{x}{j}": "*bf16" for j in range(8) for x in "rk"})
    out["ring copy"] = ("ring_jit", "ring_copy", ring, dict(D=512, W=128, NP=8, BD=512), 4, None)
    out["engram hash"] = ("engram_jit", "engram_hash_fwd",
                          dict(cids_ptr="*i64", hist_ptr="*i64", pos_ptr="*i64", req_ptr="*i64",
                               slots_ptr="*i64", cached_ptr="*i64", tab_ptr="*i64", out_ptr="*i64",
                               T="i32", pad_id="i32", s_h="i32"), dict(K=4, NH=8, BT=64), 2, None)
    out["engram gate"] = ("engram_jit", "engram_gate_fwd",
                          dict(h_ptr="*bf16", kv_ptr="*bf16", qw_ptr="*fp32", kw_ptr="*fp32",
                               out_ptr="*bf16", eps="fp32", inv_sqrt_d="fp32", s_ht="i32",
                               s_hn="i32", s_kvt="i32", s_ot="i32", s_on="i32"),
                          dict(N=4, D=5120, BD=1024, MANUAL=False), 4, None)
    quant = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", D="i32", NBLK="i32", s_x="i32",
                 s_q="i32", s_s="i32")
    out["quantize act 1x128"] = ("quant_jit", "quantize_act_fwd", quant,
                                 dict(BLOCK=128, NB=8, E8M0=False), 4, None)
    out["quantize act mxfp8"] = ("quant_jit", "quantize_act_fwd", dict(quant, s_ptr="*u8"),
                                 dict(BLOCK=32, NB=8, E8M0=True), 4, None)
    out.update(moe_cases())
    out.update(dense_cases())
    out.update(mhc_cases())
    return out


def dense_cases():
    """RoPE and fake quantization at the V4.1 slice's widths (q heads 64 x 512 and kv 512, index
    keys 128, rope_dim 64; fake_quant fp8_e4m3 / mxfp4 per 32 and nvfp4 per 16) in the wrappers'
    tiles, compiled as launched (enable_fp_fusion=False). Bitwise torch needs every product and
    sum rounded on its own, so the PTX must hold no fma (nor RoPE's SASS an FFMA), and correctly
    rounded divisions (div.rn, not Triton's approximate `/`: div.full) where the scales divide."""
    rope = dict(x_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", o_ptr="*bf16", N="i32", H="i32",
                s_xt="i32", s_xh="i32", s_c="i32")
    fq = dict(x_ptr="*bf16", o_ptr="*bf16", N="i32", s_x="i32")
    exact = dict(fusion=False, no_ptx=r"\b(fma|div\.full|div\.approx)\.")
    rope_exact = dict(exact, no_sass=r"\bFFMA\b")  # (div.rn itself is FFMA steps in SASS)
    out = {}
    for name, d, br, bp, inv in (("q", 512, 8, 256, False), ("q inverse", 512, 8, 256, True),
                                 ("ik", 128, 32, 64, False)):
        out[f"rope {name}"] = ("rope_jit", "rope_fwd", rope,
                               dict(D=d, ROPE_DIM=64, BR=br, BP=bp, INVERSE=inv, MANUAL=False), 4,
                               None, rope_exact)
    out["rope f32"] = ("rope_jit", "rope_fwd", dict(rope, x_ptr="*fp32", o_ptr="*fp32"),
                       dict(D=512, ROPE_DIM=64, BR=8, BP=256, INVERSE=False, MANUAL=False), 4, None,
                       rope_exact)
    for name, fmt, block, d, br, nb in (("fp8_e4m3", 1, 32, 512, 8, 16), ("mxfp4", 2, 32, 128, 32, 4),
                                        ("nvfp4", 3, 16, 512, 8, 32)):
        out[f"fake quant {name}"] = ("quant_jit", "fake_quant_fwd", fq,
                                     dict(D=d, FMT=fmt, BLOCK=block, BR=br, NB=nb, MANUAL=False),
                                     4, None, exact)
    return out


MHC = dict(h_ptr="*bf16", fn_ptr="*fp32", part_ptr="*fp32", sqp_ptr="*fp32", m_ptr="*fp32",
           sq_ptr="*fp32", cnt_ptr="*i32", base_ptr="*fp32", scale_ptr="*fp32", mix_ptr="*fp32",
           nw_ptr="*bf16", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32", pre_ptr="*fp32",
           post_ptr="*fp32", comb_ptr="*fp32", T="i32", D="i32", KD="i32", k_per="i32",
           nsplit="i32", eps="fp32", hc_eps="fp32", norm_eps="fp32", stride_h="i32",
           stride_fn="i32", stride_x="i32", stride_xq="i32", stride_xs="i32")
MHC_NAMES = ["mhc fused decode", "mhc fused prefill", "mhc fused unsplit", "mhc proj prefill"]


def mhc_cases():
    """Mega-mHC at V4.1-Flash width (n = 4, d = 5120: every pointer, D, KD, k_per and the row
    strides 16-divisible, the fp8_1x128 scale stride d / 128 = 40 not) in the tiles mhc.plan
    gives on the H200 (132 SMs): the one-launch kernel (mhc_jit.mhc_fused) at 64 tokens (the
    default there: 8-token blocks under the mma.sync m16 tile, split-K, last-arriver finish, 8
    warps), at 8192 (64-row wgmma tiles, split 3: opt-in, MEGAGRAPH_MHC_FUSED=1) and unsplit
    (one program per 64-token block), and the prefill default's projection (mhc_proj, wgmma):
    no local memory."""
    import torch

    from megagraph.kernels.mhc import triton as H

    div = {n for n in MHC if n.endswith("_ptr")} | {"D", "KD", "k_per", "stride_h", "stride_fn",
                                                    "stride_x", "stride_xq"}
    fin = dict(HC=4, NPAD=H.NPAD, ITERS=20, HAS_MIX=False, HAS_NW=True, E8M0=False, QB=128,
               RDT=1, MANUAL=False)
    out = {}
    for name, T, split in (("mhc fused decode", 64, None), ("mhc fused prefill", 8192, None),
                           ("mhc fused unsplit", 8192, 1)):
        p = H.plan(T, 4 * 5120, torch.device("cuda"), sms=132)
        consts = dict(fin, NM=24, SPLIT_BF16=True, SPLIT=(split or p.split) > 1, BM=p.bm,
                      BK=p.bk, BT=p.block, FBM=p.fbm, FSTAGES=p.fstages, NQ=p.nq)
        out[name] = ("mhc_jit", "mhc_fused", MHC, consts, p.warps, "HMMA" if p.bm < 64 else "HGMMA",
                     dict(stages=p.stages, div=div, no_sass=r"\b(LDL|STL)\b"))
    p = H.plan(8192, 4 * 5120, torch.device("cuda"), sms=132)
    proj = {n: MHC[n] for n in ("h_ptr", "fn_ptr", "T", "KD", "k_per", "stride_h", "stride_fn")}
    out["mhc proj prefill"] = (
        "mhc_jit", "mhc_proj", dict(proj, m_ptr="*fp32", sq_ptr="*fp32"),
        dict(NM=24, NPAD=H.NPAD, SPLIT_BF16=True, BM=p.bm, BK=p.bk, BT=p.block), p.warps, "HGMMA",
        dict(stages=p.stages, div={"h_ptr", "fn_ptr", "m_ptr", "sq_ptr", "KD", "k_per",
                                   "stride_h", "stride_fn"}, no_sass=r"\b(LDL|STL)\b"))
    return out


def moe_cases():
    """The routed-expert and FP8-H GEMMs at the tiles pick_tile gives them, and the tile-list
    kernel. A 7th element: the arguments the launcher marks 16-divisible at V4.1-Flash dims
    (every pointer; L1 strides 5120 / 2560 / 160, L2 2304 / 1152, N and K) and the stages:
    without the hints the loads do not vectorize and the L1 tile spills ~1 KB."""
    from megagraph.kernels.moe import triton as M

    gemm = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", aidx_ptr="*i32", b1_ptr="*i8", bs1_ptr="*u8",
                b2_ptr="*i8", bs2_ptr="*u8", c_ptr="*fp16", cidx_ptr="*i32", w_ptr="*fp32",
                work_ptr="*i32", MT="i32", N="i32", K="i32", limit="fp32", stride_am="i32",
                stride_as="i32", stride_bg="i32", stride_bn="i32", stride_bsg="i32",
                stride_bsn="i32", stride_cm="i32")
    cfg = M.pick_tile("l1", 1.5)
    l1 = dict(TOPK=6, KS=6, GATHER_A=True, SCATTER_C=False, WEIGHTED=False, SWIGLU=True,
              HAS_LIMIT=True, A_SCALED=True, WFMT=0, MMA=M.MMA_FP8, BLK_N_S=1, BLK_K_S=32,
              NSUB=4, USE_ASM=True, MANUAL=False, PAR=True, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
              QUANT_OUT=False, QSPLIT=1)
    l2 = dict(l1, KS=7, GATHER_A=False, SCATTER_C=True, WEIGHTED=True, SWIGLU=False,
              HAS_LIMIT=False, A_SCALED=False, MMA=M.MMA_FP16)
    ptrs = {n for n, t in gemm.items() if t.startswith("*")}
    div1 = ptrs | {"N", "K", "stride_am", "stride_bg", "stride_bn", "stride_bsg", "stride_bsn",
                   "stride_cm"}
    # the FP8-H path (MoeConfig.fp8_h; the Triton kernels' tiles): L1 with the quantizing
    # epilogue (QUANT_OUT: H e4m3 + f32 scales per 128 columns) and L2 on FP8 A with those
    # scales, at the prefill tiles (wgmma with FP8 operands: QGMMA)
    sgemm = dict(gemm, cnt_ptr="*i32", M="i32", G="i32", stride_ag="i32", stride_asg="i32",
                 stride_cg="i32", hs_ptr="*fp32", stride_hs="i32")
    q1, q2 = M.pick_tile("l1_fp8h", 48.0), M.pick_tile("l2_fp8h", 48.0)
    l1q = dict(l1, QUANT_OUT=True, BM=q1.bm, BN=q1.bn, BK=q1.bk, GROUPED=True, G_PAD=512,
               QSPLIT=q1.qsplit)
    l2q = dict(l2, A_SCALED=True, MMA=M.MMA_FP8, BM=q2.bm, BN=q2.bn, BK=q2.bk, GROUPED=True,
               G_PAD=512, QUANT_OUT=False)
    divq = div1 | {"hs_ptr"}  # the scale strides (F / 128 = 18, d / 128 = 40) are not
    # the static grid's launch also passes M = 0, G = 384 and the group strides 0, which Triton
    # specializes as 16-divisible too: without them the A pointers are not known aligned, A is
    # loaded byte by byte outside the cp.async pipeline and every prefill tile spills (432 B /
    # 64 B measured that way were this artifact, not the kernels)
    divs = divq | {"M", "G", "stride_ag", "stride_asg", "stride_cg"}
    out = {
        # FP8-H L1 at its prefill tile: 128 columns as two 64-column K loops (qsplit 2, 4 warps):
        # no local memory at all (the one-loop 128-column tile needs 8 warps = 1 program per SM
        # with 5x the barriers, or spills ~500 B at 4 warps: 2.2x the default L1 on the H200)
        "moe fp8h l1 prefill": ("moe_jit", "moe_gemm", dict(sgemm, c_ptr="*fp8e4nv"), l1q,
                                q1.num_warps, "QGMMA",
                                dict(stages=q1.num_stages, div=divs - {"work_ptr"},
                                     # Triton 3.6 (the H200 image) spills here; 3.9 does not
                                     no_sass={(3, 9): r"\b(LDL|STL)\b"})),
        # FP8-H L2: wgmma on E4M3 A and B (QGMMA, not HGMMA / mma.sync), no local memory
        "moe fp8h l2 prefill": ("moe_jit", "moe_gemm", dict(sgemm, c_ptr="*bf16"), l2q,
                                q2.num_warps, r"QGMMA\.\S*E4M3\.E4M3",
                                dict(stages=q2.num_stages,
                                     div=divs - {"stride_bsn", "work_ptr"},
                                     no_sass=r"\b(LDL|STL|HGMMA|HMMA)\b")),
    }
    # the default prefill L1 (pick_tile at ~128 rows per expert), its K loop in SASS: 4 wgmma
    # groups per chunk, each waited on
    p1 = M.pick_tile("l1", 128.0)
    out["moe l1 prefill default"] = (
        "moe_jit", "moe_gemm", sgemm,
        dict(l1, BM=p1.bm, BN=p1.bn, BK=p1.bk, PAR=p1.par, GROUPED=True, G_PAD=512), p1.num_warps,
        "QGMMA", dict(stages=p1.num_stages, div=divs - {"work_ptr"}, no_sass=r"\b(LDL|STL)\b",
                      loop={r"WARPGROUP\.DEPBAR": 4, r"QGMMA\.64x64x32": 8}))
    # Tile.swap (moe_jit.moe_acc_swap): C^T = W A^T per chunk, so the 16-row decode tile runs on
    # wgmma m64n16 (QGMMA for L1's fp8, HGMMA for L2's fp16 H) with the weight tile in E4M3 (L1:
    # no F2FP upcast at all), where the unswapped K loop is mma.sync (HMMA) on an fp16 copy of
    # the weights staged through shared memory. The default decode L1 (pick_tile "l1" at ~1.6
    # rows per expert: 16 x 64, 4 warps, 3 stages, par, swap) and the FP8-H decode roles
    # (16 x 128) swap; the fp16-H L2 does not (the case below forces it at its 16 x 128 tile). Pinned: no HMMA, no local memory, and the K loop's
    # instruction count per Triton version (the H200 image runs 3.6; K-loop sizes from the
    # per-lane MXFP4 upcast, moe_jit.FP4_E4M3_ASM).
    d1s, d2s = M.pick_tile("l1", 1.6), M.pick_tile("l2", 1.6)
    dl1 = dict(l1, BM=d1s.bm, BN=d1s.bn, BK=d1s.bk, PAR=d1s.par, GROUPED=True, G_PAD=512)
    dl2 = dict(l2, BM=d2s.bm, BN=d2s.bn, BK=d2s.bk, PAR=d2s.par, GROUPED=True, G_PAD=512)
    dl1w = dict(dl1, BN=128)  # the unswapped / FP8-H decode tiles' 128 columns
    swap = dict(no_sass=r"\b(LDL|STL|HMMA)\b", loop={r"\bF2FP": 0, r"QGMMA\.64x16x32": 8},
                max_loop={(3, 6): 760, (3, 9): 770})
    out["moe l1 swap decode"] = ("moe_jit", "moe_gemm", sgemm, dict(dl1, SWAP=1), d1s.num_warps,
                                 "QGMMA", dict(swap, stages=d1s.num_stages, div=divs - {"work_ptr"}))
    out["moe l2 swap decode"] = (
        "moe_jit", "moe_gemm", dict(sgemm, a_ptr="*fp16", c_ptr="*bf16"), dict(dl2, SWAP=1),
        d2s.num_warps, r"HGMMA\.64x16x16", dict(stages=d2s.num_stages,
                                                 div=divs - {"work_ptr", "stride_bsn"},
                                                 no_sass=r"\b(LDL|STL|HMMA)\b",
                                                 max_loop={(3, 6): 920, (3, 9): 820}))
    # swap with the FP8-H path (MoeConfig.fp8_h) at its decode tiles (pick_tile "l1_fp8h" / "l2_fp8h" at ~1.6 rows per expert: 16 x 128, 4 warps, 3 stages,
    # par, swap): L2 on E4M3 H with per-128 scales (A_SCALED) runs QGMMA m64n16 on the E4M3 W2
    # tile, no fp16 copy (no F2FP in the loop, no HGMMA / HMMA); L1 with the quantizing epilogue
    # has the 128-column swapped L1 loop
    out["moe l2 fp8h swap decode"] = (
        "moe_jit", "moe_gemm", dict(sgemm, c_ptr="*bf16"),
        dict(dl2, SWAP=1, A_SCALED=True, MMA=M.MMA_FP8), d2s.num_warps,
        r"QGMMA\.64x16x32\.F32\.E4M3\.E4M3",
        dict(stages=d2s.num_stages, div=divs - {"work_ptr", "stride_bsn"},
             no_sass=r"\b(LDL|STL|HMMA|HGMMA)\b", max_loop={(3, 6): 770, (3, 9): 770},
             loop={r"\bF2FP": 0, r"QGMMA\.64x16x32\.F32\.E4M3\.E4M3": 8}))
    out["moe l1 fp8h swap decode"] = (
        "moe_jit", "moe_gemm", dict(sgemm, c_ptr="*fp8e4nv"),
        dict(dl1w, SWAP=1, QUANT_OUT=True), d1s.num_warps, "QGMMA",
        dict(swap, stages=d1s.num_stages, div=divs - {"work_ptr"},
             loop={r"\bF2FP": 0, r"QGMMA\.64x16x32": 16},
             max_loop={(3, 6): 1420, (3, 9): 1400}))
    # the unswapped decode L1 (a tile with swap off), as the SASS reads it: mma.sync with the
    # E4M3 -> fp16 upcast (F2FP) of the weight tile in the K loop (what swap removes)
    out["moe l1 decode mma.sync"] = (
        "moe_jit", "moe_gemm", sgemm, dl1w, d1s.num_warps, "HMMA",
        dict(stages=d1s.num_stages, div=divs - {"work_ptr"}, stack=80,  # 3.9: 72 B
             loop={r"HMMA\.16816": 64, r"F2FP\.F16\.E4M3": 160}))
    up_types = dict(w_ptr="*u8", s_ptr="*u8", cnt_ptr="*i32", out_ptr="*fp8e4nv", os_ptr="*fp32",
                    N="i32", K="i32", stride_wg="i32", stride_wn="i32", stride_sg="i32",
                    stride_sn="i32", stride_og="i32", stride_on="i32", stride_osg="i32")
    return out | {
        "moe tile list": ("moe_jit", "moe_tile_list",
                          dict(cnt_ptr="*i32", work_ptr="*i32", G="i32", MT="i32"),
                          dict(BM=cfg.bm, G_PAD=512, BT=32), 4, None, {}),
        # moe_grouped_cublas' expert upcast (prefill L1 on cuBLAS, opt-in): the PRMT upcast
        # with one offset load per 32-column group; the first version gathered a scale per
        # byte (1211 loop instructions per 32 x 256 tile on 3.6, ALU-bound on the H200)
        "moe grouped cublas upcast": (
            "moe_grouped_cublas_jit", "mxfp4_rows_e4m3", up_types,
            dict(NG=256, BN=32, BK=256, USE_ASM=True), 4, "PRMT",
            dict(div=set(up_types) - {"N"}, no_sass=r"\b(LDL|STL)\b",
                 max_loop={(3, 6): 330, (3, 9): 330})),
    }


NAMES = ["attn decode q-epilogue", "attn decode split", "attn plain", "attn combine", "index decode",
         "attn prefill pipe", "index prefill", "index stream long bf16", "index stream short bf16",
         "index stream long tf32x3", "index stream short tf32x3", "compressor gemm", "compressor gemm small", "compressor rows r1",
         "compressor rows r2", "ring copy", "engram hash", "engram gate", "quantize act 1x128",
         "quantize act mxfp8", "moe tile list",
         "moe fp8h l1 prefill", "moe fp8h l2 prefill", "moe l1 prefill default", "moe l1 swap decode", "moe l2 swap decode",
         "moe grouped cublas upcast",
         "moe l1 decode mma.sync", "moe l2 fp8h swap decode", "moe l1 fp8h swap decode",
         "rope q", "rope q inverse", "rope ik", "rope f32",
         "fake quant fp8_e4m3", "fake quant mxfp4", "fake quant nvfp4"]
NAMES += MHC_NAMES


@pytest.mark.parametrize("name", NAMES)
def test_compiles_for_sm90_without_spills(name, tmp_path):
    import importlib

    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    mod, fn_name, types, consts, warps, mma, *more = cases()[name]
    opts = more[0] if more else {}
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])

    def pinned(v):
        """A value pinned per Triton version ({(major, minor): value}: the SASS differs between
        the H200 image's 3.6 and this machine's 3.9); None where this version is not pinned."""
        return v.get(version) if isinstance(v, dict) and all(
            isinstance(k, tuple) for k in v) else v

    fn = getattr(importlib.import_module(TRITON_MODULES[mod]), fn_name)
    # constexprs a case leaves out take the kernel's default, as a launch that omits them does
    consts = {**{n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                 if n not in consts and n not in types and p.default is not inspect.Parameter.empty},
              **consts}
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in opts.get("div", ())}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=warps, num_stages=opts.get("stages", 2),
                                    **({} if opts.get("fusion", True) else {"enable_fp_fusion": False})))
    if opts.get("no_ptx"):
        hit = re.search(opts["no_ptx"], k.asm["ptx"])
        assert hit is None, f"{name}: {hit.group(0)} in the PTX"
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    usage = cuobjdump(cubin, "--dump-resource-usage")
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    # the shapes were picked on Triton 3.9's build; Triton 3.6 (the H200 image) spills 136 bytes
    # in the split decode kernel at the same shape
    limit = 64 if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9) else 256
    limit = max(limit, opts.get("stack", 0))  # a case's own cap, where its comment says why
    assert stack <= limit, f"{name}: {stack} bytes of stack per thread ({usage.strip()})"
    if mma:
        sass = cuobjdump(cubin, "--dump-sass")
        assert re.search(rf"\b{mma}\b", sass), f"{name}: no {mma} in the SASS"
    if pinned(opts.get("no_sass")):
        sass = cuobjdump(cubin, "--dump-sass")
        hit = re.search(pinned(opts["no_sass"]), sass)
        assert hit is None, f"{name}: {hit.group(0)} in the SASS"
    if opts.get("loop"):
        sass = cuobjdump(cubin, "--dump-sass")
        body = last_loop(sass)
        for pat, want in opts["loop"].items():
            want = pinned(want)
            if want is None:
                continue
            got = len(re.findall(pat, body))
            assert got == want, f"{name}: {got} x {pat} in the K loop, expected {want}"
    if pinned(opts.get("max_loop")):
        sass = cuobjdump(cubin, "--dump-sass")
        n, cap = len(last_loop(sass).splitlines()), pinned(opts["max_loop"])
        assert n <= cap, f"{name}: {n} instructions in the K loop (> {cap})"


@pytest.mark.parametrize("name", MHC_NAMES[:3])
def test_mhc_fused_sm90_registers_and_arrival(name):
    """The one-launch Mega-mHC (mhc_jit.mhc_fused) as built for sm_90: no local memory, at most
    96 registers at the decode tile (168 at the 64-row prefill tiles), and on the split path
    exactly one arrival atomic, predicated to one thread (ATOMG.ADD, gpu scope) with the release
    fence before it and the L1 invalidation after it (acq_rel), the slabs read through L2
    (strong .gpu loads), the counter reset (ATOMG.EXCH); no atomics at all unsplit."""
    import importlib

    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    from sm90_build import usage_and_sass

    mod, fn_name, types, consts, warps, _, opts = mhc_cases()[name]
    fn = getattr(importlib.import_module(TRITON_MODULES[mod]), fn_name)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in opts["div"]}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=warps, num_stages=opts["stages"]))
    usage, sass = usage_and_sass(k)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0 and "LOCAL:0" in usage, usage
    # Triton 3.6 / 3.9: decode 76 / 70 registers (8 warps: 3 programs per SM), prefill 140,
    # unsplit 128 (64-row tiles, 4 warps)
    assert regs <= (96 if consts["BM"] < 64 else 168), usage
    atoms = re.findall(r"^.*\bATOMG?\.[^;]*;", sass, re.M)
    if not consts["SPLIT"]:
        assert atoms == [], atoms
        return
    adds = [a for a in atoms if ".ADD" in a]
    assert len(adds) == 1 and re.search(r"@!?U?P\d\s+ATOMG\.E\.ADD\.STRONG\.GPU", adds[0]), adds
    assert len([a for a in atoms if ".EXCH" in a]) == 1, atoms
    lines = sass.splitlines()
    at = next(i for i, line in enumerate(lines) if adds[0].strip() in line)
    assert any(re.search(r"MEMBAR\.(ALL|SC)\.GPU", x) for x in lines[at - 6:at]), \
        "no release fence before the arrival"
    assert any("CCTL.IVALL" in x for x in lines[at + 1:at + 6]), "no acquire after the arrival"
    after = "\n".join(lines[at:])
    assert re.search(r"LDG\.E\.STRONG\.GPU", after), "slabs not read through L2"
