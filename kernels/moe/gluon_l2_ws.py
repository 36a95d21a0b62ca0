"""Warp-specialized Gluon (Triton 3.6, sm_90) kernel for the PREFILL routed-expert L2 GEMM (the
down projection, > 48 rows per expert): Y = row_w x (H W2^T) on MXFP4 W2 with the fp16 H of the
L1, scattered to the (token, slot) rows of y - the drop-in twin of moe_gluon_l2.l2_gluon (same
arguments, same numerics, the same bits expected), with persistent CTAs and the W2 upcast in its
own warps. routed_experts' prefill L2 by default (H200, 8192 tokens: 3.99 -> 3.45 ms at
256-column tiles, benchmarks/results/moe-gluon-l2-ws-h200.md). One file of ~800 lines: the
partitions, their rings and the launcher's register and shared-memory budget are one design.

Why: the DIAG run of moe_gluon_l2 on the H200 (docs/kernels/moe.md) - everything 4.00
ms at 8192 tokens, 2.76 without the W2 loads / upcast, 2.34 for the wgmma + epilogue alone: the
W2 path (exponent loads, PRMT upcast, shared stores) serializes with the MMA chain in the one set
of 8 warps that does everything. Here each job has its own warps (moe_gluon_ws's structure, which
runs correctly on the H200), synchronized only by mbarriers:

  loader  (worker, 4 warps; one elected thread issues): per K chunk c (global count, running on
          across this CTA's tiles) into raw stage s = c % NS, once r_free[s] - TMA of the H rows
          row0 .. row0 + 127 of the expert-sorted H as two [64, BK] fp16 boxes, the second only
          where the tile has more than 64 rows (128-byte swizzle: the wgmma's A operand as it
          lands; rows past P zero-filled by the TMA unit, rows of the next expert inside a box
          are loaded but their accumulator rows are never stored), and of the packed W2 rows
          [BN, BK / 8] int32 words (32 bytes a row), all on r_ready[s] (one of two predicated
          mbarrier.expects with the bytes issued: count 1).
  upcast  (worker, 4 warps; or two workers of 4 warps, upp=2: each one half of the tile's W2
          rows - its own frames, raw words, B rows and sb entries - so a chunk's upcast is
          split over 8 warps): per tile, the rows' frames S0 = max(max_k e - 13, 1) from all
          K / 32 exponents of its W2 rows (moe_gluon_l2's prologue scan, global loads); per
          chunk, once r_ready[s] and b_free[u] (u = c % NU): the stage's packed words (LDS.128
          per (row, 32-column group)) and the chunk's exponents (global loads prefetched two
          chunks ahead, as in moe_gluon_l2) -> exact fp16 e2m1 x 2^(e - S0) by the same PRMT table
          (moe_gluon_l2._upcast_store: the same code, the same bits) into B stage u [BN, BK]
          (K-major, 128-byte swizzle); at a tile's last chunk also the frame scales 2^(S0 - 127)
          into sb[u]; fence.proxy.async (writer-side: this thread's st.shared before the wgmma's
          async-proxy reads, its ld.shared of the raw stage before the next TMA write), the
          partition barrier, then arrive r_free[s] and b_ready[u] (each upcast partition its
          own arrivals: the stage is ready / free once all of them arrived).
  MMA     (the default partition = rows 0..63, one worker = rows 64..127; one warpgroup each):
          per chunk, once r_ready[s] and b_ready[u]: wgmma m64n128k16 x 4 (fp16 -> fp32, async)
          chained on ONE accumulator, then wait(1) - the chunk before has retired - and its stages
          released (r_free, b_free). The rows 64..127 warpgroup skips its wgmmas on tiles of <= 64
          rows (their second H box is not loaded; nothing of them is stored): at poisson routing
          ~1 / 3 of the tiles (an expert's second tile) - less tensor work and H traffic.
          After the tile's last chunk: wait(0), the frame scales read from sb[u] of that last
          stage, the stages released, the weighted scatter epilogue
          y[(p // TOPK) * KS + p % TOPK, n] = (acc[r, n] x 2^(S0[n] - 127)) x row_w[p] (the pair
          indices and weights are loaded at the tile's start, used at its end).

Barriers (mbarrier, one per stage): r_ready [NS] count 1 (the expect-tx arrive; the TMA bytes
complete it), r_free [NS] count 2 + UPP (both MMA warpgroups + every upcast partition: each
reads the raw stage), b_ready [NU] count UPP (the upcast partitions), b_free [NU] count 2.
Every release is moe_gluon_ws._release: a partition barrier, then one elected thread's arrive
(Gluon's mbarrier.arrive has no barrier of its own). Producers wait for "free" at phase ^ 1 (a
fresh barrier counts as having completed the phase before its first).
The MMA warpgroups hold two chunks' stages (the running wgmma and the one queued behind it), so
NS >= 3 and NU >= 3 keep the producers ahead (NU = 2 still runs: the upcast of chunk c + 1 then
overlaps only wgmma(c)).

Numerics: moe_gluon_l2's, exactly: the same per-row frame S0 over all of K, the same exact fp16
weights (the same upcast function), the same wgmma (m64n128k16 fp16 -> fp32, 64 rows a warpgroup)
in the same K order on one accumulator from zero, the same epilogue expression. The tensor core's
sums are the same instruction sequence per output element, so y is expected to equal
moe_gluon_l2's bit for bit (the GPU tests check that, and the fp32 math within its bound).

Tile: BM = 128 expert-sorted rows (moe.tile_list at 128 rows: the same list as the L1's and
moe_gluon_l2's) x BN = 128 output columns, BK = 64-column chunks (any K % 64 == 0; the launcher
keeps moe_gluon_l2's acceptance, K % 192, so the two take the same calls). 16 warps (20 at
upp 2), one CTA per SM (launch maxnreg 128 = the SM's 64K registers): setmaxnreg REGS for the
workers (MMA rows 64..127, upcast, loader), the default partition the rest of 4 x 128.
Persistent: grid = min(the tile count, SMs) (or `ctas`), CTA i walks work items i, i + grid, ...
of the row-tile-major order (row tile t // (N / BN), column tile t % (N / BN)), skipping the
list's empty entries the same way in every partition so their chunk counts (stages, phases)
agree. Shared memory: NS x (16 + 4) KB raw + NU x 16 KB B + NU x 512 B frames: NS = 6, NU = 3 by
default (~169 KB); 8:3 fits (~210 KB).

bn = 256 (opt-in, `bn=256`; d % 256): a tile of 128 rows x 256 output columns, each MMA warpgroup
with two 64 x 128 accumulators chained on the same m64n128k16 wgmmas (the same instruction
sequence per output element: the same bits), waiting with two groups in flight; the upcast does
the two 128-row halves one after the other (frame scans looped, not unrolled: registers). Half
the H bytes (TMA and shared-memory writes) per FLOP. Rings NS_256:NU_256 = 4:3 (~195 KB),
setmaxnreg REGS_256.

upp = 2 (the default at bn 256, UPP; bn 128 keeps one): two upcast
partitions,
each the rows of one half of the tile (bn 256: rows 0..127 / 128..255, the halves the one
partition does one after the other; bn 128: 0..63 / 64..127), with the same upcast code per row
(the same bits). Why: the H200's ncu of the bn 256 L2 (2.69 ms at 8192 tokens, balanced) - both
MMA warpgroups spin on b_ready, the loader on r_free, the one upcast partition never waits (~329
instructions per chunk and warp). 20 warps: launch maxnreg MAXNREG_U2 = 96, setmaxnreg
REGS_256_U2 / REGS_U2 (bn 256 / 128: each MMA warpgroup 176 / 128, each upcast 48 / 96).

Triton 3.6 sm_90 build (tests/kernels/test_moe_gluon_l2_ws.py::test_l2_ws_sm90_build): the
test pins the numbers. upp 2
(test_l2_ws_sm90_build_two_upcasts): no stack / spills; per chunk each upcast loop 67 PRMT /
~190 instructions at bn 256 (one partition: 134 / 328), 33 / ~108 at bn 128 (67 / 181).
"""
from __future__ import annotations

import torch

from megagraph.kernels.moe.gluon_common import IMPORT_OK as _IMPORT_OK
from megagraph.kernels.moe.gluon_common import (
    available,  # noqa: F401  (the tests, the probe and moe call it here)
    tile_list,
)
from megagraph.kernels.moe.gluon_l2 import BK, BM, BN, OUT_DTYPES, REL_MAX, REL_MIN, _check  # noqa: F401

H_BOX = BM // 2  # the H TMA box's rows (one MMA warpgroup's 64; the second box only where used)
NS, NU = 6, 3  # default depths of the raw ring (H box + packed W2) and the B (upcast) ring
NS_256, NU_256 = 4, 3  # ... at bn 256 (24 KB raw, 33 KB B stages: 6:3 does not fit)
NUM_WARPS = 4  # the default partition (MMA rows 0..63); 3 workers of 4 warps: 16 warps in all
MAXNREG = 128  # launch register cap: 16 warps x 32 x 128 = the SM's 64K registers
# setmaxnreg of the workers (MMA rows 64..127, upcast, loader); the default partition gets the
# rest of the 4 x 128 per thread: 512 - 136 - 192 - 48 = 136. The MMA warpgroups need ~120 (a
# 64 x 128 fp32 accumulator and the epilogue: no spills at 120 in the Triton 3.6 build), the
# upcast 144 (more lets ptxas hoist more of the next chunk); the arithmetic twin's upcast (a
# test aid) needs ~200: REGS_ARITH
REGS = (136, 192, 48)
REGS_ARITH = (136, 200, 40)
# bn 256: two 64 x 128 fp32 accumulators per MMA warpgroup (176: no spills at 176, spills at
# 168), the upcast's two halves at 128 with its frame scans looped (UNROLL False)
REGS_256 = (176, 128, 32)
# two upcast partitions (upp 2), each one half of the tile's W2 rows (the H200's ncu: the L2 at
# bn 256 is bound by its one upcast partition - the MMA warpgroups spin on b_ready, the upcast
# never waits): 20 warps at a launch cap of MAXNREG_U2 = 96 (20 x 32 x 96 <= 64K registers), so
# per warpgroup lane 5 x 96 = 480 = the default MMA warpgroup (what Triton leaves it: 480 - the
# workers' sum) + R_MMA + 2 R_UP + R_LD. Default at bn 256 (H200,
# 8192 tokens, balanced routing: the L2 2.69 -> 2.55 ms, mega_moe 7.85 -> 7.55 ms in one A/B, the
# same bits; at bn 128 two partitions were slower, 2.89 -> 3.00 ms: one there)
UPP = 2
MAXNREG_U2 = 96
# bn 256: 176 + 176 (MMA: spills at 168) + 2 x 48 (halves of 128 rows, frame scans looped: no
# spills at 48 in the Triton 3.6 build) + 32; the default MMA warpgroup gets 176
REGS_256_U2 = (176, 48, 32)
# bn 128: 128 + 128 (MMA: no spills down to 120) + 2 x 96 (halves of 64 rows; at 88, beside MMA
# 136, the frame scan LLVM unrolls spills 24 B) + 32; the default MMA warpgroup gets 128
REGS_U2 = (128, 96, 32)
# LUP (bn 256 with two upcast partitions): the loader partition - its TMA issues are one elected
# thread's, the rest of its time it waits on r_free - upcasts rows 96..127 and 224..255 of every
# chunk (32-row blocks, LW32), LUP_LAG chunks behind its loads (its exponents and frames loaded
# a chunk ahead), with the rows' frames from the weight's cached row frames (row_frames: the
# values the upcasts' scans compute, which they then skip); each upcast partition does 96 of its
# 128 rows (a 64- and a 32-row block). The L1's twin (moe_gluon_ws.LOADER_UPCAST) won 0.4 ms;
# this one LOST on the H200 (8192 tokens, one A/B each, the same bits):
# balanced 6.81 -> 7.13 ms, gate routing 8.61 -> 9.20 ms (with the exponent loads not prefetched:
# 6.84 -> 7.34; LUP_LAG 1: level balanced, slower gate-routed). Off. Why (ncu): the upcasts spin
# on b_free and the MMA on b_ready - it waits for the loader. This kernel's MMA releases a raw
# stage one chunk late, so the loader's load of chunk c waits for the MMA's issue of c - 3, and
# its share of c - 2 comes after that wait: the loader sits on the MMA's critical path
# (benchmarks/results/moe-ws-14-h200.md)
LOADER_UPCAST = False
LUP_LAG = 2
# LUP's setmaxnreg: the loader holds both shares' exponent and frame loads and the tile
# coordinates of the chunk it upcasts (which lags into the previous tile at a tile's start)
REGS_256_U2_LUP = (176, 48, 32)
BN_TILE = 128  # the default tile's output columns (bn): 128 or 256
MAX_SHARED = 227 * 1024  # the sm_90 per-block opt-in limit (232448 B)


def shared_bytes(stages: int = NS, bstages: int = NU, bn: int = BN) -> int:
    """The rings' shared memory (without the barriers' few bytes) at a tile of bn output
    columns: what the launcher checks against MAX_SHARED before a launch that could not
    start."""
    return stages * (BM * BK * 2 + bn * BK // 2) + bstages * (bn * BK * 2 + bn * 4)


def _regs(use_asm: bool, bn: int, upp: int = 1) -> tuple[int, int, int]:
    """The workers' setmaxnreg for a build: REGS, REGS_ARITH (arithmetic upcast), REGS_256
    (bn 256: two accumulators a warpgroup); with two upcast partitions REGS_U2 / REGS_256_U2."""
    if upp == 2:
        return REGS_256_U2 if bn == 2 * BN else REGS_U2
    if bn == 2 * BN:
        return REGS_256
    return REGS if use_asm else REGS_ARITH


def kernel_consts(K: int, use_asm: bool = True, stages: int = NS, bstages: int = NU,
                  regs: tuple[int, int, int] | None = None, bn: int = BN,
                  upp: int | None = None, lup: bool | None = None) -> dict:
    """The constexprs of l2_ws_kernel for K columns of W2 (the launcher's and the build test's):
    KGI = the 16-exponent pieces of a W2 row the frame scan reads (moe_gluon_l2's); NB = bn /
    128 (the output columns of a tile: 128, or 256 as two m64n128k16 accumulators); UPP = the
    upcast partitions (upp None: UPP at bn 256, 1 at bn 128); regs None: _regs (REGS_256_U2_LUP
    with lup); lup: the loader's upcast share (bn 256, two upcast partitions, LUP_LAG + 2 <=
    stages, K / BK >= LUP_LAG; None: LOADER_UPCAST where that applies); LUPL its lag
    (LUP_LAG, read per call: the A/B's knob)."""
    if bn not in (BN, 2 * BN):
        raise ValueError(f"bn {bn}: {BN} or {2 * BN}")
    upp = (UPP if bn == 2 * BN else 1) if upp is None else int(upp)
    if upp not in (1, 2):
        raise ValueError(f"upp {upp}: 1 or 2")
    # (K / BK >= LUP_LAG: a lagging share reaches back one tile at most)
    # (LUP_LAG + 2 <= stages: the MMA warpgroups release a raw stage one chunk late, so the
    # loader's load of chunk c waits for the MMA to have chunk c - stages + 1's B stage, whose
    # share the loader must have made an iteration before)
    fits = (bn == 2 * BN and upp == 2 and LUP_LAG + 2 <= int(stages)
            and K // BK >= LUP_LAG)
    lup = (LOADER_UPCAST and fits) if lup is None else bool(lup)
    if lup and not fits:
        raise ValueError(f"lup: bn {2 * BN}, two upcast partitions, stages >= {LUP_LAG + 2} "
                         f"and K >= {LUP_LAG * BK}")
    r_mma, r_up, r_ld = regs or (REGS_256_U2_LUP if lup else _regs(use_asm, bn, upp))
    return dict(KGI=-(-(K // 32) // 16), USE_ASM=bool(use_asm), BM=BM, BN=BN, BK=BK,
                NS=int(stages), NU=int(bstages), NB=bn // BN, UPP=upp, R_MMA=r_mma, R_UP=r_up,
                R_LD=r_ld, LUP=lup, LUPL=int(LUP_LAG))


def row_frames(w2) -> torch.Tensor | None:
    """The W2 bank's (moe.Bank) row frames S0 = max(max_k e - REL_MAX, 1) over all of K (int32
    [G, N]: exactly what the upcasts' in-kernel scan computes), cached per weight as long as it
    lives (kernels/cublas_fp8.derived: built once at warm-up; None on a miss inside a CUDA-graph
    capture): what the loader's upcast share (lup) reads instead of scanning."""
    from megagraph.kernels.gemm import cublas_fp8

    if not w2.s.is_cuda:
        return None

    def build(pairs):
        (_, sc), = pairs
        e = sc.view(torch.uint8).to(torch.int32)
        return ((e.amax(-1) - REL_MAX).clamp_min(1).to(torch.int32).contiguous(),)

    got = cublas_fp8.derived(((w2.w, w2.s),), "l2_ws_frames", build)
    return got[0] if got else None


def launch_maxnreg(consts: dict) -> int:
    """The launch register cap for kernel_consts(...): the SM's 64K registers over the CTA's
    warps (16: MAXNREG = 128; 20 with two upcast partitions: MAXNREG_U2 = 96)."""
    return MAXNREG if consts["UPP"] == 1 else MAXNREG_U2


if _IMPORT_OK:  # the Triton 3.6 Gluon names (gluon_common's guarded import)
    from megagraph.kernels.moe.gluon_common import (
        fence_async_shared,
        gluon,
        mbarrier,
        tile_entry,
        tma,
        ttgl,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from megagraph.kernels.moe.gluon_l2 import _upcast_store
    from megagraph.kernels.moe.gluon_ws import _release, _stage

    _RMAX = ttgl.constexpr(REL_MAX)

    # ---- layouts (every partition is 4 warps) -------------------------------------------------
    # the MMA warpgroup's m64n128k16 accumulator (moe_gluon_l2's instruction, 64 rows), its rows
    # (pairs, weights, output rows) and columns (frames, output columns)
    MMA_L = ttgl.constexpr(ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16]))
    ROW_L = ttgl.constexpr(ttgl.SliceLayout(1, MMA_L))
    COL_L = ttgl.constexpr(ttgl.SliceLayout(0, MMA_L))
    # packed W2 words [BN, 2 groups, 4 words]: one (row, group) = 16 bytes per thread, rows
    # 64 apart in its two registers sets (moe_gluon_l2's lw at 4 warps)
    LW = ttgl.constexpr(ttgl.BlockedLayout([1, 1, 4], [16, 2, 1], [4, 1, 1], [2, 1, 0]))
    LE = ttgl.constexpr(ttgl.SliceLayout(2, LW))
    # the same words as the stage's [BN, 8] int32 rows (the LDS.128 of one group)
    LW2 = ttgl.constexpr(ttgl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0]))
    # the frame scan's exponent rows [BN, 16] (rows mapped to threads as in LW)
    LX = ttgl.constexpr(ttgl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))
    # ... for a 32-row block (LUP): one (row, group) per PAIR of threads, two words each (no
    # thread holds a copy of another's work)
    LW32 = ttgl.constexpr(ttgl.BlockedLayout([1, 1, 2], [8, 2, 2], [4, 1, 1], [2, 1, 0]))
    LE32 = ttgl.constexpr(ttgl.SliceLayout(2, LW32))
    LW2_32 = ttgl.constexpr(ttgl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0]))
    LX32 = ttgl.constexpr(ttgl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
    # shared: the fp16 tiles (H [BM, BK], B [BN, BK]: 128-byte rows, the wgmma's operands),
    # the packed W2 rows [BN, 8] int32 (32-byte rows, as TMA writes them), the frames
    F16_SMEM = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                     rank=2))
    W_SMEM = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32,
                                                   rank=2))
    FLAT1 = ttgl.constexpr(ttgl.SwizzledSharedLayout(1, 1, 1, [0]))
    H_TMA_LAYOUT = F16_SMEM.value
    W_TMA_LAYOUT = W_SMEM.value

    @gluon.jit
    def _n_tiles(work_ptr, N, BN: ttgl.constexpr):
        """The work items of the device tile list: its row tiles x the column tiles."""
        return ttgl.load(work_ptr) * (N // BN)

    # ---- loader ------------------------------------------------------------------------------

    @gluon.jit
    def _loader(h_desc, w_desc, a_r, w_r, r_ready, r_free, work_ptr, MT, G, P, N, K,
                BM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
                NS: ttgl.constexpr, NB: ttgl.constexpr, b_r=None, sb_r=None, bars=None,
                bs_ptr=None, f_ptr=None, stride_bsg=0, stride_bsn=0,
                USE_ASM: ttgl.constexpr = True, NU: ttgl.constexpr = 3,
                LUP: ttgl.constexpr = False, LUPL: ttgl.constexpr = 2):
        """The raw ring's producer: per chunk of this CTA's tiles, the H box and the packed W2
        rows (NB x BN of them) by TMA on r_ready (module docstring). LUP: after chunk c's
        copies, its upcast share of chunk c - LUP_LAG (_loader_share), with the coordinates of
        that chunk's tile - the previous tile's for a tile's first LUP_LAG chunks - and after
        the last tile the share of the last LUP_LAG chunks."""
        TN: ttgl.constexpr = NB * BN
        HB: ttgl.constexpr = BM // 2  # the H box: one MMA warpgroup's 64 rows
        n_k = K // BK
        c = 0
        pg = 0  # LUP: the previous tile's expert, first column, first chunk
        pn = 0
        pc0 = 0
        if LUP:  # the next share's exponents and frames (loaded one chunk ahead)
            ea = ttgl.zeros([32, 2], ttgl.int32, LE32)
            eb = ttgl.zeros([32, 2], ttgl.int32, LE32)
            sa = ttgl.zeros([32], ttgl.int32, ttgl.SliceLayout(1, LE32))
            sb = ttgl.zeros([32], ttgl.int32, ttgl.SliceLayout(1, LE32))
        for t in range(ttgl.program_id(0), _n_tiles(work_ptr, N, TN), ttgl.num_programs(0)):
            skip, g, row0, nrows, pid_n = tile_entry(work_ptr, t, N // TN, MT, G, P, BM)
            if not skip:
                c0 = c
                g32 = g.to(ttgl.int32)
                wrow = g32 * N + pid_n * TN
                two = nrows > HB  # rows 64.. hold tile rows: their box too, else not loaded
                for i in range(n_k):
                    s, ph = _stage(c, NS)
                    mbarrier.wait(r_free.index(s), ph ^ 1)  # chunk c - NS's readers are done
                    bar = r_ready.index(s)
                    # exactly one of the two expects (one arrival: r_ready's count 1) with the
                    # bytes of the boxes issued below
                    mbarrier.expect(bar, BM * BK * 2 + TN * BK // 2, pred=two)
                    mbarrier.expect(bar, HB * BK * 2 + TN * BK // 2, pred=not two)
                    a_s = a_r.index(s)
                    tma.async_copy_global_to_shared(h_desc, [row0, i * BK], bar,
                                                    a_s.slice(0, HB))
                    tma.async_copy_global_to_shared(h_desc, [row0 + HB, i * BK], bar,
                                                    a_s.slice(HB, HB), pred=two)
                    tma.async_copy_global_to_shared(w_desc, [wrow, i * (BK // 8)], bar,
                                                    w_r.index(s))
                    if LUP:
                        # the share of chunk c - LUP_LAG (its data loaded an iteration ago),
                        # then the loads of the next one's, c + 1 - LUP_LAG: each with the
                        # coordinates of its chunk's tile (this one, or the previous one)
                        if c >= LUPL:
                            jl = c - LUPL - ttgl.where(c - LUPL >= c0, c0, pc0)
                            _loader_share(w_r, b_r, sb_r, bars, c - LUPL, jl, ea, eb, sa,
                                          sb, K, USE_ASM, BK, NS, NU)
                        if c + 1 >= LUPL:
                            jn = c + 1 - LUPL
                            cur = jn >= c0
                            ea, eb, sa, sb = _share_loads(
                                bs_ptr, f_ptr, ttgl.where(cur, g32, pg),
                                ttgl.where(cur, pid_n * TN, pn),
                                jn - ttgl.where(cur, c0, pc0), N, stride_bsg, stride_bsn, BK)
                    c += 1
                pg = g32
                pn = pid_n * TN
                pc0 = c0
        if LUP:
            # the last tile's last LUP_LAG chunks (the first one's data already loaded)
            for q in ttgl.static_range(LUPL):
                j = c - LUPL + q
                if j >= 0:
                    _loader_share(w_r, b_r, sb_r, bars, j, j - pc0, ea, eb, sa, sb, K,
                                  USE_ASM, BK, NS, NU)
                    if q + 1 < LUPL:
                        ea, eb, sa, sb = _share_loads(bs_ptr, f_ptr, pg, pn, j + 1 - pc0, N,
                                                      stride_bsg, stride_bsn, BK)

    @gluon.jit
    def _share_loads(bs_ptr, f_ptr, g, n0, jl, N, stride_bsg, stride_bsn, BK: ttgl.constexpr):
        """LUP: what the loader's share of a chunk (the jl-th of its tile: expert g, output
        columns n0 .. n0 + 255) reads from global memory, requested a chunk ahead: the E8M0
        exponents of the tile's W2 rows 96..127 and 224..255 in this chunk and their frames S0
        (the cached row frames f_ptr, [G, N] int32: row_frames)."""
        rr = ttgl.arange(0, 32, layout=ttgl.SliceLayout(1, LE32))
        grp = ttgl.arange(0, 2, layout=ttgl.SliceLayout(0, LE32))
        rows_a = n0 + 96 + rr
        rows_b = n0 + 224 + rr
        s0a = ttgl.load(f_ptr + g * N + rows_a)
        s0b = ttgl.load(f_ptr + g * N + rows_b)
        e0 = bs_ptr + g.to(ttgl.int64) * stride_bsg + (jl * (BK // 32) + grp)[None, :]
        ea = ttgl.load(e0 + (rows_a.to(ttgl.int64) * stride_bsn)[:, None]).to(ttgl.int32)
        eb = ttgl.load(e0 + (rows_b.to(ttgl.int64) * stride_bsn)[:, None]).to(ttgl.int32)
        return ea, eb, s0a, s0b

    @gluon.jit
    def _loader_share(w_r, b_r, sb_r, bars, j, jl, ea, eb, s0a, s0b, K,
                      USE_ASM: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr,
                      NU: ttgl.constexpr):
        """LUP: the loader's upcast of chunk j (the jl-th of its tile) - the tile's W2 rows
        96..127 and 224..255 with their exponents ea / eb and frames s0a / s0b (_share_loads)
        - into B stage j % NU, at the tile's last chunk with their frame scales into sb; then
        the releases every upcast partition makes (fence, r_free, b_ready). The same codes and
        frames as the upcast partitions': the same bits."""
        r_ready, r_free, b_ready, b_free = bars
        s, ph = _stage(j, NS)
        u, phu = _stage(j, NU)
        mbarrier.wait(r_ready.index(s), ph)
        mbarrier.wait(b_free.index(u), phu ^ 1)
        _upcast_half(w_r.index(s).slice(96, 32), ea, s0a, b_r.index(u).slice(96, 32), USE_ASM,
                     32, BK)
        _upcast_half(w_r.index(s).slice(224, 32), eb, s0b, b_r.index(u).slice(224, 32),
                     USE_ASM, 32, BK)
        if jl == K // BK - 1:  # the epilogue's frame scales 2^(S0 - 127) (S0 >= 1: normal)
            sb_r.index(u).slice(96, 32).store((s0a << 23).to(ttgl.float32, bitcast=True))
            sb_r.index(u).slice(224, 32).store((s0b << 23).to(ttgl.float32, bitcast=True))
        fence_async_shared()
        _release(r_free, j, NS)
        mbarrier.arrive(b_ready.index(u), count=1)

    # ---- upcast ------------------------------------------------------------------------------

    @gluon.jit
    def _frames(bs_ptr, g, n0, K, stride_bsg, stride_bsn, KGI: ttgl.constexpr,
                BN: ttgl.constexpr, BK: ttgl.constexpr, UNROLL: ttgl.constexpr, f_ptr=None,
                N=0, FROWS: ttgl.constexpr = False):
        """W2 rows n0 .. n0 + BN - 1 of expert g: (their exponent pointers [BN, 2 groups] in LE,
        the exponents of chunks 0 and 1 (clamped), the frames S0 in LE's rows, the frame scales
        2^(S0 - 127) in LX's rows). UNROLL: the scan's KGI pieces unrolled (their loads in flight
        together: ~80 registers a thread at K = 2304), else a loop (one piece in flight: the
        two-halves upcast of bn 256 and the upp 2 halves, which spill otherwise; LLVM still
        unrolls the 64-row halves' small loop at bn 128 upp 2, which fits its 96 registers
        where the static_range form spills 8 B). FROWS: S0 from the cached row frames (f_ptr
        [G, N] int32, row_frames: the scan's values) instead of the scan (LUP's partitions)."""
        # ---- the rows' frames S0 = max(max e - REL_MAX, 1) over all K / 32 exponents
        # (moe_gluon_l2's scan: KGI unrolled pieces of 16, masked past K / 32)
        KG = K // 32
        lx: ttgl.constexpr = LX if BN >= 64 else LX32
        le: ttgl.constexpr = LE if BN >= 64 else LE32
        # this tile's exponents of chunks 0 and 1 (e2: chunk 1, clamped) requested with the scan
        rn_w = n0 + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, le))
        grp = ttgl.arange(0, 2, layout=ttgl.SliceLayout(0, le))
        e_ptrs = bs_ptr + g * stride_bsg + (rn_w.to(ttgl.int64) * stride_bsn)[:, None] + \
            grp[None, :]
        n_k = K // BK
        e1 = ttgl.load(e_ptrs).to(ttgl.int32)
        e2 = ttgl.load(e_ptrs + ttgl.minimum(1, n_k - 1) * (BK // 32)).to(ttgl.int32)
        if FROWS:
            s0 = ttgl.load(f_ptr + g * N + rn_w)
            frame = (s0 << 23).to(ttgl.float32, bitcast=True)
        else:
            rn_x = n0 + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, lx))
            cx = ttgl.arange(0, 16, layout=ttgl.SliceLayout(0, lx))
            x_ptrs = bs_ptr + g * stride_bsg + (rn_x.to(ttgl.int64) * stride_bsn)[:, None] + \
                cx[None, :]
            emax = ttgl.zeros([BN], ttgl.int32, ttgl.SliceLayout(1, lx))
            if UNROLL:
                for j in ttgl.static_range(KGI):
                    ex = ttgl.load(x_ptrs + 16 * j, mask=(16 * j + cx < KG)[None, :], other=0)
                    emax = ttgl.maximum(emax, ttgl.max(ex.to(ttgl.int32), axis=1))
            else:
                for j in range(KGI):
                    ex = ttgl.load(x_ptrs + 16 * j, mask=(16 * j + cx < KG)[None, :], other=0)
                    emax = ttgl.maximum(emax, ttgl.max(ex.to(ttgl.int32), axis=1))
            s0x = ttgl.maximum(emax - _RMAX, 1)
            s0 = ttgl.convert_layout(s0x, ttgl.SliceLayout(1, le))
            frame = (s0x << 23).to(ttgl.float32, bitcast=True)  # 2^(S0 - 127), S0 >= 1
        return e_ptrs, e1, e2, s0, frame

    @gluon.jit
    def _upcast_half(w_s, e, s0, b_dst, USE_ASM: ttgl.constexpr, BN: ttgl.constexpr,
                     BK: ttgl.constexpr):
        """BN packed W2 rows of a raw stage (w_s [BN, BK / 8] int32) -> exact fp16 [BN, BK] into
        b_dst (moe_gluon_l2._upcast_store)."""
        lw2: ttgl.constexpr = LW2 if BN >= 64 else LW2_32  # 32-row blocks: LUP's
        lw: ttgl.constexpr = LW if BN >= 64 else LW32
        w = w_s.load(lw2)  # [BN, 8] int32: one group's 16 (32 rows: 8) bytes per thread
        w = ttgl.convert_layout(ttgl.reshape(w, [BN, 2, 4]), lw, assert_trivial=True)
        _upcast_store(w, e, s0, b_dst, USE_ASM, BN, BK)

    @gluon.jit
    def _upcast_tile(w_r, b_r, sb_r, bars, bs_ptr, g, n0, K, c0, stride_bsg, stride_bsn,
                     KGI: ttgl.constexpr, USE_ASM: ttgl.constexpr, BK: ttgl.constexpr,
                     NS: ttgl.constexpr, NU: ttgl.constexpr, R0: ttgl.constexpr,
                     RB: ttgl.constexpr, R1: ttgl.constexpr, RB1: ttgl.constexpr,
                     UNROLL: ttgl.constexpr, f_ptr=None, N=0, FROWS: ttgl.constexpr = False):
        """One tile's chunks c0 .. c0 + K / BK - 1 for this partition's W2 rows R0 .. R0 + RB -
        1 of the tile (n0 its first column of y) and, where RB1 > 0, R1 .. R1 + RB1 - 1 too
        (bn 256 with one upcast partition: 128 + 128 rows; with the loader's share, LUP: 64 +
        32): their frame scans, then per chunk their raw stage rows -> B stage rows (module
        docstring), one block after the other. Only these rows' words, B rows and sb entries
        are touched: with two partitions each publishes its rows on the same barriers (b_ready
        / r_free count them all). UNROLL: _frames'. Returns the next chunk number."""
        r_ready, r_free, b_ready, b_free = bars
        n_k = K // BK
        e_ptrs, e1, e2, s0, frame = _frames(bs_ptr, g, n0 + R0, K, stride_bsg, stride_bsn, KGI,
                                            RB, BK, UNROLL, f_ptr, N, FROWS)
        if RB1 > 0:
            e_ptrs_b, e1_b, e2_b, s0_b, frame_b = _frames(bs_ptr, g, n0 + R1, K, stride_bsg,
                                                          stride_bsn, KGI, RB1, BK, UNROLL,
                                                          f_ptr, N, FROWS)
        for i in range(n_k):
            c = c0 + i
            s, ph = _stage(c, NS)
            u, phu = _stage(c, NU)
            e = e1
            e1 = e2
            e2 = ttgl.load(e_ptrs + ttgl.minimum(i + 2, n_k - 1) * (BK // 32)).to(ttgl.int32)
            if RB1 > 0:
                e_b = e1_b
                e1_b = e2_b
                e2_b = ttgl.load(e_ptrs_b + ttgl.minimum(i + 2, n_k - 1) * (BK // 32)).to(
                    ttgl.int32)
            mbarrier.wait(r_ready.index(s), ph)
            mbarrier.wait(b_free.index(u), phu ^ 1)
            _upcast_half(w_r.index(s).slice(R0, RB), e, s0, b_r.index(u).slice(R0, RB),
                         USE_ASM, RB, BK)
            if RB1 > 0:
                _upcast_half(w_r.index(s).slice(R1, RB1), e_b, s0_b,
                             b_r.index(u).slice(R1, RB1), USE_ASM, RB1, BK)
            if i == n_k - 1:  # the epilogue's frames ride on the tile's last B stage
                sb_r.index(u).slice(R0, RB).store(frame)
                if RB1 > 0:
                    sb_r.index(u).slice(R1, RB1).store(frame_b)
            # writer-side: this thread's st.shared (B, frames) and ld.shared (raw W) ordered
            # against the async proxy (the wgmma's reads, the next TMA's writes), then the
            # partition barrier inside _release, then the arrivals
            fence_async_shared()
            _release(r_free, c, NS)
            mbarrier.arrive(b_ready.index(u), count=1)
        return c0 + n_k

    @gluon.jit
    def _upcaster(w_r, b_r, sb_r, bars, bs_ptr, work_ptr, MT, G, P, N, K, stride_bsg,
                  stride_bsn, KGI: ttgl.constexpr, USE_ASM: ttgl.constexpr, BM: ttgl.constexpr,
                  BN: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr,
                  NU: ttgl.constexpr, NB: ttgl.constexpr, UPP: ttgl.constexpr,
                  PART: ttgl.constexpr, LUP: ttgl.constexpr = False, f_ptr=None):
        """Upcast partition PART of UPP over this CTA's tiles (the loader's order and skips): the
        tile's W2 rows PART x NB BN / UPP .. (all of them at UPP 1, one half each at UPP 2), in
        blocks of at most BN rows (the LW layouts' 128; 64 at bn 128 with UPP 2). The frame
        scan is unrolled only where the partition has the registers for it (bn 128, UPP 1).
        LUP (bn 256, UPP 2): the first 96 of the half's 128 rows, as a 64- and a 32-row block
        (the loader upcasts the last 32)."""
        TN: ttgl.constexpr = NB * BN
        ROWS: ttgl.constexpr = TN // UPP  # this partition's rows of the tile
        RB: ttgl.constexpr = (64 if LUP else ROWS) if ROWS < BN else (64 if LUP else BN)
        R1: ttgl.constexpr = PART * ROWS + RB
        RB1: ttgl.constexpr = 32 if LUP else (0 if ROWS // RB == 1 else RB)
        c = 0
        for t in range(ttgl.program_id(0), _n_tiles(work_ptr, N, TN), ttgl.num_programs(0)):
            skip, g, _, _, pid_n = tile_entry(work_ptr, t, N // TN, MT, G, P, BM)
            if not skip:
                c = _upcast_tile(w_r, b_r, sb_r, bars, bs_ptr, g, pid_n * TN, K, c, stride_bsg,
                                 stride_bsn, KGI, USE_ASM, BK, NS, NU, PART * ROWS, RB, R1,
                                 RB1, (NB == 1) & (UPP == 1), f_ptr, N, LUP)

    # ---- MMA + epilogue ----------------------------------------------------------------------

    @gluon.jit
    def _scatter(acc, sb, pair, rw, rmask, c_ptr, n0, N, stride_cm, TOPK: ttgl.constexpr,
                 KS: ttgl.constexpr, BN: ttgl.constexpr):
        """The epilogue of one [64, BN] accumulator (output columns n0 ..): y[(p // TOPK) * KS
        + p % TOPK, n] = (acc[r, n] x 2^(S0[n] - 127)) x row_w[p] (moe_gluon_l2's expression)."""
        crow = ((pair // TOPK) * KS + pair % TOPK).to(ttgl.int64)
        out = (acc * sb[None, :]) * rw[:, None]
        rn = n0 + ttgl.arange(0, BN, layout=COL_L)
        c_ptrs = c_ptr + (crow * stride_cm)[:, None] + rn[None, :]
        ttgl.store(c_ptrs, out.to(c_ptr.dtype.element_ty),
                   mask=rmask[:, None] & (rn < N)[None, :])

    @gluon.jit
    def _mma_tile(a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, row0, nrows, n0, N, K, c0,
                  stride_cm, M0: ttgl.constexpr, TOPK: ttgl.constexpr, KS: ttgl.constexpr,
                  BN: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr,
                  NU: ttgl.constexpr, NB: ttgl.constexpr):
        """Rows M0 .. M0 + 63 of one tile: the chained wgmmas over chunks c0 .., the stages
        released one chunk behind, then the weighted scatter. NB = 2: a second accumulator for
        columns n0 + BN .., its own chain of the same m64n128k16 wgmmas (each output element's
        sum is the same instruction sequence as at NB = 1). Returns the next chunk number."""
        r_ready, r_free, b_ready, b_free = bars
        # the epilogue's pairs and weights, requested now (their latency under the K loop)
        rm = M0 + ttgl.arange(0, 64, layout=ROW_L)
        rmask = rm < nrows
        active = nrows > M0
        pair = ttgl.load(cidx_ptr + row0 + rm, mask=rmask, other=0)
        rw = ttgl.load(w_ptr + pair, mask=rmask, other=0.0).to(ttgl.float32)
        acc = ttgl.zeros([64, BN], ttgl.float32, MMA_L)
        if NB == 2:
            acc_b = ttgl.zeros([64, BN], ttgl.float32, MMA_L)
        n_k = K // BK
        for i in range(n_k):
            c = c0 + i
            s, ph = _stage(c, NS)
            u, phu = _stage(c, NU)
            mbarrier.wait(r_ready.index(s), ph)
            mbarrier.wait(b_ready.index(u), phu)
            # A: this warpgroup's 64 rows of the H box; B: the [BN, BK] K-major stage, permuted;
            # chained on acc (wgmma(c - 1) may still be running: the hardware orders them).
            # Not where the warpgroup's rows hold no tile row (rows 64.. of a tile of <= 64
            # rows: their H box was not loaded, nothing of them is stored)
            if active:
                if NB == 1:
                    acc = warpgroup_mma(a_r.index(s).slice(M0, 64),
                                        b_r.index(u).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=[acc])  # wgmma(c - 1) retired
                else:
                    a_s = a_r.index(s).slice(M0, 64)
                    acc = warpgroup_mma(a_s, b_r.index(u).slice(0, BN).permute((1, 0)), acc,
                                        is_async=True)
                    acc_b = warpgroup_mma(a_s, b_r.index(u).slice(BN, BN).permute((1, 0)),
                                          acc_b, is_async=True)
                    # both of chunk c - 1's groups retired, chunk c's two may still run
                    acc, acc_b = warpgroup_mma_wait(2, deps=[acc, acc_b])
            if i > 0:
                _release(r_free, c - 1, NS)
                up, _ = _stage(c - 1, NU)
                mbarrier.arrive(b_free.index(up), count=1)
        cl = c0 + n_k - 1
        ul, _ = _stage(cl, NU)
        if NB == 1:
            acc = warpgroup_mma_wait(0, deps=[acc])
            sb = sb_r.index(ul).load(COL_L)  # the frames, before the stage is released
        else:
            acc, acc_b = warpgroup_mma_wait(0, deps=[acc, acc_b])
            sb = sb_r.index(ul).slice(0, BN).load(COL_L)
            sb_b = sb_r.index(ul).slice(BN, BN).load(COL_L)
        _release(r_free, cl, NS)
        mbarrier.arrive(b_free.index(ul), count=1)
        # ---- epilogue: y[(p // TOPK) * KS + p % TOPK, n0 + c] = acc 2^(S0 - 127) row_w[p]
        _scatter(acc, sb, pair, rw, rmask, c_ptr, n0, N, stride_cm, TOPK, KS, BN)
        if NB == 2:
            _scatter(acc_b, sb_b, pair, rw, rmask, c_ptr, n0 + BN, N, stride_cm, TOPK, KS, BN)
        return c0 + n_k

    @gluon.jit
    def _mma(a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, G, P, N, K, stride_cm,
             M0: ttgl.constexpr, TOPK: ttgl.constexpr, KS: ttgl.constexpr, BM: ttgl.constexpr,
             BN: ttgl.constexpr, BK: ttgl.constexpr, NS: ttgl.constexpr, NU: ttgl.constexpr,
             NB: ttgl.constexpr):
        """An MMA warpgroup (rows M0 .. M0 + 63 of each tile) over this CTA's tiles."""
        TN: ttgl.constexpr = NB * BN
        c = 0
        for t in range(ttgl.program_id(0), _n_tiles(work_ptr, N, TN), ttgl.num_programs(0)):
            skip, _, row0, nrows, pid_n = tile_entry(work_ptr, t, N // TN, MT, G, P, BM)
            if not skip:
                c = _mma_tile(a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, row0, nrows,
                              pid_n * TN, N, K, c, stride_cm, M0, TOPK, KS, BN, BK, NS, NU, NB)

    # ---- the kernel ----------------------------------------------------------------------------

    @gluon.jit
    def l2_ws_kernel(h_desc, w_desc, bs_ptr, c_ptr, cidx_ptr, w_ptr, work_ptr, f_ptr, MT, N,
                     K, G, P, stride_bsg, stride_bsn, stride_cm, TOPK: ttgl.constexpr,
                     KS: ttgl.constexpr, KGI: ttgl.constexpr, USE_ASM: ttgl.constexpr,
                     BM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
                     NS: ttgl.constexpr, NU: ttgl.constexpr, NB: ttgl.constexpr,
                     UPP: ttgl.constexpr, R_MMA: ttgl.constexpr, R_UP: ttgl.constexpr,
                     R_LD: ttgl.constexpr, LUP: ttgl.constexpr, LUPL: ttgl.constexpr):
        """Persistent CTAs over the work items of moe.tile_list at BM rows ([total, grp[MT],
        row0[MT], rend[MT]]) x N / (NB BN) column tiles. h_desc: H as [P, K] fp16, boxes [BM /
        2, BK]; w_desc: the W2 bank's packed rows as [G N, K / 8] int32 words, boxes [NB BN, BK /
        8]; bs_ptr the E8M0 exponents [G, N, K / 32]. UPP upcast partitions (1, or 2: each one
        half of the tile's W2 rows). LUP: the loader upcasts rows 96..127 / 224..255 (bn 256,
        UPP 2), their frames from f_ptr (row_frames; else f_ptr is never read). N % (NB BN) ==
        0, K % BK == 0 (the launcher checks)."""
        ttgl.static_assert(BM == 128, "two MMA warpgroups of 64 rows")
        ttgl.static_assert(BN == 128, "the m64n128k16 wgmma of moe_gluon_l2")
        ttgl.static_assert(BK == 64, "64-column chunks: one 128-byte swizzle row of fp16")
        ttgl.static_assert((NS >= 2) & (NU >= 2), "double-buffered rings at least")
        ttgl.static_assert((NB == 1) | (NB == 2), "tiles of 128 or 256 output columns")
        ttgl.static_assert((UPP == 1) | (UPP == 2), "one or two upcast partitions")
        ttgl.static_assert((not LUP) | ((NB == 2) & (UPP == 2) & (LUPL + 2 <= NS)),
                           "the loader's share: bn 256, two upcast partitions, LUP_LAG <= NS - 2")
        ttgl.static_assert(h_desc.block_shape[0] == BM // 2, "H boxes of 64 rows")
        ttgl.static_assert(h_desc.block_shape[1] == BK, "H boxes of BK columns")
        ttgl.static_assert(w_desc.block_shape[0] == NB * BN, "W2 boxes of the tile's rows")
        ttgl.static_assert(w_desc.block_shape[1] == BK // 8, "W2 boxes of a chunk's words")

        a_r = ttgl.allocate_shared_memory(ttgl.float16, [NS, BM, BK], F16_SMEM)
        w_r = ttgl.allocate_shared_memory(ttgl.int32, [NS, NB * BN, BK // 8], W_SMEM)
        b_r = ttgl.allocate_shared_memory(ttgl.float16, [NU, NB * BN, BK], F16_SMEM)
        sb_r = ttgl.allocate_shared_memory(ttgl.float32, [NU, NB * BN], FLAT1)
        r_ready = ttgl.allocate_shared_memory(ttgl.int64, [NS, 1], mbarrier.MBarrierLayout())
        r_free = ttgl.allocate_shared_memory(ttgl.int64, [NS, 1], mbarrier.MBarrierLayout())
        b_ready = ttgl.allocate_shared_memory(ttgl.int64, [NU, 1], mbarrier.MBarrierLayout())
        b_free = ttgl.allocate_shared_memory(ttgl.int64, [NU, 1], mbarrier.MBarrierLayout())
        for s in ttgl.static_range(NS):
            mbarrier.init(r_ready.index(s), count=1)  # the loader's expect-tx arrive
            # every reader of the raw stage: 2 MMA warpgroups + each upcast partition
            # (+ the loader where it upcasts a share, LUP)
            mbarrier.init(r_free.index(s), count=2 + UPP + LUP)
        for u in ttgl.static_range(NU):
            mbarrier.init(b_ready.index(u), count=UPP + LUP)  # each upcast partition's rows
            mbarrier.init(b_free.index(u), count=2)
        fence_async_shared()  # the initialized barriers, before the TMA unit signals them

        bars = (r_ready, r_free, b_ready, b_free)
        # (Gluon: the partitions' argument tuples written out in each call - a tuple bound to a
        # name first loses its constexprs - so the two layouts differ only in the upcasters)
        if UPP == 1:
            ttgl.warp_specialize([
                (_mma, (a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, G, P, N, K,
                        stride_cm, 0, TOPK, KS, BM, BN, BK, NS, NU, NB)),
                (_mma, (a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, G, P, N, K,
                        stride_cm, 64, TOPK, KS, BM, BN, BK, NS, NU, NB)),
                (_upcaster, (w_r, b_r, sb_r, bars, bs_ptr, work_ptr, MT, G, P, N, K,
                             stride_bsg, stride_bsn, KGI, USE_ASM, BM, BN, BK, NS, NU, NB, 1,
                             0)),
                (_loader, (h_desc, w_desc, a_r, w_r, r_ready, r_free, work_ptr, MT, G, P, N, K,
                           BM, BN, BK, NS, NB)),
            ], [4, 4, 4], [R_MMA, R_UP, R_LD])
        else:  # two upcast partitions: the tile's W2 rows' first and second halves
            ttgl.warp_specialize([
                (_mma, (a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, G, P, N, K,
                        stride_cm, 0, TOPK, KS, BM, BN, BK, NS, NU, NB)),
                (_mma, (a_r, b_r, sb_r, bars, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, G, P, N, K,
                        stride_cm, 64, TOPK, KS, BM, BN, BK, NS, NU, NB)),
                (_upcaster, (w_r, b_r, sb_r, bars, bs_ptr, work_ptr, MT, G, P, N, K,
                             stride_bsg, stride_bsn, KGI, USE_ASM, BM, BN, BK, NS, NU, NB, 2,
                             0, LUP, f_ptr)),
                (_upcaster, (w_r, b_r, sb_r, bars, bs_ptr, work_ptr, MT, G, P, N, K,
                             stride_bsg, stride_bsn, KGI, USE_ASM, BM, BN, BK, NS, NU, NB, 2,
                             1, LUP, f_ptr)),
                (_loader, (h_desc, w_desc, a_r, w_r, r_ready, r_free, work_ptr, MT, G, P, N, K,
                           BM, BN, BK, NS, NB, b_r, sb_r, bars, bs_ptr, f_ptr, stride_bsg,
                           stride_bsn, USE_ASM, NU, LUP, LUPL)),
            ], [4, 4, 4, 4], [R_MMA, R_UP, R_UP, R_LD])


def args_problem(h, w2, y=None, bn: int = BN) -> str | None:
    """Why l2_gluon_ws cannot take these arguments beyond moe_gluon_l2's own checks (its
    launcher raises it; moe._l2_kernel asks first and falls back to moe_gluon_l2), or None: the
    TMA streams - W2's expert rows one stride apart (one [G N, K / 8] word matrix), G N < 2^31,
    16-byte W2 / H rows (moe_gluon_l2 checks those too) - y's dtype (None: not checked) and the
    tile's bn output columns (d % bn)."""
    from megagraph.kernels.moe.gluon_decode import _tma_fits

    if not (w2.wfmt == 0 and w2.bk == 32 and w2.bn == 1):
        return "l2_gluon_ws takes an MXFP4 bank (E8M0 per 32 columns)"
    if bn not in (BN, 2 * BN):
        return f"bn {bn}: {BN} or {2 * BN}"
    if w2.n % bn or w2.k % BK:
        return f"N {w2.n} / K {w2.k} do not fit the {bn}-column tile / {BK}-column chunk"
    if not _tma_fits(w2):
        return "the W2 TMA stream needs expert rows one stride apart, G N < 2^31"
    if w2.w.stride(2) != 1 or w2.w.stride(1) % 16 or w2.w.data_ptr() % 16:
        return "W2 rows contiguous and 16-byte aligned (TMA)"
    if h.dim() != 2 or h.stride(1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16:
        return "h rows contiguous and 16-byte aligned (TMA)"
    if y is not None and y.dtype not in OUT_DTYPES:
        return f"y dtype {y.dtype}: one of {OUT_DTYPES}"
    return None


def descriptors(h, w2, P: int, bn: int = BN):
    """The host TMA descriptors of a launch (built per call, passed by value: CUDA-graph
    capturable): H's first P rows as [P, K] fp16 in [H_BOX, BK] boxes (half a row tile: one
    MMA warpgroup's rows; rows past P zero-filled),
    the W2 bank's packed rows as one [G N, K / 8] int32 word matrix in [bn, BK / 8] boxes (row
    g N + n = expert g's row n: args_problem checks they are one stride apart)."""
    from megagraph.kernels.moe.gluon_common import TensorDescriptor

    K = w2.k
    h_desc = TensorDescriptor(h, [P, K], [h.stride(0), 1], [H_BOX, BK], H_TMA_LAYOUT)
    wi = w2.w.view(torch.int32)  # [G, N, K / 8] words (16-byte rows: checked)
    G, N = wi.shape[0], wi.shape[1]
    w_desc = TensorDescriptor(wi, [G * N, K // 8], [wi.stride(1), 1], [bn, BK // 8],
                              W_TMA_LAYOUT)
    return h_desc, w_desc


def l2_gluon_ws(h, w2_bank, counts, srt, wts, y, *, topk: int, ks: int, max_tiles: int,
                tiles: torch.Tensor | None = None, use_asm: bool = True, diag: int = 0,
                stages: int | None = None, bstages: int | None = None,
                ctas: int | None = None, bn: int | None = None, upp: int | None = None,
                lup: bool | None = None):
    """moe_gluon_l2.l2_gluon's call (the same arguments, checks and result, bit for bit
    expected): y[(p // topk) * ks + p % topk] = wts[p] * (H[r] @ W2[g]^T) for every
    expert-sorted row r of expert g, p = srt[r]; slots no pair maps to are not written. Extra:
    stages / bstages - the raw / B ring depths (default NS / NU, NS_256 / NU_256 at bn 256; >= 2
    each, within the shared memory); ctas - the persistent grid instead of the SM count (the
    tests walk many tiles per CTA at small sizes); bn - the output columns of a tile: 128
    (BN_TILE, the default) or 256 (two accumulators a warpgroup: half the H stream per FLOP;
    d % 256); upp - the upcast partitions: 1, or 2 (each upcasts one half of the tile's W2
    rows: 20 warps at launch cap MAXNREG_U2; the same bits); None: UPP. lup - the loader's
    upcast share (kernel_consts; None: LOADER_UPCAST where it applies; it needs the cached
    row_frames, else it is not used); the same bits. diag must be 0 (this
    kernel has no DIAG variants; the argument is there so the two launchers take the same
    calls)."""
    if diag:
        raise ValueError("l2_gluon_ws has no DIAG variants (diag must be 0)")
    if y.dim() == 3:
        y = y.view(-1, y.shape[-1])
    if wts.dim() != 1:
        wts = wts.reshape(-1)
    P = _check(h, w2_bank, counts, srt, wts, y, topk, ks)
    bn = BN_TILE if bn is None else int(bn)
    if bn not in (BN, 2 * BN):
        raise ValueError(f"bn {bn}: {BN} or {2 * BN}")
    problem = args_problem(h, w2_bank, bn=bn)
    if problem:
        raise ValueError(problem)
    ns = (NS if bn == BN else NS_256) if stages is None else int(stages)
    nu = (NU if bn == BN else NU_256) if bstages is None else int(bstages)
    if ns < 2 or nu < 2:
        raise ValueError(f"stages {ns} / bstages {nu}: at least 2 each")
    if shared_bytes(ns, nu, bn) > MAX_SHARED - 1024:
        raise ValueError(f"stages {ns} / bstages {nu} at bn {bn}: {shared_bytes(ns, nu, bn)} "
                         "B of shared memory, over the sm_90 limit")
    consts = kernel_consts(w2_bank.k, use_asm, ns, nu, bn=bn, upp=upp, lup=lup)
    if max_tiles == 0 or P == 0:
        return y
    frames = row_frames(w2_bank) if consts["LUP"] else None
    if consts["LUP"] and frames is None:  # no cached frames (first use inside a capture)
        consts = kernel_consts(w2_bank.k, use_asm, ns, nu, bn=bn, upp=upp, lup=False)
    if not _IMPORT_OK:
        raise RuntimeError("l2_gluon_ws needs Triton 3.6's Gluon (moe_gluon_l2_ws.available())")
    from megagraph.kernels.common.triton import sm_count

    tiles = tile_list(counts, BM, max_tiles, tiles)
    N, K = w2_bank.n, w2_bank.k
    grid = max_tiles * (N // bn)
    grid = (max(1, min(grid, int(ctas) if ctas else sm_count(y.device))),)
    h_desc, w_desc = descriptors(h, w2_bank, P, bn)
    l2_ws_kernel[grid](
        h_desc, w_desc, w2_bank.s, y, srt, wts, tiles,
        frames if frames is not None else counts, max_tiles, N, K, counts.numel(), P,
        w2_bank.s.stride(0), w2_bank.s.stride(1), y.stride(0), TOPK=topk, KS=ks, **consts,
        num_warps=NUM_WARPS, maxnreg=launch_maxnreg(consts))
    return y
