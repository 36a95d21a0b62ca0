"""Gluon (Triton 3.6, sm_90) kernel for the DECODE routed-expert L1 GEMM: the SwiGLU
of W1 / W3 on MXFP4 weights with E4M3 activations gathered per expert-sorted row - the launch
`routed_experts` makes through `moe.gemm` at <= 12 rows per expert (Tile.swap,
moe_jit.moe_acc_swap). routed_experts runs it there by default where available (moe._l1_kernel:
Triton 3.6 on sm_90): 1.664 -> 1.106 ms at 64 tokens on the H200, 64% of HBM bandwidth
(benchmarks/probes/moe_gluon_decode_probe.py, benchmarks/results/moe-gluon-decode-h200.md).
One file of ~600 lines: the two loads' kernels (cp.async, TMA) share its layouts, chunk math,
epilogue and launcher.

Swap AB: per program one row tile of <= 16 expert-sorted rows of one expert (moe.tile_list at 16
rows) and a block of BW = 64 weight rows of W1 and the same 64 rows of W3; per 128-column K chunk

    C^T [64 weight rows, 16 tokens] = W [64, 128] @ X^T [128, 16]       (wgmma m64n16k32 x 4)

with W the wgmma's A operand IN REGISTERS (E4M3, DotOperandLayout(0, mma, k_width 4)): the MXFP4
bytes are read from shared memory, upcast in registers and handed to the wgmma - no store of the
upcast tile, no fence for it. X^T (the gathered activations of the chunk, E4M3) is the B operand
in shared memory.

Pipeline (NS = 4 stages, one warpgroup = 4 warps, every stage its own allocation and the loop
unrolled by NS, so Gluon's barrier analysis sees static stages): per chunk i
    cp.async.wait_group(NS - 2); fence.proxy.async; bar.sync        (stage i % NS landed)
    cp.async chunk i + NS - 1 into the stage chunk i - 1 used (its LDS and wgmmas are done)
    W1: LDS the packed bytes + exponents, tables, upcast -> wgmma (async)
    W3: the same -> wgmma (async)   (runs while the W1 wgmma runs)
    wait(1): acc1 += part1 * (sb1 x sa);  wait(0): acc3 += part3 * (sb3 x sa)
A stage: the packed W1 and W3 rows [128, 64] bytes (4 x 16-byte cp.async per thread), their E8M0
exponents [128, 4] (one 4-byte cp.async per thread), X [16, 128] E4M3 (NVMMA 128-byte swizzle;
four 4-byte cp.async per thread, zero-filled past the tile's rows). The A scales of every chunk
([NKP chunks, 16 tokens] f32) are copied once in the prologue.

The TMA variant (l1_decode_tma_kernel; load="tma", the default: on the
H200 at 64 tokens 0.922 ms with 3 stages against the cp.async kernel's 1.197 ms, 77% against 59%
of the copy bandwidth, the same bits; 4 stages 0.986, 6 stages 1.182 ms;
benchmarks/results/moe-gluon-decode-tma-h200.md): the packed W1 / W3 rows of a stage come by TMA
instead - two boxes of [64 rows, 64 bytes] (NVMMA 64-byte swizzle) from host descriptors of the
banks as [E F, d / 2] bytes, completing on the stage's mbarrier (one elected thread issues them;
the stage is waited for with the barrier's phase) - while the exponents and X stay on cp.async:
an exponent row of a chunk is 4 bytes, under TMA's 16-byte minimum box, and X is a row gather in
the permuted k order. Any ring depth >= 3 (stages=, TMA_STAGES = 3: 36 KB, 6 CTAs per SM); the
chunk's math is the same code (_mma_chunk), so both loads give the same bits.

The upcast (FP4_TABLE_ASM, one call per 4 packed bytes = 8 columns): a PRMT table lookup. With
the wgmma A fragment (each 32-bit register = 4 consecutive k of one row) the kernel gives thread
(lane t of a quad) of row r the 16 packed bytes 16 t .. 16 t + 15 of the row's chunk, i.e.
exactly the 32-column scale group t; each of its 4 packs (kk = 0..3, 4 bytes = 8 columns
32 t + 8 kk + 0..7) becomes two A registers: columns 32 t + 8 kk + 0..3 at k positions
32 kk + 4 t + 0..3 and 32 t + 8 kk + 4..7 at 32 kk + 16 + 4 t + 0..3. The wgmma's k order is
thus a permutation pi of the chunk's columns (kpos = 32 kk + 16 h + 4 t + i <- column
32 t + 8 kk + 4 h + i), and the X tile is copied with the same pi (4-byte pieces), so the sum is
unchanged. Proof that one table per (row, group) is exact: an asm call's p is the 4 register
elements b = 0..3 of the tensor [64 rows, 4 t, 4 kk, 4 b] (the layout's first two register
bases are b, so pack = 4 takes exactly them), i.e. bytes 16 t + 4 kk + b of ONE row inside the
16-byte group t; its tables are indexed by (row, t) only (broadcast over kk, b).
The table of (row, group): T[m] = E4M3(e2m1(m) * 2^rel) for the 8 magnitudes (T[0] = 0), rel =
e - S, S = max(max(e) - 6, 1) over the row's 4 exponents of the chunk (moe_acc's choice), all
zero for rel < -5: exactly moe_jit.e2m1_e4m3_bits (bases 0x30, 0x38, 0x3C, 0x40 .. 0x4C plus
8 rel, no lane carries for rel in [-5, 6]); signs OR-ed into bit 7 (-0 for code 8 and flushed
negatives, as e2m1_e4m3_bits). USE_ASM = False runs the same codes through integer arithmetic
(_e2m1_e4m3_bits) for the bit-exact check.

Wider token tiles (bt=32 / 64, BTS; the decode default stays BT = 16, whose sm_90 SASS is
unchanged by the parameter): the same kernels with the wgmma m64nBTk32 and X [BT, 128] per
stage, for prefill sizes (~128 rows per expert at 8192 tokens): each upcast weight chunk serves
BT tokens, so an expert's weights are read and upcast ~rows / BT times instead of rows / 16.
The cost is registers (acc + the chunk's partial of W1 and W3: 4 x BT / 2 per thread) and the X
tile (BT / 4 4-byte cp.async per thread and chunk). Triton 3.6 sm_90 builds (TMA, 3 / 4
stages): BT 16: 112 / 122 registers, 36 / 47 KB; BT 32: 157 / 160, 46 / 59 KB; BT 64: 247 /
241, 67 / 84 KB - no stack, no spills (2 CTAs per SM at BT 64, by registers). On the H200 at
8192 tokens (TMA, 3 stages): BT 32 8.88 ms, BT 64 8.30 ms (279 TFLOP/s) against the cuBLAS grouped
L1's 9.20 and the Triton L1's 10.42 (benchmarks/results/moe-gluon-l1-wide-h200.md); routed_experts
runs BT 64 above 100 rows per expert (MoeConfig.gluon_wide_l1). Other BT give other bits than
BT = 16 (the wgmma's n sets the tensor core's sum order), each within the same bound of the fp32 math.

Numerics == moe_acc_swap with MMA fp8 (per chunk and weight row S, codes at offset e - S, fp32
partial per chunk promoted acc += part * (sb x sa), sb = 2^(S - 127)), epilogue
moe_jit.swiglu_act with the clamp, fp16 (or the out dtype) H at the expert-sorted rows. Only the
tensor core's sum order inside a chunk differs (as for every wgmma kernel here).
"""
from __future__ import annotations


import torch

from megagraph.kernels.moe.gluon_common import IMPORT_OK as _IMPORT_OK
from megagraph.kernels.moe.gluon_common import available  # noqa: F401  (moe._l1_kernel and the tests call it here)
from megagraph.kernels.moe.gluon_common import (
    check_rows,
    l1_bank_problem,
    l1_format_problem,
    load_and_stages,
    tile_list,
    token_tile,
)

if _IMPORT_OK:  # the Triton 3.6 Gluon names (gluon_common's guarded import)
    from megagraph.kernels.moe.gluon_common import TensorDescriptor, async_copy, fence_async_shared, gluon
    from megagraph.kernels.moe.gluon_common import issue_chunk, issue_side, mbarrier, program_tile
    from megagraph.kernels.moe.gluon_common import swiglu, tma, ttgl
    from megagraph.kernels.moe.gluon_common import e2m1_e4m3_bits as _e2m1_e4m3_bits
    from megagraph.kernels.moe.gluon_common import warpgroup_mma, warpgroup_mma_wait
    from megagraph.kernels.moe.gluon_common import wgmma_a, wgmma_acc, wgmma_cols, wgmma_rows

BW, BT, BK, NS, NUM_WARPS = 64, 16, 128, 4, 4
# the token tiles both kernels build at (the launcher's bt=, the wgmma's n): BT = 16 for decode,
# 32 / 64 for prefill sizes, where each upcast weight chunk then serves 2 / 4x the tokens
BTS = (16, 32, 64)
# how the packed weights reach shared memory: "tma" (l1_decode_tma_kernel, TMA_STAGES stages
# unless the call says otherwise; the default) or "cp.async" (l1_decode_kernel); the same bits.
# A bank whose expert rows are not one stride apart takes cp.async when the call did not ask.
LOADS = ("cp.async", "tma")
LOAD = "tma"  # the dispatcher passes MoeConfig.gluon_decode_load
TMA_STAGES = 3


def _signed_half(out: str, sel: str, sgn: str) -> str:
    """One half of FP4_TABLE_ASM_TEXT: the 4 E4M3 bytes of the columns whose magnitudes are the
    selector nibbles `sel` (prmt of the tables $3 / $7), each nibble's sign (bit 7 of the byte
    the prmt selector `sgn` picks from w4 = word << 4 and the word $2) OR-ed into bit 7, into
    `out` (ptxas: prmt, prmt, one lop3)."""
    return (f"prmt.b32 m, $3, $7, {sel};\n"
            f"prmt.b32 q, w4, $2, {sgn};\n"
            "and.b32 q, q, 0x80808080;\n"
            f"or.b32 {out}, m, q;\n")


# One pack: $2 = 4 packed bytes (8 E2M1 codes, byte j: low nibble = column 2j, high = 2j + 1),
# $3 (= $4 .. $6) table bytes T[0..3], $7 (= $8 .. $10) T[4..7] of the pack's (row, group).
# $0 = E4M3 of columns 0..3 (nibbles 0..3 of the low half), $1 = columns 4..7.
# prmt with the magnitudes (bit 3 of each selector nibble cleared: no sign-replicate mode) looks
# up 4 bytes at once. The sign of nibble n is bit 3 of byte n // 2 for even n - bit 7 of that
# byte of w4 = word << 4 - and bit 7 of byte n // 2 for odd n: one prmt of (w4, word) with
# selectors 0x5140 (nibbles 0..3: w4.b0, w.b0, w4.b1, w.b1) / 0x7362 (nibbles 4..7) puts every
# output byte's sign at its bit 7 (moe_gluon_decode_l2's fp16 table does the same). 9 SASS a
# pack against the 12 of the byte-spread table it replaced (git
# history; H200: the MegaMoE layer at 8192 tokens 7.44 -> 7.21 ms, the same bits); the PTX
# emulator test (tests/kernels/test_moe_gluon_decode_l2.py) checks the codes on the CPU.
FP4_TABLE_ASM_TEXT = ("\n{\n"
                      ".reg .b32 pm, sh, w4, q, m;\n"
                      "and.b32 pm, $2, 0x77777777;\n"
                      "shl.b32 w4, $2, 4;\n"
                      + _signed_half("$0", "pm", "0x5140")
                      + "shr.u32 sh, pm, 16;\n"
                      + _signed_half("$1", "sh", "0x7362")
                      + "}\n")


if _IMPORT_OK:
    FP4_TABLE_ASM = ttgl.constexpr(FP4_TABLE_ASM_TEXT)
    # the TMA boxes' shared layout ([BW, 64] bytes: 64-byte rows, the widest swizzle that fits),
    # one object for the host descriptors and the kernel's stages (w1_desc.layout)
    W_TMA_LAYOUT = ttgl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)

    # ---- layouts, shared by both loads (BW = 64 weight rows, one warpgroup: the kernels
    # assert these sizes) ----------------------------------------------------------------------
    # the wgmma's and its operands' / slices' layouts: gluon_common.wgmma_acc / wgmma_a /
    # wgmma_rows / wgmma_cols at (BT, K = 32), A k_width 4 (m64nBTk32 on E4M3)

    # packed bytes [row, 64 bytes]: byte 16 t + 4 kk + b of row 16 w + 8 r + g in lane 4 g + t
    # of warp w, registers (b, kk, r): rows as the wgmma A fragment / accumulator
    P2_L = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BW, 64]))
    P_L = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[BW, 4, 4, 4]))
    # cp.async copies: weights 16 bytes, exponents 4, X 4 (the permuted k order), sa 4
    W_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [1, 0]))
    E_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0]))
    X_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 4], [1, 32], [NUM_WARPS, 1], [1, 0]))
    S_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 1], [2, 16], [NUM_WARPS, 1], [1, 0]))
    X_SMEM = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                   rank=2))
    FLAT = ttgl.constexpr(ttgl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    FLAT1 = ttgl.constexpr(ttgl.SwizzledSharedLayout(1, 1, 1, [0]))  # [NKP, BT], .index(i)

    @gluon.jit
    def upcast_packs(p, e, USE_ASM: ttgl.constexpr, BW: ttgl.constexpr, P_L: ttgl.constexpr):
        """The E4M3 codes of BW packed rows p ([BW, 4 groups, 4 packs, 4 bytes] uint8 in P_L)
        with their exponents e ([BW, 4] int32, one per group): (r0, r1, S) - r0 the columns
        0..3 and r1 the columns 4..7 of each pack ([BW, 4, 4, 4] in P_L), S the row's frame
        (module docstring: the table per (row, group), its exactness). USE_ASM: the PRMT table,
        else the integer-arithmetic twin (the same codes). Shared with moe_gluon_ws, whose
        upcast stores the same codes in column order."""
        S = ttgl.maximum(ttgl.max(e, axis=1) - 6, 1)
        r0, r1 = upcast_packs_rel(p, e - ttgl.expand_dims(S, 1), USE_ASM, BW, P_L)
        return r0, r1, S

    @gluon.jit
    def upcast_packs_rel(p, rel, USE_ASM: ttgl.constexpr, BW: ttgl.constexpr,
                         P_L: ttgl.constexpr):
        """upcast_packs' codes for given relative exponents rel = e - S ([BW, 4] int32, S the
        rows' frames however chosen: per chunk in upcast_packs, per row over all of K in
        moe_gluon_ws's FRAMES mode): (r0, r1); flushed where rel < -5."""
        if USE_ASM:
            flush = rel < -5
            ta = ttgl.where(flush, 0, 0x3C383000 + rel * 0x08080800)
            tb = ttgl.where(flush, 0, 0x4C484440 + rel * 0x08080808)
            ta = ttgl.broadcast(ttgl.expand_dims(ttgl.expand_dims(ta, 2), 3), p)[0]
            tb = ttgl.broadcast(ttgl.expand_dims(ttgl.expand_dims(tb, 2), 3), p)[0]
            r0, r1 = ttgl.inline_asm_elementwise(FP4_TABLE_ASM, "=r,=r,r,r,r,r,r,r,r,r,r",
                                                 [p, ta, tb], dtype=(ttgl.uint8, ttgl.uint8),
                                                 is_pure=True, pack=4)
        else:
            rel_b = ttgl.broadcast(ttgl.expand_dims(ttgl.expand_dims(rel, 2), 3), p)[0]
            pi = p.to(ttgl.int32)
            lo = _e2m1_e4m3_bits(pi & 0xF, rel_b).to(ttgl.uint8)
            hi = _e2m1_e4m3_bits(pi >> 4, rel_b).to(ttgl.uint8)
            # nibble order: byte b -> columns 2b (lo), 2b + 1 (hi); r0 = columns 0..3 of the
            # pack (bytes 0, 1), r1 = columns 4..7 (bytes 2, 3)
            j = ttgl.reshape(ttgl.join(lo, hi), [BW, 4, 4, 2, 4])  # [.., half, 2 (b & 1) + lohi]
            r0, r1 = ttgl.split(ttgl.permute(j, (0, 1, 2, 4, 3)))
            r0 = ttgl.convert_layout(r0, P_L)
            r1 = ttgl.convert_layout(r1, P_L)
        return r0, r1

    @gluon.jit
    def _upcast(w_t, e_st, ROW0: ttgl.constexpr, USE_ASM: ttgl.constexpr, BW: ttgl.constexpr,
                BT: ttgl.constexpr):
        """One matrix's BW weight rows of the stage (packed bytes w_t [BW, 64], their exponents
        rows ROW0 .. ROW0 + BW - 1 of e_st [2 BW, 4]) -> the wgmma A operand (E4M3 [BW, 128] in
        wgmma_a(BT, 32, 4), k permuted as the module docstring says) and the rows' promotion scales
        2^(S - 127) (wgmma_rows(BT, 32)). w_t's shared layout is the load's (flat for cp.async, NVMMA
        64-byte swizzle for TMA): the LDS.128 of group t per row reads 16 contiguous bytes
        either way."""
        e_l: ttgl.constexpr = ttgl.SliceLayout(2, ttgl.SliceLayout(3, P_L))
        p = w_t.load(P2_L)  # [BW, 64] uint8: LDS.128 of group t per row
        p = ttgl.convert_layout(ttgl.reshape(p, [BW, 4, 4, 4]), P_L, assert_trivial=True)
        e = e_st.slice(ROW0, BW).load(e_l).to(ttgl.int32)  # [BW, 4]: thread t: group t
        r0, r1, S = upcast_packs(p, e, USE_ASM, BW, P_L)
        # [row, t, kk, i] x h -> [row, kk, h, t, i] = k position 32 kk + 16 h + 4 t + i
        a = ttgl.permute(ttgl.join(r0, r1), (0, 2, 4, 1, 3))
        a = ttgl.reshape(a, [BW, 128]).to(ttgl.float8e4nv, bitcast=True)
        a = ttgl.convert_layout(a, wgmma_a(BT, 32, 4))
        sb = (S << 23).to(ttgl.float32, bitcast=True)  # S >= 1: 2^(S - 127), normal
        return a, ttgl.convert_layout(sb, wgmma_rows(BT, 32))

    @gluon.jit
    def _mma_chunk(i, w1_cur, w3_cur, e_cur, x_cur, sa_s, acc1, acc3, USE_ASM: ttgl.constexpr,
                   BW: ttgl.constexpr, BT: ttgl.constexpr):
        """Chunk i's math once its stage (packed W1 / W3 tiles, exponents, X) is in and fenced:
        W1 upcast ->
        wgmma (async), W3 upcast -> wgmma (runs while the W1 wgmma runs), then the per-chunk
        promotion acc += part * (sb x sa) of each. Both loads' kernels end their chunk with it,
        so their numerics are one code path."""
        zero = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 32))
        xT = x_cur.permute((1, 0))  # [BK, BT]: the K-major [BT, BK] stage
        a1, sb1 = _upcast(w1_cur, e_cur, 0, USE_ASM, BW, BT)
        t1 = warpgroup_mma(a1, xT, zero, use_acc=False, is_async=True)
        a3, sb3 = _upcast(w3_cur, e_cur, BW, USE_ASM, BW, BT)
        t3 = warpgroup_mma(a3, xT, zero, use_acc=False, is_async=True)
        sa = sa_s.index(i).load(wgmma_cols(BT, 32))
        t1 = warpgroup_mma_wait(1, deps=[t1])
        acc1 += t1 * (ttgl.expand_dims(sb1, 1) * ttgl.expand_dims(sa, 0))
        t3 = warpgroup_mma_wait(0, deps=[t3])
        acc3 += t3 * (ttgl.expand_dims(sb3, 1) * ttgl.expand_dims(sa, 0))
        return acc1, acc3

    @gluon.jit
    def _chunk(i, n_k, w_cur, e_cur, x_cur, w_nxt, e_nxt, x_nxt, sa_s, acc1, acc3, w_ptrs,
               e_ptrs, x_ptrs, x_mask, USE_ASM: ttgl.constexpr, NS: ttgl.constexpr,
               BW: ttgl.constexpr, BT: ttgl.constexpr, BK: ttgl.constexpr):
        async_copy.wait_group(NS - 2)  # this thread's copies of chunk i landed
        # writer-side proxy fence (CUTLASS's order, the PTX rule: each writing thread fences its
        # own completed generic-proxy writes BEFORE the barrier the wgmma issuers wait at): X
        # (cp.async) -> the wgmma's async proxy. Fenced after the barrier instead, a fast warp
        # could issue its wgmma before a slow warp had fenced its copies of the stage.
        fence_async_shared()
        # every thread's copies of chunk i in and fenced; every thread done with chunk i - 1
        # (its LDS, its waited wgmmas): the stage written below is free. (Triton 3.6's membar
        # pass adds its own CTA barrier right after the async_wait, as the next op is no
        # barrier: two per chunk, K loop 1407 -> 1423 instructions per 4 chunks.)
        ttgl.thread_barrier()
        issue_chunk(w_nxt, e_nxt, x_nxt, w_ptrs, e_ptrs, x_ptrs, x_mask, i + NS - 1, n_k, BK)
        return _mma_chunk(i, w_cur.slice(0, BW), w_cur.slice(BW, BW), e_cur, x_cur, sa_s, acc1,
                          acc3, USE_ASM, BW, BT)

    @gluon.jit
    def _side_pointers(a_ptr, as_ptr, aidx_ptr, bs1_ptr, bs2_ptr, g, n0, row0, nrows, K,
                       stride_am, stride_as, stride_bsg, stride_bsn, TOPK: ttgl.constexpr,
                       BW: ttgl.constexpr, BT: ttgl.constexpr, BK: ttgl.constexpr,
                       NKP: ttgl.constexpr):
        """The cp.async sources both loads share: the E8M0 exponent rows of the stage (rows
        0..BW-1 W1, BW..2BW-1 W3), the activation tile in the wgmma's k order with its row mask,
        the A scales of every chunk [NKP, BT] with their mask."""
        re = ttgl.arange(0, 2 * BW, layout=ttgl.SliceLayout(1, E_CP_L))
        ce = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, E_CP_L))
        # row strides of 4-byte multiples written as 4 x (stride / 4): the 4-byte cp.async needs
        # that alignment proven also where the stride is not a multiple of 16 (not specialized)
        eofs = ((n0 + re % BW).to(ttgl.int64) * (stride_bsn // 4) * 4)[:, None] + ce[None, :]
        e_ptrs = ttgl.where((re < BW)[:, None], bs1_ptr + g * stride_bsg + eofs,
                            bs2_ptr + g * stride_bsg + eofs)
        # X [BT tokens, BK] in the wgmma's k order: position 32 kk + 16 h + 4 t + i holds
        # column 32 t + 8 kk + 4 h + i of the chunk
        rx = ttgl.arange(0, BT, layout=ttgl.SliceLayout(1, X_CP_L))
        kx = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, X_CP_L))
        colx = ((kx // 4) % 4) * 32 + (kx // 32) * 8 + ((kx // 16) % 2) * 4 + kx % 4
        srcx = ttgl.load(aidx_ptr + row0 + rx, mask=rx < nrows, other=0)
        x_ptrs = a_ptr + ((srcx // TOPK).to(ttgl.int64) * (stride_am // 4) * 4)[:, None] + \
            colx[None, :]
        x_mask = (rx < nrows)[:, None] & (kx < BK)[None, :]
        # A scales of every chunk, [NKP, BT] (chunk-major: a token's chunk i at sa_s[i])
        cs = ttgl.arange(0, NKP, layout=ttgl.SliceLayout(1, S_CP_L))
        ts = ttgl.arange(0, BT, layout=ttgl.SliceLayout(0, S_CP_L))
        srcs = ttgl.load(aidx_ptr + row0 + ts, mask=ts < nrows, other=0)
        s_ptrs = as_ptr + ((srcs // TOPK).to(ttgl.int64) * stride_as)[None, :] + cs[:, None]
        s_mask = (cs < K // BK)[:, None] & (ts < nrows)[None, :]
        return e_ptrs, x_ptrs, x_mask, s_ptrs, s_mask

    @gluon.jit
    def _store_h(acc1, acc3, c_ptr, limit, row0, nrows, n0, N, stride_cm,
                 HAS_LIMIT: ttgl.constexpr, BW: ttgl.constexpr, BT: ttgl.constexpr):
        """The epilogue both loads share: moe_jit.swiglu_act, out[row0 + token, n0 + weight
        row] for the tile's rows."""
        h = swiglu(acc1, acc3, limit, HAS_LIMIT)
        rn = n0 + ttgl.arange(0, BW, layout=wgmma_rows(BT, 32))
        tk = ttgl.arange(0, BT, layout=wgmma_cols(BT, 32))
        c_ptrs = c_ptr + ((row0 + tk).to(ttgl.int64) * stride_cm)[None, :] + rn[:, None]
        ttgl.store(c_ptrs, h.to(c_ptr.dtype.element_ty),
                   mask=(tk < nrows)[None, :] & (rn < N)[:, None])

    @gluon.jit
    def _check_sizes(NW: ttgl.constexpr, BW: ttgl.constexpr, BT: ttgl.constexpr,
                     BK: ttgl.constexpr):
        """The sizes this module's layouts are built for, asserted at compile time by both
        loads' kernels: one warpgroup, 64 weight rows per matrix, 128-column chunks, one of
        BTS token tiles."""
        ttgl.static_assert(NW == 4, "one warpgroup")
        ttgl.static_assert(BW == 64, "64 weight rows per matrix")
        ttgl.static_assert(BK == 128, "128-column chunks")
        ttgl.static_assert((BT == 16) | (BT == 32) | (BT == 64), "16-, 32- or 64-token tiles")

    @gluon.jit
    def l1_decode_kernel(a_ptr, as_ptr, aidx_ptr, b1_ptr, bs1_ptr, b2_ptr, bs2_ptr, c_ptr,
                         work_ptr, MT, N, K, G, P, limit, stride_am, stride_as, stride_bg,
                         stride_bn, stride_bsg, stride_bsn, stride_cm,
                         TOPK: ttgl.constexpr, HAS_LIMIT: ttgl.constexpr,
                         USE_ASM: ttgl.constexpr, BW: ttgl.constexpr, BT: ttgl.constexpr,
                         BK: ttgl.constexpr, NS: ttgl.constexpr, NKP: ttgl.constexpr,
                         NW: ttgl.constexpr):
        """Program pid: row tile pid // (N / BW) of the tile list (moe.tile_list at BT rows:
        [total, grp[MT], row0[MT], rend[MT]]), weight rows (pid % (N / BW)) * BW of W1 and W3.
        N % BW == 0, K % BK == 0, K / BK <= NKP (the launcher checks); out-of-range list entries
        exit before any pointer is formed."""
        ttgl.static_assert(NS == 4, "the loop is unrolled for 4 stages")
        _check_sizes(NW, BW, BT, BK)

        # ---- the tile ------------------------------------------------------------------
        skip, g, row0, nrows, pid_n = program_tile(work_ptr, N, MT, G, P, BW, BT)
        if skip:
            return
        n0 = pid_n * BW

        # weights: rows 0..BW-1 of the stage = W1 rows n0.., rows BW..2BW-1 = W3 rows n0..
        rw = ttgl.arange(0, 2 * BW, layout=ttgl.SliceLayout(1, W_CP_L))
        cw = ttgl.arange(0, 64, layout=ttgl.SliceLayout(0, W_CP_L))
        is1 = (rw < BW)[:, None]
        wofs = ((n0 + rw % BW).to(ttgl.int64) * stride_bn)[:, None] + cw[None, :]
        w_ptrs = ttgl.where(is1, b1_ptr + g * stride_bg + wofs, b2_ptr + g * stride_bg + wofs)
        e_ptrs, x_ptrs, x_mask, s_ptrs, s_mask = _side_pointers(
            a_ptr, as_ptr, aidx_ptr, bs1_ptr, bs2_ptr, g, n0, row0, nrows, K, stride_am,
            stride_as, stride_bsg, stride_bsn, TOPK, BW, BT, BK, NKP)
        n_k = K // BK

        # ---- shared memory: NS stages (each its own allocation), the A scales ----------
        w0 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 64], FLAT)
        w1 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 64], FLAT)
        w2 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 64], FLAT)
        w3 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 64], FLAT)
        e0 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 4], FLAT)
        e1 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 4], FLAT)
        e2 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 4], FLAT)
        e3 = ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 4], FLAT)
        x0 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BT, BK], X_SMEM)
        x1 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BT, BK], X_SMEM)
        x2 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BT, BK], X_SMEM)
        x3 = ttgl.allocate_shared_memory(ttgl.float8e4nv, [BT, BK], X_SMEM)
        sa_s = ttgl.allocate_shared_memory(ttgl.float32, [NKP, BT], FLAT)

        # prologue: the A scales with chunk 0, chunks 1 .. NS - 2 (clamped)
        async_copy.async_copy_global_to_shared(sa_s, s_ptrs, mask=s_mask)
        issue_chunk(w0, e0, x0, w_ptrs, e_ptrs, x_ptrs, x_mask, 0, n_k, BK)
        issue_chunk(w1, e1, x1, w_ptrs, e_ptrs, x_ptrs, x_mask, 1, n_k, BK)
        issue_chunk(w2, e2, x2, w_ptrs, e_ptrs, x_ptrs, x_mask, 2, n_k, BK)

        # the same bytes as a ring of [BT] rows (.index(i): a rank-1 layout), for the reads
        sa_r = sa_s._reinterpret(ttgl.float32, [NKP, BT], FLAT1)
        acc1 = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 32))
        acc3 = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 32))
        for i in range(0, n_k, NS):
            acc1, acc3 = _chunk(i, n_k, w0, e0, x0, w3, e3, x3, sa_r, acc1, acc3, w_ptrs, e_ptrs,
                                x_ptrs, x_mask, USE_ASM, NS, BW, BT, BK)
            if i + 1 < n_k:
                acc1, acc3 = _chunk(i + 1, n_k, w1, e1, x1, w0, e0, x0, sa_r, acc1, acc3, w_ptrs,
                                    e_ptrs, x_ptrs, x_mask, USE_ASM, NS, BW, BT, BK)
            if i + 2 < n_k:
                acc1, acc3 = _chunk(i + 2, n_k, w2, e2, x2, w1, e1, x1, sa_r, acc1, acc3, w_ptrs,
                                    e_ptrs, x_ptrs, x_mask, USE_ASM, NS, BW, BT, BK)
            if i + 3 < n_k:
                acc1, acc3 = _chunk(i + 3, n_k, w3, e3, x3, w2, e2, x2, sa_r, acc1, acc3, w_ptrs,
                                    e_ptrs, x_ptrs, x_mask, USE_ASM, NS, BW, BT, BK)
        async_copy.wait_group(0)  # the clamped re-copies past K (never read)
        _store_h(acc1, acc3, c_ptr, limit, row0, nrows, n0, N, stride_cm, HAS_LIMIT, BW, BT)

    @gluon.jit
    def _tma_rows(desc, wrow, c, bar, dst, n_k, BK: ttgl.constexpr):
        """TMA of K chunk c's packed rows wrow .. wrow + BW - 1 of one bank (box [BW, BK / 2]
        bytes) into dst, completing on bar. Only for c < n_k: unlike the clamped cp.async
        re-reads, a copy past K would complete a barrier phase nobody waits for and could land
        after the CTA exits."""
        tma.async_copy_global_to_shared(desc, [wrow, c * (BK // 2)], bar, dst, pred=c < n_k)

    @gluon.jit
    def _arm(bar, c, n_k, BW: ttgl.constexpr, BK: ttgl.constexpr):
        """Arm a stage barrier for K chunk c (c < n_k, as _tma_rows): one arrival (the init
        count) + the W1 and W3 boxes' bytes. It may precede the copies: the phase completes
        only when the transaction count is back at zero."""
        mbarrier.expect(bar, 2 * BW * (BK // 2), pred=c < n_k)

    @gluon.jit
    def _chunk_tma(i, phase, n_k, w1_cur, w3_cur, e_cur, x_cur, bar_cur, w1_nxt, w3_nxt, e_nxt,
                   x_nxt, bar_nxt, sa_s, acc1, acc3, w1_desc, w3_desc, wrow, e_ptrs, x_ptrs,
                   x_mask, USE_ASM: ttgl.constexpr, NS: ttgl.constexpr, BW: ttgl.constexpr,
                   BT: ttgl.constexpr, BK: ttgl.constexpr):
        """_chunk with the packed weights on TMA. Two CTA barriers per chunk, as _chunk: A
        (every thread done with chunk i - 1, so its stage nxt is free) and B (every thread past
        its wait for chunk i's weights, so that stage's barrier may be re-armed). Triton's membar
        pass sees every op on one mbarrier or stage as a write to that allocation and puts a CTA
        barrier between any two not yet separated by one (an expect and a copy, or two copies,
        on one mbarrier: 4 BAR.SYNC per chunk), so the two copies of chunk c = i + NS - 1 (into
        stage nxt, armed one round earlier) straddle B, and the stage just waited for is re-armed
        for chunk i + NS after B. One proxy fence, between A and the first copy: after this
        thread's cp.async wait (its exponents and X of chunk i) and before B, which the wgmma
        follows - the writer-side order of _chunk; and between the generic LDS of stage nxt
        (chunk i - 1) and the async-proxy TMA writing it (Triton's fence pass would add one
        there, before the first copy, on its own)."""
        c = i + NS - 1
        async_copy.wait_group(NS - 2)
        ttgl.thread_barrier()  # A
        fence_async_shared()
        _tma_rows(w1_desc, wrow, c, bar_nxt, w1_nxt, n_k, BK)
        mbarrier.wait(bar_cur, phase)  # chunk i's W1 / W3 landed, visible to this thread's LDS
        ttgl.thread_barrier()  # B
        _tma_rows(w3_desc, wrow, c, bar_nxt, w3_nxt, n_k, BK)
        _arm(bar_cur, i + NS, n_k, BW, BK)
        issue_side(e_nxt, x_nxt, e_ptrs, x_ptrs, x_mask, c, n_k, BK)
        return _mma_chunk(i, w1_cur, w3_cur, e_cur, x_cur, sa_s, acc1, acc3, USE_ASM, BW, BT)

    @gluon.jit
    def l1_decode_tma_kernel(a_ptr, as_ptr, aidx_ptr, w1_desc, bs1_ptr, w3_desc, bs2_ptr, c_ptr,
                             work_ptr, MT, N, K, G, P, limit, stride_am, stride_as, stride_bsg,
                             stride_bsn, stride_cm, TOPK: ttgl.constexpr,
                             HAS_LIMIT: ttgl.constexpr, USE_ASM: ttgl.constexpr,
                             BW: ttgl.constexpr, BT: ttgl.constexpr, BK: ttgl.constexpr,
                             NS: ttgl.constexpr, NKP: ttgl.constexpr, NW: ttgl.constexpr):
        """l1_decode_kernel with the packed weights streamed by TMA: w1_desc / w3_desc describe
        the banks as [G N, K / 2] bytes (boxes [BW, BK / 2], NVMMA 64-byte swizzle), expert g's
        block n0 at row g N + n0; one mbarrier per stage. NS >= 3 stages of any count (the
        loop unrolled by NS through static_range, every stage its own allocation: constant
        stage indices, as l1_decode_kernel)."""
        ttgl.static_assert(NS >= 3, "a ring of at least 3 stages")
        _check_sizes(NW, BW, BT, BK)

        skip, g, row0, nrows, pid_n = program_tile(work_ptr, N, MT, G, P, BW, BT)
        if skip:
            return
        n0 = pid_n * BW
        wrow = g.to(ttgl.int32) * N + n0  # < G N: the launcher checks that it fits int32
        e_ptrs, x_ptrs, x_mask, s_ptrs, s_mask = _side_pointers(
            a_ptr, as_ptr, aidx_ptr, bs1_ptr, bs2_ptr, g, n0, row0, nrows, K, stride_am,
            stride_as, stride_bsg, stride_bsn, TOPK, BW, BT, BK, NKP)
        n_k = K // BK

        # ---- shared memory: the rings as tuples of allocations (stage s = ring[s]) ---------
        w1_r = ()
        w3_r = ()
        e_r = ()
        x_r = ()
        bars = ()
        for s in ttgl.static_range(NS):
            w1_r = w1_r + (ttgl.allocate_shared_memory(ttgl.uint8, [BW, BK // 2],
                                                       w1_desc.layout),)
            w3_r = w3_r + (ttgl.allocate_shared_memory(ttgl.uint8, [BW, BK // 2],
                                                       w3_desc.layout),)
            e_r = e_r + (ttgl.allocate_shared_memory(ttgl.uint8, [2 * BW, 4], FLAT),)
            x_r = x_r + (ttgl.allocate_shared_memory(ttgl.float8e4nv, [BT, BK], X_SMEM),)
            bars = bars + (ttgl.allocate_shared_memory(ttgl.int64, [1],
                                                       mbarrier.MBarrierLayout()),)
        sa_s = ttgl.allocate_shared_memory(ttgl.float32, [NKP, BT], FLAT)
        for s in ttgl.static_range(NS):
            mbarrier.init(bars[s], count=1)
        fence_async_shared()  # the initialized barriers, before the TMA unit signals them

        # prologue: every stage armed for its first chunk (0 .. NS - 1), the A scales with
        # chunk 0, chunks 0 .. NS - 2 issued (chunk NS - 1: by chunk 0)
        for s in ttgl.static_range(NS):
            _arm(bars[s], s, n_k, BW, BK)
        async_copy.async_copy_global_to_shared(sa_s, s_ptrs, mask=s_mask)
        for s in ttgl.static_range(NS - 1):
            _tma_rows(w1_desc, wrow, s, bars[s], w1_r[s], n_k, BK)
            _tma_rows(w3_desc, wrow, s, bars[s], w3_r[s], n_k, BK)
            issue_side(e_r[s], x_r[s], e_ptrs, x_ptrs, x_mask, s, n_k, BK)

        sa_r = sa_s._reinterpret(ttgl.float32, [NKP, BT], FLAT1)
        acc1 = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 32))
        acc3 = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 32))
        for i in range(0, n_k, NS):
            phase = (i // NS) & 1  # phases of each stage's barrier completed so far, mod 2
            for s in ttgl.static_range(NS):
                if i + s < n_k:
                    nx: ttgl.constexpr = (s + NS - 1) % NS
                    acc1, acc3 = _chunk_tma(i + s, phase, n_k, w1_r[s], w3_r[s], e_r[s], x_r[s],
                                            bars[s], w1_r[nx], w3_r[nx], e_r[nx], x_r[nx],
                                            bars[nx], sa_r, acc1, acc3, w1_desc, w3_desc, wrow,
                                            e_ptrs, x_ptrs, x_mask, USE_ASM, NS, BW, BT, BK)
        # the clamped cp.async re-copies past K (never read); every armed phase was waited for
        async_copy.wait_group(0)
        for s in ttgl.static_range(NS):
            mbarrier.invalidate(bars[s])
        _store_h(acc1, acc3, c_ptr, limit, row0, nrows, n0, N, stride_cm, HAS_LIMIT, BW, BT)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def l1_gluon_decode(a_q, a_scale, a_idx, w1, w3, counts, out, *, topk: int, max_tiles: int,
                    limit: float | None = None, tiles: torch.Tensor | None = None,
                    use_asm: bool | None = None, load: str | None = None,
                    stages: int | None = None, bt: int | None = None) -> torch.Tensor:
    """out [P, F] (expert-sorted rows; fp16 in routed_experts, fp32 / bf16 fine; a row-strided
    view is fine) = swiglu(A W1^T, A W3^T) per expert, A row of sorted row r = a_q[a_idx[r] //
    topk] (E4M3 [T, d], a_scale [T, d / 128] f32); w1 / w3: moe.Bank MXFP4 [E, F, d / 2] with E8M0
    [E, F, d / 32]; counts [E] int32 rows per expert. Row tiles of bt rows (one of BTS, default
    BT = 16, the decode tile; 32 / 64 for prefill sizes): max_tiles bounds them (routed_experts'
    formula: min(P, P // bt + E)); tiles: moe.tile_list(counts, bt, max_tiles) if already built
    (else built here: one tiny launch, no host sync, CUDA-graph capturable). use_asm: the PRMT
    table upcast (default) or its integer-arithmetic twin. load: how the packed weights are
    streamed, "cp.async" or "tma" (default LOAD; routed_experts passes
    MoeConfig.gluon_decode_load); stages:
    the TMA ring's depth (>= 3, default TMA_STAGES). Both loads give the same bits at one bt;
    different bt need not (the wgmma's n changes the tensor core's sum order)."""
    if not _IMPORT_OK:
        raise RuntimeError("l1_gluon_decode needs Triton 3.6 Gluon")
    if load is None and stages is None and not (_tma_fits(w1) and _tma_fits(w3)):
        load = "cp.async"  # the default load on a bank TMA cannot describe
    load, ns = _load_and_stages(load, stages)
    bt = _token_tile(bt)
    problem = l1_format_problem("l1_gluon_decode", a_q, a_scale, w1, w3)
    if problem:
        raise ValueError(problem)
    N, K = w1.n, w1.k
    if N % BW or K % BK or w3.n != N or w3.k != K:
        raise ValueError(f"N {N} / K {K} do not fit the {BW}-row block / {BK}-column chunk")
    n_k = K // BK
    nkp = max(16, _next_pow2(n_k))
    if nkp > 256:
        raise ValueError(f"K {K}: more than 256 chunks of A scales")
    problem = l1_bank_problem(w1, w3, counts)
    if problem:
        raise ValueError(problem)
    if a_q.stride(1) != 1 or a_q.stride(0) % 4 or a_q.data_ptr() % 4 or out.stride(1) != 1:
        raise ValueError("a_q rows contiguous and 4-byte aligned, out rows contiguous")
    P = check_rows(a_scale, a_idx, out, N, K)  # (K // 128 == n_k: K % BK == 0 checked)
    if max_tiles == 0 or P == 0:
        return out
    tiles = tile_list(counts, bt, max_tiles, tiles)
    use_asm = True if use_asm is None else bool(use_asm)
    grid = (max_tiles * (N // BW),)
    if load == "tma":
        l1_decode_tma_kernel[grid](
            a_q, a_scale, a_idx, _weight_desc(w1), w1.s, _weight_desc(w3), w3.s, out, tiles,
            max_tiles, N, K, counts.numel(), P, float(limit or 0.0), a_q.stride(0),
            a_scale.stride(0), w1.s.stride(0), w1.s.stride(1), out.stride(0),
            TOPK=topk, HAS_LIMIT=limit is not None and limit > 0, USE_ASM=use_asm,
            BW=BW, BT=bt, BK=BK, NS=ns, NKP=nkp, NW=NUM_WARPS, num_warps=NUM_WARPS)
        return out
    l1_decode_kernel[grid](
        a_q, a_scale, a_idx, w1.w, w1.s, w3.w, w3.s, out, tiles, max_tiles, N, K,
        counts.numel(), P, float(limit or 0.0), a_q.stride(0), a_scale.stride(0),
        w1.w.stride(0), w1.w.stride(1), w1.s.stride(0), w1.s.stride(1), out.stride(0),
        TOPK=topk, HAS_LIMIT=limit is not None and limit > 0, USE_ASM=use_asm,
        BW=BW, BT=bt, BK=BK, NS=NS, NKP=nkp, NW=NUM_WARPS, num_warps=NUM_WARPS)
    return out


def _load_and_stages(load: str | None, stages: int | None) -> tuple[str, int]:
    """gluon_common.load_and_stages with this module's LOAD / TMA_STAGES (read per call)."""
    return load_and_stages(load, stages, LOAD, TMA_STAGES, LOADS)


def _token_tile(bt: int | None) -> int:
    """gluon_common.token_tile with this module's BT / BTS."""
    return token_tile(bt, BT, BTS)


def _tma_fits(bank) -> bool:
    """Can _weight_desc describe this bank (expert rows one stride apart, G N < 2^31)?"""
    G, N, _ = bank.w.shape
    return bank.w.stride(0) == N * bank.w.stride(1) and G * N < 2 ** 31


def _weight_desc(bank, box_rows: int = BW):
    """The host TMA descriptor of a bank's packed MXFP4 bytes as one [G N, K / 2] matrix (row
    g N + n = expert g's weight row n; boxes [BW, BK / 2]): what l1_decode_tma_kernel copies
    from. The rows of all experts must be one stride apart (stride(0) == N stride(1)) and
    G N must fit the descriptor's int32 coordinates; the 16-byte base / row alignment TMA
    needs is what the launcher already checks. Built per call (a host-side cuTensorMap filled
    at launch and passed by value: CUDA-graph capturable). box_rows: the box's weight rows
    (moe_gluon_ws's 128-column tile takes 128)."""
    w = bank.w.view(torch.uint8)
    G, N, KB = w.shape
    if not _tma_fits(bank):
        raise ValueError("load='tma' needs the experts' weight rows one stride apart, G N < 2^31")
    return TensorDescriptor(w, [G * N, KB], [w.stride(1), 1], [box_rows, BK // 2], W_TMA_LAYOUT)
