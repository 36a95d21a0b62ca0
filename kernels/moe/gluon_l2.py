"""Gluon (Triton 3.6, sm_90) kernel for the PREFILL routed-expert L2 GEMM (the down projection,
> 48 rows per expert): Y = row_w x (H W2^T) on MXFP4 W2 with the fp16 H of the L1, scattered to
the (token, slot) rows of y - the launch `routed_experts` makes through `moe.gemm(role="l2")`
(moe.triton_l2: moe_jit's SCATTER_C / WEIGHTED tile, load_b_tile's MXFP4 x fp16 MMA). The
Triton L2 takes 5.88 ms at 8192 tokens on the H200 (197 TFLOP/s): as in the Triton L1, its
upcast in registers cannot overlap its MMA (docs/kernels/moe.md). A hand-written pipeline;
the prefill L2 where its warp-specialized twin (gluon_l2_ws) does not take the call
(tests/kernels/moe/test_moe_gluon_l2.py; 4.01 against the Triton L2's 5.82 ms on the H200).

Tile: BM = 128 expert-sorted rows of H (one expert: moe.tile_list at 128 rows) x BN = 128
output columns (W2 rows n0 .. n0 + 127), 8 warps = 2 warpgroups of 64 rows, wgmma m64n128k16
fp16 -> fp32. Per 64-column K chunk i (stage i % 3 of a 3-stage ring; the loop is unrolled by 3
so every stage is its own allocation with a static index):

    wait A[i]'s cp.async group, fence.proxy.async, CTA barrier   (A[i], B[i] visible to wgmma)
    cp.async A[i + 1] (H rows, contiguous: 4 x 16 bytes per thread) into stage (i + 1) % 3
    issue wgmma(A[i], B[i]^T) into acc, async (chained: wgmma(i - 1) may still run)
    upcast W2 chunk i + 1 (bytes loaded one chunk ago) -> fp16 into B stage (i + 1) % 3
    (fenced by its writers at the top of chunk i + 1, with their cp.async bytes)
    load the MXFP4 bytes + E8M0 exponents of chunk i + 2 into registers
    wgmma wait(1): wgmma(i - 1) has retired (its stage (i - 1) % 3 = (i + 2) % 3 is the one
    chunk i + 1 refills, after chunk i + 1's barrier), wgmma(i) may still run

Stage (i + 1) % 3 was last read by wgmma(i - 2), which every warpgroup waited for (wait(1) at the
end of chunk i - 1) before chunk i's barrier, so the stores into it are safe; the tensor cores
always have the next chunk's wgmma queued behind the running one (no per-chunk drain, unlike the
L1's wait(0) + promotion).

The upcast (moe_gluon_decode_l2.FP16_TABLE_ASM_TEXT, one call per packed word = 8 columns -> 4
fp16x2 registers, the decode L2's PRMT table): each thread owns one (row, 32-column group) of the
chunk: one 16-byte load of its 4 words, one exponent byte, one table pair, 4 table upcasts and
4 STS.128 into the K-major 128B-swizzled NVMMA stage [BN, 64] fp16 (the wgmma's B, permuted).

Numerics: the E8M0 scale is folded into EXACT fp16 values with ONE frame per W2 row (output
column) over all of K: S0 = max(max_k e - 13, 1) over the row's K / 32 exponents (a prologue
reads them: K / 32 bytes a row), every weight becomes e2m1 x 2^rel, rel = e - S0 <= 13 (at most
6 x 2^13 = 49152, a normal fp16 whose low byte is zero: the table's high bytes 0x38 .. 0x46 + 4
rel stay in the normal exponent range for rel in [-13, 13], no carry out of a byte); rel < -13
(e more than 26 binades below the row's largest exponent: below 2^-26 of the row's largest
weight) flushes to zero. fp16 x fp16 products are exact in the tensor core (fp32 sums), and the
frame 2^(S0 - 127) is applied once in the epilogue (a power of two: exact), with the routing
weight: y[(p // topk) * ks + p % topk, n] = (acc[r, n] * 2^(S0[n] - 127)) * row_w[p].
moe.gemm role "l2" (the Triton L2, and the decode L2) folds per 128-column chunk instead (S =
max(max e - 6, 1) of the chunk's 4 exponents, rel in [-5, 6], rel < -5 flushed, the fp32 chunk
partial promoted by 2^(S - 127)): both are exact for every weight within 11 binades of its
chunk's largest exponent; beyond that the Triton L2 flushes weights this kernel keeps (and this
kernel flushes only beyond 26 binades of the row's largest). Where nothing flushes the two
differ only in the tensor core's fp32 sum order. Why one frame: no fp32 partial per chunk (64
registers a thread at BN = 128) and no promotion between chunks, so the wgmmas chain on one
accumulator with one group in flight.

USE_ASM = False: the same 4 registers per word with integer arithmetic (fp16x2_regs)
elementwise on the same word tensor (bit-exact twin of the table, for the GPU tests).

Triton 3.6 sm_90 build (bf16 y, F = 2304; tests/kernels/test_moe_gluon_l2.py::
test_l2_gluon_sm90_build): 124 registers, no stack, 98816 B of shared memory (3 x (16 + 16) KB
rings + the frames): two CTAs of 8 warps per SM. K loop: 337 instructions per 3 chunks (~112
per chunk of 128 x 128 x 64), per chunk 4 HGMMA.64x128x16 per warpgroup, 1 WARPGROUP.DEPBAR
gsb0 0x1 (one group left in flight), 2 BAR.SYNC, one MEMBAR + FENCE.VIEW.ASYNC (writer-side,
proxy_fence_problems), 4 LDGSTS.128, 1 LDG.128 + 1 LDG.U8, 32 PRMT, 4 STS.128, no LDS. The
arithmetic twin: 155 registers, ~464 per chunk (a test aid). Estimate at 8192 tokens (balanced,
15360 programs x 36 chunks), not measured: tensor cores 1.17 ms at the dense fp16 peak; shared
memory ~80 KB a chunk (the two warpgroups' wgmma reads 16 + 2 x 16 KB, the H copy 16 KB, the
upcast stores 16 KB) at 128 B/clk: ~1.5 ms; issue ~4.7k instructions per warp and program:
0.63 ms at one instruction per clock per scheduler; HBM ~3.1 GB (W2 once per row tile, H, y):
~0.9 ms. So ~1.6 - 2.2 ms against the Triton L2's 5.88 ms; at poisson routing ~1.5x the row
tiles (experts of 129 .. 183 rows take two 128-row tiles), ~2.4 - 3.3 ms.
"""
from __future__ import annotations

import torch

from megagraph.kernels.moe.gluon_common import IMPORT_OK as _IMPORT_OK
from megagraph.kernels.moe.gluon_common import available  # noqa: F401  (the tests, the probe and moe call it here)
from megagraph.kernels.moe.gluon_common import OUT_DTYPES, check_l2_pairs, tile_list
from megagraph.kernels.moe.gluon_decode_l2 import STEP_A, STEP_B, TABLE_A, TABLE_B

BM, BN, BK, NS, NUM_WARPS = 128, 128, 64, 3, 8
# the per-row frame: rel = e - S0 in [REL_MIN, REL_MAX] is an exact normal fp16 of the table
# (high byte 0x38 .. 0x46 + 4 rel in [0x04, 0x7A]); S0 = max(max e - REL_MAX, 1)
REL_MIN, REL_MAX = -13, 13


# DIAG bits (timing diagnosis only, WRONG results; 0 builds the same machine code as without
# them): 1 no W2 loads / upcast in the K loop, 2 no wgmma, 4 no A (H) copies in the K loop
DIAG_BITS = {"w": 1, "mma": 2, "a": 4}


def kernel_consts(K: int, use_asm: bool = True, diag: int = 0) -> dict:
    """The constexprs of l2_kernel for K columns of W2 (the launcher's and the ahead-of-time
    build test's): KGI = the 16-exponent pieces of a W2 row the frame scan reads (unrolled)."""
    return dict(KGI=-(-(K // 32) // 16), USE_ASM=bool(use_asm), BM=BM, BN=BN, BK=BK, NS=NS,
                NW=NUM_WARPS, DIAG=int(diag))


def frame(e_max: int) -> int:
    """S0 of a W2 row whose largest E8M0 exponent is e_max (the kernel's formula, for tests)."""
    return max(e_max - REL_MAX, 1)


def fp16_bits(c: int, rel: int) -> int:
    """The fp16 bits of E2M1 code c (4 bits) x 2^rel as the kernel's upcast writes them (Python
    ints: the CPU twin of gluon_common.fp16_bits at REL_MIN): high byte 0x38 (0.5) or 0x38 + 2 m
    (m = 2 .. 7: 1 .. 6) plus 4 rel, sign at bit 15; (signed) zero for magnitude 0 or
    rel < REL_MIN."""
    m = c & 7
    hb = (0x38 + 2 * m if m >= 2 else 0x38) + 4 * rel
    if m == 0 or rel < REL_MIN:
        hb = 0
    return ((hb << 8) | ((c & 8) << 12)) & 0xFFFF


def tables(rel: int) -> tuple[int, int]:
    """The table words (ta, tb) the kernel passes to FP16_TABLE_ASM at offset rel (uint32)."""
    if rel < REL_MIN:
        return 0, 0
    return (TABLE_A + rel * STEP_A) & 0xFFFFFFFF, (TABLE_B + rel * STEP_B) & 0xFFFFFFFF


if _IMPORT_OK:  # the Triton 3.6 Gluon names (gluon_common's guarded import)
    from megagraph.kernels.moe.gluon_common import (
        async_copy,
        fence_async_shared,
        fp16x2_regs,
        gluon,
        halves,
        program_tile,
        refill_a,
        ttgl,
    )
    from megagraph.kernels.moe.gluon_common import warpgroup_mma, warpgroup_mma_wait
    from megagraph.kernels.moe.gluon_decode_l2 import fp16_table_regs, fp16_tables

    _RMIN, _RMAX = ttgl.constexpr(REL_MIN), ttgl.constexpr(REL_MAX)

    @gluon.jit
    def _load_w(w_ptrs, e_ptrs, k0):
        """The packed words (int32 [BN, 2 groups, 4 words]: thread = one (row, group), one
        16-byte load) and E8M0 exponents (int32 [BN, 2]) of the K chunk at column k0 (< K:
        callers clamp)."""
        w = ttgl.load(w_ptrs + k0 // 8)
        e = ttgl.load(e_ptrs + k0 // 32).to(ttgl.int32)
        return w, e

    @gluon.jit
    def _upcast_store(w, e, s0, b_dst, USE_ASM: ttgl.constexpr, BN: ttgl.constexpr,
                      BK: ttgl.constexpr):
        """Packed words w [BN, 2, 4] and exponents e [BN, 2] of one chunk, the rows' frames s0
        [BN] -> the exact fp16 weights e2m1 x 2^(e - s0) [BN, BK] in column order into the
        K-major stage b_dst (module docstring: word kk of group g, byte j, nibble i -> column
        32 g + 8 kk + 2 j + i)."""
        rel = e - ttgl.expand_dims(s0, 1)  # [BN, 2]: one offset per (row, group) = thread
        if USE_ASM:
            ta, tb = fp16_tables(rel, _RMIN)  # per thread, then broadcast to its 4 words
            ta = ttgl.broadcast(ttgl.expand_dims(ta, 2), w)[0]
            tb = ttgl.broadcast(ttgl.expand_dims(tb, 2), w)[0]
            r0, r1, r2, r3 = fp16_table_regs(w, ta, tb)
        else:
            rel_w = ttgl.broadcast(ttgl.expand_dims(rel, 2), w)[0]
            r0, r1, r2, r3 = fp16x2_regs(w, rel_w, _RMIN)
        # [row, g, kk, a, b] with register j = 2 a + b, then its halves i: column 32 g + 8 kk
        # + 2 j + i in row-major order
        x = halves(ttgl.join(ttgl.join(r0, r2), ttgl.join(r1, r3)))
        x = ttgl.reshape(x, [BN, BK]).to(ttgl.float16, bitcast=True)
        b_dst.store(x)

    @gluon.jit
    def _chunk(i, n_k, a_cur, b_cur, a_nxt, b_nxt, acc, w, e, s0, a_ptrs, a_mask, w_ptrs,
               e_ptrs, USE_ASM: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr,
               DIAG: ttgl.constexpr):
        """K chunk i: A[i] in a_cur (cp.async issued one chunk ago), B[i] upcast in b_cur (one
        chunk ago); the words / exponents w, e of chunk i + 1 in registers. Returns acc (with
        wgmma(i) possibly still in flight) and chunk i + 2's words / exponents. Every prefetch
        index is clamped to the last chunk (n_k - 1): past K it refills a stage nobody reads,
        never reads past a row."""
        # A[i] landed; the writer-side fence covers each thread's cp.async bytes of A[i] AND
        # its upcast stores of B[i] (made in chunk i - 1 or the prologue), then the CTA barrier
        # (gluon_common.refill_a): every thread's A[i] copies and B[i] stores are in and
        # fenced, every warpgroup waited for wgmma(i - 2) (wait(1) at the end of chunk i - 1),
        # so stage (i + 1) % 3, written from here on, has no reader left; A[i + 1] copied
        if (DIAG & 4) == 0:
            refill_a(a_nxt, a_ptrs, a_mask, i, n_k, BK)
        else:  # DIAG: the same fence and barrier, no copy
            fence_async_shared()
            ttgl.thread_barrier()
        # wgmma: A [BM, BK] (K-major smem) @ B [BK, BN]: the [BN, BK] K-major stage, permuted;
        # chained on acc (wgmma(i - 1) may still be running: the hardware orders them)
        if (DIAG & 2) == 0:
            acc = warpgroup_mma(a_cur, b_cur.permute((1, 0)), acc, is_async=True)
        # while the tensor cores run chunks i - 1, i: upcast chunk i + 1 into its stage. No
        # fence here: the writer-side fence at the top of chunk i + 1 (after these stores in
        # each thread's program order, before the barrier wgmma(i + 1) waits at) orders them
        # for the async proxy, as it does the thread's cp.async bytes.
        if (DIAG & 1) == 0:
            _upcast_store(w, e, s0, b_nxt, USE_ASM, BN, BK)
            # chunk i + 2's bytes: a whole chunk of latency to hide
            k2 = ttgl.minimum(i + 2, n_k - 1) * BK
            w, e = _load_w(w_ptrs, e_ptrs, k2)
        if (DIAG & 2) == 0:
            # wgmma(i - 1) retired (its stage is refilled in chunk i + 1, after the barrier)
            acc = warpgroup_mma_wait(1, deps=[acc])
        return acc, w, e

    @gluon.jit
    def l2_kernel(h_ptr, b_ptr, bs_ptr, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, N, K, G, P,
                  stride_hm, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_cm,
                  TOPK: ttgl.constexpr, KS: ttgl.constexpr, KGI: ttgl.constexpr,
                  USE_ASM: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr,
                  BK: ttgl.constexpr, NS: ttgl.constexpr, NW: ttgl.constexpr,
                  DIAG: ttgl.constexpr):
        """Program pid: row tile pid // (N / BN) of the tile list (moe.tile_list at BM rows:
        [total, grp[MT], row0[MT], rend[MT]], rend the END OF THE GROUP), output columns
        (pid % (N / BN)) * BN. N % BN == 0, K % (NS * BK) == 0 (the launcher checks);
        out-of-range list entries exit before any pointer is formed. KGI = ceil(K / 512): the
        16-exponent pieces of a W2 row (kernel_consts)."""
        ttgl.static_assert(NS == 3, "the loop is unrolled for 3 stages")
        ttgl.static_assert(BM == 16 * NW, "BM = 64 rows per warpgroup")
        ttgl.static_assert(BK == 64, "64-column chunks: one 128-byte swizzle row of fp16")
        # ---- layouts ------------------------------------------------------------------
        mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                          instr_shape=[16, BN, 16])
        row_l: ttgl.constexpr = ttgl.SliceLayout(1, mma)
        col_l: ttgl.constexpr = ttgl.SliceLayout(0, mma)
        # A copy: 16 bytes (8 fp16) per cp.async, 8 threads per 128-byte row
        la: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        # packed W2 words [BN, 2 groups, 4 words]: one (row, group) = 16 bytes per thread
        lw: ttgl.constexpr = ttgl.BlockedLayout([1, 1, 4], [16, 2, 1], [NW, 1, 1], [2, 1, 0])
        le: ttgl.constexpr = ttgl.SliceLayout(2, lw)
        # the prologue's exponent rows [BN, 16] (rows mapped to threads as in lw)
        lx: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [16, 2], [NW, 1], [1, 0])
        f16_sl: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=128,
                                                        element_bitwidth=16, rank=2)
        s_sl: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [0])

        # ---- the tile ------------------------------------------------------------------
        skip, g, row0, nrows, pid_n = program_tile(work_ptr, N, MT, G, P, BN, BM)
        if skip:
            return
        n0 = pid_n * BN

        # H rows row0 .. row0 + nrows - 1 (contiguous in sorted order), zero-filled past them
        rm_a = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, la))
        rk = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, la))
        a_ptrs = h_ptr + ((row0 + rm_a).to(ttgl.int64) * stride_hm)[:, None] + rk[None, :]
        a_mask = (rm_a < nrows)[:, None] & (rk < BK)[None, :]

        # W2 rows n0 .. n0 + BN - 1 as int32 words: word 4 g + kk of the chunk (k0 // 8 words
        # in); a row is stride_bn bytes, a multiple of 16 (the launcher checks)
        rn_w = n0 + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, le))
        grp = ttgl.arange(0, 2, layout=ttgl.SliceLayout(0, le))
        kk = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, lw)))
        w32 = (b_ptr + g * stride_bg).to(ttgl.pointer_type(ttgl.int32), bitcast=True)
        wofs = (rn_w.to(ttgl.int64) * (stride_bn // 4))[:, None] + (grp * 4)[None, :]
        w_ptrs = w32 + ttgl.expand_dims(wofs, 2) + ttgl.expand_dims(ttgl.expand_dims(kk, 0), 1)
        e_ptrs = bs_ptr + g * stride_bsg + (rn_w.to(ttgl.int64) * stride_bsn)[:, None] + \
            grp[None, :]

        # ---- shared rings: 3 A stages, 3 B stages (each its own allocation) ----------------
        a0 = ttgl.allocate_shared_memory(ttgl.float16, [BM, BK], f16_sl)
        a1 = ttgl.allocate_shared_memory(ttgl.float16, [BM, BK], f16_sl)
        a2 = ttgl.allocate_shared_memory(ttgl.float16, [BM, BK], f16_sl)
        b0 = ttgl.allocate_shared_memory(ttgl.float16, [BN, BK], f16_sl)
        b1 = ttgl.allocate_shared_memory(ttgl.float16, [BN, BK], f16_sl)
        b2 = ttgl.allocate_shared_memory(ttgl.float16, [BN, BK], f16_sl)

        n_k = K // BK
        # prologue: A chunk 0 in flight and the words / exponents of B chunks 0 and 1 requested
        # before the frames' exponent scan, so their latencies overlap it
        async_copy.async_copy_global_to_shared(a0, a_ptrs, mask=a_mask)
        async_copy.commit_group()
        w0, e0 = _load_w(w_ptrs, e_ptrs, 0)
        w, e = _load_w(w_ptrs, e_ptrs, ttgl.minimum(1, n_k - 1) * BK)

        # ---- the rows' frames S0 = max(max e - REL_MAX, 1) over all K / 32 exponents --------
        # KGI pieces of 16 exponents (a constexpr: the scan is unrolled, its loads issued
        # together), masked past K / 32
        KG = K // 32
        rn_x = n0 + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, lx))
        cx = ttgl.arange(0, 16, layout=ttgl.SliceLayout(0, lx))
        x_ptrs = bs_ptr + g * stride_bsg + (rn_x.to(ttgl.int64) * stride_bsn)[:, None] + \
            cx[None, :]
        emax = ttgl.zeros([BN], ttgl.int32, ttgl.SliceLayout(1, lx))
        for j in ttgl.static_range(KGI):
            ex = ttgl.load(x_ptrs + 16 * j, mask=(16 * j + cx < KG)[None, :], other=0)
            emax = ttgl.maximum(emax, ttgl.max(ex.to(ttgl.int32), axis=1))
        s0x = ttgl.maximum(emax - _RMAX, 1)
        s0 = ttgl.convert_layout(s0x, ttgl.SliceLayout(1, le))
        # the epilogue's frame 2^(S0 - 127) per output column: read back after the K loop
        sb_s = ttgl.allocate_shared_memory(ttgl.float32, [BN], s_sl,
                                           (s0x << 23).to(ttgl.float32, bitcast=True))
        _upcast_store(w0, e0, s0, b0, USE_ASM, BN, BK)  # fenced at chunk 0's top

        acc = ttgl.zeros([BM, BN], ttgl.float32, mma)
        # unrolled by 3: chunk i uses stage i % 3; n_k % 3 == 0 (the launcher checks)
        for i in range(0, n_k, 3):
            acc, w, e = _chunk(i, n_k, a0, b0, a1, b1, acc, w, e, s0, a_ptrs, a_mask, w_ptrs,
                               e_ptrs, USE_ASM, BN, BK, DIAG)
            acc, w, e = _chunk(i + 1, n_k, a1, b1, a2, b2, acc, w, e, s0, a_ptrs, a_mask,
                               w_ptrs, e_ptrs, USE_ASM, BN, BK, DIAG)
            acc, w, e = _chunk(i + 2, n_k, a2, b2, a0, b0, acc, w, e, s0, a_ptrs, a_mask,
                               w_ptrs, e_ptrs, USE_ASM, BN, BK, DIAG)
        if (DIAG & 2) == 0:
            acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)  # the clamped re-copy of the last A chunk (never read)

        # ---- epilogue: y[(p // TOPK) * KS + p % TOPK, n0 + c] = acc 2^(S0 - 127) row_w[p] -----
        rm = ttgl.arange(0, BM, layout=row_l)
        rmask = rm < nrows
        pair = ttgl.load(cidx_ptr + row0 + rm, mask=rmask, other=0)
        crow = ((pair // TOPK) * KS + pair % TOPK).to(ttgl.int64)
        rw = ttgl.load(w_ptr + pair, mask=rmask, other=0.0).to(ttgl.float32)
        sb = sb_s.load(col_l)
        out = (acc * sb[None, :]) * rw[:, None]
        rn = n0 + ttgl.arange(0, BN, layout=col_l)
        c_ptrs = c_ptr + (crow * stride_cm)[:, None] + rn[None, :]
        ttgl.store(c_ptrs, out.to(c_ptr.dtype.element_ty),
                   mask=rmask[:, None] & (rn < N)[None, :])


def _check(h, w2, counts, c_idx, row_w, out, topk: int, ks: int) -> int:
    """The launcher's argument checks (ValueError, before any launch); returns P, the sorted
    rows."""
    if not (w2.wfmt == 0 and w2.bk == 32 and w2.bn == 1):
        raise ValueError("l2_gluon takes an MXFP4 bank (E8M0 per 32 columns)")
    N, K = w2.n, w2.k
    if N % BN or K % (NS * BK):
        raise ValueError(f"N {N} / K {K} do not fit the {BN}-column tile / {NS * BK}-column K "
                         "step (3 stages of 64)")
    if h.dtype != torch.float16 or h.dim() != 2 or h.shape[1] != K:
        raise ValueError(f"h must be fp16 [P, {K}]")
    if h.stride(1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16:
        raise ValueError("h rows contiguous and 16-byte aligned (cp.async of 16 bytes)")
    if w2.w.stride(2) != 1 or w2.w.stride(1) % 16 or w2.w.stride(0) % 16 or \
            w2.w.data_ptr() % 16:
        raise ValueError("W2 rows contiguous and 16-byte aligned (16-byte word loads)")
    if w2.s.stride(2) != 1:
        raise ValueError("W2 exponent rows must be contiguous")
    return check_l2_pairs(h, counts, c_idx, row_w, out, groups=w2.groups, N=N, topk=topk,
                          ks=ks, names=("srt", "wts", "y"))


def l2_gluon(h, w2_bank, counts, srt, wts, y, *, topk: int, ks: int, max_tiles: int,
             tiles: torch.Tensor | None = None, use_asm: bool = True, diag: int = 0):
    """y[(p // topk) * ks + p % topk] = wts[p] * (H[r] @ W2[g]^T) for every expert-sorted row r
    of expert g, p = srt[r] (moe.gemm role "l2" as routed_experts launches it); slots no pair
    maps to are not written. h: fp16 [>= P, F] in sorted row order; w2_bank: moe.Bank MXFP4
    [E, d, F / 2] with E8M0 [E, d, F / 32]; counts [E] int32 rows per expert; srt int32 [P];
    wts: the pair weights ([T, topk] or flat, contiguous, any float dtype); y: [T, ks, d] or its
    [T * ks, d] view (a row-strided 2-D view is fine), fp32 / bf16 / fp16. Row tiles of BM = 128
    rows: max_tiles bounds them (routed_experts' formula: min(P, P // 128 + E)); tiles:
    moe.tile_list(counts, 128, max_tiles) if already built (else built here: one tiny launch,
    no host sync). use_asm: the PRMT table upcast (default) or its integer-arithmetic twin.
    diag: DIAG_BITS - skips work and gives WRONG results, for timing diagnosis only."""
    if y.dim() == 3:
        y = y.view(-1, y.shape[-1])
    if wts.dim() != 1:
        wts = wts.reshape(-1)
    P = _check(h, w2_bank, counts, srt, wts, y, topk, ks)
    if max_tiles == 0 or P == 0:
        return y
    if not _IMPORT_OK:
        raise RuntimeError("l2_gluon needs Triton 3.6's Gluon (moe_gluon_l2.available())")
    tiles = tile_list(counts, BM, max_tiles, tiles)
    N, K = w2_bank.n, w2_bank.k
    consts = kernel_consts(K, use_asm, diag)
    grid = (max_tiles * (N // BN),)
    l2_kernel[grid](
        h, w2_bank.w, w2_bank.s, y, srt, wts, tiles, max_tiles, N, K, counts.numel(), P,
        h.stride(0), w2_bank.w.stride(0), w2_bank.w.stride(1), w2_bank.s.stride(0),
        w2_bank.s.stride(1), y.stride(0), TOPK=topk, KS=ks, **consts, num_warps=NUM_WARPS)
    return y
