"""Gluon (Triton 3.6, sm_90) kernel for the prefill routed-expert L1 GEMM: the
SwiGLU of W1 / W3 on MXFP4 weights with E4M3 activations - the launch `routed_experts` makes
through `moe.gemm` (GROUPED, GATHER_A, SWIGLU, A_SCALED, MXFP4 + E8M0 per 32 columns, MMA_FP8).

Why: the Triton L1 (moe_jit.moe_acc) dequantizes each MXFP4 B chunk in registers, stores it to
shared memory, fences, barriers and then waits on each chunk's wgmma before starting the next
chunk's work (docs/kernels/moe.md): Triton's pipeliner cannot keep a wgmma async when
an operand is computed in registers, so the upcast and the tensor cores never overlap. Here the
pipeline is written by hand:

  per 128-column K chunk i (A stage i % 2, B stage i % 2; the loop is unrolled by 2 so every
  stage is its own allocation with a static index and Gluon's barrier analysis adds none):
    wait A[i]'s cp.async group, fence.proxy.async, CTA barrier   (A[i], B[i] visible to wgmma)
    issue cp.async of A[i + 1] into the stage chunk i - 1 read (all its wgmmas waited)
    issue wgmma(A[i], W1[i]^T) and wgmma(A[i], W3[i]^T), async (fresh fp32 partials)
    upcast W1 / W3 chunk i + 1 (bytes loaded one chunk ago) -> E4M3 into the other B stage, its
    per-row promotion scale sb into a small f32 ring beside it; fence.proxy.async (writers)
    load the MXFP4 bytes + E8M0 exponents of chunk i + 2 into registers (a whole chunk to land),
    the A scales of chunk i + 1
    wait for the two wgmmas, promote: acc += part * (sa x sb)  (moe_acc's formula)

so the tensor cores run chunk i while the CUDA cores upcast chunk i + 1. A is gathered
(A row = aidx[row] // TOPK): TMA on Hopper has no row gather, but cp.async takes one address per
16 bytes, so each thread copies its rows' 16-byte pieces straight into the 128B-swizzled
NVMMA ring, no registers. The B tile is [BN rows of W1] and [BN rows of W3], E4M3, K-major.

Numerics (== moe_acc with MMA_FP8, PAR or not): per chunk and B row, S = max(max(e) - 6, 1)
over the row's 4 E8M0 exponents, the same PTX upcast (moe_jit.FP4_E4M3_ASM, or its arithmetic
twin) to E4M3 codes at offset e - S, sb = 2^(S - 127); the fp32 wgmma partial of the chunk
(use_acc=False) is promoted as acc += part * (sa[:, None] * sb[None, :]); epilogue
silu(min(g, lim)) * clamp(u, -lim, lim) (moe_jit.swiglu_act), stored as out's dtype (fp16 in
routed_experts) at the expert-sorted row. Only the sum order inside a chunk (tensor core) may
differ from the Triton kernel.

Tile: BM = 128 rows x BN = 64 columns of W1 and of W3, 8 warps (2 warpgroups of 64 rows, the
wgmma m64n64k32), 2 A stages, 2 B stages: two fp32 accumulators and two in-flight partials =
4 x 32 registers per thread. K % 256 == 0 (the loop runs chunk pairs: a tail chunk for an odd
count spilled). Triton 3.6 sm_90 build: 255 registers, no stack, 66 KB of shared memory (the
rings + 768 bytes holding the epilogue's output rows / columns, which spilled when kept in
registers across the K loop), per chunk pair 1218 instructions, 16 QGMMA, 4 WARPGROUP.ARRIVE,
2 WARPGROUP.DEPBAR, 4 BAR.SYNC (2 per chunk: see the proxy fence below), 8 LDGSTS, 16 STS, no F2FP
(tests/kernels/test_moe_gluon.py::test_l1_gluon_sm90_build).
BM = 128 halves the upcast work per MMA flop against the Triton L1's 64-row tile. routed_experts
runs its prefill L1 here where moe._gluon_l1 says so (opt-in: MEGAGRAPH_MOE_GLUON_PREFILL=1;
> 48 rows per expert, shapes that fit, available()); the H200 probe
(benchmarks/moe_gluon_probe.py) timed it at 7.31 ms against 8.54 ms for the Triton L1 at
balanced 8192 tokens (sixth session), 10.03 against 10.47 ms at poisson routing (seventh).

The proxy fence (eighth session): until then every Gluon kernel here ran wait_group -> CTA
barrier -> fence.proxy.async -> wgmma, the fence on the READER side after the barrier (to save a
barrier: Triton 3.6's membar pass puts a CTA barrier right after an async_wait unless the next
op is a barrier). The PTX rule (and CUTLASS, and Triton's own FenceInsertion for register ->
shared stores) is writer-side: each thread fences its own completed generic-proxy writes (here
its cp.async bytes, after its wait) BEFORE the barrier the wgmma issuers wait at. With the fence
after the barrier a fast warp could issue its wgmma before a slow warp had fenced its part of
the stage. The kernels now run wait_group -> fence.proxy.async -> CTA barrier -> wgmma; in SASS
DEPBAR, BAR.SYNC (membar's), MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, BAR.SYNC (ours), then the
WARPGROUP.ARRIVE / QGMMA: one more BAR.SYNC per chunk, K loop 1210 -> 1218 instructions per
chunk pair. The sm_90 tests check the fence's position (test_moe_gluon.proxy_fence_problems).
On the H200 (eighth session, Triton 3.6) the writer-side builds passed every test: this kernel
(bm 128, per-lane upcast) and both decode kernels, the 10x repeated-launch bit checks included
(100 + 16 passed). (The wait and the fence as one inline asm, which membar does not see as a
wait, would keep a single barrier - tried on a scratch copy of the decode L1: 1419
instructions, 4 BAR.SYNC per 4 chunks - not done: it hides the wait from Triton's analyses;
worth it only if the H200 times the second barrier.)

Removed variants (the code is in commit f12126b, with the writer-side fence; 3a35562 has them
under the old one): asm = "pack" (the packed weights loaded as int32 words, one upcast offset
per word folded into a per-(row, group) PRMT table pair: 785 against 1218 K-loop instructions
per chunk pair, 64 PRMT against 232, 255 registers, no stack) and bm = 64 (8 warps as 2
warpgroups side by side along N, wgmma m64n32; 138 / 130 registers lane / pack; slower: 14.29 /
10.62 ms against 10.03 at poisson routing, seventh session). In the seventh session, under the
reader-side fence, both gave run-to-run different wrong outputs on the H200 in one-program debug
launches (pack at bm 128; the arithmetic upcast at bm 64): a few accumulator registers of one
warp off by up to 2^70 (benchmarks/results/moe-gluon-h200.md). f12126b brought them back with
the writer-side fence and they still failed on the H200 (eighth session), so the fence order
was ruled out as their cause:
  - bm = 64: test_l1_gluon_no_limit_and_asm_off[64-lane] ("use_asm=False: a repeated launch
    gave other bits") and test_l1_gluon_debug_pieces[64-lane-256|512|1024] ("ones (bm 64,
    d 256, arith): rel inf, 1504/4096 bad ... first (0, 33): 6.78136e+25 vs 32768");
  - asm = "pack": an ILLEGAL MEMORY ACCESS in test_l1_gluon_no_limit_and_asm_off[128-pack]
    (d 512, F 128, E 4, T 77, top-3, exponents 108 .. 127) and in every pack debug-pieces case,
    under CUDA_LAUNCH_BLOCKING=1 too; yet benchmarks/moe_gluon_probe.py --routing poisson
    --tokens 8192 --variants 128:lane,128:pack checked pack correct at 256 and 8192 tokens (in
    child processes) and timed it at 8.616 ms against 10.306 ms for lane (Triton L1 10.487 ms).
Next leads: for pack, compute-sanitizer memcheck on the failing case (an out-of-bounds int32
word load? the launcher checked the banks' 4-byte alignment of rows and bases); for bm = 64, the
accumulator layout of two warpgroups along N (NVMMADistributedLayout warps_per_cta [4, 2],
instr_shape [16, 32, 32]; the failing launches reported were the arithmetic upcast's, no
inline PTX). The SASS of both showed no register or ordinary shared-memory hazard (no register
of an in-flight QGMMA touched before its WARPGROUP.DEPBAR; every ring stage written after the
CTA barrier that follows its readers' waits). Because the default shares the pipeline,
routed_experts runs this kernel only on request (moe.GLUON_PREFILL,
MEGAGRAPH_MOE_GLUON_PREFILL=1) until that is understood.

Fixes after the first H200 run (every output wrong): the upcast now passes every element's own
offset rel + 6 (moe_jit.fp4_rel6) as moe_jit.FP4_E4M3_ASM reads it (it passed the signed rel:
weights decoded 2^-6 too small); tile-list entries are checked (group < G, rows inside P,
non-empty) before any pointer is formed; the prologue's chunk-1 prefetch is clamped (K = 256
reads no byte past a row).
"""
from __future__ import annotations

import torch

from megagraph.kernels.moe.gluon_common import IMPORT_OK as _IMPORT_OK
from megagraph.kernels.moe.gluon_common import available  # noqa: F401  (moe._gluon_l1 and the tests call it here)
from megagraph.kernels.moe.gluon_common import check_rows, tile_list

if _IMPORT_OK:  # the Triton 3.6 Gluon names (gluon_common's guarded import)
    from megagraph.kernels.moe.gluon_common import async_copy, fence_async_shared, gluon, refill_a, swiglu, tile_entry
    from megagraph.kernels.moe.gluon_common import ttgl
    from megagraph.kernels.moe.gluon_common import e2m1_e4m3_bits as _e2m1_e4m3_bits
    from megagraph.kernels.moe.gluon_common import warpgroup_mma, warpgroup_mma_wait

BM, BN, BK, NSA, NUM_WARPS = 128, 64, 128, 2, 8
ASM_MODES = {"arith": 0, "lane": 1}  # USE_ASM of l1_kernel


def kernel_consts(asm: str = "lane") -> dict:
    """The constexprs of l1_kernel for an upcast (the launcher's and the ahead-of-time build
    test's): asm "lane" = moe_jit.FP4_E4M3_ASM (per-byte-lane offsets), "arith" = its
    arithmetic twin."""
    if asm not in ASM_MODES:
        raise ValueError(f"asm {asm!r}: one of {sorted(ASM_MODES)}")
    return dict(USE_ASM=ASM_MODES[asm], BM=BM, BN=BN, BK=BK, NSA=NSA, NW=NUM_WARPS)


def _asm_text() -> str:
    from megagraph.kernels.moe.triton_jit import FP4_E4M3_ASM

    return getattr(FP4_E4M3_ASM, "value", FP4_E4M3_ASM)


if _IMPORT_OK:
    FP4_ASM = ttgl.constexpr(_asm_text())

    @gluon.constexpr_function
    def _b_layout(nw):
        """The packed weights' register layout [BN, 4 groups, 16 bytes] uint8: 8 bytes (16
        columns) of one row and group per thread (8 warps)."""
        return ttgl.BlockedLayout([1, 1, 8], [4, 4, 2], [nw, 1, 1], [2, 1, 0])

    @gluon.jit
    def _dequant_store(p, e, b_dst, sb_dst, USE_ASM: ttgl.constexpr, BN: ttgl.constexpr,
                       BK: ttgl.constexpr):
        """Packed codes p uint8 [BN, 4, 16] (row, 32-column group, byte) and the biased E8M0
        exponents e int32 [BN, 4] -> E4M3 [BN, BK] in column order into b_dst, and the row's
        promotion scale 2^(S - 127) into sb_dst (load_b_tile's MMA_FP8 MXFP4 branch).
        The upcast takes, for EVERY element, its own exponent offset rel + 6 in [0, 12]
        (moe_jit.fp4_rel6: rel = e - S clamped at -6), as moe_jit.FP4_E4M3_ASM now reads one
        offset per byte lane (the first version of this kernel passed the signed rel: with
        these exponents (rel in [1, 6]) the PTX path then decoded every weight 2^-6 too small)."""
        S = ttgl.maximum(ttgl.max(e, axis=1) - 6, 1)
        rel6 = ttgl.maximum(e - ttgl.expand_dims(S - 6, 1), 0)  # fp4_rel6: max(rel, -6) + 6
        rel6_p = ttgl.broadcast(ttgl.expand_dims(rel6, 2), p)[0]
        if USE_ASM:
            lo, hi = ttgl.inline_asm_elementwise(FP4_ASM, "=r,=r,r,r",
                                                 [p, rel6_p.to(ttgl.uint8)],
                                                 dtype=(ttgl.uint8, ttgl.uint8),
                                                 is_pure=True, pack=4)
        else:  # moe_jit.fp4_halves_e4m3's arithmetic branch
            pi = p.to(ttgl.int32)
            rel_p = rel6_p - 6
            lo = _e2m1_e4m3_bits(pi & 0xF, rel_p).to(ttgl.uint8)
            hi = _e2m1_e4m3_bits(pi >> 4, rel_p).to(ttgl.uint8)
        b = ttgl.reshape(ttgl.join(lo, hi), [BN, BK])  # byte j -> cols 2j (lo), 2j + 1 (hi)
        b_dst.store(b.to(ttgl.float8e4nv, bitcast=True))
        bits = ttgl.where(S <= 0, 0x00400000, S << 23)  # moe_jit.exp2_biased
        sb_dst.store(bits.to(ttgl.float32, bitcast=True))

    @gluon.jit
    def _load_b(b_ptr, bs_ptr, pofs, eofs, k0):
        """MXFP4 bytes (uint8 [BN, 4, 16]) and E8M0 exponents (int32 [BN, 4]) of chunk k0 of
        one weight matrix (offsets pofs / eofs already hold the rows; k0 < K: callers clamp)."""
        p = ttgl.load(b_ptr + pofs + k0 // 2).to(ttgl.uint8, bitcast=True)
        e = ttgl.load(bs_ptr + eofs + k0 // 32).to(ttgl.int32)
        return p, e

    @gluon.jit
    def _chunk(i, n_k, a_cur, a_nxt, w1_cur, w3_cur, w1_nxt, w3_nxt, sb1_cur, sb3_cur, sb1_nxt,
               sb3_nxt, acc1, acc2, p1, e1, p3, e3, sa, a_ptrs, a_mask, as_ptrs, rmask, b1, b2,
               bs1, bs2, pofs, eofs, USE_ASM: ttgl.constexpr, BM: ttgl.constexpr,
               BN: ttgl.constexpr, BK: ttgl.constexpr, mma: ttgl.constexpr):
        """K chunk i: A[i] in a_cur (cp.async, issued one chunk ago), W1 / W3 chunk i upcast
        in w1_cur / w3_cur with their row scales in sb1_cur / sb3_cur (one chunk ahead); the
        MXFP4 bytes p1 / p3, exponents e1 / e3 of chunk i + 1 in registers; sa: A scales of
        chunk i. Returns the accumulators and chunk i + 2's bytes / chunk i + 1's A scales.
        Every prefetch index is clamped to the last chunk (n_k - 1): past K it reloads that
        chunk into the free stage, never reads past a row."""
        # A[i] landed, each thread's cp.async bytes of it fenced (writer-side: before the CTA
        # barrier the wgmma issuers wait at; fenced after it, as before the eighth session, a
        # fast warp could issue its wgmma before a slow warp had fenced its part of A[i]), the
        # barrier (gluon_common.refill_a): every thread's A[i] copies and B[i] stores are in
        # and fenced by their writers, and every warpgroup waited on chunk i - 1's wgmmas (the
        # readers of the stages written below); A[i + 1] copied
        refill_a(a_nxt, a_ptrs, a_mask, i, n_k, BK)
        zero = ttgl.zeros([BM, BN], ttgl.float32, mma)
        # wgmma: A [BM, BK] (K-major smem) @ B [BK, BN]: the [BN, BK] K-major stage, permuted
        t1 = warpgroup_mma(a_cur, w1_cur.permute((1, 0)), zero, use_acc=False, is_async=True)
        t3 = warpgroup_mma(a_cur, w3_cur.permute((1, 0)), zero, use_acc=False, is_async=True)
        # while the tensor cores run chunk i: upcast chunk i + 1 into the other B stage (its
        # last reader, chunk i - 1's wgmma, finished before the barrier)
        _dequant_store(p1, e1, w1_nxt, sb1_nxt, USE_ASM, BN, BK)
        _dequant_store(p3, e3, w3_nxt, sb3_nxt, USE_ASM, BN, BK)
        fence_async_shared()  # each writer fences its own stores before the next barrier
        # chunk i + 2's bytes, chunk i + 1's A scales: a whole chunk of latency to hide
        k2 = ttgl.minimum(i + 2, n_k - 1) * BK
        p1, e1 = _load_b(b1, bs1, pofs, eofs, k2)
        p3, e3 = _load_b(b2, bs2, pofs, eofs, k2)
        sa_n = ttgl.load(as_ptrs + ttgl.minimum(i + 1, n_k - 1), mask=rmask, other=1.0)
        t1, t3 = warpgroup_mma_wait(0, deps=[t1, t3])
        col_l: ttgl.constexpr = ttgl.SliceLayout(0, mma)
        sb1 = sb1_cur.load(col_l)
        sb3 = sb3_cur.load(col_l)
        acc1 += t1 * (sa[:, None] * sb1[None, :])  # moe_acc's promotion (after the wait)
        acc2 += t3 * (sa[:, None] * sb3[None, :])
        return acc1, acc2, p1, e1, p3, e3, sa_n

    @gluon.jit
    def l1_kernel(a_ptr, as_ptr, aidx_ptr, b1_ptr, bs1_ptr, b2_ptr, bs2_ptr, c_ptr, work_ptr,
                  MT, N, K, G, P, limit, stride_am, stride_as, stride_bg, stride_bn, stride_bsg,
                  stride_bsn, stride_cm,
                  TOPK: ttgl.constexpr, HAS_LIMIT: ttgl.constexpr, USE_ASM: ttgl.constexpr,
                  BM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
                  NSA: ttgl.constexpr, NW: ttgl.constexpr):
        """One [BM, BN] tile of H = swiglu(A W1^T, A W3^T): program pid -> row tile pid // num_n
        of the device tile list (moe.tile_list: [total, grp[MT], row0[MT], rend[MT]]), column
        tile pid % num_n. N % BN == 0, K % BK == 0 (the launcher checks); G experts, P sorted
        rows (a tile list entry out of these ranges is skipped, never dereferenced). NSA = 2
        (two A stages; the only value built)."""
        ttgl.static_assert(NSA == 2, "two A stages")
        # ---- layouts -------------------------------------------------------------------
        # NW / 4 warpgroups along M, each wgmma m64 x n64
        ttgl.static_assert(BM == 16 * NW, "BM = 64 rows per warpgroup")
        mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0],
                                                          warps_per_cta=[NW, 1],
                                                          instr_shape=[16, BN, 32])
        row_l: ttgl.constexpr = ttgl.SliceLayout(1, mma)
        col_l: ttgl.constexpr = ttgl.SliceLayout(0, mma)
        # A copy: 16 bytes per cp.async, 8 threads per 128-byte row
        la: ttgl.constexpr = ttgl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
        # B bytes [BN, 4 groups of 32 columns, 16 bytes]: 8 bytes (16 columns) of one row and
        # group per thread
        lb: ttgl.constexpr = _b_layout(NW)
        lb_e: ttgl.constexpr = ttgl.SliceLayout(2, lb)
        # one NVMMA layout object for every fp8 stage: the cp.async / st.shared writers and the
        # wgmma descriptors use the same 128-byte swizzle (rows of exactly 128 bytes)
        f8_sl: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=128,
                                                       element_bitwidth=8, rank=2)
        s_sl: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [0])

        # ---- the tile (moe_tile_list's entries, as moe_gemm_persistent reads them) ------
        skip, g, row0, nrows, pid_n = tile_entry(work_ptr, ttgl.program_id(0), N // BN, MT, G,
                                                 P, BM)
        if skip:
            return

        # gathered A rows, in the copy layout and in the accumulator's row layout (for sa)
        rm_a = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, la))
        src_a = ttgl.load(aidx_ptr + row0 + rm_a, mask=rm_a < nrows, other=0)
        a_ofs = (src_a // TOPK).to(ttgl.int64) * stride_am
        rk = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, la))
        a_ptrs = a_ptr + a_ofs[:, None] + rk[None, :]
        a_mask = (rm_a < nrows)[:, None] & (rk < BK)[None, :]
        rm = ttgl.arange(0, BM, layout=row_l)
        rmask = rm < nrows
        src = ttgl.load(aidx_ptr + row0 + rm, mask=rmask, other=0)
        as_ptrs = as_ptr + (src // TOPK).to(ttgl.int64) * stride_as

        # B rows of this column tile: byte / exponent offsets in the upcast layout
        rn_b = pid_n * BN + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, lb_e))
        grp = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, lb_e))
        byt = ttgl.arange(0, 16, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, lb)))
        pofs2 = rn_b[:, None] * stride_bn + grp[None, :] * 16
        pofs = ttgl.expand_dims(pofs2, 2) + ttgl.expand_dims(ttgl.expand_dims(byt, 0), 1)
        eofs = rn_b[:, None] * stride_bsn + grp[None, :]
        b1 = b1_ptr + g * stride_bg
        b2 = b2_ptr + g * stride_bg
        bs1 = bs1_ptr + g * stride_bsg
        bs2 = bs2_ptr + g * stride_bsg

        # ---- shared rings: 2 A stages, 2 B stages (+ their row scales) -------------------
        a0 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BM, BK], f8_sl)
        a1 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BM, BK], f8_sl)
        w1_0 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BN, BK], f8_sl)
        w1_1 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BN, BK], f8_sl)
        w3_0 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BN, BK], f8_sl)
        w3_1 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BN, BK], f8_sl)
        sb1_0 = ttgl.allocate_shared_memory(ttgl.float32, [BN], s_sl)
        sb1_1 = ttgl.allocate_shared_memory(ttgl.float32, [BN], s_sl)
        sb3_0 = ttgl.allocate_shared_memory(ttgl.float32, [BN], s_sl)
        sb3_1 = ttgl.allocate_shared_memory(ttgl.float32, [BN], s_sl)

        # expert-sorted output row of each tile row (-1: past the group) and the output
        # columns, for the epilogue: read back from shared memory after the K loop, which runs
        # at the 255-register limit (kept in registers across it, they spilled)
        crow_s = ttgl.allocate_shared_memory(ttgl.int32, [BM], s_sl,
                                             ttgl.where(rmask, row0 + rm, -1))
        ccol_s = ttgl.allocate_shared_memory(ttgl.int32, [BN], s_sl,
                                             pid_n * BN + ttgl.arange(0, BN, layout=col_l))

        n_k = K // BK
        # prologue: A chunk 0 in flight, B chunk 0 upcast (fenced), B chunk 1 in registers
        # (clamped: K = BK has no chunk 1), A scales of chunk 0
        async_copy.async_copy_global_to_shared(a0, a_ptrs, mask=a_mask)
        async_copy.commit_group()
        p1, e1 = _load_b(b1, bs1, pofs, eofs, 0)
        p3, e3 = _load_b(b2, bs2, pofs, eofs, 0)
        _dequant_store(p1, e1, w1_0, sb1_0, USE_ASM, BN, BK)
        _dequant_store(p3, e3, w3_0, sb3_0, USE_ASM, BN, BK)
        fence_async_shared()
        k1 = ttgl.minimum(1, n_k - 1) * BK
        p1, e1 = _load_b(b1, bs1, pofs, eofs, k1)
        p3, e3 = _load_b(b2, bs2, pofs, eofs, k1)
        sa = ttgl.load(as_ptrs, mask=rmask, other=1.0)

        acc1 = ttgl.zeros([BM, BN], ttgl.float32, mma)
        acc2 = ttgl.zeros([BM, BN], ttgl.float32, mma)
        # unrolled by 2 so every ring stage is its own allocation with a static index (Gluon's
        # barrier analysis then sees no false hazard between the stage read and the one
        # written, and a chunk keeps a single CTA barrier); chunk i uses stage i % 2; n_k is
        # even (the launcher checks)
        for i in range(0, n_k, 2):
            acc1, acc2, p1, e1, p3, e3, sa = _chunk(
                i, n_k, a0, a1, w1_0, w3_0, w1_1, w3_1, sb1_0, sb3_0, sb1_1, sb3_1, acc1,
                acc2, p1, e1, p3, e3, sa, a_ptrs, a_mask, as_ptrs, rmask, b1, b2, bs1, bs2,
                pofs, eofs, USE_ASM, BM, BN, BK, mma)
            acc1, acc2, p1, e1, p3, e3, sa = _chunk(
                i + 1, n_k, a1, a0, w1_1, w3_1, w1_0, w3_0, sb1_1, sb3_1, sb1_0, sb3_0, acc1,
                acc2, p1, e1, p3, e3, sa, a_ptrs, a_mask, as_ptrs, rmask, b1, b2, bs1, bs2,
                pofs, eofs, USE_ASM, BM, BN, BK, mma)
        async_copy.wait_group(0)  # the clamped re-copy of the last A chunk (never read)

        # ---- epilogue: moe_jit.swiglu_act, expert-sorted rows ------------------------------
        out = swiglu(acc1, acc2, limit, HAS_LIMIT)
        crow = crow_s.load(row_l)
        rn = ccol_s.load(col_l)
        c_ptrs = c_ptr + crow.to(ttgl.int64)[:, None] * stride_cm + rn[None, :]
        ttgl.store(c_ptrs, out.to(c_ptr.dtype.element_ty),
                   mask=(crow >= 0)[:, None] & (rn < N)[None, :])


def l1_gluon(a_q, a_scale, a_idx, w1, w3, counts, out, *, topk: int, max_tiles: int,
             limit: float | None = None, tiles: torch.Tensor | None = None,
             use_asm: bool | None = None) -> torch.Tensor:
    """out [P, F] (expert-sorted rows, fp16 / bf16 / fp32; a row-strided view is fine) =
    swiglu(A W1^T, A W3^T) per expert, A row of sorted row r = a_q[a_idx[r] // topk] (E4M3
    [T, d], scales a_scale [T, d / 128] f32). w1 / w3: moe.Bank of MXFP4 [E, F, d/2] with E8M0
    [E, F, d/32]; counts [E] int32 rows per expert (sorted order). The same arguments as the
    L1 moe.gemm launch in routed_experts; max_tiles bounds the row tiles of BM rows
    (e.g. min(P, P // BM + E)); tiles: moe.tile_list(counts, BM, max_tiles) if already built
    (else built here: one tiny launch, no host sync). use_asm: the PTX upcast (default:
    moe.asm_ok's bit-exact check on this device, made for the per-lane PTX), else its
    arithmetic twin."""
    from megagraph.kernels.moe import triton as moe

    if not (w1.wfmt == 0 and w3.wfmt == 0 and w1.bk == 32 and w1.bn == 1):
        raise ValueError("l1_gluon takes MXFP4 banks (E8M0 per 32 columns)")
    if a_q.dtype != torch.float8_e4m3fn or a_scale is None:
        raise ValueError("l1_gluon takes E4M3 activations with fp8_1x128 scales")
    N, K = w1.n, w1.k
    # the K loop runs chunk pairs (stage 0, stage 1): an even chunk count (a tail chunk for an
    # odd one spilled at 255 registers)
    if N % BN or K % (2 * BK) or w3.n != N or w3.k != K:
        raise ValueError(f"N {N} / K {K} do not fit the {BN}-column tile / {2 * BK}-column K "
                         "step")
    if w1.w.stride() != w3.w.stride() or w1.s.stride() != w3.s.stride():
        raise ValueError("W1 and W3 banks need the same strides")
    if w1.groups != w3.groups or counts.numel() > w1.groups:
        raise ValueError("counts has more experts than the banks")
    if a_q.stride(1) != 1 or a_q.stride(0) % 16 or out.stride(1) != 1:
        raise ValueError("a_q rows must be contiguous and 16-byte aligned, out rows contiguous")
    if a_q.data_ptr() % 16:
        raise ValueError("a_q must be 16-byte aligned (cp.async of 16 bytes)")
    P = check_rows(a_scale, a_idx, out, N, K)
    if max_tiles == 0 or P == 0:
        return out
    if not _IMPORT_OK:
        raise RuntimeError("l1_gluon needs Triton 3.6's Gluon (moe_gluon.available())")
    tiles = tile_list(counts, BM, max_tiles, tiles)
    if use_asm is None:
        use_asm = moe.asm_ok(out.device)
    consts = kernel_consts("lane" if use_asm else "arith")
    grid = (max_tiles * (N // BN),)
    l1_kernel[grid](
        a_q, a_scale, a_idx, w1.w, w1.s, w3.w, w3.s, out, tiles, max_tiles, N, K,
        counts.numel(), P, float(limit or 0.0), a_q.stride(0), a_scale.stride(0),
        w1.w.stride(0), w1.w.stride(1), w1.s.stride(0), w1.s.stride(1), out.stride(0),
        TOPK=topk, HAS_LIMIT=limit is not None and limit > 0, **consts,
        num_warps=consts["NW"])
    return out
