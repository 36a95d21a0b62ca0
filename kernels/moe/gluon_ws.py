"""Warp-specialized Gluon (Triton 3.6, sm_90) kernel for the PREFILL routed-expert L1:
H[r, :] = swiglu(clamp(A_r W1_e^T), A_r W3_e^T) for the expert-sorted rows r of each expert e, MXFP4
weights (E2M1 + E8M0 per 32 columns), E4M3 activations with one f32 scale per (token, 128 columns),
rows gathered through a_idx (row r reads token a_idx[r] // topk).

Why: the decode kernel at 64-token tiles (moe_gluon_decode, bt=64) upcasts the weights in the same
registers the wgmma accumulates in (247 registers, 2 CTAs of 4 warps per SM) and is latency-bound at
~280 TFLOP/s; overlapping upcast and wgmma by hand inside one set of warps gave wrong outputs on
the H200 (docs/kernels/moe.md, "Tried and dropped"). Here every job has its own warps (CUTLASS /
DeepGEMM style), synchronized only by mbarriers (one file of ~1300 lines: the partitions, rings
and register budget are one design):

  loader  (worker, 4 warps): per K chunk c into ring stage s = c % NS - TMA of the packed W1 / W3
          rows [BN, BK / 2] bytes (moe_gluon_decode's host descriptors), cp.async of the gathered
          A rows [BM, BK] E4M3 (16 bytes per copy, NVMMA 128-byte swizzle), their A scales [BM]
          and the W1 / W3 exponents [2 BN, 4]; the cp.async group of chunk c is waited for one
          chunk later, fenced (fence.proxy.async: the wgmma reads A through the async proxy) by
          every loader thread, then r_ready[s] is arrived (count 2: this arrive + the TMA's
          expect-tx arrive).
  upcast  (worker, 4 warps): per chunk, once r_ready[s] and b_free[u] (u = c % NU): the packed
          bytes + exponents -> E4M3 [BN, BK] (K-major, NVMMA 128-byte swizzle: the wgmma's B
          operand) per matrix into stage u of the B ring and the rows' promotion scales into
          sb[u]; fence.proxy.async (the writer-side order: every thread fences its own st.shared,
          then the partition barrier inside arrive); arrive r_free[s] (raw W / exponents read)
          and b_ready[u].
  MMA     (default partition = rows 0..63, one worker = rows 64..127: one warpgroup each, so
          each runs at its own pace and the tensor cores can run one while the other promotes):
          per chunk, once r_ready[s] and b_ready[u]: wgmma m64n64k32 x 4 per matrix (A = its 64
          rows of the A stage, B = the upcast tile), a fresh fp32 partial per matrix, promoted
          acc += part * (sa x sb) after its wait; arrive r_free[s], b_free[u].
  epilogue (MMA warpgroups): moe_jit.swiglu_act (gluon_common.swiglu), out's dtype (fp16 in
          routed_experts) at the expert-sorted rows.

Barriers (mbarrier, one per stage): r_ready [NS] count 2, r_free [NS] count 3 (both MMA warpgroups
+ the upcast warps), b_ready [NU] count 1, b_free [NU] count 2. Gluon lowers mbarrier.arrive to
one elected thread's arrive, so each partition's release runs a barrier of its own warps first
(_release: every thread's waited copies / wgmmas, fenced stores, before the arrive). Producers
wait for "free" at phase ^ 1: a fresh barrier counts as having completed the phase before its
first (the ring starts empty).

Numerics == moe_gluon_decode (and moe_acc with MMA fp8): per chunk and weight row S = max(max(e) -
6, 1) over the row's 4 exponents of the chunk, codes upcast to E4M3 as e2m1 * 2^(e - S) (flushed
for e - S < -5) by the same PTX table (moe_gluon_decode.FP4_TABLE_ASM, or the integer twin
gluon_common.e2m1_e4m3_bits with use_asm=False: the same codes), fp32 partial per chunk promoted
acc += part * (sa x sb) with sb = 2^(S - 127). Only the tensor core's sum order inside a chunk
differs from the other kernels (m64n64k32 here): the same bound against the fp32 math, not their
bits. Unlike the decode kernel the upcast tile is stored in the natural column order (a pack of 4
bytes gives its 8 columns in order: FP4_TABLE_ASM's $0 = columns 0..3, $1 = 4..7), so A is copied
unpermuted in 16-byte pieces.

Tile: BM = 128 expert-sorted rows (moe.tile_list at 128 rows) x BN = 64 columns of F for W1 and W3,
BK = 128-column chunks (K % 128 == 0, any chunk count). 16 warps: setmaxnreg gives the MMA
warpgroups the registers the producers do not take (REGS: launch maxnreg 128 = 64K registers per
CTA, one CTA per SM). Shared memory per ring stage 25 KB (A 16 KB, W1 + W3 8 KB, exponents,
scales) and per B stage 16.5 KB: NS = 4, NU = 2 by default (~134 KB).

The 128-column tile (bn=BN_WIDE; routed_experts' default, MoeConfig.ws_l1_bn):
128 rows x 128 columns of W1 AND of W3 per CTA, so each A chunk feeds 256 wgmma columns and the A
stream from L2 (the 64-column tile's floor) halves. Each MMA warpgroup holds four
64 x 64 accumulators (128 registers) and runs the chunk's four quarters one at a time (qlag 0) or
with the next in flight (qlag 1, measured slower); the promotion is a non-pure asm fma so LLVM
cannot sink it below the next wgmmas (all four partials live: spilled). With A by TMA the loader
needs 24-32 registers, which pays for a second upcast partition (upp 2: W1's and W3's, 20 warps at
a launch cap of 96): 8192 tokens on the H200, 7.94 ms (64 columns) -> 6.94 (128, gathered A) ->
6.21 ms (128, A by TMA, two upcasts; benchmarks/results/moe-ws-wide-12-h200.md). The same bits as
the 64-column tile (the same wgmmas and promotion per output element).

Row frames (frames=row_frames(w1, w3); routed_experts' default, 128
columns only): each weight row's frame S = max(largest exponent over ALL of K - 6, 1) instead of
each chunk's. The loader copies the tile's frames with every chunk, the upcasts encode e - S (no
per-chunk max reduction), the MMA warpgroups promote acc += part * sa (no column scales: no shared
loads, no FMUL between a quarter's wgmma wait and its FFMAs) and scale the accumulators by
2^(S - 127) per column once, before the SwiGLU. The same bits wherever row_frames accepts the
weights (every exponent of a row within 11 binades of its largest, so neither frame flushes a
group): the row frame's codes are the chunk frame's times 2^(S_chunk - S_row), exact in E4M3,
the tensor core's sums scale with them, the promotions' FMAs and the final power-of-two scale
are exact. Why: ncu on the H200 (benchmarks/probes/ncu_moe.py) showed the MMA warpgroups bounding the
L1 and ~30% of their stall samples on the column scales' shared loads after each wgmma wait;
L1 4.35 -> 3.85 ms at 8192 tokens with balanced routing (benchmarks/results/moe-ws-13-h200.md).

The loader's upcast share (lup, LOADER_UPCAST; routed_experts' default,
two upcast partitions only): ncu showed the loader waiting on r_free ~80% of the time
while the upcasts bounded the L1. The chunk's upcast is cut into eight 32-row blocks (P_L32):
each upcast partition does three of its matrix's four, the loader the fourth of W1 and of W3
(_upcast_units), LUP_LAG = 2 chunks behind its loads - after it published them (LAG <= LUP_LAG)
and before it waits for their stage to be free again (LUP_LAG < NS), so its waits are the ones
the loads already had (stage c - NS free = the MMA warpgroups done with c - NS; the share of
chunk c - 2 needs B stage (c - 2) % 2 free = MMA done with c - 4). r_free and b_ready count
the loader's arrival too. The same codes in the same places: the same bits. H200, 8192 tokens,
balanced routing: the layer 7.21 -> 6.82 ms (benchmarks/results/moe-ws-14-h200.md). The upcast
table (moe_gluon_decode.FP4_TABLE_ASM) is 9 SASS a pack (signs by one
prmt of the word and the word << 4; 12 before): 7.44 -> 7.21 ms.

FP8 H (EPI; routed_experts' default at prefill sizes): l1_gluon_ws(...,
out_scale=...) makes the 128-column tile's epilogue quantize H per row and its 128 columns with
quantize_act fp8_1x128's numerics (_pow2_exp: the scale's exponent from amax's bits, the codes by
the conversion's round-to-nearest-even) into an E4M3 out and f32 scales (EPI 1); and the same
kernel runs the down projection on that H (EPI 2, moe_gluon_l2_fp8.l2_gluon_ws_fp8): A = the
expert-sorted H itself by TMA (its scales by sorted row), "W1" / "W3" = two 128-row halves of W2
(a tile of 256 output columns), the epilogue's combine weight and (token, slot) scatter. Why: the
fp16-H L2 ran at half the FP8 tensor rate; the down GEMM now runs at the L1's efficiency per FLOP
(H200, 8192 tokens, balanced: L2 2.40 -> 1.71 ms, the layer 6.84 -> 6.18 ms in one table;
benchmarks/results/moe-fp8h-15-h200.md). The MMA and upcast loops are EPI 0's (only the epilogue
and the loader's A-scale / W3-row addressing differ).

Triton 3.6 sm_90 build (tests/kernels/test_moe_gluon_ws.py, not yet run on a GPU): no stack, no
spills, setmaxnreg 200 / 200 / 64 / 48, 136636 B shared (NS 6 / NU 3 fits too); per chunk the MMA
loop is 217 instructions (8 QGMMA 64x64x32, 64 FMUL + 64 FFMA of promotion), the upcast loop 306
(64 PRMT, 4 LDS.128, 8 STS.128), the loader loop 125 (2 UTMALDG, 10 LDGSTS). Not persistent: one
tile per CTA, so each CTA pays its ring's fill and the epilogue unhidden (~40 chunks per tile at
K = 5120).
"""
from __future__ import annotations


import torch

from megagraph.kernels.common.triton import sm_count
from megagraph.kernels.moe.gluon_common import IMPORT_OK as _IMPORT_OK
from megagraph.kernels.moe.gluon_common import (
    available,  # noqa: F401  (the tests and the probe call it here)
    check_rows,
    l1_bank_problem,
    l1_format_problem,
    tile_list,
)

if _IMPORT_OK:  # the Triton 3.6 Gluon names (gluon_common's guarded import)
    from megagraph.kernels.moe.gluon_common import (
        async_copy,
        fence_async_shared,
        gluon,
        mbarrier,
        swiglu,
        tile_entry,
        tma,
        ttgl,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from megagraph.kernels.moe.gluon_decode import upcast_packs, upcast_packs_rel

BM, BN, BK = 128, 64, 128
# the wgmma's n and the upcast's row block: a BN = 128 tile (opt-in, BN_WIDE) runs its W1 / W3
# columns as two 64-column halves of these layouts
WN = 64
BN_WIDE = 128
# ring depths of the BN = 128 tile: a raw stage is 33.5 KB (A 16, W1 + W3 16), a B stage 33 KB,
# so 4:2 (200 KB) is the deepest that fits; REGS_WIDE its setmaxnreg (one partial in flight)
NS_WIDE, NU_WIDE = 4, 2
NS, NU = 4, 2  # default depths of the raw ring (A, packed W, exponents, scales) and the B ring
LAG = 1  # chunks of gathered A copies the loader keeps in flight beyond the one it waits for
# DIAG bits (timing diagnosis only, WRONG results): 1 no upcast, 2 no wgmma, 4 no A copies
DIAG_BITS = {"upcast": 1, "mma": 2, "a": 4}
# persistent CTAs: one per SM, each walking tiles pid, pid + grid, ... with its rings' chunk count
# running on (the loader fills the next tile's stages during the MMA warpgroups' epilogue)
PERSIST = False
# A by TMA: the gathered rows copied once into expert-sorted order (a_q[a_idx // topk], P x K
# E4M3), then [BM, BK] boxes on the stages' barriers: no gathered cp.async of A in the loader
A_TMA = False
if _IMPORT_OK:
    A_TMA_LAYOUT = ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    # STMA's boxes (unswizzled): exponents [BN, 16] bytes, A scales [1, BM] / frames [1, BN] f32
    E_TMA_LAYOUT = ttgl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    S_TMA_LAYOUT = ttgl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
NUM_WARPS = 4  # the default partition (MMA rows 0..63); 3 workers of 4 warps: 16 warps in all
MAXNREG = 128  # launch register cap: 16 warps x 32 x 128 = the SM's 64K registers
# setmaxnreg of the workers (MMA rows 64..127, upcast, loader); the default partition gets the
# rest of the 4 x 128 per thread: 512 - 200 - 64 - 48 = 200
REGS = (200, 64, 48)
# BN = 128: each MMA warpgroup holds four 64 x 64 fp32 accumulators (128 registers) and one
# 64 x 64 partial at a time (its promotion before the next quarter's wgmma), so the same split
REGS_WIDE = (200, 64, 48)
# ... and with the next quarter's wgmma in flight during a promotion (WIDE_QLAG 1: two partials
# live, 64 registers more than one): the MMA warpgroups take what the producers can spare
WIDE_QLAG = 0  # 1 measured 6.92 ms against 6.74 for 0 (8192 tokens, A by TMA; H200)
REGS_WIDE_Q = (216, 56, 24)
# ... and with two upcast partitions (W1's and W3's: two upcast warps per scheduler), 20 warps at
# a launch cap of 96 registers: 480 per warpgroup lane = 184 + 184 (MMA; no spills down to 176
# at qlag 0) + 2 x 40 (upcast) + 32 (the A-by-TMA loader)
WIDE_UPP = 2
# the rows 64..127 MMA warpgroup skips its wgmmas and promotions on tiles of <= 64 rows (an
# expert's last partial tile: ~1/3 of the tiles at 8192 tokens, whose rows 64.. are never
# stored), as moe_gluon_l2_ws's does; the stages are still waited for and released. Default:
# 8192 tokens, gate-like random routing, 6.04 -> 5.73 ms, the same
# bits (benchmarks/results/moe-ws-13-h200.md); no effect where every tile is full (balanced)
SKIP_IDLE = True
# LUP: the loader partition (idle ~80% of the time, ncu) upcasts a share of every chunk - the
# last 32-row block of W1 and of W3, two of the chunk's eight - LUP_LAG chunks behind its loads,
# so each upcast partition does three blocks instead of four (128 columns, two upcast
# partitions). Default: H200, 8192 tokens, balanced routing, the
# MegaMoE layer 7.21 -> 6.82 ms (with AREG; 7.17 without), the same bits
# (benchmarks/results/moe-ws-14-h200.md)
LOADER_UPCAST = True
LUP_LAG = 2
# STMA: the loader's small per-chunk copies (A scales, exponents, frames) by TMA on the stage's
# barrier instead of cp.async - no cp.async wait and no publish in its loop (ncu: a
# third of the L1 loader's samples sat right after its cp.async
# wait, the upcasts waited on r_ready). The A scales come from a tile-ordered copy
# (moe.tile_scales: a TMA box's inner start must be 16-byte aligned - the H200 raised an illegal
# instruction otherwise), the exponents in 16-byte groups of 4 chunks. Where it applies: A by
# TMA, exponent rows of K / 32 % 16 == 0 bytes (K = 5120 yes; the down GEMM's K = 2304 no).
# Default on the 128-column tile (routed_experts' L1; the tile
# it was measured and tested on): H200, 8192 tokens, the MegaMoE layer 6.48 -> 6.30 ms balanced
# (faster in each of 3 rounds), 8.04 -> 8.00 gate-routed, the same bits
# (benchmarks/results/moe-fp8h-15-h200.md); MoeConfig.ws_small_tma=false turns it off.
SMALL_TMA = True


def _lup_fits(lag: int, stages: int) -> bool:
    """LUP's ring condition: the loader's upcast runs LUP_LAG chunks behind its loads, after
    it published them (lag <= LUP_LAG) and before it reuses their stage (LUP_LAG < stages)."""
    return lag <= LUP_LAG < stages


# the 128-column tile's MMA warpgroups read their 64 A rows of a chunk into registers once and run
# the four quarters' wgmmas on them (wgmma's register A operand): the wgmmas' shared-memory reads
# of A drop from 4 x 8 KB to one 8 KB load per chunk and warpgroup (row frames, A by TMA, qlag 0).
# Default: H200, 8192 tokens, L1 3.94 -> 3.90 ms balanced, 5.28 ->
# 5.19 gate-like; mega_moe 7.85 -> 7.81 / 9.96 -> 9.88 ms (one A/B, 2 rounds), the same bits.
# Small: with row frames shared memory was no longer the limit (L1/TEX 75% -> 54% busy in ncu)
AREG = True
# ... its registers at two upcast partitions: 16 more a thread in the MMA warpgroups (192: one
# spilled register at 184) for what row frames saved in the upcasts (32: no spills; the chunk
# frame's reduction is gone)
REGS_WIDE_AREG = (192, 32, 32)
REGS_WIDE_U2 = (184, 40, 32)
# LUP: the loader holds its copy pointers through its upcast share: at AREG's 32 registers it
# spills a few (16 B of stack, 3 local loads / stores in its loop) - still the fastest (6.82 ms
# against 7.17 with the loader at 48 and the MMA warpgroups at 184 without AREG)
REGS_WIDE_LUP_AREG = (192, 32, 32)
REGS_WIDE_LUP = (184, 32, 48)

if _IMPORT_OK:
    # ---- layouts (every partition is 4 warps) -------------------------------------------------
    # the MMA warpgroup's m64n64k32 accumulator, its rows (A scales, output rows) and columns
    MMA_L = ttgl.constexpr(ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WN, 32]))
    ROW_L = ttgl.constexpr(ttgl.SliceLayout(1, MMA_L))
    WN_C = ttgl.constexpr(WN)  # WN inside the kernels
    # LUP: the loader's 32-row blocks of a chunk (_upcast_units' bits: W1's and W3's block 3)
    LUP_UNITS = ttgl.constexpr(0xC0)
    COL_L = ttgl.constexpr(ttgl.SliceLayout(0, MMA_L))
    # the MMA warpgroup's 64 rows of an A stage in registers (wgmma's register A operand, E4M3:
    # k_width 4), read once per chunk for the four quarters (AREG)
    A_REG_L = ttgl.constexpr(ttgl.DotOperandLayout(operand_index=0, parent=MMA_L, k_width=4))
    # packed bytes [BN rows, 64 bytes]: 16 bytes (= one 32-column group t) of one row per thread,
    # lanes (t, t, row, row, row), warps rows 8 / 16, register rows 32
    P2_L = ttgl.constexpr(ttgl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
    # the same as [row, t, kk, b] (byte 16 t + 4 kk + b): an asm pack of 4 = the b of one (row,
    # t, kk), one PRMT table per (row, t)
    P_L = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [32, 0, 0, 0]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[WN, 4, 4, 4]))
    # ... for a 32-row block (LUP's units: the loader upcasts 2 of a chunk's 8 32-row blocks)
    P_L32 = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[32, 4, 4, 4]))
    # the upcast tile [BN, BK] E4M3: the thread's 32 columns 32 t .. 32 t + 31 of its rows, in
    # register order (two 16-byte st.shared per row)
    B_L = ttgl.constexpr(ttgl.BlockedLayout([1, 32], [8, 4], [4, 1], [1, 0]))
    # loader copies: A 16 bytes, exponents 4, A scales 4
    A_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
    E_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0]))
    S_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1], [32], [4], [0]))
    # shared: the fp8 tiles (A [BM, BK], B [BN, BK]: 128-byte rows), flat exponents / scales
    F8_SMEM = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                    rank=2))
    FLAT = ttgl.constexpr(ttgl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    FLAT1 = ttgl.constexpr(ttgl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _stage(c, NS: ttgl.constexpr):
        """Ring stage and barrier phase (parity) of chunk c in a ring of NS stages."""
        return c % NS, (c // NS) & 1

    @gluon.jit
    def _release(bars, c, NS: ttgl.constexpr):
        """The partition's arrival on bars[stage of chunk c] for ALL its threads: Gluon lowers
        mbarrier.arrive to one elected thread's arrive, with no barrier of its own (Triton's
        membar pass adds one only where it sees a shared-memory hazard: not after a fence), so
        the partition barrier here orders every thread's prior work (its waited copies or
        wgmmas, its fenced stores) before that arrive. A second arrive right after it (the B
        ring's) is covered by the same barrier."""
        ttgl.thread_barrier()
        s, _ = _stage(c, NS)
        mbarrier.arrive(bars.index(s), count=1)

    # ---- loader ----------------------------------------------------------------------------------

    @gluon.jit
    def _loader_tile(a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, w3_desc, bs1_ptr, bs2_ptr, ring,
                     bars, g, row0, nrows, n0, wrow, K, c0, stride_am, stride_as, stride_bsg,
                     stride_bsn, f1_ptr, f3_ptr, TOPK: ttgl.constexpr, BM: ttgl.constexpr,
                     BN: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr,
                     LAG: ttgl.constexpr, DIAG: ttgl.constexpr, A_TMA: ttgl.constexpr,
                     FRAMES: ttgl.constexpr, bring=None, USE_ASM: ttgl.constexpr = 1,
                     NU: ttgl.constexpr = 2, LUP: ttgl.constexpr = False,
                     LUPL: ttgl.constexpr = 2, DOWN: ttgl.constexpr = False,
                     STMA: ttgl.constexpr = False, sd=None, sring=None, srow=0):
        """Fill the raw ring with one tile's chunks, global chunk numbers c0 .. c0 + K / BK - 1
        (see the module docstring). Chunk c's cp.async group is waited for after chunk c + LAG's
        copies are issued (wait_group(LAG)), so the loader keeps up to LAG + 1 chunks of
        gathered copies in flight; the count runs on across tiles (persistent CTAs): the last
        LAG chunks of a tile are published while the next tile's copies are in flight, and
        only _loader's tail waits for the very last ones. LAG <= NS - 1 (chunk c + LAG's stage
        must not wait for chunk c's consumers). DIAG & 4: no A / A-scale copies (timing
        diagnosis only). A_TMA: A's [BM, BK] box by TMA from the expert-sorted copy of the rows
        (a_desc; rows past P zero-filled by the TMA unit), on the stage's barrier with the
        weights; the A scales and exponents stay on cp.async. FRAMES: the tile's rows' frames
        (f1_ptr / f3_ptr [G, N] int32, row g N + n of W1 / W3) with every chunk too, for the
        upcast (4-byte cp.async, 2 a thread). LUP: after publishing, the loader upcasts its share
        (the last 32-row block of W1 and of W3: _upcast_units) of chunk c - LUP_LAG, whose
        stage it published LUP_LAG - LAG chunks earlier (bars: all four rings' barriers, bring
        the B ring). DOWN (l2_gluon_ws_fp8): A is the expert-sorted H itself - its scales by
        sorted row, no a_idx - and "W3" is the 128 W2 rows after "W1"'s (row wrow + BN; the
        launcher offsets the exponent and frame pointers by BN rows). STMA: the A scales, the
        exponents and the frames by TMA too (sd: their descriptors, sring: their stage buffers
        as the TMA writes them; stride_as = the transposed scales' row length): the stage is
        ready when its bytes land - no cp.async, no wait, no publish; the A scales from the
        launcher's tile-ordered copy, this tile's at column srow = its list index x BM (a box's
        inner start must be 16-byte aligned: an expert's row offset is not). Returns the next
        chunk number."""
        a_r, w1_r, w3_r, e_r, sa_r, f_r = ring
        r_ready, r_free, _, _ = bars
        # gathered A rows (masked past the tile: zero-filled, their outputs never stored)
        ra = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, A_CP_L))
        ka = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, A_CP_L))
        tok = ttgl.load(aidx_ptr + row0 + ra, mask=ra < nrows, other=0) // TOPK
        a_ptrs = a_ptr + (tok.to(ttgl.int64) * stride_am)[:, None] + ka[None, :]
        A_BYTES: ttgl.constexpr = BM * BK if (A_TMA and (DIAG & 4) == 0) else 0
        a_mask = (ra < nrows)[:, None] & (ka < BK)[None, :]
        rs = ttgl.arange(0, BM, layout=S_CP_L)
        if DOWN:  # the expert-sorted H's own rows
            tok_s = row0 + rs
        else:
            tok_s = ttgl.load(aidx_ptr + row0 + rs, mask=rs < nrows, other=0) // TOPK
        s_ptrs = as_ptr + tok_s.to(ttgl.int64) * stride_as
        # exponent rows: 0..BN-1 of W1, BN..2BN-1 of W3 (rows n0.. of expert g); row strides of
        # 4-byte multiples written as 4 x (stride / 4) so the 4-byte cp.async is provably aligned
        re = ttgl.arange(0, 2 * BN, layout=ttgl.SliceLayout(1, E_CP_L))
        ce = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, E_CP_L))
        eofs = g * stride_bsg + \
            ((n0 + re % BN).to(ttgl.int64) * (stride_bsn // 4) * 4)[:, None] + ce[None, :]
        e_ptrs = ttgl.where((re < BN)[:, None], bs1_ptr + eofs, bs2_ptr + eofs)
        rf = ttgl.arange(0, 2 * BN, layout=S_CP_L)
        f_ptrs = ttgl.where(rf < BN, f1_ptr, f3_ptr) + (wrow + rf % BN)

        W3_ROW: ttgl.constexpr = BN if DOWN else 0  # DOWN: "W3" = the next BN rows of W2
        # STMA: exponents (a [BN, 16]-byte box: chunks 4 (i // 4) .. + 3), A scales,
        # frames - all on the stage's barrier
        S_BYTES: ttgl.constexpr = (2 * BN * 16 + BM * 4 + (2 * BN * 4 if FRAMES else 0)) \
            if STMA else 0
        n_k = K // BK
        for i in range(n_k):
            c = c0 + i
            s, ph = _stage(c, NS)
            mbarrier.wait(r_free.index(s), ph ^ 1)  # the consumers of chunk c - NS are done
            bar = r_ready.index(s)
            mbarrier.expect(bar, 2 * BN * (BK // 2) + A_BYTES + S_BYTES)
            tma.async_copy_global_to_shared(w1_desc, [wrow, i * (BK // 2)], bar, w1_r.index(s))
            tma.async_copy_global_to_shared(w3_desc, [wrow + W3_ROW, i * (BK // 2)], bar,
                                            w3_r.index(s))
            if A_BYTES > 0:
                tma.async_copy_global_to_shared(a_desc, [row0, i * BK], bar, a_r.index(s))
            if STMA:
                e1_desc, e3_desc, sa_desc, f1_desc, f3_desc = sd
                e_t, sa_t, f_t = sring
                # (a box's inner start must be 16-byte aligned - the H200 raised an illegal
                # instruction at 4 i: so the group of chunks i // 4, read at (i % 4) 4)
                tma.async_copy_global_to_shared(e1_desc, [wrow, (i // 4) * 16], bar,
                                                e_t.index(s).slice(0, BN))
                tma.async_copy_global_to_shared(e3_desc, [wrow + W3_ROW, (i // 4) * 16], bar,
                                                e_t.index(s).slice(BN, BN))
                tma.async_copy_global_to_shared(sa_desc, [i, srow], bar, sa_t.index(s))
                if FRAMES:
                    tma.async_copy_global_to_shared(f1_desc, [wrow // BN, 0], bar,
                                                    f_t.index(s).slice(0, 1))
                    tma.async_copy_global_to_shared(f3_desc, [(wrow + W3_ROW) // BN, 0], bar,
                                                    f_t.index(s).slice(1, 1))
            elif (DIAG & 4) == 0:
                if not A_TMA:
                    async_copy.async_copy_global_to_shared(a_r.index(s), a_ptrs + i * BK,
                                                           mask=a_mask)
                async_copy.async_copy_global_to_shared(sa_r.index(s), s_ptrs + i,
                                                       mask=rs < nrows)
            if not STMA:
                async_copy.async_copy_global_to_shared(e_r.index(s), e_ptrs + i * (BK // 32))
                if FRAMES:
                    async_copy.async_copy_global_to_shared(f_r.index(s), f_ptrs)
                async_copy.commit_group()
                if c >= LAG:
                    _publish(r_ready, c - LAG, LAG, NS)
            if LUP:
                if c >= LUPL:
                    _upcast_units(ring, bars, bring, c - LUPL, LUP_UNITS, 32, USE_ASM, BN, BK,
                                  NS, NU, DIAG, FRAMES, (c - LUPL) % 4)
        return c0 + n_k

    @gluon.jit
    def _loader(a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, w3_desc, bs1_ptr, bs2_ptr, ring, bars,
                work_ptr, tile, MT, G, P, N, K, stride_am, stride_as, stride_bsg, stride_bsn,
                f1_ptr, f3_ptr, TOPK: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr,
                BK: ttgl.constexpr, NS: ttgl.constexpr, LAG: ttgl.constexpr,
                DIAG: ttgl.constexpr, PERSIST: ttgl.constexpr, A_TMA: ttgl.constexpr,
                FRAMES: ttgl.constexpr, bring=None, USE_ASM: ttgl.constexpr = 1,
                NU: ttgl.constexpr = 2, LUP: ttgl.constexpr = False,
                LUPL: ttgl.constexpr = 2, DOWN: ttgl.constexpr = False,
                STMA: ttgl.constexpr = False, sd=None, sring=None):
        """The loader partition: this CTA's tiles (_tiles), then the last LAG chunks published
        (oldest first: wait_group(LAG - 1 - j) leaves exactly the newer ones pending); LUP: then
        its upcast share of the last LUP_LAG chunks."""
        CT: ttgl.constexpr = 2 * BN if DOWN else BN  # weight rows per column tile
        c = 0
        if PERSIST:
            for t in range(tile, ttgl.load(work_ptr) * (N // CT), ttgl.num_programs(0)):
                skip, g, row0, nrows, pid_n = tile_entry(work_ptr, t, N // CT, MT, G, P, BM)
                if not skip:
                    c = _loader_tile(a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, w3_desc,
                                     bs1_ptr, bs2_ptr, ring, bars, g, row0, nrows, pid_n * CT,
                                     g.to(ttgl.int32) * N + pid_n * CT, K, c, stride_am,
                                     stride_as, stride_bsg, stride_bsn, f1_ptr, f3_ptr, TOPK,
                                     BM, BN, BK, NS, LAG, DIAG, A_TMA, FRAMES, bring, USE_ASM,
                                     NU, LUP, LUPL, DOWN, STMA, sd, sring,
                                     (t // (N // CT)) * BM)
        else:
            _, g, row0, nrows, pid_n = tile_entry(work_ptr, tile, N // CT, MT, G, P, BM)
            c = _loader_tile(a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, w3_desc, bs1_ptr,
                             bs2_ptr, ring, bars, g, row0, nrows, pid_n * CT,
                             g.to(ttgl.int32) * N + pid_n * CT, K, c, stride_am, stride_as,
                             stride_bsg, stride_bsn, f1_ptr, f3_ptr, TOPK, BM, BN, BK, NS, LAG,
                             DIAG, A_TMA, FRAMES, bring, USE_ASM, NU, LUP, LUPL, DOWN, STMA, sd,
                             sring, (tile // (N // CT)) * BM)
        r_ready, _, _, _ = bars
        if not STMA:  # (STMA: no cp.async, nothing to publish)
            for j in ttgl.static_range(LAG):  # the last LAG chunks, oldest first
                if c - LAG + j >= 0:
                    _publish(r_ready, c - LAG + j, LAG - 1 - j, NS)
        if LUP:
            for j in ttgl.static_range(LUPL):
                if c - LUPL + j >= 0:
                    _upcast_units(ring, bars, bring, c - LUPL + j, LUP_UNITS, 32, USE_ASM, BN,
                                  BK, NS, NU, DIAG, FRAMES, (c - LUPL + j) % 4)

    @gluon.jit
    def _publish(r_ready, c, PENDING: ttgl.constexpr, NS: ttgl.constexpr):
        """Chunk c's cp.async bytes are in (this thread's groups but the PENDING newest), fenced
        by every loader thread for the wgmma's async proxy (writer-side, before the partition
        barrier inside arrive), then r_ready of its stage gets the loader's arrival."""
        async_copy.wait_group(PENDING)
        fence_async_shared()
        _release(r_ready, c, NS)

    # ---- upcast ------------------------------------------------------------------------------------

    @gluon.jit
    def _upcast_store(w_s, e_s, f_s, ROW0: ttgl.constexpr, b_dst, sb_dst,
                      USE_ASM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
                      FRAMES: ttgl.constexpr, ecol=0):
        """One matrix's BN packed rows (w_s [BN, BK / 2] bytes, NVMMA 64-byte swizzle as TMA
        wrote them; exponents rows ROW0.. of e_s [2 BN, 4]) -> E4M3 [BN, BK] in column order into
        b_dst and the rows' promotion scales 2^(S - 127) into sb_dst [BN]. The per-(row, group)
        table and its proof are moe_gluon_decode.upcast_packs's; only the output order differs
        (natural columns: pack kk of group t -> columns 32 t + 8 kk + 4 h + b). FRAMES: the
        rows' frames over all of K from f_s (the loader's copy; rows ROW0.. like e_s) instead
        of the chunk's, and no promotion scales (the MMA warpgroups apply the frames in their
        epilogue). STMA's exponent stage [2 BN, 16]: 4 chunks' bytes a row, this chunk's at
        column 4 ecol (ecol = the chunk's index in its tile % 4 = its global number c % 4: STMA
        needs K / 32 % 16 == 0, so a tile's chunk count is a multiple of 4)."""
        pl: ttgl.constexpr = P_L if BN == WN_C else P_L32  # 64-row blocks, or LUP's 32
        e_l: ttgl.constexpr = ttgl.SliceLayout(2, ttgl.SliceLayout(3, pl))
        p = w_s.load(P2_L)  # [BN, 64] uint8: 16 contiguous bytes (one group) per thread
        p = ttgl.convert_layout(ttgl.reshape(p, [BN, 4, 4, 4]), pl, assert_trivial=True)
        e_rows = e_s.slice(ROW0, BN)
        if e_s.shape[1] == 4:
            e = e_rows.load(e_l)
        elif ecol == 0:  # STMA (the column's start must be a constant: one load per case)
            e = e_rows.slice(0, 4, dim=1).load(e_l)
        elif ecol == 1:
            e = e_rows.slice(4, 4, dim=1).load(e_l)
        elif ecol == 2:
            e = e_rows.slice(8, 4, dim=1).load(e_l)
        else:
            e = e_rows.slice(12, 4, dim=1).load(e_l)
        e = e.to(ttgl.int32)  # [BN, 4]
        if FRAMES:
            S = f_s.slice(ROW0, BN).load(ttgl.SliceLayout(1, e_l))
            r0, r1 = upcast_packs_rel(p, e - ttgl.expand_dims(S, 1), USE_ASM, BN, pl)
        else:
            r0, r1, S = upcast_packs(p, e, USE_ASM, BN, pl)
        # [row, t, kk, b] x h -> [row, t, kk, h, b] = column 32 t + 8 kk + 4 h + b
        b = ttgl.permute(ttgl.join(r0, r1), (0, 1, 2, 4, 3))
        b = ttgl.reshape(b, [BN, BK]).to(ttgl.float8e4nv, bitcast=True)
        b_dst.store(ttgl.convert_layout(b, B_L))
        if not FRAMES:
            sb_dst.store((S << 23).to(ttgl.float32, bitcast=True))  # S >= 1: 2^(S - 127)

    @gluon.jit
    def _upcast_units(ring, bars, bring, c, UNITS: ttgl.constexpr, ROWS: ttgl.constexpr,
                      USE_ASM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
                      NS: ttgl.constexpr, NU: ttgl.constexpr, DIAG: ttgl.constexpr,
                      FRAMES: ttgl.constexpr, ecol=0):
        """Chunk c's ROWS-row blocks in UNITS (bit 2 h: rows ROWS h .. of W1, bit 2 h + 1: the
        same of W3, in that order) upcast from raw stage c % NS into B stage c % NU, then the
        partition's releases: one proxy fence for both directions (its st.shared of the B stage
        before the wgmma reads it, its ld.shared of the raw stage before the next TMA writes
        it), r_free (raw stage read) and b_ready. DIAG & 1: only the handshakes (timing
        diagnosis only). ecol: _upcast_store's (STMA)."""
        _, w1_r, w3_r, e_r, _, f_r = ring
        r_ready, r_free, b_ready, b_free = bars
        b1_r, b3_r, sb_r = bring
        s, ph = _stage(c, NS)
        u, phu = _stage(c, NU)
        mbarrier.wait(r_ready.index(s), ph)
        mbarrier.wait(b_free.index(u), phu ^ 1)
        sb = sb_r.index(u)
        if (DIAG & 1) == 0:
            for q in ttgl.static_range(2 * (BN // ROWS)):
                if ((UNITS >> q) & 1) != 0:
                    if q % 2 == 0:
                        _upcast_store(w1_r.index(s).slice(ROWS * (q // 2), ROWS), e_r.index(s),
                                      f_r.index(s), ROWS * (q // 2),
                                      b1_r.index(u).slice(ROWS * (q // 2), ROWS),
                                      sb.slice(ROWS * (q // 2), ROWS), USE_ASM, ROWS, BK, FRAMES,
                                      ecol)
                    else:
                        _upcast_store(w3_r.index(s).slice(ROWS * (q // 2), ROWS), e_r.index(s),
                                      f_r.index(s), BN + ROWS * (q // 2),
                                      b3_r.index(u).slice(ROWS * (q // 2), ROWS),
                                      sb.slice(BN + ROWS * (q // 2), ROWS), USE_ASM, ROWS, BK,
                                      FRAMES, ecol)
        fence_async_shared()
        _release(r_free, c, NS)
        mbarrier.arrive(b_ready.index(u), count=1)

    @gluon.jit
    def _upcaster(ring, bars, bring, work_ptr, tile, MT, G, P, N, K, USE_ASM: ttgl.constexpr,
                  BM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
                  NS: ttgl.constexpr, NU: ttgl.constexpr, DIAG: ttgl.constexpr,
                  PERSIST: ttgl.constexpr, MATS: ttgl.constexpr, FRAMES: ttgl.constexpr,
                  LUP: ttgl.constexpr = False, DOWN: ttgl.constexpr = False):
        """Raw ring stage -> B ring stage, chunk by chunk (_upcast_units; see the module
        docstring). The upcast needs no tile coordinates: only how many chunks this CTA's tiles
        hold (_tile_chunks). MATS: the matrices this partition upcasts (bit 1 W1, bit 2 W3: 3
        with one upcast partition, 1 and 2 with two), in 64-row blocks; LUP: three of its
        matrix's four 32-row blocks (the loader upcasts the fourth: LUP_UNITS)."""
        # bit 2 h = W1's block h, 2 h + 1 = W3's (_upcast_units)
        ROWS: ttgl.constexpr = 32 if LUP else WN_C
        W1B: ttgl.constexpr = 0x5555 & ((1 << (2 * (BN // ROWS))) - 1)
        MINE: ttgl.constexpr = (W1B if (MATS & 1) != 0 else 0) | \
            ((W1B << 1) if (MATS & 2) != 0 else 0)
        UNITS: ttgl.constexpr = (MINE & ~LUP_UNITS) if LUP else MINE
        for c in range(_tile_chunks(work_ptr, tile, MT, G, P, N, K, BM, BN, BK, PERSIST,
                                    DOWN)):
            _upcast_units(ring, bars, bring, c, UNITS, ROWS, USE_ASM, BN, BK, NS, NU, DIAG,
                          FRAMES, c % 4)

    # ---- MMA + epilogue ------------------------------------------------------------------------

    @gluon.jit
    def _mma_wait(r_ready, b_ready, c, NS: ttgl.constexpr, NU: ttgl.constexpr):
        """An MMA warpgroup's wait for chunk c: its raw stage (A, scales) and its B stage landed;
        returns the two stage indices."""
        s, ph = _stage(c, NS)
        u, phu = _stage(c, NU)
        mbarrier.wait(r_ready.index(s), ph)
        mbarrier.wait(b_ready.index(u), phu)
        return s, u

    @gluon.jit
    def _mma_release(r_free, b_free, c, NS: ttgl.constexpr, NU: ttgl.constexpr):
        """An MMA warpgroup's release of chunk c's stages (after its wgmmas were waited for)."""
        _release(r_free, c, NS)
        u, _ = _stage(c, NU)
        mbarrier.arrive(b_free.index(u), count=1)

    @gluon.jit
    def _mma_tile(ring, bars, bring, c_ptr, row0, nrows, n0, N, K, c0, limit, stride_cm,
                  M0: ttgl.constexpr, HAS_LIMIT: ttgl.constexpr, BN: ttgl.constexpr,
                  BK: ttgl.constexpr, NS: ttgl.constexpr, NU: ttgl.constexpr,
                  DIAG: ttgl.constexpr, SKIP: ttgl.constexpr = False):
        """Rows M0 .. M0 + 63 of the tile: per chunk the W1 and W3 wgmmas (fresh partials; W3's
        issued before W1's is waited for), the per-chunk promotion, the stages released; then
        the SwiGLU epilogue into out. DIAG & 2: no wgmma / promotion, only the handshakes
        (timing diagnosis only). Global chunk numbers c0 ..; returns the next one."""
        a_r, _, _, _, sa_r, _ = ring
        r_ready, r_free, b_ready, b_free = bars
        b1_r, b3_r, sb_r = bring
        zero = ttgl.zeros([64, BN], ttgl.float32, MMA_L)
        acc1 = ttgl.zeros([64, BN], ttgl.float32, MMA_L)
        acc3 = ttgl.zeros([64, BN], ttgl.float32, MMA_L)
        for i in range(K // BK):
            c = c0 + i
            s, u = _mma_wait(r_ready, b_ready, c, NS, NU)
            # SKIP: no wgmmas where this warpgroup's rows hold no tile row (rows 64.. of a tile
            # of <= 64 rows - an expert's last partial tile: nothing of them is stored); the
            # stages are still waited for and released (the barrier counts)
            if ((DIAG & 2) == 0) & ((not SKIP) | (nrows > M0)):
                a_s = a_r.index(s).slice(M0, 64)
                t1 = warpgroup_mma(a_s, b1_r.index(u).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                t3 = warpgroup_mma(a_s, b3_r.index(u).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                sa = sa_r.index(s).slice(M0, 64).load(ROW_L)
                sb = sb_r.index(u)
                sb1 = sb.slice(0, BN).load(COL_L)
                sb3 = sb.slice(BN, BN).load(COL_L)
                t1 = warpgroup_mma_wait(1, deps=[t1])
                acc1 += t1 * (ttgl.expand_dims(sa, 1) * ttgl.expand_dims(sb1, 0))
                t3 = warpgroup_mma_wait(0, deps=[t3])
                acc3 += t3 * (ttgl.expand_dims(sa, 1) * ttgl.expand_dims(sb3, 0))
            _mma_release(r_free, b_free, c, NS, NU)
        h = swiglu(acc1, acc3, limit, HAS_LIMIT)
        rm = M0 + ttgl.arange(0, 64, layout=ROW_L)
        rn = n0 + ttgl.arange(0, BN, layout=COL_L)
        c_ptrs = c_ptr + ((row0 + rm).to(ttgl.int64) * stride_cm)[:, None] + rn[None, :]
        ttgl.store(c_ptrs, h.to(c_ptr.dtype.element_ty),
                   mask=(rm < nrows)[:, None] & (rn < N)[None, :])
        return c0 + K // BK

    @gluon.jit
    def _promote(acc, part, sa, sb_s, FRAMES: ttgl.constexpr):
        """acc += part * (sa x sb): the chunk's fp32 partial of one 64 x 64 quarter, promoted by
        the rows' A scales sa and the quarter's columns' weight frames (sb_s: their [64] slice of
        the B stage's scales). FRAMES: the weights' frames are per row over all of K, applied
        once in the epilogue (_frame_scale), so acc += part * sa: no shared-memory load of the
        column scales and no FMUL between the wgmma wait and the FFMAs (the ncu samples:
        ~30% of the MMA warps' stalls sat there)."""
        if FRAMES:
            scale = ttgl.broadcast(ttgl.expand_dims(sa, 1), part)[0]
        else:
            sb = sb_s.load(COL_L)
            scale = ttgl.expand_dims(sa, 1) * ttgl.expand_dims(sb, 0)
        # fma(part, scale, acc): what acc + part * scale contracts to (the BN = 64 loop's FFMA),
        # as NON-pure asm: LLVM keeps volatile asm in program order, so the promotion stays
        # between this quarter's wait and the next quarter's wgmma. As plain arithmetic LLVM
        # sinks it below the later wgmmas (their asm does not read acc) and all four partials
        # are live at once: 128 + 128 registers, spilled.
        return ttgl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
                                           [part, scale, acc], dtype=ttgl.float32,
                                           is_pure=False, pack=1)

    @gluon.jit
    def _frame_scale(acc, f_ptr):
        """acc x 2^(S - 127) per column: the frames S (int32, >= 1) of the quarter's 64 weight
        rows at f_ptr - a power of two, so exact: acc then holds what the per-chunk frames'
        promotions would have summed, bit for bit."""
        S = ttgl.load(f_ptr + ttgl.arange(0, WN_C, layout=COL_L))
        return acc * ttgl.expand_dims((S << 23).to(ttgl.float32, bitcast=True), 0)

    @gluon.jit
    def _quarter(a_s, b_s, t):
        """The chunk's wgmma of one 64 x 64 quarter (A rows of this warpgroup x 64 rows of an
        upcast B tile) into a fresh partial, waited for. use_acc=False ignores the accumulator
        operand; it is the previous quarter's (dead, promoted) partial rather than a zero tile
        so that the wgmma can write in place. (The sm_90 build was the same with a zero tile:
        what keeps the partials from piling up is _promote's ordering, not this.)"""
        return warpgroup_mma_wait(0, deps=[_issue(a_s, b_s, t)])

    @gluon.jit
    def _issue(a_s, b_s, t):
        """_quarter's wgmma, not waited for."""
        return warpgroup_mma(a_s, b_s.permute((1, 0)), t, use_acc=False, is_async=True)

    @gluon.jit
    def _mma_tile_wide(ring, bars, bring, c_ptr, row0, nrows, n0, N, K, c0, limit, stride_cm,
                       f1_ptr, f3_ptr, frow, M0: ttgl.constexpr, HAS_LIMIT: ttgl.constexpr,
                       BN: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr,
                       NU: ttgl.constexpr, DIAG: ttgl.constexpr, QLAG: ttgl.constexpr,
                       SKIP: ttgl.constexpr = False, FRAMES: ttgl.constexpr = False,
                       AREG: ttgl.constexpr = False, aidx_ptr=None, ep_ptr=None, ep_stride=0,
                       TOPK: ttgl.constexpr = 1, EPI: ttgl.constexpr = 0):
        """_mma_tile for BN = 128: rows M0 .. M0 + 63 x 128 columns of W1 and of W3 as four 64 x
        64 accumulators (W1 columns 0..63 / 64..127, the same of W3: 128 registers a thread).
        Per chunk the four quarters' wgmmas run one at a time, each waited for and promoted
        before the next is issued (QLAG 0), so only one 64 x 64 partial is live: 128 + 32
        registers fit REGS_WIDE's 200 and REGS_WIDE_U2's 184; the other MMA warpgroup's wgmmas
        fill the tensor core while this one promotes. QLAG 1 keeps the next quarter's wgmma in
        flight during a promotion (two partials: REGS_WIDE_Q's 216). Numerics are _mma_tile's:
        the same m64n64k32 wgmmas per output element and the same promotion, so the same bits
        as BN = 64. FRAMES: promotions by the A scales only, the weight frames of the tile's
        columns (f1_ptr / f3_ptr + frow: row g N + n0 of the [G, N] frames) applied to the
        accumulators before the SwiGLU (_frame_scale): the same bits (see l1_gluon_ws). EPI: the
        epilogue (_epilogue_wide)."""
        a_r, _, _, _, sa_r, _ = ring
        r_ready, r_free, b_ready, b_free = bars
        b1_r, b3_r, sb_r = bring
        t = ttgl.zeros([64, WN_C], ttgl.float32, MMA_L)  # the partial, carried (see _quarter)
        t2 = ttgl.zeros([64, WN_C], ttgl.float32, MMA_L)  # QLAG 1: the second one
        acc1a = ttgl.zeros([64, WN_C], ttgl.float32, MMA_L)
        acc1b = ttgl.zeros([64, WN_C], ttgl.float32, MMA_L)
        acc3a = ttgl.zeros([64, WN_C], ttgl.float32, MMA_L)
        acc3b = ttgl.zeros([64, WN_C], ttgl.float32, MMA_L)
        for i in range(K // BK):
            c = c0 + i
            s, u = _mma_wait(r_ready, b_ready, c, NS, NU)
            # SKIP: no wgmmas where this warpgroup's rows hold no tile row (rows 64.. of a tile
            # of <= 64 rows - an expert's last partial tile: nothing of them is stored); the
            # stages are still waited for and released (the barrier counts)
            if ((DIAG & 2) == 0) & ((not SKIP) | (nrows > M0)):
                a_s = a_r.index(s).slice(M0, 64)
                if AREG:  # once per chunk, the four quarters' wgmmas read it from registers
                    a_s = a_s.load(A_REG_L)
                b1 = b1_r.index(u)
                b3 = b3_r.index(u)
                sb = sb_r.index(u)
                sa = sa_r.index(s).slice(M0, 64).load(ROW_L)
                if QLAG == 0:
                    t = _quarter(a_s, b1.slice(0, WN_C), t)
                    acc1a = _promote(acc1a, t, sa, sb.slice(0, WN_C), FRAMES)
                    t = _quarter(a_s, b1.slice(WN_C, WN_C), t)
                    acc1b = _promote(acc1b, t, sa, sb.slice(WN_C, WN_C), FRAMES)
                    t = _quarter(a_s, b3.slice(0, WN_C), t)
                    acc3a = _promote(acc3a, t, sa, sb.slice(BN, WN_C), FRAMES)
                    t = _quarter(a_s, b3.slice(WN_C, WN_C), t)
                    acc3b = _promote(acc3b, t, sa, sb.slice(BN + WN_C, WN_C), FRAMES)
                else:
                    # the next quarter's wgmma in flight while this one's partial is promoted:
                    # two partials live (t, t2), each wgmma written into the registers of the
                    # partial promoted just before it
                    p0 = _issue(a_s, b1.slice(0, WN_C), t)
                    p1 = _issue(a_s, b1.slice(WN_C, WN_C), t2)
                    p0 = warpgroup_mma_wait(1, deps=[p0])
                    acc1a = _promote(acc1a, p0, sa, sb.slice(0, WN_C), FRAMES)
                    p2 = _issue(a_s, b3.slice(0, WN_C), p0)
                    p1 = warpgroup_mma_wait(1, deps=[p1])
                    acc1b = _promote(acc1b, p1, sa, sb.slice(WN_C, WN_C), FRAMES)
                    p3 = _issue(a_s, b3.slice(WN_C, WN_C), p1)
                    p2 = warpgroup_mma_wait(1, deps=[p2])
                    acc3a = _promote(acc3a, p2, sa, sb.slice(BN, WN_C), FRAMES)
                    p3 = warpgroup_mma_wait(0, deps=[p3])
                    acc3b = _promote(acc3b, p3, sa, sb.slice(BN + WN_C, WN_C), FRAMES)
                    t = p2
                    t2 = p3
            _mma_release(r_free, b_free, c, NS, NU)
        if FRAMES:
            acc1a = _frame_scale(acc1a, f1_ptr + frow)
            acc1b = _frame_scale(acc1b, f1_ptr + frow + WN_C)
            acc3a = _frame_scale(acc3a, f3_ptr + frow)
            acc3b = _frame_scale(acc3b, f3_ptr + frow + WN_C)
        _epilogue_wide(acc1a, acc1b, acc3a, acc3b, c_ptr, row0, nrows, n0, limit, stride_cm,
                       aidx_ptr, ep_ptr, ep_stride, M0, HAS_LIMIT, BN, TOPK, EPI)
        return c0 + K // BK

    @gluon.jit
    def _pow2_exp(amax):
        """e = ceil(log2(max(amax, 1e-4) / 448)) from amax's f32 bits, no division: a = m 2^k
        (1 <= m < 2) is at most 448 2^e = 1.75 2^(e + 8) for e = k - 8 where m <= 1.75 (the
        mantissa field <= 0x600000), else for e = k - 7 - exactly quantize_act's exponent
        (kernels.dense.quant.ceil_log2_div: the correctly rounded quotient's ceil(log2)
        lands on the same integer on both sides of 1.75, the exact power of two included)."""
        bits = ttgl.maximum(amax, 1e-4).to(ttgl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(ttgl.int32)

    @gluon.jit
    def _epilogue_wide(acc1a, acc1b, acc3a, acc3b, c_ptr, row0, nrows, n0, limit, stride_cm,
                       aidx_ptr, ep_ptr, ep_stride, M0: ttgl.constexpr,
                       HAS_LIMIT: ttgl.constexpr, BN: ttgl.constexpr, TOPK: ttgl.constexpr,
                       EPI: ttgl.constexpr):
        """The 128-column tile's output, rows M0 .. M0 + 63 (stored where < nrows):
        EPI 0: swiglu(W1 part, W3 part) in out's dtype at the expert-sorted rows, columns n0..;
        EPI 1: the same quantized per row and the tile's 128 columns (one block of H) as
        quantize_act fp8_1x128 does - scale 2^e, e = _pow2_exp(row amax), codes = h 2^-e
        clamped to +-448 and rounded to E4M3 nearest-even by the conversion (cvt.rn.satfinite)
        into out (E4M3), the scale 2^e (f32) into ep_ptr[row, n0 / 128] (row stride ep_stride);
        EPI 2 (DOWN, l2_gluon_ws_fp8): the four accumulators are output columns n0 .. n0 + 255
        of Y (W2 rows: "W1"'s 128, then "W3"'s), times the pair's combine weight ep_ptr[p], p =
        aidx_ptr[row] (moe_gluon_l2's epilogue: acc x 2^(S - 127) x row_w), scattered to row
        (p // TOPK) ep_stride + p % TOPK of y (ep_stride = its slots per token)."""
        rm = M0 + ttgl.arange(0, 64, layout=ROW_L)
        rok = rm < nrows
        rows = rok[:, None]
        rn = n0 + ttgl.arange(0, WN_C, layout=COL_L)
        ty = c_ptr.dtype.element_ty
        if EPI == 2:
            p = ttgl.load(aidx_ptr + row0 + rm, mask=rok, other=0)
            w = ttgl.expand_dims(ttgl.load(ep_ptr + p, mask=rok, other=0.0).to(ttgl.float32), 1)
            dst = (p // TOPK).to(ttgl.int64) * ep_stride + p % TOPK
            base = c_ptr + (dst * stride_cm)[:, None]
            ttgl.store(base + rn[None, :], (acc1a * w).to(ty), mask=rows)
            ttgl.store(base + (rn + WN_C)[None, :], (acc1b * w).to(ty), mask=rows)
            ttgl.store(base + (rn + BN)[None, :], (acc3a * w).to(ty), mask=rows)
            ttgl.store(base + (rn + BN + WN_C)[None, :], (acc3b * w).to(ty), mask=rows)
        else:
            base = c_ptr + ((row0 + rm).to(ttgl.int64) * stride_cm)[:, None]
            ha = swiglu(acc1a, acc3a, limit, HAS_LIMIT)
            if EPI == 1:  # both halves live for the row's amax
                hb = swiglu(acc1b, acc3b, limit, HAS_LIMIT)
                e = _pow2_exp(ttgl.maximum(ttgl.max(ttgl.abs(ha), axis=1),
                                           ttgl.max(ttgl.abs(hb), axis=1)))
                inv = ttgl.expand_dims(((127 - e) << 23).to(ttgl.float32, bitcast=True), 1)
                ha = ttgl.minimum(ttgl.maximum(ha * inv, -448.0), 448.0)
                hb = ttgl.minimum(ttgl.maximum(hb * inv, -448.0), 448.0)
                ttgl.store(ep_ptr + (row0 + rm).to(ttgl.int64) * ep_stride + n0 // BN,
                           ((e + 127) << 23).to(ttgl.float32, bitcast=True), mask=rok)
                ttgl.store(base + rn[None, :], ha.to(ty), mask=rows)
                ttgl.store(base + (rn + WN_C)[None, :], hb.to(ty), mask=rows)
            else:  # one half at a time (the gathered-A build at 200 registers spills otherwise)
                ttgl.store(base + rn[None, :], ha.to(ty), mask=rows)
                hb = swiglu(acc1b, acc3b, limit, HAS_LIMIT)
                ttgl.store(base + (rn + WN_C)[None, :], hb.to(ty), mask=rows)

    @gluon.jit
    def _mma(ring, bars, bring, c_ptr, work_ptr, tile, MT, G, P, N, K, limit, stride_cm,
             f1_ptr, f3_ptr, M0: ttgl.constexpr, HAS_LIMIT: ttgl.constexpr, BM: ttgl.constexpr,
             BN: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr, NU: ttgl.constexpr,
             DIAG: ttgl.constexpr, PERSIST: ttgl.constexpr, QLAG: ttgl.constexpr,
             SKIP: ttgl.constexpr, FRAMES: ttgl.constexpr, AREG: ttgl.constexpr,
             aidx_ptr=None, ep_ptr=None, ep_stride=0, TOPK: ttgl.constexpr = 1,
             EPI: ttgl.constexpr = 0):
        """An MMA warpgroup (rows M0 .. M0 + 63 of each tile) over this CTA's tiles."""
        CT: ttgl.constexpr = 2 * BN if EPI == 2 else BN  # weight rows per column tile
        c = 0
        if PERSIST:
            for t in range(tile, ttgl.load(work_ptr) * (N // CT), ttgl.num_programs(0)):
                skip, g, row0, nrows, pid_n = tile_entry(work_ptr, t, N // CT, MT, G, P, BM)
                if not skip:
                    if BN == WN_C:
                        c = _mma_tile(ring, bars, bring, c_ptr, row0, nrows, pid_n * BN, N, K,
                                      c, limit, stride_cm, M0, HAS_LIMIT, BN, BK, NS, NU, DIAG,
                                      SKIP)
                    else:
                        c = _mma_tile_wide(ring, bars, bring, c_ptr, row0, nrows, pid_n * CT, N,
                                           K, c, limit, stride_cm, f1_ptr, f3_ptr,
                                           g.to(ttgl.int32) * N + pid_n * CT, M0, HAS_LIMIT,
                                           BN, BK, NS, NU, DIAG, QLAG, SKIP, FRAMES, AREG,
                                           aidx_ptr, ep_ptr, ep_stride, TOPK, EPI)
        else:
            _, g, row0, nrows, pid_n = tile_entry(work_ptr, tile, N // CT, MT, G, P, BM)
            if BN == WN_C:
                _mma_tile(ring, bars, bring, c_ptr, row0, nrows, pid_n * BN, N, K, c, limit,
                          stride_cm, M0, HAS_LIMIT, BN, BK, NS, NU, DIAG, SKIP)
            else:
                _mma_tile_wide(ring, bars, bring, c_ptr, row0, nrows, pid_n * CT, N, K, c, limit,
                               stride_cm, f1_ptr, f3_ptr, g.to(ttgl.int32) * N + pid_n * CT, M0,
                               HAS_LIMIT, BN, BK, NS, NU, DIAG, QLAG, SKIP, FRAMES, AREG,
                               aidx_ptr, ep_ptr, ep_stride, TOPK, EPI)

    @gluon.jit
    def _tile_chunks(work_ptr, tile, MT, G, P, N, K, BM: ttgl.constexpr, BN: ttgl.constexpr,
                     BK: ttgl.constexpr, PERSIST: ttgl.constexpr, DOWN: ttgl.constexpr = False):
        """How many chunks this CTA's tiles hold: K / BK per tile that tile_entry does not skip
        (every partition walks the same tiles and skips the same ones, so their global chunk
        numbers - the rings' stages and phases - agree)."""
        CT: ttgl.constexpr = 2 * BN if DOWN else BN  # weight rows per column tile
        n = K // BK
        if PERSIST:
            total = 0
            for t in range(tile, ttgl.load(work_ptr) * (N // CT), ttgl.num_programs(0)):
                skip, _, _, _, _ = tile_entry(work_ptr, t, N // CT, MT, G, P, BM)
                total += ttgl.where(skip, 0, n)
            n = total
        return n


    # ---- the kernel ----------------------------------------------------------------------------

    @gluon.jit
    def l1_ws_kernel(a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, bs1_ptr, w3_desc, bs2_ptr, c_ptr,
                     work_ptr, f1_ptr, f3_ptr, ep_ptr, e1_desc, e3_desc, sa_desc, f1_desc,
                     f3_desc,
                     MT, N, K, G, P, limit, stride_am, stride_as, stride_bsg, stride_bsn,
                     stride_cm, ep_stride, TOPK: ttgl.constexpr, HAS_LIMIT: ttgl.constexpr,
                     USE_ASM: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr,
                     BK: ttgl.constexpr, NS: ttgl.constexpr, NU: ttgl.constexpr,
                     LAG: ttgl.constexpr, DIAG: ttgl.constexpr, PERSIST: ttgl.constexpr,
                     A_TMA: ttgl.constexpr, QLAG: ttgl.constexpr, UPP: ttgl.constexpr,
                     SKIP: ttgl.constexpr, FRAMES: ttgl.constexpr, AREG: ttgl.constexpr,
                     R_MMA: ttgl.constexpr, R_UP: ttgl.constexpr, R_LD: ttgl.constexpr,
                     LUP: ttgl.constexpr, LUPL: ttgl.constexpr, EPI: ttgl.constexpr = 0,
                     STMA: ttgl.constexpr = False):
        """Program pid: row tile pid // (N / BN) of moe.tile_list at BM rows, columns
        (pid % (N / BN)) * BN of W1 and W3 (w1_desc / w3_desc: the banks as [G N, K / 2] bytes,
        boxes [BN, BK / 2]). N % BN == 0, K % BK == 0 (the launcher checks); out-of-range list
        entries exit before any pointer is formed or any warp is specialized. EPI
        (_epilogue_wide): 0 H, 1 H quantized to E4M3 per 128 columns (scales into ep_ptr), 2
        the DOWN GEMM of l2_gluon_ws_fp8 (column tiles of 2 BN rows of one weight; ep_ptr the
        combine weights)."""
        ttgl.static_assert(BM == 128, "two MMA warpgroups of 64 rows")
        ttgl.static_assert((BN == WN_C) | (BN == 2 * WN_C),
                           "64 or 128 columns of W1 and W3 (the TMA box; 64-column wgmmas)")
        ttgl.static_assert(BK == 128, "128-column chunks (one A scale per chunk)")
        ttgl.static_assert((NS >= 2) & (NU >= 2), "double-buffered rings at least")
        ttgl.static_assert((LAG >= 1) & (LAG < NS), "1 <= LAG <= NS - 1 (the loader's lag)")
        ttgl.static_assert((not FRAMES) | (BN == 2 * WN_C), "row frames: the 128-column tile")
        ttgl.static_assert((EPI == 0) | ((BN == 2 * WN_C) & A_TMA),
                           "the FP8-H epilogues: the 128-column tile with A by TMA")
        ttgl.static_assert((not STMA) | (A_TMA & ((DIAG & 4) == 0)),
                           "the small copies by TMA: A by TMA too (no cp.async left)")
        DOWN: ttgl.constexpr = EPI == 2
        CT: ttgl.constexpr = 2 * BN if DOWN else BN  # weight rows per column tile
        ttgl.static_assert((not LUP) | ((BN == 2 * WN_C) & (UPP == 2) & (LUPL >= LAG)
                                        & (LUPL < NS)),
                           "the loader's upcast share: 128 columns, two upcast partitions, "
                           "LAG <= LUPL < NS")

        tile = ttgl.program_id(0)
        if not PERSIST:
            skip, _, _, _, _ = tile_entry(work_ptr, tile, N // CT, MT, G, P, BM)
            if skip:
                return

        a_r = ttgl.allocate_shared_memory(ttgl.float8e4nv, [NS, BM, BK], F8_SMEM)
        w1_r = ttgl.allocate_shared_memory(ttgl.uint8, [NS, BN, BK // 2], w1_desc.layout)
        w3_r = ttgl.allocate_shared_memory(ttgl.uint8, [NS, BN, BK // 2], w3_desc.layout)
        if STMA:  # the small copies by TMA: buffers in the descriptors' layouts, read through
            # plain views of the same bytes (the exponents: [2 BN, 16] a stage, the chunk's 4
        # bytes first in each row)
            e_t = ttgl.allocate_shared_memory(ttgl.uint8, [NS, 2 * BN, 16], e1_desc.layout)
            e_r = e_t  # (_upcast_store reads a row's first 4 bytes)
            sa_t = ttgl.allocate_shared_memory(ttgl.float32, [NS, 1, BM], sa_desc.layout)
            sa_r = sa_t._reinterpret(ttgl.float32, [NS, BM], FLAT1)
            if FRAMES:
                f_t = ttgl.allocate_shared_memory(ttgl.int32, [NS, 2, BN], f1_desc.layout)
                f_r = f_t._reinterpret(ttgl.int32, [NS, 2 * BN], FLAT1)
            else:
                f_t = sa_t
                f_r = sa_r  # never read
        else:
            e_r = ttgl.allocate_shared_memory(ttgl.uint8, [NS, 2 * BN, 4], FLAT)
            sa_r = ttgl.allocate_shared_memory(ttgl.float32, [NS, BM], FLAT1)
            if FRAMES:  # the rows' frames (int32 [2 BN]: W1's, W3's), with every chunk
                f_r = ttgl.allocate_shared_memory(ttgl.int32, [NS, 2 * BN], FLAT1)
            else:
                f_r = sa_r  # never read
            e_t = e_r
            sa_t = sa_r
            f_t = f_r
        b1_r = ttgl.allocate_shared_memory(ttgl.float8e4nv, [NU, BN, BK], F8_SMEM)
        b3_r = ttgl.allocate_shared_memory(ttgl.float8e4nv, [NU, BN, BK], F8_SMEM)
        sb_r = ttgl.allocate_shared_memory(ttgl.float32, [NU, 2 * BN], FLAT1)
        r_ready = ttgl.allocate_shared_memory(ttgl.int64, [NS, 1], mbarrier.MBarrierLayout())
        r_free = ttgl.allocate_shared_memory(ttgl.int64, [NS, 1], mbarrier.MBarrierLayout())
        b_ready = ttgl.allocate_shared_memory(ttgl.int64, [NU, 1], mbarrier.MBarrierLayout())
        b_free = ttgl.allocate_shared_memory(ttgl.int64, [NU, 1], mbarrier.MBarrierLayout())
        for s in ttgl.static_range(NS):
            # the TMA's expect + the loader's arrive (STMA: the expect alone)
            mbarrier.init(r_ready.index(s), count=1 if STMA else 2)
            # 2 MMA warpgroups + the upcast partitions (UPP: one, or two - W1 / W3 - each)
            # (+ the loader, LUP: it upcasts a share of each chunk)
            mbarrier.init(r_free.index(s), count=2 + UPP + LUP)
        for u in ttgl.static_range(NU):
            mbarrier.init(b_ready.index(u), count=UPP + LUP)
            mbarrier.init(b_free.index(u), count=2)
        fence_async_shared()  # the initialized barriers, before the TMA unit signals them

        ring = (a_r, w1_r, w3_r, e_r, sa_r, f_r)
        bring = (b1_r, b3_r, sb_r)
        sd = (e1_desc, e3_desc, sa_desc, f1_desc, f3_desc)
        sring = (e_t, sa_t, f_t)
        bars = (r_ready, r_free, b_ready, b_free)
        # (Gluon: the partitions' argument tuples written out in each call - a tuple bound to a
        # name first loses its constexprs)
        if UPP == 1:
            ttgl.warp_specialize([
                (_mma, (ring, bars, bring, c_ptr, work_ptr, tile, MT, G, P, N, K, limit,
                        stride_cm, f1_ptr, f3_ptr, 0, HAS_LIMIT, BM, BN, BK, NS, NU, DIAG,
                        PERSIST, QLAG, SKIP, FRAMES, AREG, aidx_ptr, ep_ptr, ep_stride, TOPK,
                        EPI)),
                (_mma, (ring, bars, bring, c_ptr, work_ptr, tile, MT, G, P, N, K, limit,
                        stride_cm, f1_ptr, f3_ptr, 64, HAS_LIMIT, BM, BN, BK, NS, NU, DIAG,
                        PERSIST, QLAG, SKIP, FRAMES, AREG, aidx_ptr, ep_ptr, ep_stride, TOPK,
                        EPI)),
                (_upcaster, (ring, bars, bring, work_ptr, tile, MT, G, P, N, K, USE_ASM, BM, BN,
                             BK, NS, NU, DIAG, PERSIST, 3, FRAMES, False, DOWN)),
                (_loader, (a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, w3_desc, bs1_ptr, bs2_ptr,
                           ring, bars, work_ptr, tile, MT, G, P, N, K, stride_am,
                           stride_as, stride_bsg, stride_bsn, f1_ptr, f3_ptr, TOPK, BM, BN, BK,
                           NS, LAG, DIAG, PERSIST, A_TMA, FRAMES, bring, USE_ASM, NU, False,
                           LUPL, DOWN, STMA, sd, sring)),
            ], [4, 4, 4], [R_MMA, R_UP, R_LD])
        else:  # two upcast partitions: W1's and W3's
            ttgl.warp_specialize([
                (_mma, (ring, bars, bring, c_ptr, work_ptr, tile, MT, G, P, N, K, limit,
                        stride_cm, f1_ptr, f3_ptr, 0, HAS_LIMIT, BM, BN, BK, NS, NU, DIAG,
                        PERSIST, QLAG, SKIP, FRAMES, AREG, aidx_ptr, ep_ptr, ep_stride, TOPK,
                        EPI)),
                (_mma, (ring, bars, bring, c_ptr, work_ptr, tile, MT, G, P, N, K, limit,
                        stride_cm, f1_ptr, f3_ptr, 64, HAS_LIMIT, BM, BN, BK, NS, NU, DIAG,
                        PERSIST, QLAG, SKIP, FRAMES, AREG, aidx_ptr, ep_ptr, ep_stride, TOPK,
                        EPI)),
                (_upcaster, (ring, bars, bring, work_ptr, tile, MT, G, P, N, K, USE_ASM, BM, BN,
                             BK, NS, NU, DIAG, PERSIST, 1, FRAMES, LUP, DOWN)),
                (_upcaster, (ring, bars, bring, work_ptr, tile, MT, G, P, N, K, USE_ASM, BM, BN,
                             BK, NS, NU, DIAG, PERSIST, 2, FRAMES, LUP, DOWN)),
                (_loader, (a_ptr, a_desc, as_ptr, aidx_ptr, w1_desc, w3_desc, bs1_ptr, bs2_ptr,
                           ring, bars, work_ptr, tile, MT, G, P, N, K, stride_am,
                           stride_as, stride_bsg, stride_bsn, f1_ptr, f3_ptr, TOPK, BM, BN, BK,
                           NS, LAG, DIAG, PERSIST, A_TMA, FRAMES, bring, USE_ASM, NU, LUP,
                           LUPL, DOWN, STMA, sd, sring)),
            ], [4, 4, 4, 4], [R_MMA, R_UP, R_UP, R_LD])


def kernel_consts(*, topk: int, has_limit: bool, use_asm: bool = True,
                  stages: int | None = None, bstages: int | None = None, lag: int | None = None,
                  diag: int = 0, persist: bool | None = None, a_tma: bool | None = None,
                  regs: tuple[int, int, int] | None = None, bn: int = BN,
                  qlag: int | None = None, upp: int | None = None,
                  skip: bool | None = None, frames: bool = False,
                  areg: bool | None = None, lup: bool | None = None, epi: int = 0,
                  stma: bool = False) -> dict:
    """l1_ws_kernel's constexprs (the launcher's and the ahead-of-time build test's); lag None:
    LAG (clamped to stages - 1); stages / bstages / regs None: the tile's defaults (NS / NU /
    REGS at bn 64, NS_WIDE / NU_WIDE / REGS_WIDE at bn 128); qlag (bn 128 only): 1 = the next
    quarter's wgmma issued before this one's promotion (REGS_WIDE_Q), 0 = one at a time; None:
    WIDE_QLAG with A by TMA, else 0. upp: upcast partitions, 1, or 2 (W1's and W3's: bn 128
    with A by TMA and qlag 0 only, REGS_WIDE_U2, launch_maxnreg 96); None: WIDE_UPP there, else
    1. skip None: SKIP_IDLE (the rows 64..127 warpgroup's wgmmas skipped on tiles of <= 64
    rows). frames: the weights' frames per row over all of K (bn 128 only; l1_gluon_ws). epi:
    the epilogue (_epilogue_wide: 0 H, 1 FP8 H + scales, 2 the FP8-H down GEMM; 1 and 2 need
    bn 128 and A by TMA). stma: the A scales, exponents and frames by TMA as well (A by TMA;
    not the down GEMM: W2's exponent rows are not a TMA stream; l1_gluon_ws)."""
    if stma and (epi == 2 or a_tma is False):
        raise ValueError("stma: A by TMA, not the down GEMM")
    if bn not in (BN, BN_WIDE):
        raise ValueError(f"bn {bn}: {BN} or {BN_WIDE}")
    if epi not in (0, 1, 2):
        raise ValueError(f"epi {epi}: 0, 1 or 2")
    if epi and (bn != BN_WIDE or a_tma is False):
        raise ValueError(f"epi {epi} (FP8 H): bn {BN_WIDE} with A by TMA")
    if epi or stma:
        a_tma = True
    wide = bn == BN_WIDE
    if frames and not wide:
        raise ValueError(f"row frames need bn {BN_WIDE}")
    stages = (NS_WIDE if wide else NS) if stages is None else int(stages)
    bstages = (NU_WIDE if wide else NU) if bstages is None else int(bstages)
    r_mma, r_up, r_ld = (REGS_WIDE if wide else REGS) if regs is None else regs
    lag = min(LAG, stages - 1) if lag is None else int(lag)
    persist = PERSIST if persist is None else bool(persist)
    a_tma = A_TMA if a_tma is None else bool(a_tma)
    # qlag None: WIDE_QLAG where A comes by TMA (its loader fits 24 registers), else 0 (the
    # gathered A's loader needs 48: no room for the second partial)
    qlag = ((WIDE_QLAG if a_tma else 0) if qlag is None else int(qlag)) if wide else 0
    if qlag not in (0, 1):
        raise ValueError(f"qlag {qlag}: 0 or 1")
    upp = ((WIDE_UPP if wide and a_tma and qlag == 0 else 1) if upp is None else int(upp))
    if upp not in (1, 2) or (upp == 2 and not (wide and a_tma and qlag == 0)):
        raise ValueError(f"upp {upp}: 1, or 2 with bn {BN_WIDE}, A by TMA and qlag 0")
    areg = (AREG and frames and a_tma and qlag == 0) if areg is None else bool(areg)
    if areg and not (wide and frames and a_tma and qlag == 0):
        # (with gathered A the loader's 48 registers leave too few: 16 bytes spilled)
        raise ValueError(f"areg: bn {BN_WIDE} with row frames, A by TMA and qlag 0")
    # None: the default where it applies (two upcast partitions, a ring deep enough for the
    # share's lag: 2-stage rings run without it); asked for explicitly, it must apply
    lup = (LOADER_UPCAST and upp == 2 and _lup_fits(lag, stages)) if lup is None else bool(lup)
    if lup and not (upp == 2 and _lup_fits(lag, stages)):
        raise ValueError(f"lup: two upcast partitions (bn {BN_WIDE}, A by TMA, qlag 0) and "
                         f"lag <= {LUP_LAG} < stages")
    if regs is None and wide:
        r_mma, r_up, r_ld = (REGS_WIDE_LUP_AREG if lup and areg else REGS_WIDE_LUP if lup
                             else REGS_WIDE_AREG if areg and upp == 2
                             else REGS_WIDE_U2 if upp == 2
                             else REGS_WIDE_Q if qlag else REGS_WIDE)
    return dict(TOPK=topk, HAS_LIMIT=has_limit,
                USE_ASM=bool(use_asm), BM=BM, BN=bn, BK=BK,
                NS=stages, NU=bstages, LAG=lag, DIAG=int(diag), PERSIST=persist, A_TMA=a_tma,
                QLAG=qlag, UPP=upp, SKIP=SKIP_IDLE if skip is None else bool(skip),
                FRAMES=bool(frames), AREG=areg, R_MMA=r_mma, R_UP=r_up, R_LD=r_ld, LUP=lup,
                LUPL=int(LUP_LAG), EPI=int(epi), STMA=bool(stma))


def launch_maxnreg(consts: dict) -> int:
    """The launch register cap for kernel_consts(...): the SM's 64K registers over the CTA's
    warps (16: 128; 20 with two upcast partitions: 96, a multiple of 8)."""
    return MAXNREG if consts["UPP"] == 1 else 96


def l1_gluon_ws(a_q, a_scale, a_idx, w1, w3, counts, out, *, topk: int, max_tiles: int,
                limit: float | None = None, tiles: torch.Tensor | None = None,
                use_asm: bool | None = None, stages: int | None = None,
                bstages: int | None = None, lag: int | None = None,
                diag: int = 0, persist: bool | None = None,
                ctas: int | None = None, a_tma: bool | None = None,
                bn: int = BN, qlag: int | None = None, upp: int | None = None,
                skip: bool | None = None,
                frames: tuple[torch.Tensor, torch.Tensor] | None = None,
                areg: bool | None = None, lup: bool | None = None,
                out_scale: torch.Tensor | None = None,
                stma: bool | None = None, a_prep: bool = True) -> torch.Tensor:
    """out [P, F] (expert-sorted rows; fp16 in routed_experts, fp32 / bf16 fine; a row-strided
    view is fine) = swiglu(A W1^T, A W3^T) per expert, A row of sorted row r = a_q[a_idx[r] //
    topk] (E4M3 [T, d] with 16-byte aligned rows, a_scale [T, d / 128] f32); w1 / w3: moe.Bank
    MXFP4 [E, F, d / 2] (expert rows one stride apart: the TMA descriptor) with E8M0 [E, F, d / 32];
    counts [E] int32 rows per expert. Row tiles of BM = 128 rows: max_tiles bounds them
    (min(P, P // 128 + E)); tiles: moe.tile_list(counts, 128, max_tiles) if already built (else
    built here: one tiny launch, no host sync, CUDA-graph capturable). use_asm: the PRMT table
    upcast (default) or its integer twin (the same bits). stages / bstages: the raw / B ring
    depths (default NS / NU); lag: the loader's lag (1 <= lag < stages; default LAG clamped);
    diag: DIAG bits - skips work and gives WRONG results, for timing diagnosis only; persist:
    one CTA per SM over all tiles (default PERSIST); ctas: the persistent grid instead of the SM
    count (the tests walk many tiles per CTA at small sizes); a_tma: A by TMA from an
    expert-sorted copy of its rows made here (default A_TMA); bn: the tile's columns of W1 and
    W3, BN (64) or BN_WIDE (128: half the A bytes per MMA - each A chunk feeds 256 wgmma
    columns -, the same bits; its ring defaults NS_WIDE / NU_WIDE); qlag / upp / skip: kernel_consts'.
    frames: (f1, f3) = row_frames(w1, w3) (bn 128 only): each weight row's frame over all of K
    instead of each chunk's - the upcast takes it from the loader, the promotion needs no column
    scales, the epilogue applies 2^(S - 127); row_frames gives them only where that is the same
    bits (every row's exponents within 11 binades of its largest). areg: kernel_consts' (None:
    AREG where frames are given). lup: the loader upcasts a share of each chunk (None:
    LOADER_UPCAST where two upcast partitions run); the same bits. out_scale (FP8 H, the
    vendor's activation quantization before the down projection): out is E4M3 and gets H
    quantized per row and 128 columns as quantize_act fp8_1x128 does, out_scale [>= P, F / 128]
    f32 the scales (bn 128, A by TMA; l2_gluon_ws_fp8 takes both). stma: the A scales (from a
    transposed expert-sorted copy made here), the exponents and the frames by TMA as well, so
    the loader neither waits for nor publishes cp.async copies (None: SMALL_TMA on the
    128-column tile where it applies: A by TMA and the exponent rows a TMA stream, K / 32 % 16
    == 0); the same bits. a_prep: the A copies (sorted rows, tile-ordered scales) by Triton
    kernels (MoeConfig.a_prep_triton), else torch ops."""
    from megagraph.kernels.moe.gluon_decode import _weight_desc

    if not _IMPORT_OK:
        raise RuntimeError("l1_gluon_ws needs Triton 3.6 Gluon")
    problem = args_problem(a_q, a_scale, w1, w3, counts, out, bn)
    if problem:
        raise ValueError(problem)
    N, K = w1.n, w1.k
    wide = bn == BN_WIDE
    ns = (NS_WIDE if wide else NS) if stages is None else int(stages)
    nu = (NU_WIDE if wide else NU) if bstages is None else int(bstages)
    if ns < 2 or nu < 2:
        raise ValueError(f"stages {ns} / bstages {nu}: at least 2 each")
    if lag is not None and not 1 <= int(lag) < ns:
        raise ValueError(f"lag {lag}: 1 <= lag < stages ({ns})")
    P = check_rows(a_scale, a_idx, out, N, K)
    epi = 0
    if out_scale is not None:
        epi = 1
        problem = _fp8_h_problem(out, out_scale, P, N)
        if problem:
            raise ValueError(problem)
    elif out.dtype == torch.float8_e4m3fn:
        raise ValueError("an E4M3 out needs out_scale (FP8 H)")
    if max_tiles == 0 or P == 0:
        return out
    tiles = tile_list(counts, BM, max_tiles, tiles)
    a_tma_on = (A_TMA if a_tma is None else bool(a_tma)) or epi > 0
    stma_ok = a_tma_on and not diag & 4 and _stma_fits(w1, w3)
    if stma is None:
        stma = SMALL_TMA and stma_ok and bn == BN_WIDE
    elif stma and not stma_ok:
        raise ValueError("stma: A by TMA and exponent rows of K / 32 % 16 == 0 bytes "
                         "(contiguous E8M0 banks)")
    consts = kernel_consts(topk=topk, has_limit=limit is not None and limit > 0,
                           use_asm=True if use_asm is None else bool(use_asm), stages=ns,
                           bstages=nu, lag=lag, diag=diag, persist=persist, a_tma=a_tma,
                           bn=bn, qlag=qlag, upp=upp, skip=skip, frames=frames is not None,
                           areg=areg, lup=lup, epi=epi, stma=bool(stma))
    _check_frames(frames, counts.numel(), N, out.device)
    grid = max_tiles * (N // bn)
    if consts["PERSIST"]:
        grid = min(grid, int(ctas) if ctas else sm_count(out.device))
    grid = (grid,)
    w1_desc = _weight_desc(w1, bn)
    a_desc = w1_desc  # a placeholder of the right kind where A_TMA is off (never read)
    if consts["A_TMA"]:
        from megagraph.kernels.moe import triton as moe
        from megagraph.kernels.moe.gluon_common import TensorDescriptor

        a_sorted = moe.sorted_rows(a_q, a_idx, topk, a_prep)
        a_desc = TensorDescriptor(a_sorted, [P, K], [a_sorted.stride(0), 1], [BM, BK],
                                  A_TMA_LAYOUT)
    sdesc = (w1_desc,) * 5  # placeholders of the right kind where STMA is off (never read)
    stride_as = a_scale.stride(0)
    if consts["STMA"]:
        sdesc, stride_as = _small_descs(a_scale, a_idx, topk, tiles, max_tiles, w1, w3, frames,
                                        K, bn, a_prep)
    ep = out_scale if out_scale is not None else a_scale  # (EPI 0: a placeholder, never read)
    l1_ws_kernel[grid](
        a_q, a_desc, a_scale, a_idx, w1_desc, w1.s, _weight_desc(w3, bn), w3.s, out, tiles,
        *(frames if frames is not None else (counts, counts)), ep, *sdesc, max_tiles, N, K,
        counts.numel(), P, float(limit or 0.0), a_q.stride(0), stride_as,
        w1.s.stride(0), w1.s.stride(1), out.stride(0), ep.stride(0), **consts,
        num_warps=NUM_WARPS, maxnreg=launch_maxnreg(consts))
    return out


def _stma_fits(w1, w3) -> bool:
    """STMA's exponent stream: each bank's E8M0 exponents one [G N, K / 32] byte matrix (rows one
    stride apart, contiguous) whose rows are a multiple of 16 bytes (TMA's stride rule), 16-byte
    aligned."""
    for b in (w1, w3):
        e = b.s
        if not e.is_contiguous() or e.shape[-1] % 16 or e.data_ptr() % 16:
            return False
    return True


def _small_descs(a_scale, a_idx, topk: int, tiles, MT: int, w1, w3, frames, K: int, bn: int,
                 a_prep: bool = True):
    """STMA's descriptors (e1, e3, sa, f1, f3) and the scale copy's row length: the A scales in
    tile order (moe.tile_scales: [K / 128, MT BM], chunk i of tile j = one [1, BM] box at [i, j
    BM]), the banks' exponents as [G N, K / 32] bytes in [bn, 16] boxes (chunks 4 (i // 4) ..
    + 3: a box starts 16-byte aligned), the frames as [G N / bn, bn] int32 in [1, bn] boxes (the
    launcher's f1 / f3 where frames are off: placeholders, never read)."""
    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe.gluon_common import TensorDescriptor

    kc = K // 128
    sa_t = moe.tile_scales(a_scale, a_idx, topk, tiles, MT, kc, BM, a_prep)
    P4 = sa_t.shape[1]
    G, N = w1.s.shape[0], w1.s.shape[1]
    e = [TensorDescriptor(b.s.view(torch.uint8).view(G * N, K // 32), [G * N, K // 32],
                          [K // 32, 1], [bn, 16], E_TMA_LAYOUT) for b in (w1, w3)]
    sa = TensorDescriptor(sa_t, [kc, P4], [P4, 1], [1, BM], S_TMA_LAYOUT)
    if frames is not None:
        f = [TensorDescriptor(fr.view(G * N // bn, bn), [G * N // bn, bn], [bn, 1], [1, bn],
                              S_TMA_LAYOUT) for fr in frames]
    else:
        f = [sa, sa]
    return (e[0], e[1], sa, f[0], f[1]), P4


def _check_frames(frames, G: int, N: int, device) -> None:
    """frames (row_frames / down_frames) as the kernel reads them: int32 [G, N] contiguous."""
    for f in frames or ():
        if f.dtype != torch.int32 or tuple(f.shape) != (G, N) or not f.is_contiguous() or \
                f.device != device:
            raise ValueError(f"frames: int32 [{G}, {N}] contiguous on {device} (row_frames), "
                             f"got {f.dtype} {tuple(f.shape)}")


def _fp8_h_problem(h, h_scale, P: int, F: int) -> str | None:
    """Why (h, h_scale) is not an FP8 H of P rows x F columns (E4M3 codes with contiguous,
    16-byte aligned rows: a TMA source; f32 scales [>= P, F / 128] with contiguous rows), or
    None."""
    if h.dtype != torch.float8_e4m3fn or h.shape[0] < P or h.shape[1] != F:
        return f"FP8 H: E4M3 [>= {P}, {F}], got {h.dtype} {tuple(h.shape)}"
    if h.stride(1) != 1 or h.stride(0) % 16 or h.data_ptr() % 16:
        return "FP8 H rows contiguous and 16-byte aligned (the TMA stream)"
    if h_scale.dtype != torch.float32 or h_scale.shape[0] < P or h_scale.shape[1] != F // 128 \
            or h_scale.stride(1) != 1:
        return (f"FP8 H scales: f32 [>= {P}, {F // 128}] with contiguous rows, got "
                f"{h_scale.dtype} {tuple(h_scale.shape)}")
    if h_scale.device != h.device:
        return "FP8 H and its scales on one device"
    return None


# row frames (l1_gluon_ws's frames): exact where every exponent of a weight row is at least
# its frame - 5 (the upcast table flushes below; the frame is max(largest - 6, 1)), i.e. within
# 11 binades of the row's largest; the per-chunk frames flush nothing there either
FRAME_SPAN = 11


def frames_of(s: torch.Tensor) -> torch.Tensor | None:
    """The frames S = max(max_k e - 6, 1) of the weight rows of E8M0 exponents s ([..., N,
    K / 32], uint8 or float8_e8m0fnu) over all of K, int32 [..., N] contiguous; None where a row
    holds an exponent more than FRAME_SPAN binades below its largest: the row frame would flush
    a group the chunk's frame keeps, so the bits would differ from the per-chunk kernel's."""
    e = s.view(torch.uint8)
    S = (e.amax(-1).to(torch.int32) - 6).clamp_min(1)
    if bool((e.amin(-1).to(torch.int32) < S - 5).any()):
        return None
    return S.contiguous()


def row_frames(w1, w3) -> tuple[torch.Tensor, torch.Tensor] | None:
    """frames_of W1's and W3's banks (moe.Bank), cached per weight as long as it lives (built
    once at warm-up: a scan of the exponents with one host sync; None on a miss inside a CUDA
    graph capture, and where frames_of gives None): what routed_experts passes as
    l1_gluon_ws's frames."""
    from megagraph.kernels.gemm import cublas_fp8

    if not w1.s.is_cuda:  # the kernel is CUDA's (and the cache's capture check needs CUDA)
        return None

    def build(pairs):
        f = [frames_of(sc) for _, sc in pairs]
        return () if None in f else tuple(f)  # () is cached too: "does not apply"

    got = cublas_fp8.derived(((w1.w, w1.s), (w3.w, w3.s)), "l1_ws_frames", build)
    return got or None


def args_problem(a_q, a_scale, w1, w3, counts, out, bn: int = BN) -> str | None:
    """Why l1_gluon_ws cannot take these arguments, or None (its launcher raises it;
    moe._l1_kernel asks first and falls through to another L1): the formats, the tile, the
    banks' copies, the TMA weight stream, 16-byte A rows and contiguous out rows. counts None:
    not checked."""
    from megagraph.kernels.moe.gluon_decode import _tma_fits

    problem = l1_format_problem("l1_gluon_ws", a_q, a_scale, w1, w3)
    if problem:
        return problem
    N, K = w1.n, w1.k
    if bn not in (BN, BN_WIDE):
        return f"bn {bn}: {BN} or {BN_WIDE}"
    if N % bn or K % BK or w3.n != N or w3.k != K:
        return f"N {N} / K {K} do not fit the {bn}-column tile / {BK}-column chunk"
    problem = l1_bank_problem(w1, w3, counts)
    if problem:
        return problem
    if not (_tma_fits(w1) and _tma_fits(w3)):
        return "the TMA weight stream needs expert rows one stride apart, G N < 2^31"
    if a_q.stride(1) != 1 or a_q.stride(0) % 16 or a_q.data_ptr() % 16 or out.stride(1) != 1:
        return "a_q rows contiguous and 16-byte aligned (16-byte cp.async), out rows contiguous"
    return None
