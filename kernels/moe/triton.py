"""MegaMoE on Hopper in Triton: router, expert permutation, grouped expert GEMMs on MXFP4 weights
with the SwiGLU clamp fused into the first GEMM and the combine weights into the second, the
shared expert through the FP8-block GEMM, and the combine + mHC residual expand; plus the dense
FP8-block GEMMs (`linear_q`, `grouped_linear_q`, `swiglu_mlp_q`).

Same calling convention and semantics as kernels/fused/reference.py (and kernels/capturable):
no host synchronization, static shapes (the workspaces are sized from the input shapes, i.e.
the plan's worst case), so every op here is CUDA-graph capturable. Inputs the kernels do not
cover (CPU tensors outside the Triton interpreter, act_fmt other than fp8_1x128, dense expert
weights, K not a multiple of 128, ...) run the capturable kernels instead.

mega_moe launches (T tokens, k = topk, E experts, P = T*k pairs):
  1 gate_scores   x @ gate_w^T in fp32 (bf16 tensor cores, exact products); few tokens:
                  split over K into slabs that route_topk adds in order       [S, T, E] f32
  2 route_topk    sqrtsoftplus / bias / top-k / renormalize / x route_scale, expert counts
                  by atomics (hash routing: experts from tid2eid[token_ids])   ids, w [T, k]
  3 moe_plan      exclusive scan of the counts -> per-expert cursors (1 program)
  4 moe_scatter   pair -> its expert-sorted row (atomic cursors)               sorted [P]
  5 moe_gemm L1   rows of one expert per tile, A = x_q rows gathered by token, W1 and W3 of
                  the tile's expert, SwiGLU-clamp epilogue                       H [P, F] f16
                  (prefill: moe_grouped_cublas - E4M3 upcast of the touched experts, row
                  gather, cuBLAS grouped FP8 GEMM, swiglu_rows: 4 launches + cumsum)
  6 moe_gemm L2   A = H rows, B = W2, epilogue: x routing weight, row scattered to its
                  (token, slot)                                                  Y [T, k+1, d]
  7,8 moe_gemm    shared expert, dense (FP8-block weights): L1 (SwiGLU) -> Hs, L2 -> Y[:, k];
                  L1 on cuBLAS + swiglu_rows where kernels/cublas_fp8 applies; on a side
                  stream, concurrent with 3-6 (SHARED_STREAM). Where the routed H is E4M3
                  (prefill sizes on sm_90): shared_expert_fp8h - both GEMMs on cuBLAS FP8, H
                  quantized by swiglu_rows_q, its output in its own [T, d] tensor
  9 moe_combine   y = sum of the k slots (+ shared), streams' = post*y + comb^T streams
(+ one memset of the counts). The grouped GEMMs launch a static worst-case grid
(min(P, P // BM + E) row tiles x N tiles); each program finds its expert by a scan of the
counts, and programs past the last tile return at once. Empty experts own no tile.
Persistent variant (MEGAGRAPH_MOE_PERSISTENT=1, decode sizes; GemmConfig.persistent): one
moe_tile_list launch writes the compact list of non-empty row tiles from the counts on the
device, then each grouped GEMM is a fixed grid of persistent x SMs programs looping over
(tile, N tile) items (moe_gemm_persistent): no program for an empty expert, still static for
CUDA graphs, the same tile code (moe_jit.moe_tile) and so the same numbers. Off by default until
timed on the H200.
FP8-H variant (routed_experts(..., fp8_h=True); MEGAGRAPH_MOE_FP8_H=1 at every token count; BY
DEFAULT at prefill sizes on sm_90 since the fifteenth session, FP8_H_PREFILL): L1's SwiGLU
epilogue quantizes H per row and 128 columns to E4M3 with a power-of-two f32 scale (quantize_act
fp8_1x128's numerics, DeepSeek's activation quantization before w2), H [P, F] e4m3 + scales
[P, F/128]; L2 then runs the FP8 MMA on H's scales, as L1 does on x's. At prefill sizes both are
the warp-specialized Gluon kernels (moe_gluon_ws with its FP8-H epilogue, moe_gluon_l2_fp8: the
layer at 8192 tokens 6.84 -> 6.18 ms on the H200), elsewhere moe_jit's (quantize_out, A_SCALED).

Numerics (vs the reference: fp32 math on dequantized operands):
* L1 (FP8 MMA): per 128-column chunk, the four E8M0 scales of a weight row are split into
  S = max - 6 (applied to the fp32 partial product with the activation's f32 scale) and
  rel = s - S folded exactly into the E4M3 weight values (E2M1 x 2^rel is exact in E4M3 for
  rel in [-5, 6]: every row whose scales within 128 columns span <= 11 binades; blocks further
  below are flushed to 0, an error below 2^-11 of the chunk's largest weight). Products are
  exact; Hopper's FP8 MMA accumulates each 128-chunk with ~2^-14 relative precision before the
  fp32 promotion. g, u, SwiGLU in fp32; H stored in fp16 (2^-11 relative).
* L2 (FP16 MMA): W2 dequantized the same way to E4M3 and upcast to fp16 (exact), H in fp16;
  fp32 accumulation and promotion per 128 columns.
* L2 with FP8 H (the default at prefill sizes on sm_90): H rounded to E4M3 per 128 columns (at
  most 2^-4 relative per element, the errors averaging down in the dot product): a few %
  relative (Frobenius) vs the
  fp32-H reference; vs the reference that quantizes H the same way
  (kernels.moe.reference.moe_experts(h_fmt="fp8_1x128")) only the accumulation order and the
  rare E4M3 rounding flip of an H element whose fp32 value lies within that noise of a rounding
  boundary remain.
* Shared expert / dense FP8-block weights (32x32 or 128x128 blocks): fp16 MMA, the weight
  exponents within a 128-chunk folded in fp16 (exact for spreads <= 15 binades); FP8 MMA when
  one scale covers the chunk (128x128 blocks).
* Y (per-(token, slot) weighted expert outputs) in bf16 (fp32 for fp32 activations), summed in
  fp32 in slot order and rounded like the reference (routed -> act dtype, + shared -> act dtype,
  expand in fp32 -> streams dtype).
* Router: bf16 x bf16 products are exact in fp32 (an fp32 gate weight is split into bf16 hi +
  lo); only the summation order differs, so top-k picks equal the reference's except at ties
  within ~1e-6.
Result: bf16 outputs within ~3e-3 relative (Frobenius) of the reference; tests bound 1e-2.

The E2M1 -> E4M3 upcast has two implementations: PTX (prmt lookups on 4 packed bytes, ~2.5
integer ops per weight) and plain Triton integer arithmetic (~11 ops per weight; the only one the
interpreter runs). The PTX path is used where a one-time check on the device (asm_ok: both paths
on every byte value and exponent offset, bit for bit) passes; MEGAGRAPH_FP4_ASM=1 / 0 forces it
on / off.
MEGAGRAPH_MOE_EXACT=1 runs every GEMM on fully dequantized bf16 (fp32 in the interpreter)
operands: slower, bit-faithful products, for debugging.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.moe.grouped_cublas import MIN_ROWS_PER_EXPERT

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# PTX upcast: "1" on, "0" off, unset = on where a one-time device check (asm_ok) passes
_ASM_ENV = os.environ.get("MEGAGRAPH_FP4_ASM", "")
USE_ASM: bool | None = None if (_ASM_ENV == "" and not INTERPRET) else (_ASM_ENV == "1"
                                                                         and not INTERPRET)
EXACT = os.environ.get("MEGAGRAPH_MOE_EXACT", "0") == "1"
# Persistent routed-expert GEMMs at decode sizes (moe_gemm_persistent): OFF by default until
# timed on the H200 (docs/kernels/moe.md, "Left to do" 4); "1" turns them on for the
# l1 / l2 roles at <= 12 rows per expert with PERSISTENT_PER_SM programs per SM.
PERSISTENT = os.environ.get("MEGAGRAPH_MOE_PERSISTENT", "0") == "1"
# 2: the decode tiles' sm_90 build (Triton 3.9) holds 255 (L1) / 178 (L2) registers x 128
# threads, so two programs are resident per SM; not yet swept (benchmarks/moe_tune.py does)
PERSISTENT_PER_SM = 2
# FP8 second GEMM (H quantized to E4M3 per row and 128 columns in L1's epilogue, L2 on the FP8 MMA
# with the per-128 scales: DeepSeek's official inference numerics for the expert down-projection
# input; 3.4e-2 relative vs the fp32-H reference). "1" turns it on for routed_experts
# (moe_experts_q, mega_moe) at EVERY token count (the decode sizes then leave the Gluon decode
# kernels, which take fp16 H, for moe_jit's); routed_experts(fp8_h=...) overrides per call; at
# prefill sizes FP8_H_PREFILL (below) turns it on by default. Tiles of moe_jit's kernels: the
# "l1_fp8h" / "l2_fp8h" roles of pick_config / CONFIG_OVERRIDE.
FP8_H = os.environ.get("MEGAGRAPH_MOE_FP8_H", "0") == "1"
# The hand-written Gluon L1 kernels (Triton 3.6 on sm_90, where available; _gluon_l1):
# MEGAGRAPH_MOE_GLUON "0" keeps the Triton moe_gemm everywhere. The decode L1
# (moe_gluon_decode, <= 12 rows per expert) is on by default (H200, seventh session: 1.66 ->
# 1.11 ms at 64 tokens, bit-stable across launches); the prefill L1 (moe_gluon, > 48 rows) only
# with MEGAGRAPH_MOE_GLUON_PREFILL=1: two variants of its pipeline (asm "pack", bm 64; removed,
# in commit f12126b) gave wrong outputs on the H200, with either proxy-fence order, and the
# cause is not found (kernels/moe/gluon_l1.py).
GLUON = os.environ.get("MEGAGRAPH_MOE_GLUON", "1") == "1"
GLUON_DECODE = os.environ.get("MEGAGRAPH_MOE_GLUON_DECODE", "1") == "1"
GLUON_PREFILL = os.environ.get("MEGAGRAPH_MOE_GLUON_PREFILL", "0") == "1"
# dense FP8-block GEMMs (linear_q) from this many rows on go to cuBLAS (kernels/gemm/cublas_fp8.py)
CUBLAS_MIN_ROWS = int(os.environ.get("MEGAGRAPH_CUBLAS_FP8_MIN_ROWS", "1"))
# routed_experts' L1 at prefill sizes (> moe_grouped_cublas.MIN_ROWS_PER_EXPERT rows per expert)
# on cuBLAS's rowwise grouped FP8 GEMM after a per-call E4M3 upcast of the touched experts
# (moe_grouped_cublas). On by default from the ninth session: in one run on the H200
# (benchmarks/moe_ab.py, mega_moe with the Gluon prefill L2) 14.56 against 15.78 ms at 8192
# tokens (128 rows per expert), but 11.54 against 9.63 ms at 4096 (64 rows: the upcast of all
# experts is a fixed ~3 ms that the Triton L1 only pays back from ~100 rows per expert)
CUBLAS_PREFILL = os.environ.get("MEGAGRAPH_MOE_CUBLAS_PREFILL", "1") == "1"
# mega_moe runs the shared expert on a side stream, concurrent with the routed experts. Off by
# default: on the H200 (64 tokens, CUDA graphs) the layer took 2.001 ms with it against 1.904 ms
# without (three A/B pairs in one run, eighth session): the Gluon decode L1's grid loses SMs to
# the shared expert's kernels and pays for it in its tail
SHARED_STREAM = os.environ.get("MEGAGRAPH_MOE_SHARED_STREAM", "0") == "1"
# ... or on the side stream only while the router runs (gate GEMM, top-k, permutation: small
# launches that leave SMs idle), joined before the routed experts, whose grids want every SM
# (SHARED_STREAM's finding); at most SHARED_EARLY_MAX_TOKENS tokens. On the H200 (thirteenth
# session, one A/B, 2 rounds, the same bits): 64 tokens 1.626 -> 1.607 ms; 8192 tokens 7.51 ->
# 7.65 ms (balanced routing), hence decode sizes only
SHARED_EARLY = os.environ.get("MEGAGRAPH_MOE_SHARED_EARLY", "1") == "1"
SHARED_EARLY_MAX_TOKENS = 256
# the shared expert's bf16 W2 GEMM writes its slot of y directly (off: a temporary and a copy).
# H200, thirteenth session (one A/B, 2 rounds, the same bits): 8192 tokens balanced 7.66 -> 7.45
# ms, gate-routed 9.59 -> 9.44; 64 tokens unchanged
SHARED_MM_OUT = True
# grouped_linear_q (wo_a, 8 groups) from this many rows on: one cuBLAS GEMM per group (at 64 rows
# 8 launches of ~6 us lose to one batched Triton launch of 40 us; at 8192 rows the Triton GEMM
# takes 2.2 ms)
CUBLAS_GROUPED_MIN_ROWS = int(os.environ.get("MEGAGRAPH_CUBLAS_FP8_GROUPED_MIN_ROWS", "256"))
# routed_experts' L1 above WIDE_L1_MIN_ROWS rows per expert on the decode L1 kernel with 64-token
# tiles (moe_gluon_decode, bt=64, weights by TMA): on the H200 at 8192 tokens (~128 rows per
# expert) 8.30 ms against the cuBLAS grouped L1's 9.20 and the Triton L1's 10.42, the same error
# to fp32 math as the Triton L1 (benchmarks/moe_gluon_decode_probe.py --tokens 8192 --bt 32,64,
# ninth session). Only where it was timed against what it replaces - the cuBLAS L1's range, so
# its threshold is the cuBLAS L1's: between 48 and 100 rows per expert it was not timed against
# the Triton L1, which stays there
WIDE_L1_MIN_ROWS = MIN_ROWS_PER_EXPERT
GLUON_WIDE_L1 = os.environ.get("MEGAGRAPH_MOE_GLUON_WIDE_L1", "1") == "1"
WIDE_BT = 64
# ... and, first, the warp-specialized L1 with persistent CTAs (moe_gluon_ws, 6-stage raw ring,
# 3-stage upcast ring): 7.90 ms at 8192 tokens against the wide decode kernel's 8.26 in the same
# H200 call (benchmarks/moe_gluon_ws_probe.py, tenth session; its 128-row tiles are the Gluon
# prefill L2's, so the two share one tile list)
GLUON_WS_L1 = os.environ.get("MEGAGRAPH_MOE_GLUON_WS_L1", "1") == "1"
WS_STAGES, WS_BSTAGES = 6, 3
# its tile's columns of W1 / W3: 64, or 128 (moe_gluon_ws.BN_WIDE: each A chunk feeds twice the
# wgmma columns, half the A bytes from L2 per MMA; the same bits) where F % 128 == 0, on its own
# rings WS_WIDE_STAGES / WS_WIDE_BSTAGES (4:2, the deepest that fits 227 KB). 128 by default
# (twelfth session, H200, 8192 tokens: the L1 7.94 -> 6.94 ms with gathered A, 6.21 ms with A by
# TMA and two upcast partitions; mega_moe 12.68 -> 11.55 -> 10.75 ms in one A/B, the same bits;
# benchmarks/results/moe-ws-wide-12-h200.md)
WS_L1_BN = int(os.environ.get("MEGAGRAPH_MOE_GLUON_WS_L1_BN", "128"))
WS_WIDE_STAGES, WS_WIDE_BSTAGES = 4, 2
# ... with A by TMA (its light loader leaves the registers for a second upcast partition:
# moe_gluon_ws.WIDE_UPP)
WS_WIDE_A_TMA = os.environ.get("MEGAGRAPH_MOE_GLUON_WS_WIDE_A_TMA", "1") == "1"
# ... with each weight row's frame over all of K (moe_gluon_ws.row_frames, cached per weight)
# where that gives the same bits (every row's E8M0 exponents within 11 binades of its largest):
# the promotion by the A scales alone, no column scales per quarter (ncu, thirteenth session:
# the MMA warpgroups bound the L1 and ~30% of their stalls waited on those shared loads).
# Default since the thirteenth session: H200, 8192 tokens, L1 4.35 -> 3.85 ms at balanced
# routing (5.97 -> 5.43 gate-like), mega_moe 8.29 -> 7.91 / 10.58 -> 9.95 ms, the same bits
# (benchmarks/results/moe-ws-13-h200.md)
WS_L1_FRAMES = os.environ.get("MEGAGRAPH_MOE_GLUON_WS_FRAMES", "1") == "1"
# its A rows by TMA from an expert-sorted copy made per call (moe_gluon_ws.A_TMA). Off: on the
# H200 mega_moe at 8192 tokens took 13.08 vs 13.14 ms with it (one call, two rounds, same
# outputs) - 0.4% for a 252 MB copy per call; the L1's load floor did not move (3.22 vs 3.19 ms)
WS_A_TMA = os.environ.get("MEGAGRAPH_MOE_GLUON_WS_A_TMA", "0") == "1"
# The decode L2 (moe_gluon_decode_l2, <= 12 rows per expert; MEGAGRAPH_MOE_GLUON turns it off too)
GLUON_DECODE_L2 = os.environ.get("MEGAGRAPH_MOE_GLUON_DECODE_L2", "1") == "1"
# The prefill L2 (moe_gluon_l2, > 48 rows per expert): on by default from the ninth session (H200,
# poisson routing at 8192 tokens: 4.01 against the Triton L2's 5.82 ms, rel. diff 7.4e-5,
# benchmarks/moe_gluon_l2_probe.py; mega_moe 15.78 against 17.61 ms at 8192, 9.63 against 10.25
# at 4096 tokens, benchmarks/moe_ab.py; its tests repeat launches and compare the bits)
GLUON_PREFILL_L2 = os.environ.get("MEGAGRAPH_MOE_GLUON_PREFILL_L2", "1") == "1"
# ... and its warp-specialized twin moe_gluon_l2_ws (loader / upcast / two MMA warpgroups on
# mbarrier rings, persistent CTAs; the same numerics: bit-equal to moe_gluon_l2 in its 69 GPU
# tests) in its place wherever the prefill L2 runs and the call fits its TMA streams
# (moe_gluon_l2_ws.args_problem), 256-column tiles where d % 256 == 0, else 128; else
# moe_gluon_l2 as before. On by default from the eleventh session (H200, 8192 tokens, poisson
# routing: 3.99 -> 3.45 ms at 256 columns / 4:3 rings, 3.56 at 128 / 8:3,
# benchmarks/results/moe-gluon-l2-ws-h200.md). MEGAGRAPH_MOE_GLUON_PREFILL_L2_WS=0 turns it off.
# Ring depths WS_L2_RINGS, tile columns WS_L2_BN (None: 256 where it fits, else 128).
GLUON_PREFILL_L2_WS = os.environ.get("MEGAGRAPH_MOE_GLUON_PREFILL_L2_WS", "1") == "1"
WS_L2_RINGS = None  # (stages, bstages) of l2_gluon_ws; None: its defaults for the tile
WS_L2_BN = None
# FP8 H at prefill sizes (> WIDE_L1_MIN_ROWS rows per expert): the warp-specialized L1 writes
# E4M3 H + scales in its epilogue and runs the down GEMM too (moe_gluon_l2_fp8: the L1's kernel on
# FP8 H x W2, the FP8 tensor cores); off: FP8 H (FP8_H, fp8_h=True) on the Triton kernels (moe_gemm
# roles l1_fp8h / l2_fp8h)
GLUON_WS_L2_FP8 = os.environ.get("MEGAGRAPH_MOE_GLUON_WS_FP8_H", "1") == "1"
# routed_experts' H format where fp8_h is None and FP8_H is off: E4M3 wherever the two kernels
# above take the call (prefill sizes on sm_90: _prefill_fp8_h_may, then their pickers), fp16
# elsewhere (decode: its Gluon kernels are
# bound by weight bandwidth, FP8 H would buy nothing there). Why it is the default since the
# fifteenth session: it is the vendor's own numerics - DeepSeek's V4 inference quantizes the input
# of every FP4 expert GEMM to FP8 per 128 columns (act_quant before fp4_gemm; its fp8 x fp4 MegaMoE
# and the DeepGEMM grouped FP8 baseline of #7 do the same), as this engine already does for the
# L1's input x - and on the H200 at 8192 tokens the layer ran 6.74 -> 6.33 ms balanced, 8.83 ->
# 8.00 gate-routed (benchmarks/results/moe-fp8h-15-h200.md). Its cost: ~3.4% relative
# difference of the routed output against fp16 H (E4M3's 2^-4 half step on H; the same size as
# the L1's own input quantization).
FP8_H_PREFILL = os.environ.get("MEGAGRAPH_MOE_FP8_H_PREFILL", "1") == "1"
# the shared expert follows the routed experts' H format (shared_expert_fp8h: both its GEMMs on
# cuBLAS's FP8 GEMM, H quantized per 128 columns by swiglu_rows_q) wherever that is E4M3 and its
# weights are FP8-block; "0": its bf16 W2 GEMM on bf16 H as before. Sixteenth session, H200, 8192
# tokens: the shared expert 686 -> 492 us (with cublas_fp8.FORM_PREFILL's 128 x 128 recipe), the
# layer 6.16 -> 5.62 ms with the Triton A copies (benchmarks/results/moe-16-h200.md)
SHARED_FP8_H = os.environ.get("MEGAGRAPH_MOE_SHARED_FP8_H", "1") == "1"
# the router's gate GEMM tile above 256 tokens (gate_scores: rows x experts, warps, stages);
# each score's K loop runs in the same order in any tile. 128 x 64 since the sixteenth session:
# route_ids at 8192 tokens 139 -> 114 us on the H200, the same ids and weights bit for bit
# (benchmarks/gate_tile_probe.py; 128 x 128 at 4 or 8 warps 116-118, 64 x 64 139)
GATE_BM, GATE_BE, GATE_WARPS, GATE_STAGES = 128, 64, 4, 3
# the warp-specialized L1's input copies (sorted_rows: A's rows in expert order; tile_scales: its
# scales in tile order) as two Triton kernels (90 us at 8192 tokens on the H200); off:
# index_select and 17 torch ops (279 us; ncu, sixteenth session)
A_PREP_TRITON = True
MMA_FP8, MMA_FP16, MMA_BF16, MMA_F32 = 0, 1, 2, 3
WFMT = {"mxfp4": 0, "fp8_block": 1}
RDT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class GemmConfig:
    """Tile of one GEMM launch: rows, columns (per weight matrix), K chunk (divides 128 or is
    128), warps, software-pipeline stages; par: MXFP4 K split by column parity (A split in
    registers instead of interleaving the upcast weights); persistent: grouped GEMMs only, > 0
    launches that many programs per SM looping over a device-built list of the non-empty tiles
    (moe_gemm_persistent), 0 the static worst-case grid (moe_gemm). A GEMM that quantizes its
    output (the FP8-H L1, role "l1_fp8h") needs bn a multiple of 128; qsplit = 2 (bn = 128
    only, ignored without a quantized output) computes those 128 columns as two 64-column K loops
    in one program (moe_jit.moe_tile QSPLIT): the 64-column tile's registers, same numbers.
    fuse (the SwiGLU GEMM on MXFP4 weights, static grid; off by default until timed on the
    H200): one MMA per K chunk (moe_jit.moe_acc_fused: W1 / W3 rows interleaved into one
    [2 bn, bk] B tile, A read by the wgmma from shared memory, one wait per chunk where the
    default loop has four); par is ignored. Other GEMMs ignore it.
    swap (grouped / dense GEMMs on MXFP4 weights with the fp8 / fp16 MMA, static grid, not with
    fuse or qsplit 2; off by default until timed on the H200): the K loop with the
    operands swapped (moe_jit.moe_acc_swap: C^T = W A^T per chunk, the bn weight rows as the
    MMA's M and the bm activation rows as its N), so a 16-row decode tile runs on wgmma
    (m64n16) with the E4M3 weight tile instead of mma.sync on an fp16 copy of it routed
    through shared memory (docs/kernels/moe.md, fifth session, decode at 36%). With
    FP8-H it applies to both roles: "l2_fp8h" runs the fp8 MMA on E4M3 H x E4M3 W2 (no fp16
    copy at all), "l1_fp8h" (qsplit 1) quantizes the swapped tile's H in its epilogue."""

    bm: int
    bn: int
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3
    par: bool = False
    persistent: int = 0
    qsplit: int = 1
    fuse: bool = False
    swap: bool = False


# Benchmarks and tests may set these: role ("l1", "l2", "l1_fp8h", "l2_fp8h", "dense",
# "dense_swiglu") -> GemmConfig.
CONFIG_OVERRIDE: dict[str, GemmConfig] = {}


def pick_config(role: str, rows_per_group: float) -> GemmConfig:
    """Tile per role and expected rows per group (expert or dense M). The routed-expert tiles come
    from the H200 sweep (benchmarks/moe_tune.py -> benchmarks/results/moe-tune-h200.md; routed
    experts at 64 tokens 3.91 -> 2.98 ms with 16-row L1 tiles; at 8192 tokens 18.6 -> 16.5 / 17.5 ms
    with a 64-row, 4-warp L1 / L2 tile, each timed with the other GEMM's old tile); the dense FP8-block tiles and the middle range (12 < rows
    <= 48) are still the SASS-based picks (issue slots per KB of weights in the K loop, spills)."""
    if role in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[role]
    # decode: most experts hold 1-2 rows, the static grid is mostly programs that exit at once
    pers = PERSISTENT_PER_SM if (PERSISTENT and role in ("l1", "l2", "l1_fp8h", "l2_fp8h")
                                 and rows_per_group <= 12) else 0
    # FP8-H tiles (docs/kernels/moe.md, fifth session): the L1 quantizes H per 128
    # columns in its epilogue, so a program owns 128 columns; one [64, 128] x 2 K loop needs 8
    # warps (1 program per SM, 5x the barriers of the 4-warp loop: 21.7 ms on the H200 against
    # 9.7 ms for the default L1) or spills at 4 warps (~500 B). qsplit = 2 runs the default
    # prefill L1's 64 x 64 x 4-warp loop twice per program instead (sm_90 build with the
    # launcher's divisibility: 255 registers, no stack, 670 instructions per K chunk against the
    # default's 675, two programs per SM): to be timed (moe_tune --fp8-h). L2 on FP8 A: the H200
    # sweep's best 64 x 128 x 4 warps x 4 stages (~4.8 ms; 8 warps 9.8 ms: 1 program per SM).
    # Decode: the fp16 path's 16 x 128 tiles.
    # Decode on the static grid: the swapped MMA (GemmConfig.swap) where the sixth session's H200
    # sweep timed it faster (moe_tune --swap, routed experts at 64 tokens, benchmarks/results/
    # moe-tune-swap-h200.md): L1 16 x 64 3.20 -> 2.74 ms (1.17x), FP8-H L1 / L2 16 x 128 1.11x /
    # 1.13x; the fp16-H L2 swapped was no faster (1.00x) and stays on mma.sync.
    swap = pers == 0
    if role == "l1_fp8h":
        if INTERPRET:
            return GemmConfig(16, 128, 128, 4, 1, par=True, persistent=pers)
        if rows_per_group <= 12:
            return GemmConfig(16, 128, 128, 4, 3, par=True, persistent=pers, swap=swap)
        return GemmConfig(64, 128, 128, 4, 3, par=True, qsplit=2)
    if role == "l2_fp8h":
        if INTERPRET:
            role = "l2"
        elif rows_per_group <= 12:
            return GemmConfig(16, 128, 128, 4, 3, par=True, persistent=pers, swap=swap)
        else:
            return GemmConfig(64, 128, 128, 4, 4, par=True)
    if INTERPRET:
        return GemmConfig(16, 32, 128, 4, 1, par=role in ("l1", "l2"), persistent=pers)
    if role == "l1":
        if rows_per_group <= 12:
            if swap:
                return GemmConfig(16, 64, 128, 4, 3, par=True, swap=True)
            return GemmConfig(16, 128, 128, 4, 3, par=True, persistent=pers)
        if rows_per_group <= 48:
            return GemmConfig(64, 64, 128, 4, 4, par=True)
        return GemmConfig(64, 64, 128, 4, 3, par=True)
    if role == "l2":
        if rows_per_group <= 12:
            return GemmConfig(16, 128, 128, 4, 3, par=True, persistent=pers)
        if rows_per_group <= 48:
            return GemmConfig(64, 128, 128, 4, 4, par=True)
        return GemmConfig(64, 128, 128, 4, 3, par=True)
    # dense (linear_q, the shared expert): at decode sizes the weights stream once through
    # few row tiles, so the column tile sets the parallelism: 32 weight columns per program
    # (16 x 2 for the SwiGLU pair). The 64 / 128-column tiles gave the attention projections
    # at 64 tokens 10 (wq_a, N = 1280) to 80 programs on 132 SMs: 2-7% of the HBM bandwidth,
    # the shared expert 6% (benchmarks/results/kernels-moe-h200.md, sixth session).
    swiglu = role == "dense_swiglu"
    if rows_per_group <= 12:
        return GemmConfig(16, 16 if swiglu else 32, 128, 4, 4)
    if rows_per_group <= 64:
        return GemmConfig(64, 16 if swiglu else 32, 128, 4, 4)
    return GemmConfig(128, 64 if swiglu else 128, 128, 8, 3)


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _cuda_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)  # FP8 tensor cores


@functools.cache
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (1 under the interpreter: the persistent
    grid is then GemmConfig.persistent programs)."""
    if INTERPRET:
        return 1
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_device(t: Tensor) -> bool:
    """Triton runs here: a CUDA tensor on an sm_89+ device, or any tensor under the interpreter."""
    if INTERPRET:
        return t.device.type == "cpu"
    return t.device.type == "cuda" and _cuda_ok(t.device.index or 0)


def _jit():
    from megagraph.kernels.moe import triton_jit as moe_jit

    return moe_jit


_ASM_CHECKED: dict = {}


def asm_ok(dev: torch.device) -> bool:
    """Whether the PTX upcast may run on `dev`: MEGAGRAPH_FP4_ASM when set, else a one-time check
    that it matches the arithmetic upcast bit for bit on every byte value and exponent offset
    in [-6, 6], with a different offset in neighbouring elements (each byte lane has its own:
    moe_jit.FP4_E4M3_ASM) (run outside CUDA-graph capture; during a capture an unchecked device
    says no)."""
    if USE_ASM is not None:
        return USE_ASM
    key = dev.index or 0
    if key not in _ASM_CHECKED:
        if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return False
        try:
            jit = _jit()
            bn, bk = 16, 512  # 16 rows x 256 bytes: every byte value with all 13 offsets
            p = torch.arange(256, dtype=torch.int32, device=dev).to(torch.uint8).repeat(bn, 1)
            r = torch.arange(bn, device=dev, dtype=torch.int32)[:, None]
            rel = ((r + torch.arange(bk // 2, device=dev, dtype=torch.int32)) % 13).contiguous()
            a = torch.empty(bn, bk, dtype=torch.uint8, device=dev)
            b = torch.empty_like(a)
            jit.fp4_upcast_check[(1,)](p, rel, a, b, BN=bn, BK=bk, num_warps=4)
            _ASM_CHECKED[key] = bool(torch.equal(a, b))
        except Exception:  # noqa: BLE001  (a compile failure means no)
            _ASM_CHECKED[key] = False
    return _ASM_CHECKED[key]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


@dataclass
class Bank:
    """One weight matrix (or a stack of G) as the GEMM reads it: B [G, N, K or K/2] (rows
    contiguous), E8M0 scales as uint8 [G, ns, ks], block of one scale (bn, bk), format code."""

    w: Tensor
    s: Tensor
    wfmt: int
    bn: int
    bk: int
    n: int
    k: int

    @property
    def groups(self) -> int:
        return self.w.shape[0]


def bank(w: Tensor, s: Tensor | None, fmt: str) -> Bank | None:
    """A Bank of 2-D [N, K] or stacked [G, N, K] weights, or None when the GEMM does not take
    this format / layout."""
    if fmt not in WFMT or s is None or w.dim() not in (2, 3) or s.dim() != w.dim():
        return None
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    s3 = s if s.dim() == 3 else s.unsqueeze(0)
    if w3.stride(-1) != 1 or s3.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        return None
    n = w3.shape[1]
    if fmt == "mxfp4":
        if w3.dtype not in (torch.int8, torch.uint8):
            return None
        k = w3.shape[2] * 2
        if tuple(s3.shape[1:]) != (n, k // 32):
            return None
        bn, bk = 1, 32
    else:
        if w3.dtype != torch.float8_e4m3fn:
            return None
        from megagraph.kernels import formats

        k = w3.shape[2]
        try:
            bn, bk = formats.infer_block_size((n, k), tuple(s3.shape[1:]))
        except ValueError:
            return None
        if bk & (bk - 1) or bn & (bn - 1) or bk < 32:
            return None
    if k % 128:
        return None
    s3 = s3.view(torch.uint8)
    return Bank(w3, s3 if s3.stride(-1) == 1 else s3.contiguous(), WFMT[fmt], bn, bk, n, k)


# ---------------------------------------------------------------------------------------------
# the GEMM launcher
# ---------------------------------------------------------------------------------------------


def _mma_for(a_dtype: torch.dtype, b: Bank, bk: int) -> int:
    if EXACT or a_dtype == torch.float32:
        return MMA_F32 if (INTERPRET or a_dtype == torch.float32) else MMA_BF16
    if a_dtype == torch.float8_e4m3fn:
        if b.wfmt == 0 or b.bk >= bk:
            return MMA_FP8
        return MMA_FP16
    return MMA_FP16  # fp16 A (H)


def tile_list(counts: Tensor, bm: int, max_tiles: int) -> Tensor:
    """The non-empty row tiles of a grouped GEMM, built on the device from the per-group counts
    (moe_tile_list: int32 [1 + 3 * max_tiles], the total first; no host sync)."""
    jit = _jit()
    G = counts.numel()
    if max_tiles == 0:
        return torch.zeros(1, dtype=torch.int32, device=counts.device)
    work = torch.empty(1 + 3 * max_tiles, dtype=torch.int32, device=counts.device)
    bt = 32
    jit.moe_tile_list[(-(-max_tiles // bt),)](counts, work, G, max_tiles, BM=bm,
                                              G_PAD=_next_pow2(G), BT=bt, num_warps=4)
    return work


def gemm(a: Tensor, a_scale: Tensor | None, b1: Bank, out: Tensor, *, b2: Bank | None = None,
         role: str, rows_per_group: float, counts: Tensor | None = None,
         a_idx: Tensor | None = None, c_idx: Tensor | None = None, row_w: Tensor | None = None,
         topk: int = 1, ks: int = 1, m: int | None = None, max_tiles: int | None = None,
         limit: float | None = None, batched: bool = False,
         a_group_stride: int = 0, as_group_stride: int = 0, c_group_stride: int = 0,
         tiles: Tensor | None = None, out_scale: Tensor | None = None) -> Tensor:
    """One moe_gemm launch. a [R, K] (fp8 with a_scale [R, K/128] f32, fp16, or fp32);
    out [rows, N] rows (stride(0) = row stride; a view is fine). Grouped when `counts` is given
    (rows sorted by group, `max_tiles` row tiles), else dense over m rows (x G groups with
    per-group offsets when `batched`). Grouped with a persistent config: moe_gemm_persistent
    over `tiles` (tile_list of counts at this config's bm; built here when not given).
    out_scale (the FP8-H L1): out is e4m3 and gets the codes, out_scale [rows, N/128] f32 the
    power-of-two scale of each row's 128 columns (moe_jit.quantize_out)."""
    jit = _jit()
    cfg = pick_config(role, rows_per_group)
    if out_scale is not None:
        _check_quant_out(cfg, b1, out, out_scale, batched)
    if counts is not None and cfg.persistent > 0:
        return _gemm_persistent(a, a_scale, b1, out, cfg, b2=b2, counts=counts, a_idx=a_idx,
                                c_idx=c_idx, row_w=row_w, topk=topk, ks=ks, max_tiles=max_tiles,
                                limit=limit, tiles=tiles, out_scale=out_scale)
    bk = cfg.bk
    K = b1.k
    if K % bk or (a_scale is not None and 128 % bk):
        raise ValueError(f"K {K} and the chunk {bk} do not fit")
    mma = _mma_for(a.dtype, b1, bk)
    nsub = bk // min(bk, b1.bk)
    N = b1.n
    bn = cfg.bn if out_scale is not None else max(16, min(cfg.bn, _next_pow2(N)))
    bm = cfg.bm
    num_n = -(-N // bn)
    G = b1.groups
    grouped = counts is not None
    if grouped:
        grid = (max_tiles * num_n, 1)
    else:
        grid = (-(-m // bm) * num_n, G if batched else 1)
    if grid[0] == 0:
        return out
    dummy = out
    b2 = b2 or b1
    jit.moe_gemm[grid](
        a, a_scale if a_scale is not None else dummy, a_idx if a_idx is not None else dummy,
        b1.w, b1.s, b2.w, b2.s, out, c_idx if c_idx is not None else dummy,
        row_w if row_w is not None else dummy, counts if counts is not None else dummy,
        m or 0, N, K, G, float(limit or 0.0),
        a.stride(0), a_scale.stride(0) if a_scale is not None else 0, a_group_stride,
        as_group_stride, b1.w.stride(0), b1.w.stride(1), b1.s.stride(0), b1.s.stride(1),
        out.stride(0), c_group_stride,
        out_scale if out_scale is not None else dummy,
        out_scale.stride(0) if out_scale is not None else 0,
        TOPK=topk, KS=ks, GROUPED=grouped, GATHER_A=a_idx is not None,
        SCATTER_C=c_idx is not None, WEIGHTED=row_w is not None, SWIGLU=b2 is not b1,
        HAS_LIMIT=limit is not None and limit > 0, A_SCALED=a_scale is not None,
        WFMT=b1.wfmt, MMA=mma, BLK_N_S=b1.bn, BLK_K_S=b1.bk, NSUB=nsub,
        USE_ASM=b1.wfmt == 0 and mma in (MMA_FP8, MMA_FP16) and asm_ok(out.device),
        MANUAL=INTERPRET, PAR=cfg.par and b1.wfmt == 0 and mma in (MMA_FP8, MMA_FP16),
        BM=bm, BN=bn, BK=bk, G_PAD=_next_pow2(G) if grouped else 1,
        QUANT_OUT=out_scale is not None, QSPLIT=cfg.qsplit if out_scale is not None else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"FUSE": 1} if _fuse_ok(cfg, b1, b2, mma, out_scale) else {}),
        **({"SWAP": 1} if _swap_ok(cfg, b1, mma, out_scale) else {}))
    return out


def _swap_ok(cfg: GemmConfig, b1: Bank, mma: int, out_scale: Tensor | None) -> bool:
    """GemmConfig.swap applies: MXFP4 weights (E8M0 per 32 columns of one row) with the fp8 /
    fp16 MMA, a 128-column K chunk, not fused (fuse wins); a quantized output (the FP8-H L1)
    only unsplit (qsplit 1: moe_tile's QSPLIT = 2 path has its own K loops). The FP8-H L2 (E4M3
    H with per-128 scales, A_SCALED) is the fp8 MMA: QGMMA m64n16 on the E4M3 W2 tile. SWAP is
    passed only when on, so the default launch compiles the same kernel as before the option
    existed."""
    return (cfg.swap and not cfg.fuse and b1.wfmt == 0 and b1.bn == 1 and b1.bk == 32
            and mma in (MMA_FP8, MMA_FP16) and cfg.bk == 128
            and (out_scale is None or cfg.qsplit == 1))


def _fuse_ok(cfg: GemmConfig, b1: Bank, b2: Bank, mma: int, out_scale: Tensor | None) -> bool:
    """GemmConfig.fuse applies: the SwiGLU GEMM (two weight banks) on MXFP4 (E8M0 per 32 columns
    of one row) with the fp8 / fp16 MMA, a 128-column K chunk, no quantized output (moe_tile's
    QSPLIT path) and a power-of-two tile. FUSE is passed only when on, so the default launch
    compiles the same kernel as before the option existed."""
    return (cfg.fuse and b2 is not b1 and b1.wfmt == 0 and b1.bn == 1 and b1.bk == 32
            and mma in (MMA_FP8, MMA_FP16) and cfg.bk == 128 and out_scale is None)


def _check_quant_out(cfg: GemmConfig, b1: Bank, out: Tensor, out_scale: Tensor,
                     batched: bool) -> None:
    """The FP8-H epilogue's preconditions: whole 128-column blocks per tile, e4m3 codes, f32
    scales of one row per output row."""
    if cfg.bn % 128 or b1.n % 128 or batched:
        raise ValueError(f"quantized output needs bn ({cfg.bn}) and N ({b1.n}) multiples of 128 "
                         "and no batched groups")
    if cfg.qsplit not in (1, 2) or (cfg.qsplit == 2 and cfg.bn != 128):
        raise ValueError(f"qsplit {cfg.qsplit}: 1, or 2 with bn 128 (two 64-column halves)")
    if (out.dtype != torch.float8_e4m3fn or out_scale.dtype != torch.float32
            or out_scale.shape[-1] != b1.n // 128 or out_scale.stride(-1) != 1
            or out.stride(-1) != 1):
        raise ValueError("quantized output: out e4m3 [rows, N], out_scale f32 [rows, N / 128]")


def _gemm_persistent(a, a_scale, b1: Bank, out, cfg: GemmConfig, *, b2, counts, a_idx, c_idx,
                     row_w, topk, ks, max_tiles, limit, tiles, out_scale=None) -> Tensor:
    """The grouped moe_gemm as moe_gemm_persistent: min(persistent x SMs, worst-case items)
    programs (static: CUDA-graph capturable), same tile, flags and numerics."""
    jit = _jit()
    bk, bm = cfg.bk, cfg.bm
    K, N = b1.k, b1.n
    if K % bk or (a_scale is not None and 128 % bk):
        raise ValueError(f"K {K} and the chunk {bk} do not fit")
    mma = _mma_for(a.dtype, b1, bk)
    bn = cfg.bn if out_scale is not None else max(16, min(cfg.bn, _next_pow2(N)))
    items = max_tiles * -(-N // bn)
    if items == 0:
        return out
    if tiles is None:
        tiles = tile_list(counts, bm, max_tiles)
    grid = (min(items, cfg.persistent * num_sms(out.device.index or 0)),)
    dummy = out
    b2 = b2 or b1
    jit.moe_gemm_persistent[grid](
        a, a_scale if a_scale is not None else dummy, a_idx if a_idx is not None else dummy,
        b1.w, b1.s, b2.w, b2.s, out, c_idx if c_idx is not None else dummy,
        row_w if row_w is not None else dummy, tiles, max_tiles, N, K, float(limit or 0.0),
        a.stride(0), a_scale.stride(0) if a_scale is not None else 0, b1.w.stride(0),
        b1.w.stride(1), b1.s.stride(0), b1.s.stride(1), out.stride(0),
        out_scale if out_scale is not None else dummy,
        out_scale.stride(0) if out_scale is not None else 0,
        TOPK=topk, KS=ks, GATHER_A=a_idx is not None, SCATTER_C=c_idx is not None,
        WEIGHTED=row_w is not None, SWIGLU=b2 is not b1,
        HAS_LIMIT=limit is not None and limit > 0, A_SCALED=a_scale is not None,
        WFMT=b1.wfmt, MMA=mma, BLK_N_S=b1.bn, BLK_K_S=b1.bk, NSUB=bk // min(bk, b1.bk),
        USE_ASM=b1.wfmt == 0 and mma in (MMA_FP8, MMA_FP16) and asm_ok(out.device),
        MANUAL=INTERPRET, PAR=cfg.par and b1.wfmt == 0 and mma in (MMA_FP8, MMA_FP16),
        BM=bm, BN=bn, BK=bk, QUANT_OUT=out_scale is not None,
        QSPLIT=cfg.qsplit if out_scale is not None else 1, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


# ---------------------------------------------------------------------------------------------
# router and permutation
# ---------------------------------------------------------------------------------------------

SCORES = {"sqrtsoftplus": 0, "softmax": 1, "sigmoid": 2}


def route_ids(x: Tensor, gate_w: Tensor, bias: Tensor | None, *, topk: int, route_scale: float,
              norm_topk: bool, score_func: str, tid2eid: Tensor | None = None,
              token_ids: Tensor | None = None, counts: Tensor | None = None,
              ids64: bool = False) -> tuple[Tensor, Tensor]:
    """(ids [T, k] i32 (i64 if ids64), weights [T, k] f32); counts (i32 [E], zeroed) gets the
    expert histogram when given."""
    jit = _jit()
    T, D = x.shape
    E = gate_w.shape[0]
    dev = x.device
    ids = torch.empty(T, topk, dtype=torch.int64 if ids64 else torch.int32, device=dev)
    wts = torch.empty(T, topk, dtype=torch.float32, device=dev)
    if T == 0:
        return ids, wts
    small = T <= 256 or INTERPRET
    bm = 16 if small else int(GATE_BM)
    be = 64 if small else int(GATE_BE)
    bk = 64
    split = _gate_split(-(-T // bm) * -(-E // be), D, bk)
    scores = torch.empty(split, T, E, dtype=torch.float32, device=dev)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gw = gate_w if gate_w.stride(-1) == 1 else gate_w.contiguous()
    if INTERPRET or x.dtype == torch.float32 or x.dtype != torch.bfloat16:
        mode = 2
    else:
        mode = 0 if gw.dtype == torch.bfloat16 else 1
        if gw.dtype not in (torch.bfloat16, torch.float32):
            mode = 2
    jit.gate_scores[(-(-T // bm), -(-E // be), split)](
        x, gw, scores, T, E, D, D // split, x.stride(0), gw.stride(0), scores.stride(1),
        scores.stride(0), MODE=mode, BM=bm, BE=be, BK=bk,
        num_warps=4 if small else int(GATE_WARPS), num_stages=3 if small else int(GATE_STAGES))
    hashed = tid2eid is not None
    bmk = 8
    jit.route_topk[(-(-T // bmk),)](
        scores, bias if bias is not None else scores, ids, wts,
        counts if counts is not None else ids, tid2eid if hashed else ids,
        token_ids if hashed else ids, T, E, float(route_scale), scores.stride(1),
        scores.stride(0), SPLIT=split, TOPK=topk, K_PAD=_next_pow2(max(topk, 2)), SCORE=SCORES[score_func],
        HAS_BIAS=bias is not None, NORM=bool(norm_topk), HASH=hashed, COUNT=counts is not None,
        IDS64=ids64, BM=bmk, E_PAD=_next_pow2(E), num_warps=4)
    return ids, wts


def _gate_split(programs: int, D: int, bk: int) -> int:
    """K slices of the router's gate GEMM: enough for ~128 programs when few tokens give few
    (64 tokens x 384 experts: 24 tiles of 16 x 64 each streaming all 5120 columns, 30 us on the
    H200 for 4 MB of weights), each slice a multiple of bk; 1 when the tiles fill the GPU."""
    split = 1
    while programs * split * 2 <= 128 and D % (split * 2 * bk) == 0 and split < 8:
        split *= 2
    return split


def permute(ids: Tensor, counts: Tensor, E: int) -> Tensor:
    """Expert-sorted pair list (i32 [P]) from flat ids [P] and their histogram counts [E]."""
    jit = _jit()
    P = ids.numel()
    srt = torch.empty(P, dtype=torch.int32, device=ids.device)
    cur = torch.empty(E, dtype=torch.int32, device=ids.device)
    jit.moe_plan[(1,)](counts, cur, E, E_PAD=_next_pow2(E), num_warps=4)
    bp = 256
    jit.moe_scatter[(-(-P // bp),)](ids, cur, srt, P, E, BP=bp, num_warps=4)
    return srt


def sorted_rows(a: Tensor, a_idx: Tensor, topk: int) -> Tensor:
    """[P, K] copy of a's rows in expert-sorted order: row r = a[a_idx[r] // topk] (the A the
    warp-specialized L1 streams by TMA), by moe_gather_rows in 32-bit words where the rows allow
    (K bytes and the row stride multiples of 4, a 4-byte aligned base; 16-byte accesses when
    they are multiples of 16), else index_select."""
    P, K = a_idx.numel(), a.shape[1]
    nbytes = K * a.element_size()
    out = torch.empty(P, K, dtype=a.dtype, device=a.device)
    if not (A_PREP_TRITON and on_device(a) and nbytes % 4 == 0 and a.stride(1) == 1
            and (a.stride(0) * a.element_size()) % 4 == 0 and a.data_ptr() % 4 == 0):
        return torch.index_select(a, 0, torch.div(a_idx, topk, rounding_mode="floor"),
                                  out=out)
    if P == 0:
        return out
    src = a.view(torch.uint8).view(torch.int32)  # any dtype's rows as 32-bit words
    W = nbytes // 4
    bw = 256 if W % 256 == 0 else min(256, _next_pow2(W))
    br = max(1, 2048 // bw)
    _jit().moe_gather_rows[(-(-P // br),)](
        src, a_idx, out.view(torch.uint8).view(torch.int32), P, W, src.stride(0), W, TOPK=topk,
        BR=br, BW=bw, num_warps=4)
    return out


def tile_scales(a_scale: Tensor, a_idx: Tensor, topk: int, tiles: Tensor, max_tiles: int,
                kc: int, bm: int) -> Tensor:
    """[kc, max_tiles bm] f32: column j bm + r = the A scales (chunks 0..kc-1) of row r of tile j
    of tile_list's device list (sorted row row0_j + r, token a_idx[...] // topk), 0 past the
    tile's rows and past the list: each tile's scales start 16-byte aligned (the
    warp-specialized L1's STMA boxes). One launch, no host sync (CUDA-graph capturable)."""
    if not (A_PREP_TRITON and on_device(a_scale)):
        return _tile_scales_torch(a_scale, a_idx, topk, tiles, max_tiles, kc, bm)
    out = torch.empty(kc, max_tiles * bm, dtype=torch.float32, device=a_scale.device)
    if max_tiles == 0:
        return out
    _jit().moe_tile_scales[(max_tiles,)](
        a_scale, a_idx, tiles, out, max_tiles, a_idx.numel(), kc, a_scale.stride(0), TOPK=topk,
        BM=bm, KC_PAD=_next_pow2(kc), num_warps=4)
    return out


def _tile_scales_torch(a_scale: Tensor, a_idx: Tensor, topk: int, tiles: Tensor, MT: int,
                       kc: int, bm: int) -> Tensor:
    """tile_scales in torch ops (where Triton does not run, and A_PREP_TRITON off): 17
    launches, 159 us at 8192 tokens on the H200 (ncu, sixteenth session; the kernel: 10 us)."""
    dev = a_scale.device
    P = a_idx.numel()
    row0 = tiles[1 + MT:1 + 2 * MT].long()
    rend = tiles[1 + 2 * MT:1 + 3 * MT].long()
    idx = row0[:, None] + torch.arange(bm, device=dev)[None, :]
    ok = (idx < rend.clamp(max=P)[:, None]) & (idx >= 0) & \
        (torch.arange(MT, device=dev)[:, None] < tiles[0].long())
    src = torch.div(a_idx.index_select(0, idx.clamp(0, max(P - 1, 0)).flatten()), topk,
                    rounding_mode="floor")
    sa = a_scale[:, :kc].float().index_select(0, src) * ok.flatten()[:, None]
    return sa.t().contiguous()


def routed_experts(x_q: Tensor, x_scale: Tensor, ids: Tensor, wts: Tensor, counts: Tensor,
                   w1: Bank, w3: Bank, w2: Bank, y: Tensor, *, topk: int,
                   swiglu_limit: float | None, fp8_h: bool | None = None) -> Tensor:
    """Y[t, j] = wts[t, j] * E_{ids[t, j]}(x[t]) for every pair, into y [T, KS, d] (KS >= topk).
    fp8_h: H as E4M3 + per-(row, 128 columns) scales written by L1's epilogue, L2 on the FP8 MMA
    (roles "l1_fp8h" / "l2_fp8h"), or H in fp16 (False); None: FP8 H where FP8_H says so (every
    size), else where FP8_H_PREFILL picks it: prefill sizes where both warp-specialized FP8-H
    kernels take the call (tried first with an E4M3 H; fp16 H if either does not)."""
    T = x_q.shape[0]
    P = T * topk
    E = w1.groups
    srt = permute(ids.reshape(-1), counts, E)
    rpg = P / max(1, min(E, P))
    auto = fp8_h is None and not FP8_H and _prefill_fp8_h_may(x_q, rpg)
    fp8_h = auto or (FP8_H if fp8_h is None else bool(fp8_h))
    h, h_scale, gluon, gluon2 = _h_and_kernels(x_q, x_scale, w1, w3, w2, y, P, rpg, fp8_h)
    if auto and (gluon is None or gluon2 is None):  # the ws FP8-H kernels do not take it
        fp8_h = False
        h, h_scale, gluon, gluon2 = _h_and_kernels(x_q, x_scale, w1, w3, w2, y, P, rpg, False)
    r1, r2 = ("l1_fp8h", "l2_fp8h") if fp8_h else ("l1", "l2")
    cfg1 = pick_config(r1, rpg)
    mt1 = min(P, P // cfg1.bm + E)
    tiles1 = tile_list(counts, cfg1.bm, mt1) if cfg1.persistent else None
    shared_tiles = None  # one device tile list for both Gluon decode kernels (same row tile)
    if gluon is not None and gluon2 is not None and gluon[1] == gluon2[1]:
        shared_tiles = tile_list(counts, gluon[1], min(P, P // gluon[1] + E))
    if gluon is not None:
        launch, rows = gluon
        launch(x_q, x_scale, srt, w1, w3, counts, h, topk=topk,
               max_tiles=min(P, P // rows + E), limit=swiglu_limit, tiles=shared_tiles)
    elif _cublas_prefill(x_q, w1, w3, h, r1, rpg):
        from megagraph.kernels.moe import grouped_cublas as moe_grouped_cublas

        moe_grouped_cublas.l1_swiglu(x_q, x_scale, srt, w1, w3, counts, h, topk=topk,
                                     limit=swiglu_limit)
    else:
        gemm(x_q, x_scale, w1, h, b2=w3, role=r1, rows_per_group=rpg, counts=counts,
             a_idx=srt, topk=topk, max_tiles=mt1, limit=swiglu_limit, tiles=tiles1,
             out_scale=h_scale)
    cfg2 = pick_config(r2, rpg)
    ks = y.shape[1]
    mt2 = min(P, P // cfg2.bm + E)
    tiles2 = tiles1 if (tiles1 is not None and cfg2.bm == cfg1.bm) else None  # one list for both
    if gluon2 is not None:
        launch, rows = gluon2
        launch(h, w2, counts, srt, wts.reshape(-1), y.view(T * ks, -1), topk=topk, ks=ks,
               max_tiles=min(P, P // rows + E), tiles=shared_tiles)
    else:
        gemm(h, h_scale, w2, y.view(T * ks, -1), role=r2, rows_per_group=rpg, counts=counts,
             c_idx=srt, row_w=wts.reshape(-1), topk=topk, ks=ks, max_tiles=mt2, tiles=tiles2)
    return y


def _prefill_fp8_h_may(x_q: Tensor, rows_per_group: float) -> bool:
    """Whether routed_experts tries FP8 H by default (FP8_H_PREFILL): prefill sizes (>
    WIDE_L1_MIN_ROWS rows per expert) where the warp-specialized kernels can run (sm_90 with
    Gluon). The cheap gate before an E4M3 H is allocated; the kernels' own pickers decide."""
    if not FP8_H_PREFILL or rows_per_group <= WIDE_L1_MIN_ROWS:
        return False
    from megagraph.kernels.moe import gluon_ws as mw

    return mw.available(x_q.device)


def _shared_fp8_h_may(x_q: Tensor, rows_per_group: float) -> bool:
    """Whether mega_moe tries the shared expert with FP8 H (shared_expert_fp8h): SHARED_FP8_H
    on and the routed experts' H is E4M3 at this size (FP8_H, or FP8_H_PREFILL's gate) - one
    numerics decision for all the layer's experts."""
    return SHARED_FP8_H and (FP8_H or _prefill_fp8_h_may(x_q, rows_per_group))


def _h_and_kernels(x_q: Tensor, x_scale: Tensor | None, w1: Bank, w3: Bank, w2: Bank,
                   y: Tensor, P: int, rows_per_group: float, fp8_h: bool):
    """routed_experts' H (E4M3 + f32 scales per 128 columns with fp8_h, else fp16 / fp32 and
    no scales) and the Gluon kernels that take its L1 / L2 (_gluon_l1 / _gluon_l2: (launch,
    row tile) or None)."""
    F = w1.n
    h_scale = None
    if fp8_h:
        h = torch.empty(P, F, dtype=torch.float8_e4m3fn, device=x_q.device)
        h_scale = torch.empty(P, F // 128, dtype=torch.float32, device=x_q.device)
    else:
        h_dtype = torch.float32 if (EXACT or x_q.dtype == torch.float32) else torch.float16
        h = torch.empty(P, F, dtype=h_dtype, device=x_q.device)
    r1, r2 = ("l1_fp8h", "l2_fp8h") if fp8_h else ("l1", "l2")
    return (h, h_scale, _gluon_l1(x_q, x_scale, w1, w3, h, r1, rows_per_group, h_scale),
            _gluon_l2(h, w2, y, r2, rows_per_group, h_scale))


def _gluon_l1(x_q: Tensor, x_scale: Tensor | None, w1: Bank, w3: Bank, h: Tensor,
              role: str, rows_per_group: float, h_scale: Tensor | None = None):
    """(launch, row tile) of the Gluon kernel that runs routed_experts' L1 instead of moe_gemm,
    or None.
    Prefill (> WIDE_L1_MIN_ROWS = 100 rows per expert): the warp-specialized kernel with
    persistent CTAs (GLUON_WS_L1, default: 7.90 ms at 8192 tokens on the H200 at 64 columns, 6.21
    ms at WS_L1_BN = 128 with A by TMA and two upcast partitions), else the decode
    kernel with 64-token tiles and its weights by TMA (GLUON_WIDE_L1, default: 8.30 ms against the
    cuBLAS grouped L1's 9.20); above 48 rows with GLUON_PREFILL (opt-in, first): moe_gluon, the
    hand-pipelined
    128 x 64 tile (timed on the H200 at ~128 rows, sixth session: 8.54 -> 7.31 ms at 8192
    tokens, rel. diff 2.5e-4 to the Triton L1, both 2.3e-4 to fp32 math:
    benchmarks/results/moe-gluon-h200.md). Decode (<= 12 rows per expert, GLUON_DECODE):
    moe_gluon_decode, the swapped wgmma with the upcast weights as a register operand (1.66 ->
    1.11 ms at 64 tokens, same file). Both need the fp16-H role
    with E4M3 activations on MXFP4 banks whose shapes fit the tile, MEGAGRAPH_MOE_GLUON not "0",
    no CONFIG_OVERRIDE for the role (tests and sweeps pin the Triton tile), and Gluon's sm_90
    APIs importable (available(): Triton 3.6, CUDA sm_90). Anything else keeps moe_gemm; the
    middle range (12 < rows <= 48) too (not timed). FP8 H (role "l1_fp8h", h E4M3 + h_scale):
    the warp-specialized kernel's 128-column tile with A by TMA quantizes H in its epilogue
    (moe_gluon_ws.l1_gluon_ws(out_scale=...)) where it applies, else moe_gemm."""
    if role == "l1_fp8h" and h_scale is not None:
        return _gluon_l1_fp8h(x_q, x_scale, w1, w3, h, h_scale, rows_per_group)
    if not GLUON or role != "l1" or role in CONFIG_OVERRIDE:
        return None
    if x_q.dtype != torch.float8_e4m3fn or x_scale is None or h.dtype != torch.float16:
        return None
    if not _mxfp4_e8m0_32(w1, w3):
        return None
    if rows_per_group > 48 and GLUON_PREFILL:
        from megagraph.kernels.moe import gluon_l1 as mod

        ok = w1.n % mod.BN == 0 and w1.k % (2 * mod.BK) == 0
        pick = (mod.l1_gluon, mod.BM)
    elif (rows_per_group > WIDE_L1_MIN_ROWS and GLUON_WS_L1
          and _ws_fits(x_q, x_scale, w1, w3, h)):
        from megagraph.kernels.moe import gluon_ws as mod

        ok = True
        wide = int(WS_L1_BN) == mod.BN_WIDE and w1.n % mod.BN_WIDE == 0
        pick = (_ws_l1_launch(w1, w3, wide, a_tma=WS_WIDE_A_TMA if wide else WS_A_TMA),
                mod.BM)
    elif rows_per_group > WIDE_L1_MIN_ROWS and GLUON_WIDE_L1:
        from megagraph.kernels.moe import gluon_decode as mod

        ok = (w1.n % mod.BW == 0 and w1.k % mod.BK == 0 and w1.k // mod.BK <= 256
              and mod._tma_fits(w1) and mod._tma_fits(w3))
        pick = (functools.partial(mod.l1_gluon_decode, bt=WIDE_BT, load="tma"), WIDE_BT)
    elif rows_per_group <= 12 and GLUON_DECODE:
        from megagraph.kernels.moe import gluon_decode as mod

        ok = w1.n % mod.BW == 0 and w1.k % mod.BK == 0 and w1.k // mod.BK <= 256
        pick = (mod.l1_gluon_decode, mod.BT)
    else:
        return None
    return pick if ok and mod.available(x_q.device) else None


def _gluon_l1_fp8h(x_q: Tensor, x_scale: Tensor | None, w1: Bank, w3: Bank, h: Tensor,
                   h_scale: Tensor, rows_per_group: float):
    """_gluon_l1's FP8-H case: (launch, 128) of the warp-specialized L1 writing E4M3 H and its
    scales (the 128-column tile, A by TMA, row frames where they apply: the fp16-H default's
    schedule) at prefill sizes (> WIDE_L1_MIN_ROWS rows per expert, GLUON_WS_L1 and
    GLUON_WS_L2_FP8), or None (moe_gemm's FP8-H epilogue runs)."""
    if not (GLUON and GLUON_WS_L1 and GLUON_WS_L2_FP8) or "l1_fp8h" in CONFIG_OVERRIDE:
        return None
    if rows_per_group <= WIDE_L1_MIN_ROWS or x_q.dtype != torch.float8_e4m3fn or \
            x_scale is None or not _mxfp4_e8m0_32(w1, w3):
        return None
    from megagraph.kernels.moe import gluon_ws as mod

    if w1.n % mod.BN_WIDE or not mod.available(x_q.device) or \
            mod.args_problem(x_q, x_scale, w1, w3, None, h, mod.BN_WIDE) or \
            mod._fp8_h_problem(h, h_scale, h.shape[0], w1.n):
        return None
    return _ws_l1_launch(w1, w3, True, a_tma=True, out_scale=h_scale), mod.BM


def _ws_l1_launch(w1: Bank, w3: Bank, wide: bool, **kw):
    """moe_gluon_ws.l1_gluon_ws as routed_experts launches it, fp16 H or FP8 H: persistent CTAs,
    the tile's rings (WS_WIDE_* on the 128-column tile, WS_* on the 64-column one), row frames
    on the 128-column tile where WS_L1_FRAMES and the weights allow; kw: the rest (a_tma,
    out_scale)."""
    from megagraph.kernels.moe import gluon_ws as mod

    rings = (WS_WIDE_STAGES, WS_WIDE_BSTAGES) if wide else (WS_STAGES, WS_BSTAGES)
    frames = mod.row_frames(w1, w3) if wide and WS_L1_FRAMES else None
    return functools.partial(mod.l1_gluon_ws, persist=True, stages=rings[0], bstages=rings[1],
                             bn=mod.BN_WIDE if wide else mod.BN, frames=frames, **kw)


def _ws_fits(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank, h: Tensor) -> bool:
    """l1_gluon_ws can run here and takes these arguments (its own checks,
    moe_gluon_ws.args_problem): False falls through to the wide decode L1 instead of an error
    at launch."""
    from megagraph.kernels.moe import gluon_ws as mw

    return mw.available(x_q.device) and mw.args_problem(x_q, x_scale, w1, w3, None, h) is None


def _cublas_prefill(x_q: Tensor, w1: Bank, w3: Bank, h: Tensor, role: str,
                    rows_per_group: float) -> bool:
    """routed_experts' L1 on cuBLAS's grouped FP8 GEMM (moe_grouped_cublas, the experts upcast per
    call: mega_moe 15.78 -> 14.56 ms at 8192 tokens on the H200): CUBLAS_PREFILL on, the
    fp16-H role without a CONFIG_OVERRIDE (tests and sweeps pin the Triton tile), and what
    moe_grouped_cublas.applies checks (prefill sizes, formats, its device check)."""
    if not CUBLAS_PREFILL or role != "l1" or role in CONFIG_OVERRIDE:
        return False
    from megagraph.kernels.moe import grouped_cublas as moe_grouped_cublas

    return moe_grouped_cublas.applies(x_q, w1, w3, h, rows_per_group)


def triton_l2(h: Tensor, w2: Bank, counts: Tensor, srt: Tensor, wts: Tensor,
              y: Tensor) -> Tensor:
    """The Triton L2 as routed_experts launches it with fp16 H (moe.gemm role "l2": y [T, ks, d]
    row (p // topk) * ks + p % topk = wts[p] x H[r] W2^T for sorted row r, p = srt[r]): the
    baseline the Gluon decode L2 is tested and timed against."""
    T, k = wts.shape
    P, E = T * k, counts.numel()
    rpg = P / max(1, min(E, P))
    mt2 = min(P, P // pick_config("l2", rpg).bm + E)
    return gemm(h, None, w2, y.view(T * y.shape[1], -1), role="l2", rows_per_group=rpg,
                counts=counts, c_idx=srt, row_w=wts.reshape(-1), topk=k, ks=y.shape[1],
                max_tiles=mt2)


def _gluon_l2(h: Tensor, w2: Bank, y: Tensor, role: str, rows_per_group: float,
              h_scale: Tensor | None = None):
    """(launch, row tile) of the Gluon kernel that runs routed_experts' L2 instead of moe_gemm,
    or None: the decode L2 (moe_gluon_decode_l2.l2_gluon_decode: swapped fp16 wgmma, the MXFP4
    W2 upcast in registers) at <= 12 rows per expert, fp16 H (not FP8-H), an MXFP4 W2 whose
    shape fits the tile (d % 64, F % 128), y fp32 / bf16 / fp16, MEGAGRAPH_MOE_GLUON and
    MEGAGRAPH_MOE_GLUON_DECODE_L2 on, no CONFIG_OVERRIDE for the role, available(). Above 48
    rows per expert with GLUON_PREFILL_L2 (opt-in): the prefill L2 (moe_gluon_l2.l2_gluon,
    128 x 128 tiles, d % 128, F % 384); with GLUON_PREFILL_L2_WS too (default on) its
    warp-specialized twin moe_gluon_l2_ws.l2_gluon_ws where the call fits its TMA streams
    (256-column tiles where d % 256 == 0). FP8 H (role "l2_fp8h"): above WIDE_L1_MIN_ROWS rows
    per expert with GLUON_WS_L2_FP8, the warp-specialized L1 kernel runs the down GEMM
    (moe_gluon_l2_fp8.l2_gluon_ws_fp8) where its args_problem passes; else moe_gemm."""
    if role == "l2_fp8h" and h_scale is not None:
        return _gluon_l2_fp8h(h, h_scale, w2, y, rows_per_group)
    if not GLUON or role != "l2" or role in CONFIG_OVERRIDE:
        return None
    if h.dtype != torch.float16 or not _mxfp4_e8m0_32(w2):
        return None
    if rows_per_group > 48 and GLUON_PREFILL_L2:
        from megagraph.kernels.moe import gluon_l2 as mod

        if w2.n % mod.BN or w2.k % (mod.NS * mod.BK) or y.dtype not in mod.OUT_DTYPES:
            return None
        if GLUON_PREFILL_L2_WS:
            from megagraph.kernels.moe import gluon_l2_ws as mws

            # int(): moe_ab.py sets knobs as strings
            for bn in ([int(WS_L2_BN)] if WS_L2_BN else [2 * mws.BN, mws.BN]):
                if mws.available(h.device) and mws.args_problem(h, w2, y, bn) is None:
                    ns, nu = WS_L2_RINGS or (None, None)
                    kw = dict(stages=ns, bstages=nu) if WS_L2_RINGS else {}
                    return (functools.partial(mws.l2_gluon_ws, **kw, bn=bn), mws.BM)
        return (mod.l2_gluon, mod.BM) if mod.available(h.device) else None
    if rows_per_group > 12 or not GLUON_DECODE_L2:
        return None
    from megagraph.kernels.moe import gluon_decode_l2 as mod

    if w2.n % mod.BW or w2.k % mod.BK or y.dtype not in mod.OUT_DTYPES:
        return None
    return (mod.l2_gluon_decode, mod.BT) if mod.available(h.device) else None


def _gluon_l2_fp8h(h: Tensor, h_scale: Tensor, w2: Bank, y: Tensor, rows_per_group: float):
    """_gluon_l2's FP8-H case: (launch with l2_gluon_ws's arguments, 128) or None."""
    if not (GLUON and GLUON_WS_L2_FP8) or "l2_fp8h" in CONFIG_OVERRIDE or \
            rows_per_group <= WIDE_L1_MIN_ROWS or not _mxfp4_e8m0_32(w2):
        return None
    from megagraph.kernels.moe import gluon_l2_fp8 as mod

    if not mod.available(h.device) or \
            mod.args_problem(h, h_scale, w2, y.view(-1, y.shape[-1])) is not None:
        return None

    def launch(h, w2, counts, srt, wts, y, **kw):
        return mod.l2_gluon_ws_fp8(h, h_scale, w2, counts, srt, wts, y, **kw)

    return launch, mod.BM


def _mxfp4_e8m0_32(*banks: Bank) -> bool:
    """MXFP4 banks with one E8M0 exponent per 32 columns of a row (what the Gluon kernels read)."""
    return all(b.wfmt == 0 and b.bk == 32 and b.bn == 1 for b in banks)


def shared_expert(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank, w2: Bank, out: Tensor, *,
                  swiglu_limit: float | None) -> Tensor:
    """out [T, d] (a strided view is fine) = W2 (silu(min(W1 x, lim)) * clamp(W3 x)) (dense)."""
    T = x_q.shape[0]
    h_dtype = torch.float32 if (EXACT or x_q.dtype == torch.float32) else torch.float16
    y13 = _cublas_l1(x_q, x_scale, w1, w3)
    w2b = _bf16_w2(w2) if y13 is not None else None
    if w2b is not None:
        h_dtype = torch.bfloat16  # the bf16 GEMM's operand (the fp16 H of the Triton L2 below)
    h = torch.empty(T, w1.n, dtype=h_dtype, device=x_q.device)
    if y13 is not None:  # [W1; W3] as one cuBLAS GEMM (fp32 out), then the SwiGLU + clamp
        bf = 1024
        _jit().swiglu_rows[(T, -(-w1.n // bf))](
            y13, h, w1.n, float(swiglu_limit or 0.0), y13.stride(0), h.stride(0),
            HAS_LIMIT=swiglu_limit is not None and swiglu_limit > 0, BF=bf, num_warps=4)
    else:
        gemm(x_q, x_scale, w1, h, b2=w3, role="dense_swiglu", rows_per_group=T, m=T,
             limit=swiglu_limit)
    if w2b is not None:  # cuBLAS bf16 on the cached exact bf16 W2
        if SHARED_MM_OUT and out.dtype == torch.bfloat16 and out.stride(-1) == 1:
            # straight into the strided slot view (cuBLAS's ldc): no temporary and no copy (95
            # us of 8192 x 5120 bf16 on the H200, ncu, thirteenth session)
            torch.mm(h, w2b.t(), out=out)
        else:
            out.copy_(torch.mm(h, w2b.t()))
    else:
        gemm(h, None, w2, out, role="dense", rows_per_group=T, m=T)
    return out


def _bf16_w2(w2: Bank) -> Tensor | None:
    """The shared expert's W2 as a cached bf16 matrix (kernels/cublas_fp8.dense_bf16: exact) for
    a cuBLAS bf16 GEMM on bf16 H, where the first GEMM ran on cuBLAS; None keeps the Triton L2 on
    fp16 H. Why bf16 and not FP8 H: the reference keeps H in high precision (E4M3 H costs ~3% on
    the output, moe.FP8_H); why not the Triton GEMM: 24 us at 64 rows and 0.79 ms at 8192 on the
    H200 for 24 MB of weights, 5-13% of the bandwidth / bf16 roofline."""
    if w2.wfmt != 1 or w2.groups != 1:
        return None
    from megagraph.kernels.gemm import cublas_fp8

    return cublas_fp8.dense_bf16(w2.w[0], w2.s[0])


def shared_expert_fp8h(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank, w2: Bank, *,
                       swiglu_limit: float | None, out_dtype: torch.dtype) -> Tensor | None:
    """The shared expert with FP8 H, all on cuBLAS's block-scaled FP8 GEMM: [W1; W3] x into bf16
    [T, 2F] (_cublas_l1), swiglu_rows_q quantizing H per row and 128 columns to E4M3 (the
    routed experts' FP8-H numerics: quantize_act fp8_1x128, DeepSeek's activation quantization
    before every FP8 linear), then H W2^T into a new [T, d] tensor of out_dtype (scaled_mm has
    no out=: combine reads it from there, shared_out). None where it does not apply: FP8-block
    banks of one weight each, F % 128 == 0, a bf16 / fp32 out, W2 and the L1 taken by cuBLAS.
    Why: the bf16 W2 GEMM (0.25 ms at 8192 tokens on the H200) runs at the bf16 roofline, the
    FP8 one has twice the ceiling; the L1's bf16 output halves its 134 MB fp32 write."""
    from megagraph.kernels.gemm import cublas_fp8

    F = w1.n
    form = cublas_fp8.prefill_form(x_q.shape[0])  # 128 x 128 weight blocks at prefill sizes
    if (w2.wfmt != 1 or w2.groups != 1 or F % 128 or w2.k != F
            or out_dtype not in (torch.bfloat16, torch.float32)
            or _cublas_l1_problem(x_q, w1, w3)
            or cublas_fp8.prepare((w2.w[0], w2.s[0]), form=form) is None):
        return None
    y13 = _cublas_l1(x_q, x_scale, w1, w3, torch.bfloat16, form=form)
    if y13 is None:
        return None
    h, hs = swiglu_fp8(y13, F, swiglu_limit)
    return cublas_fp8.linear(h, hs, [(w2.w[0], w2.s[0])], out_dtype, form=form)


def swiglu_fp8(y13: Tensor, F: int, swiglu_limit: float | None) -> tuple[Tensor, Tensor]:
    """(H E4M3 [T, F], scales f32 [T, F / 128]) = quantize_act fp8_1x128 of swiglu_act(y13[:, :F],
    y13[:, F:2F]) (swiglu_rows_q; F % 128 == 0); the scales outer-dim-major (stride (1, T)), the
    layout cuBLAS reads."""
    if F % 128:
        raise ValueError(f"swiglu_fp8: F {F} is no multiple of 128")
    T = y13.shape[0]
    h = torch.empty(T, F, dtype=torch.float8_e4m3fn, device=y13.device)
    hs = torch.empty(F // 128, T, dtype=torch.float32, device=y13.device).t()
    if T == 0:
        return h, hs
    bf = 512 if F % 512 == 0 else 128
    br = 2048 // bf
    _jit().swiglu_rows_q[(-(-T // br), F // bf)](
        y13, h, hs, T, F, float(swiglu_limit or 0.0), y13.stride(0), h.stride(0), hs.stride(0),
        hs.stride(1), HAS_LIMIT=swiglu_limit is not None and swiglu_limit > 0, BR=br, BF=bf,
        num_warps=4)
    return h, hs


def _cublas_l1_problem(x_q: Tensor, w1: Bank, w3: Bank) -> bool:
    """_cublas_l1 does not take the call (its cheap checks, before any weight is prepared)."""
    return (w1.wfmt != 1 or w3.wfmt != 1 or w1.groups != 1 or w3.groups != 1 or INTERPRET
            or EXACT or x_q.dtype != torch.float8_e4m3fn or x_q.shape[0] < CUBLAS_MIN_ROWS)


def _cublas_l1(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank,
               out_dtype: torch.dtype = torch.float32, form: str | None = None) -> Tensor | None:
    """The shared expert's first GEMM on cuBLAS (kernels/gemm/cublas_fp8.py): [T, 2F] = x @
    [W1; W3]^T in out_dtype (fp32; bf16 for shared_expert_fp8h, whose H is E4M3 afterwards) for
    FP8-block banks (one weight each), E4M3 x, >= CUBLAS_MIN_ROWS rows; else None (the Triton
    dense_swiglu tile with the SwiGLU in its epilogue runs). form: cublas_fp8.linear's."""
    if _cublas_l1_problem(x_q, w1, w3):
        return None
    from megagraph.kernels.gemm import cublas_fp8

    return cublas_fp8.linear(x_q, x_scale, [(w1.w[0], w1.s[0]), (w3.w[0], w3.s[0])],
                             out_dtype, form=form)


def combine(y: Tensor, out: Tensor, *, topk: int, shared: bool, rdt: torch.dtype,
            streams: Tensor | None = None, post: Tensor | None = None,
            comb: Tensor | None = None, shared_out: Tensor | None = None) -> Tensor:
    """out = the routed slots y[:, :topk] summed (+ the shared expert's output: y's slot topk,
    or shared_out [T, d] where it has its own tensor - shared_expert_fp8h's) (+ the mHC residual
    expand of streams with post / comb); moe_combine."""
    jit = _jit()
    T, _, D = y.shape
    if T == 0:
        return out
    bd = 256 if not INTERPRET else 128
    expand = streams is not None
    hc = streams.shape[1] if expand else 1
    sh = shared_out if shared_out is not None else (y[:, topk] if shared else y)
    if sh.stride(-1) != 1 or sh.shape[0] != T:
        raise ValueError("combine: the shared output needs [T, d] rows with unit column stride")
    jit.moe_combine[(T, -(-D // bd))](
        y, sh, streams if expand else y, post if expand else y, comb if expand else y, out, D,
        y.stride(0), sh.stride(0), streams.stride(0) if expand else 0,
        streams.stride(1) if expand else 0, out.stride(0), out.stride(1) if expand else 0,
        K=topk, SHARED=shared, EXPAND=expand, HC=hc, RDT=RDT[rdt], MANUAL=INTERPRET, BD=bd,
        num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------


def _fallback(name: str):
    from megagraph.kernels.fused import capturable as fused

    return getattr(fused, name)


def _q_ok(x_q: Tensor, x_scale: Tensor, act_fmt: str) -> bool:
    return (available() and on_device(x_q) and act_fmt == "fp8_1x128"
            and x_q.dtype == torch.float8_e4m3fn and x_scale.dtype == torch.float32
            and x_q.shape[-1] % 128 == 0 and x_q.stride(-1) == 1 and x_scale.stride(-1) == 1)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _ydtype(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt == torch.float32 else torch.bfloat16


def moe_experts_q(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt,
                  swiglu_limit, act_fmt, out_dtype):
    """kernels.fused.reference.moe_experts_q: routed experts on the quantized activation."""
    from megagraph.graph.interp import TORCH_DTYPES

    banks = [bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    odt = TORCH_DTYPES[out_dtype]
    if (not _q_ok(x_q, x_scale, act_fmt) or None in banks or x_q.dim() != 2
            or odt not in RDT or banks[0].k != x_q.shape[1]):
        return _fallback("moe_experts_q")(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale,
                                          w2, w2_scale, fmt=fmt, swiglu_limit=swiglu_limit,
                                          act_fmt=act_fmt, out_dtype=out_dtype)
    jit = _jit()
    T, d = x_q.shape
    k = ids.shape[1]
    E = banks[0].groups
    out = torch.empty(T, d, dtype=odt, device=x_q.device)
    if T == 0:
        return out
    ids32 = ids.to(torch.int32).clamp_(0, E - 1).contiguous()
    counts = torch.zeros(E, dtype=torch.int32, device=x_q.device)
    P = T * k
    jit.count_ids[(-(-P // 1024),)](ids32, counts, P, E, BP=1024, num_warps=4)
    y = torch.empty(T, k, d, dtype=_ydtype(odt), device=x_q.device)
    routed_experts(x_q, x_scale, ids32, weights.float().contiguous(), counts, *banks, y,
                   topk=k, swiglu_limit=swiglu_limit)
    return combine(y, out, topk=k, shared=False, rdt=odt)


def swiglu_mlp_q(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt, swiglu_limit,
                 act_fmt, out_dtype):
    """kernels.fused.reference.swiglu_mlp_q: one dense SwiGLU expert (the shared expert)."""
    from megagraph.graph.interp import TORCH_DTYPES

    banks = [bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    if (not _q_ok(x_q, x_scale, act_fmt) or None in banks or banks[0].groups != 1
            or banks[0].k != x_q.shape[-1]):
        return _fallback("swiglu_mlp_q")(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale,
                                         fmt=fmt, swiglu_limit=swiglu_limit, act_fmt=act_fmt,
                                         out_dtype=out_dtype)
    xq, xs = _flat(x_q), _flat(x_scale)
    out = torch.empty(xq.shape[0], banks[2].n, dtype=TORCH_DTYPES[out_dtype], device=x_q.device)
    if xq.shape[0]:
        shared_expert(xq, xs, *banks, out, swiglu_limit=swiglu_limit)
    return out.reshape(*x_q.shape[:-1], banks[2].n)


def linear_q(x_q, x_scale, weight, scale=None, *, fmt, act_fmt, out_dtype):
    """kernels.fused.reference.linear_q: y = dequant(x_q) @ dequant(W)^T on FP8-block (or MXFP4)
    weights; DeepGEMM's fp8_gemm_nt where importable and the scales are its 1x128 / 128x128
    recipe (V4 blocks), else cuBLAS's block-scaled FP8 GEMM (kernels/gemm/cublas_fp8.py: FP8-block
    weights reblocked once to 1x128 scales, >= CUBLAS_MIN_ROWS rows, where its device check
    passed), else this Triton GEMM."""
    from megagraph.graph.interp import TORCH_DTYPES

    b = bank(weight, scale, fmt) if weight.dim() == 2 else None
    if not _q_ok(x_q, x_scale, act_fmt) or b is None or b.k != x_q.shape[-1]:
        return _fallback("linear_q")(x_q, x_scale, weight, scale, fmt=fmt, act_fmt=act_fmt,
                                     out_dtype=out_dtype)
    xq, xs = _flat(x_q), _flat(x_scale)
    odt = TORCH_DTYPES[out_dtype]
    y = _deepgemm_linear(xq, xs, weight, scale, b, odt)
    if y is None and b.wfmt == 1 and not INTERPRET and xq.shape[0] >= CUBLAS_MIN_ROWS:
        from megagraph.kernels.gemm import cublas_fp8

        y = cublas_fp8.linear(xq, xs, [(weight, scale)], odt)
    if y is None:
        y = torch.empty(xq.shape[0], b.n, dtype=odt, device=x_q.device)
        if xq.shape[0]:
            gemm(xq, xs, b, y, role="dense", rows_per_group=xq.shape[0], m=xq.shape[0])
    return y.reshape(*x_q.shape[:-1], b.n)


def grouped_linear_q(x_q, x_scale, weight, scale=None, *, groups, fmt, act_fmt, out_dtype):
    """kernels.fused.reference.grouped_linear_q (block-diagonal): one batched launch, program
    axis 1 = group."""
    from megagraph.graph.interp import TORCH_DTYPES

    b = bank(weight, scale, fmt) if weight.dim() == 2 else None
    ok = (_q_ok(x_q, x_scale, act_fmt) and b is not None and x_q.dim() == 2
          and b.n % groups == 0 and x_q.shape[1] == groups * b.k and b.k % 128 == 0)
    if ok and b.wfmt == 1:
        ok = (b.n // groups) % b.bn == 0
    if not ok:
        return _fallback("grouped_linear_q")(x_q, x_scale, weight, scale, groups=groups, fmt=fmt,
                                             act_fmt=act_fmt, out_dtype=out_dtype)
    T = x_q.shape[0]
    o = b.n // groups
    y = torch.empty(T, b.n, dtype=TORCH_DTYPES[out_dtype], device=x_q.device)
    if T == 0:
        return y
    if (b.wfmt == 1 and not INTERPRET and T >= CUBLAS_GROUPED_MIN_ROWS
            and _cublas_groups(x_q, x_scale, weight, scale, groups, b, y)):
        return y
    # the weight as G groups of [o, K]: views with a group stride
    ws = b.w.shape[-1]
    wg = Bank(b.w.reshape(groups, o, ws), b.s.reshape(groups, -1, b.s.shape[-1]), b.wfmt, b.bn,
              b.bk, o, b.k)
    gemm(x_q, x_scale, wg, y, role="dense", rows_per_group=T, m=T, batched=True,
         a_group_stride=b.k, as_group_stride=b.k // 128, c_group_stride=o)
    return y


def _cublas_groups(x_q: Tensor, x_scale: Tensor, weight: Tensor, scale: Tensor, groups: int,
                   b: Bank, y: Tensor) -> bool:
    """grouped_linear_q as one cuBLAS block-scaled GEMM per group (kernels/gemm/cublas_fp8.py; each
    group's rows of the weight are their own cached reblocked weight): True when every group
    ran, False (y untouched) where the first group's weight does not take cuBLAS. Above
    CUBLAS_GROUPED_MIN_ROWS only: at decode sizes G launches cost more than the one batched
    Triton launch."""
    from megagraph.kernels.gemm import cublas_fp8

    o, k = b.n // groups, b.k
    so = o // b.bn
    for g in range(groups):
        xg = x_q[:, g * k:(g + 1) * k].contiguous()
        sg = x_scale[:, g * k // 128:(g + 1) * k // 128]
        yg = cublas_fp8.linear(xg, sg, [(weight[g * o:(g + 1) * o], scale[g * so:(g + 1) * so])],
                               y.dtype)
        if yg is None:
            if g == 0:
                return False
            raise RuntimeError("cublas_fp8: group 0 of a grouped weight took cuBLAS, group "
                               f"{g} did not")
        y[:, g * o:(g + 1) * o] = yg
    return True


@functools.cache
def _deep_gemm():
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def _deepgemm_linear(xq, xs, weight, scale, b: Bank, odt) -> Tensor | None:
    """DeepGEMM's sm90 FP8 GEMM when importable and the weight scales are 128x128 blocks (its
    1d2d recipe; V4.1's 32x32 blocks do not fit it): optional, never required."""
    if b.wfmt != 1 or (b.bn, b.bk) != (128, 128) or odt != torch.bfloat16 or INTERPRET:
        return None
    deep_gemm = _deep_gemm()
    if deep_gemm is None:
        return None
    try:
        from megagraph.kernels import formats

        y = torch.empty(xq.shape[0], b.n, dtype=torch.bfloat16, device=xq.device)
        deep_gemm.fp8_gemm_nt((xq, xs), (weight, formats.e8m0_to_f32(scale)), y)
        return y
    except Exception:  # noqa: BLE001  (an API / layout mismatch: the Triton GEMM runs)
        return None


def route(x, gate_w, bias=None, *, topk, route_scale, norm_topk=True, score_func="sqrtsoftplus"):
    """kernels.moe.reference.route: (ids i64 [T, k], weights f32 [T, k])."""
    if not (available() and on_device(x) and x.dim() == 2 and score_func in SCORES):
        from megagraph.kernels.moe.capturable import route as fallback

        return fallback(x, gate_w, bias, topk=topk, route_scale=route_scale,
                        norm_topk=norm_topk, score_func=score_func)
    return route_ids(x, gate_w, bias, topk=topk, route_scale=route_scale, norm_topk=norm_topk,
                     score_func=score_func, ids64=True)


def mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3, w3_scale,
             w2, w2_scale, sw1=None, sw1_scale=None, sw3=None, sw3_scale=None, sw2=None,
             sw2_scale=None, tid2eid=None, token_ids=None, *, topk, route_scale, norm_topk=True,
             score_func="sqrtsoftplus", fmt="dense", shared_fmt="dense", swiglu_limit=0.0,
             act_fmt):
    """kernels.fused.reference.mega_moe: route -> routed experts + shared expert -> combine ->
    hc_expand, in 9 launches (module doc). DeepGEMM's MegaMoE runs the routed experts instead
    where kernels/moe/deepgemm_mega.py takes the call (sm_100, opt-in; it returns None otherwise)."""
    from megagraph.kernels.moe import deepgemm_mega

    y = deepgemm_mega.mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1,
                               w1_scale, w3, w3_scale, w2, w2_scale, sw1, sw1_scale, sw3,
                               sw3_scale, sw2, sw2_scale, tid2eid, token_ids, topk=topk,
                               route_scale=route_scale, norm_topk=norm_topk,
                               score_func=score_func, fmt=fmt, shared_fmt=shared_fmt,
                               swiglu_limit=swiglu_limit, act_fmt=act_fmt)
    if y is not None:
        return y
    banks = [bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    shared = sw1 is not None
    sbanks = ([bank(w, s, shared_fmt) for w, s in ((sw1, sw1_scale), (sw3, sw3_scale),
                                                    (sw2, sw2_scale))] if shared else [])
    ok = (_q_ok(x_q, x_scale, act_fmt) and None not in banks and None not in sbanks
          and x.dim() == 2 and streams.dim() == 3 and x.dtype in RDT and streams.dtype in RDT
          and score_func in SCORES and banks[0].k == x.shape[1]
          and (not shared or sbanks[0].groups == 1))
    if not ok:
        return _mega_moe_fallback(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1,
                                  w1_scale, w3, w3_scale, w2, w2_scale, sw1, sw1_scale, sw3,
                                  sw3_scale, sw2, sw2_scale, tid2eid, token_ids, topk=topk,
                                  route_scale=route_scale, norm_topk=norm_topk,
                                  score_func=score_func, fmt=fmt, shared_fmt=shared_fmt,
                                  swiglu_limit=swiglu_limit, act_fmt=act_fmt)
    T, d = x.shape
    E = banks[0].groups
    dev = x.device
    out = torch.empty(streams.shape, dtype=streams.dtype, device=dev)
    if T == 0:
        return out
    early = SHARED_EARLY and T <= SHARED_EARLY_MAX_TOKENS
    side = (_side_stream(dev) if shared and (SHARED_STREAM or early) and not INTERPRET
            else None)
    forked = side is not None
    if forked:  # the shared expert on the side stream (it needs x_q only)
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
    s_out = None  # the shared expert's own output tensor (FP8 H on cuBLAS)
    if shared and _shared_fp8_h_may(x_q, T * topk / max(1, min(E, T * topk))):
        with torch.cuda.stream(side) if forked else contextlib.nullcontext():
            s_out = shared_expert_fp8h(x_q, x_scale, *sbanks, swiglu_limit=swiglu_limit,
                                       out_dtype=_ydtype(x.dtype))
        if forked and s_out is not None:
            s_out.record_stream(main)  # made on the side stream, read and freed on main
    ks = topk + int(shared and s_out is None)
    y = torch.empty(T, ks, d, dtype=_ydtype(x.dtype), device=dev)
    if forked and s_out is None:
        with torch.cuda.stream(side):
            shared_expert(x_q, x_scale, *sbanks, y[:, topk], swiglu_limit=swiglu_limit)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    ids, wts = route_ids(x, gate_w, gate_bias, topk=topk, route_scale=route_scale,
                         norm_topk=norm_topk, score_func=score_func, tid2eid=tid2eid,
                         token_ids=token_ids, counts=counts)
    if side is not None and not SHARED_STREAM:
        main.wait_stream(side)  # SHARED_EARLY: overlapping the router only, joined here
        side = None
    routed_experts(x_q, x_scale, ids, wts, counts, *banks, y, topk=topk,
                   swiglu_limit=swiglu_limit)
    if side is not None:
        main.wait_stream(side)  # joined before anything reads y or frees the inputs
    elif shared and not forked and s_out is None:
        shared_expert(x_q, x_scale, *sbanks, y[:, topk], swiglu_limit=swiglu_limit)
    sc = streams if streams.stride(-1) == 1 else streams.contiguous()
    return combine(y, out, topk=topk, shared=shared, rdt=x.dtype, streams=sc,
                   post=post.float().contiguous(), comb=comb.float().contiguous(),
                   shared_out=s_out)


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(dev: torch.device) -> torch.cuda.Stream | None:
    """One side stream per device for the shared expert (captured into CUDA graphs as a fork /
    join: the graph then runs it as a parallel branch). Why: at decode the routed GEMMs are
    bound by HBM bandwidth on weights the shared expert does not touch, and the shared expert
    (34 us at 64 tokens on the H200) is a few small launches that leave SMs idle; on one stream
    they added up (mega_moe 1.85 ms, 59% of the bandwidth roofline)."""
    if dev.type != "cuda":
        return None
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def _mega_moe_fallback(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
                       w3_scale, w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                       tid2eid, token_ids, **attrs):
    if tid2eid is None:
        return _fallback("mega_moe")(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1,
                                     w1_scale, w3, w3_scale, w2, w2_scale, sw1, sw1_scale, sw3,
                                     sw3_scale, sw2, sw2_scale, **attrs)
    from megagraph.kernels.fused.reference import mega_moe as reference

    return reference(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
                     w3_scale, w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                     tid2eid, token_ids, **attrs)


for _f in (moe_experts_q, swiglu_mlp_q, linear_q, grouped_linear_q, route, mega_moe):
    _f.capturable = True

__all__ = ["CONFIG_OVERRIDE", "FP8_H", "GemmConfig", "available", "bank", "combine", "gemm",
           "grouped_linear_q", "linear_q", "mega_moe", "moe_experts_q", "num_sms", "on_device",
           "permute", "pick_config", "route", "route_ids", "routed_experts", "shared_expert",
           "swiglu_mlp_q", "tile_list"]
