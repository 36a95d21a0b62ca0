"""Gluon (Triton 3.6, sm_90) kernel for the DECODE routed-expert L2 GEMM (the down
projection): Y = row_w x (H W2^T) on MXFP4 W2 with the fp16 H of the L1, scattered to the
(token, slot) rows of y - the launch `routed_experts` makes through `moe.gemm(role="l2")` at
<= 12 rows per expert (moe_jit.moe_tile with SCATTER_C / WEIGHTED, load_b_tile's MXFP4 x fp16
MMA). The Triton L2 runs there at ~33% of the H200's HBM bandwidth; this is the L2 twin of
moe_gluon_decode.py (the decode L1: 1.66 -> 1.11 ms, 64%). routed_experts runs it there by
default where available (moe._l2_kernel): 1.035 -> 0.607 ms at 64 tokens on the H200, 59% of HBM
bandwidth (benchmarks/probes/moe_gluon_decode_l2_probe.py, benchmarks/results/moe-gluon-decode-h200.md).

Swap AB, as the decode L1: per program one row tile of <= BT = 16 expert-sorted rows of one
expert (moe.tile_list at 16 rows) and a block of BW = 64 weight rows (output columns of y); per
128-column K chunk

    C^T [64 weight rows, 16 tokens] += W2 [64, 128] @ H^T [128, 16]      (wgmma m64n16k16 x 8)

with W2 the wgmma's A operand IN REGISTERS (fp16, DotOperandLayout(0, mma, k_width 2)): the
MXFP4 bytes are read from shared memory and upcast in registers - no store of the upcast tile.
H^T (the chunk's 16 rows of H, fp16, NVMMA-swizzled, K-major) is the B operand in shared memory.

Pipeline (NS = 4 stages, one warpgroup, every stage its own allocation and the loop unrolled by
NS as in the L1s, so Gluon's barrier analysis sees static stages): per chunk i
    cp.async.wait_group(NS - 2); fence.proxy.async; bar.sync        (stage i % NS landed)
    cp.async chunk i + NS - 1 into the stage chunk i - 1 used (its LDS and wgmma are done)
    LDS the packed words + exponents, tables, upcast -> wgmma (async) -> wait(0)
    acc += part * sb                      (sb = 2^(S - 127) per weight row, moe_jit.promote)
A stage: the packed W2 rows [64, 64 bytes] (2 x 16-byte cp.async per thread), their E8M0
exponents [64, 4] (4-byte cp.async), H [16, 128] fp16 (eight 4-byte cp.async per thread, in the
k order below, zero-filled past the tile's rows). No A scales (H is fp16).

The TMA variant (l2_decode_tma_kernel; load="tma", MoeConfig.gluon_decode_l2_load; NOT
the default: correct on the H200 - the same bits, every test passed - but not faster, 0.642 ms at
3 stages, 0.693 at 4, 0.721 at 6 against the cp.async kernel's 0.621 at 64 tokens, and mega_moe
1.650 against 1.633 ms; unlike the L1, the L2's weight stream is not what bounds it:
benchmarks/results/moe-gluon-decode-l2-tma-h200.md): the decode L1's TMA design with one box per stage - the
packed W2 rows of a stage come by TMA, a [64 rows, 64 bytes] box (NVMMA 64-byte swizzle, read as
[64, 16] words in the same swizzle: one LDS.128 per row and group, no bank conflicts) from a
host descriptor of the bank as [E d, F / 2] bytes, completing on the stage's mbarrier, while
the exponents (4 bytes per row and chunk, under TMA's 16-byte minimum box) and the H rows stay
on cp.async. Any ring depth >= 3 (stages=, TMA_STAGES = 3: 25 KB, 91 registers as the cp.async
kernel); the chunk's math is the same code (_mma_chunk), so both loads give the same bits.

The k order (one fp16x2 A register = 2 consecutive k = 2 adjacent columns = one packed byte):
the m64n16k16 fp16 A fragment gives lane 4 g + t of warp w the k pairs (2t, 2t+1) and
(2t+8, 2t+9) of rows 16 w + g and 16 w + g + 8 per k16 step, so over a chunk's 8 steps a thread
holds 16 k pairs per row - exactly one 32-column scale group. Thread t reads the 16 packed bytes
of group t of each of its rows (one LDS.128 each: words kk = 0..3); byte j of word kk is pair
q = 4 kk + j of the group and goes to k positions

    kpos = 16 (q // 2) + 8 (q % 2) + 2 t + i  <-  column 32 t + 2 q + i        (i = 0, 1)

(kpos = 32 kk + 16 (j // 2) + 8 (j % 2) + 2 t + i). H is copied into shared memory with the
same permutation in 4-byte pieces (h_column: the column at each k position), so the sum over the
chunk is unchanged (tests/kernels/test_moe_gluon_decode_l2.py checks the bijection and the dot
product on the CPU).

The upcast (FP16_TABLE_ASM, one call per packed word = 8 columns -> 4 fp16x2 registers): every
E2M1 magnitude times 2^rel, rel in [-5, 6], is an fp16 with a ZERO low byte, its high byte
0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46 (0.5 .. 6) plus 4 rel (the exponent field is bits
10..14: no carry out of a byte over [-5, 6]), 0 for code 0. Per (row, group) two table words
(ta = high bytes of magnitudes 0..3, tb = 4..7; all zero for rel < -5: the flush) are looked up
by one prmt with the 4 magnitude nibbles of a half word; the nibbles' sign bits are moved to bit
7 of their bytes (prmt of the word and the word << 4, one and); two prmt with a zero word then
spread the 4 high bytes into 2 fp16x2 registers (byte 2 j' -> bits 8..15, 2 j' + 1 -> 24..31).
rel = e - S, S = max(max(e) - 6, 1) over the row's 4 exponents of the chunk (moe_acc's choice).
USE_ASM = False computes the same 4 registers per word with integer arithmetic (fp16x2_regs)
elementwise on the same word tensor - no layout operation differs - for the bit-exact check.

Wider token tiles (bt=32 / 64 / 128, BTS; the decode default stays BT = 16, whose sm_90 machine
code is unchanged by the parameter - the .text of both kernels compared byte for byte): the same
kernels with the wgmma m64nBTk16 and H [BT, 128] per stage, for prefill sizes (~128 rows per
expert at 8192 tokens): each upcast W2 chunk serves BT tokens, so an expert's W2 is read and
upcast ~rows / BT times instead of rows / 16. The per-chunk promotion stays (the chunk's fp32
partial next to acc: 2 x BT / 2 registers a thread), and H comes as BT / 2 4-byte cp.async per
thread and chunk; the copy pointers a thread holds are those of 16 rows (H_SLAB, _issue_side),
else BT = 128 spills. Triton 3.6 sm_90 builds, registers / shared / CTAs per SM (cp.async 4
stages; TMA 3 stages): BT 32: 113 / 49 KB / 4, 107 / 37 KB / 4; BT 64: 153 / 81 KB / 2, 147 /
61 KB / 3; BT 128: 236 / 145 KB / 1, 232 / 109 KB / 2 - no stack, no spills, 2 BAR.SYNC per
chunk at every BT. Not timed yet and not used by routed_experts. Other BT give other bits than
BT = 16 (the wgmma's n sets the tensor core's sum order), each within the same bound of the
fp32 math.

Numerics == moe.gemm role "l2" at decode (load_b_tile MMA == 1: the E4M3 codes e2m1 x 2^rel,
converted to fp16, which are these exact fp16 values; fp32 partial per chunk from the fp16 MMA,
acc += part * 2^(S - 127)); epilogue out row (p // topk) * ks + p % topk of sorted row r
(p = c_idx[r]) = acc * row_w[p], cast to out's dtype. Only the tensor core's sum order inside a
chunk differs (as for every wgmma kernel here).
"""
from __future__ import annotations


import torch

from megagraph.kernels.moe.gluon_common import IMPORT_OK as _IMPORT_OK
from megagraph.kernels.moe.gluon_common import available  # noqa: F401  (the tests and the probe call it here)
from megagraph.kernels.moe.gluon_common import (
    OUT_DTYPES,
    check_l2_pairs,
    load_and_stages,
    tile_list,
    token_tile,
)
from megagraph.kernels.moe import gluon_decode as _l1

BW, BT, BK, NS, NUM_WARPS = 64, 16, 128, 4, 4
# the token tiles both kernels build at (the launcher's bt=, the wgmma's n): BT = 16 for decode,
# 32 / 64 / 128 for prefill sizes (~128 rows per expert at 8192 tokens), where each upcast W2
# chunk then serves 2 / 4 / 8x the tokens
BTS = (16, 32, 64, 128)
# the H rows whose copy pointers a thread holds across the K loop (_side_pointers): a BT-row
# stage's row r is copied through row r % H_SLAB's pointer plus an offset added per chunk
H_SLAB = 16
# how the packed W2 rows reach shared memory: "cp.async" (l2_decode_kernel, the default) or
# "tma" (l2_decode_tma_kernel, TMA_STAGES stages unless the call says otherwise); the same bits.
# A bank whose expert rows are not one stride apart takes cp.async when the call did not ask.
LOADS = ("cp.async", "tma")
LOAD = "cp.async"  # the dispatcher passes MoeConfig.gluon_decode_l2_load
TMA_STAGES = 3

# the decode L1's TMA pieces (the host descriptor and its fit check here; W_TMA_LAYOUT,
# _tma_rows below): its W1 / W3 box is this kernel's W2 box, [BW rows, BK / 2 bytes] of a bank
# viewed as [G N, K / 2] bytes
assert (BW, BK) == (_l1.BW, _l1.BK), "the decode L1's TMA box is the W2 box"
_weight_desc, _tma_fits = _l1._weight_desc, _l1._tma_fits


def h_column(kpos):
    """The chunk column whose H element sits at wgmma k position kpos (0 .. 127): kpos =
    16 s + 8 h + 2 t + i <- column 32 t + 4 s + 2 h + i (pair q = 2 s + h of group t, module
    docstring). Plain arithmetic on ints, torch tensors or (as _h_column, gluon.jit of this
    function) the kernel's tensors: one formula for the kernel and the CPU test."""
    return ((kpos // 2) % 4) * 32 + (kpos // 16) * 4 + ((kpos // 8) % 2) * 2 + kpos % 2


def _signs_and_spread(sel: str, sgn: str, out0: str, out1: str) -> str:
    """One half word of FP16_TABLE_ASM_TEXT: high bytes of the 4 magnitude nibbles `sel` from
    the tables $5 / $6, the nibbles' signs (prmt selector `sgn` of w4 = word << 4 and the word
    $4: bit 7 of each picked byte) OR-ed into bit 7, spread into the fp16x2 registers out0
    (nibbles 0, 1 of the half) and out1 (2, 3). Written once: the halves differ in these
    names only."""
    return (f"prmt.b32 m, $5, $6, {sel};\n"
            f"prmt.b32 q, w4, $4, {sgn};\n"
            "and.b32 q, q, 0x80808080;\n"
            "or.b32 m, m, q;\n"
            f"prmt.b32 {out0}, m, 0, 0x1404;\n"
            f"prmt.b32 {out1}, m, 0, 0x3424;\n")


# One packed word: $4 = 4 bytes (8 E2M1 codes, byte j: low nibble = column 2j, high = 2j + 1),
# $5 = table high bytes T[0..3] (T[0] = 0), $6 = T[4..7] of the word's (row, group).
# $0 .. $3 = fp16x2 of bytes 0 .. 3 (low half = column 2j, high half = 2j + 1).
# prmt with the magnitudes (bit 3 of each selector nibble cleared: no sign-replicate mode) looks
# up 4 high bytes at once; the sign of nibble n is bit 3 of byte n // 2 for even n (bit 7 of
# that byte of word << 4), bit 7 for odd n: selectors 0x5140 (nibbles 0..3: w4.b0, w.b0, w4.b1,
# w.b1) and 0x7362 (nibbles 4..7); the spread puts a zero word's byte (4) in the low bytes.
FP16_TABLE_ASM_TEXT = ("\n{\n"
                       ".reg .b32 pm, sh, w4, q, m;\n"
                       "and.b32 pm, $4, 0x77777777;\n"
                       "shl.b32 w4, $4, 4;\n"
                       + _signs_and_spread("pm", "0x5140", "$0", "$1")
                       + "shr.u32 sh, pm, 16;\n"
                       + _signs_and_spread("sh", "0x7362", "$2", "$3")
                       + "}\n")

# the A operand's assembly in _upcast: [row, t, kk, i, j % 2, j // 2] (the joins of the 4
# registers' fp16 halves) -> [row, kk, j // 2, j % 2, t, i], i.e. k position 32 kk + 16 (j // 2)
# + 8 (j % 2) + 2 t + i (the CPU test replays it on column indices)
A_ORDER = (0, 2, 5, 4, 1, 3)

# table words of rel = 0 and their step per unit of rel (4 per byte; byte 0 of ta is T[0] = 0)
TABLE_A, TABLE_B = 0x3E3C3800, 0x46444240
STEP_A, STEP_B = 0x04040400, 0x04040404
# the flush: rel = e - S below REL_MIN gives (signed) zero (S = max(max e - 6, 1) per chunk)
REL_MIN = -5


if _IMPORT_OK:  # the Triton 3.6 Gluon names (gluon_common's guarded import)
    from megagraph.kernels.moe.gluon_common import async_copy, fence_async_shared, fp16x2_regs, gluon, halves
    from megagraph.kernels.moe.gluon_common import mbarrier, program_tile, ttgl
    from megagraph.kernels.moe.gluon_common import warpgroup_mma, warpgroup_mma_wait
    from megagraph.kernels.moe.gluon_common import wgmma_a, wgmma_acc, wgmma_cols, wgmma_rows
    from megagraph.kernels.moe.gluon_decode import W_TMA_LAYOUT, _tma_rows  # noqa: F401  (W_TMA_LAYOUT: the tests)

    FP16_TABLE_ASM = ttgl.constexpr(FP16_TABLE_ASM_TEXT)
    _TA, _TB = ttgl.constexpr(TABLE_A), ttgl.constexpr(TABLE_B)
    _SA, _SB = ttgl.constexpr(STEP_A), ttgl.constexpr(STEP_B)
    _RMIN = ttgl.constexpr(REL_MIN)
    _A_ORDER = ttgl.constexpr(A_ORDER)
    _SLAB = ttgl.constexpr(H_SLAB)
    _h_column = gluon.jit(h_column)

    # ---- layouts, shared by both loads (BW = 64 weight rows, one warpgroup: the kernels
    # assert these sizes) ----------------------------------------------------------------------
    # the wgmma's and its operands' / slices' layouts: gluon_common.wgmma_acc / wgmma_a /
    # wgmma_rows / wgmma_cols at (BT, K = 16), A k_width 2 (m64nBTk16 on fp16)

    # packed words [row, 16 words]: word 4 t + kk of row 16 w + 8 r + g in lane 4 g + t of
    # warp w, registers (kk, r): rows as the wgmma A fragment / accumulator
    W2_L = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BW, 16]))
    W_L = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[BW, 4, 4]))
    # cp.async copies: weights 16 bytes, exponents 4, H 4 (2 fp16 of the permuted k order)
    W_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [1, 0]))
    E_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0]))
    X_CP_L = ttgl.constexpr(ttgl.BlockedLayout([1, 2], [1, 32], [NUM_WARPS, 1], [1, 0]))
    X_SMEM = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                   rank=2))
    FLAT = ttgl.constexpr(ttgl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # a TMA stage ([BW, 64] bytes in W_TMA_LAYOUT) read as [BW, 16] words: the same 64-byte
    # swizzle (16-byte units XOR-ed by row) described for 32-bit elements, so the word view
    # addresses the same bytes and group t of a row stays one 16-byte LDS.128
    W_WORDS_TMA = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=64,
                                                        element_bitwidth=32, rank=2))

    @gluon.jit
    def fp16_tables(rel, REL_MIN: ttgl.constexpr):
        """The table words (ta, tb) of FP16_TABLE_ASM at offsets rel, elementwise: TABLE + rel *
        STEP, both zero for rel < REL_MIN (the flush; -5 here, moe_gluon_l2's per-row frame
        passes -13)."""
        flush = rel < REL_MIN
        return ttgl.where(flush, 0, _TA + rel * _SA), ttgl.where(flush, 0, _TB + rel * _SB)

    @gluon.jit
    def fp16_table_regs(w, ta, tb):
        """FP16_TABLE_ASM on the packed words w with their table words ta, tb (the shape of w):
        the 4 fp16x2 registers (bytes 0 .. 3; gluon_common.fp16x2_regs is the arithmetic
        twin). The one call of the PTX for both L2 kernels."""
        return ttgl.inline_asm_elementwise(
            FP16_TABLE_ASM, "=r,=r,=r,=r,r,r,r", [w, ta, tb],
            dtype=(ttgl.int32, ttgl.int32, ttgl.int32, ttgl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _upcast(w_words, e_st, USE_ASM: ttgl.constexpr, BW: ttgl.constexpr,
                BT: ttgl.constexpr):
        """The stage's packed rows (w_words: the [BW, 64] bytes as [BW, 16] int32 words in the
        load's shared layout; e_st [BW, 4] exponents) -> the wgmma A operand (fp16 [BW, 128] in
        wgmma_a(BT, 16, 2), k permuted as the module docstring says) and the rows' promotion scales
        2^(S - 127) (wgmma_rows(BT, 16))."""
        e_l: ttgl.constexpr = ttgl.SliceLayout(2, W_L)
        w = w_words.load(W2_L)  # LDS.128 of group t
        w = ttgl.convert_layout(ttgl.reshape(w, [BW, 4, 4]), W_L, assert_trivial=True)
        e = e_st.load(e_l).to(ttgl.int32)  # [BW, 4]: thread t: group t
        S = ttgl.maximum(ttgl.max(e, axis=1) - 6, 1)
        rel = e - ttgl.expand_dims(S, 1)
        rel_w = ttgl.broadcast(ttgl.expand_dims(rel, 2), w)[0]
        if USE_ASM:
            ta, tb = fp16_tables(rel_w, _RMIN)
            r0, r1, r2, r3 = fp16_table_regs(w, ta, tb)
        else:
            r0, r1, r2, r3 = fp16x2_regs(w, rel_w, _RMIN)
        # [row, t, kk, i, j % 2, j // 2] -> the k order (A_ORDER)
        lo = ttgl.join(halves(r0), halves(r1))
        hi = ttgl.join(halves(r2), halves(r3))
        a = ttgl.permute(ttgl.join(lo, hi), _A_ORDER.value)
        a = ttgl.reshape(a, [BW, 128]).to(ttgl.float16, bitcast=True)
        a = ttgl.convert_layout(a, wgmma_a(BT, 16, 2), assert_trivial=True)
        sb = (S << 23).to(ttgl.float32, bitcast=True)  # S >= 1: 2^(S - 127), normal
        return a, ttgl.convert_layout(sb, wgmma_rows(BT, 16), assert_trivial=True)

    @gluon.jit
    def _mma_chunk(w_words, e_cur, x_cur, acc, USE_ASM: ttgl.constexpr, BW: ttgl.constexpr,
                   BT: ttgl.constexpr):
        """A chunk's math once its stage (packed W2 words, exponents, H) is in and fenced: the
        upcast -> wgmma (async) -> wait, then acc += part * sb. Both loads' kernels end their
        chunk with it, so their numerics are one code path."""
        a, sb = _upcast(w_words, e_cur, USE_ASM, BW, BT)
        zero = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 16))
        t = warpgroup_mma(a, x_cur.permute((1, 0)), zero, use_acc=False, is_async=True)
        t = warpgroup_mma_wait(0, deps=[t])
        return acc + t * ttgl.expand_dims(sb, 1)

    @gluon.jit
    def _chunk(i, n_k, w_cur, e_cur, x_cur, w_nxt, e_nxt, x_nxt, acc, w_ptrs, e_ptrs, x_src,
               USE_ASM: ttgl.constexpr, NS: ttgl.constexpr, BW: ttgl.constexpr,
               BT: ttgl.constexpr, BK: ttgl.constexpr):
        async_copy.wait_group(NS - 2)  # this thread's copies of chunk i landed
        # writer-side proxy fence (CUTLASS's order, the PTX rule: each writing thread fences its
        # own completed generic-proxy writes BEFORE the barrier the wgmma issuers wait at): H
        # (cp.async) -> the wgmma's async proxy. Fenced after the barrier instead, a fast warp
        # could issue its wgmma before a slow warp had fenced its copies of the stage.
        fence_async_shared()
        # every thread's copies of chunk i in and fenced; every thread done with chunk i - 1
        # (its LDS, its waited wgmma): the stage written below is free. (Triton 3.6's membar
        # pass adds its own CTA barrier right after the async_wait, as the next op is no
        # barrier: two per chunk, K loop 830 -> 846 instructions per 4 chunks.)
        ttgl.thread_barrier()
        _issue_chunk(w_nxt, e_nxt, x_nxt, w_ptrs, e_ptrs, x_src, i + NS - 1, n_k, BK)
        w_words = w_cur._reinterpret(ttgl.int32, [BW, 16], FLAT)
        return _mma_chunk(w_words, e_cur, x_cur, acc, USE_ASM, BW, BT)

    @gluon.jit
    def _side_pointers(h_ptr, bs_ptr, g, n0, row0, nrows, stride_hm, stride_bsg, stride_bsn,
                       BW: ttgl.constexpr, BT: ttgl.constexpr, BK: ttgl.constexpr):
        """The cp.async sources both loads share: the E8M0 exponent rows of the block, and the
        tile's H rows as _issue_side's x_src: (pointers [BT, BK] in the wgmma's k order
        (h_column) for the rows modulo H_SLAB, each row's offset to its own row, the row
        mask)."""
        re = ttgl.arange(0, BW, layout=ttgl.SliceLayout(1, E_CP_L))
        ce = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, E_CP_L))
        # row strides of 4-byte multiples written as 4 x (stride / 4): the 4-byte cp.async needs
        # that alignment proven also where the stride is not a multiple of 16 (not specialized)
        e_ptrs = bs_ptr + g * stride_bsg + \
            ((n0 + re).to(ttgl.int64) * (stride_bsn // 4) * 4)[:, None] + ce[None, :]
        # H [BT rows, BK] in the wgmma's k order (h_column), 2 fp16 (4 bytes) per piece; row r
        # as row r % H_SLAB plus (r // H_SLAB) H_SLAB rows, added per chunk (_issue_side)
        rx = ttgl.arange(0, BT, layout=ttgl.SliceLayout(1, X_CP_L))
        kx = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, X_CP_L))
        x_ptrs = h_ptr + ((row0 + rx % _SLAB).to(ttgl.int64) * (stride_hm // 2) * 2)[:, None] + \
            _h_column(kx)[None, :]
        x_slab = ((rx // _SLAB) * (_SLAB * (stride_hm // 2) * 2))[:, None]
        x_mask = (rx < nrows)[:, None] & (kx < BK)[None, :]
        return e_ptrs, (x_ptrs, x_slab, x_mask)

    @gluon.jit
    def _issue_side(e_dst, x_dst, e_ptrs, x_src, c, n_k, BK: ttgl.constexpr):
        """gluon_common.issue_side on _side_pointers' H source: cp.async of K chunk
        min(c, n_k - 1)'s exponents and H rows, committed as one group (all the TMA kernel
        streams by cp.async). The rows' slab offsets are added to the H_SLAB rows' pointers
        here, per chunk (with k0, so the compiler cannot hoist the sums): pointers for all BT
        rows held across the K loop are BT / 2 64-bit registers a thread, which the 128-token
        tile (acc and the chunk's partial: 128 registers) has no room for - it spilled (stack
        32 B at 255 registers with cp.async; 236 registers without spills this way, the BT = 16
        machine code unchanged)."""
        k0 = ttgl.minimum(c, n_k - 1) * BK
        async_copy.async_copy_global_to_shared(e_dst, e_ptrs + k0 // 32)
        x_ptrs, x_slab, x_mask = x_src
        async_copy.async_copy_global_to_shared(x_dst, x_ptrs + (x_slab + k0), mask=x_mask)
        async_copy.commit_group()

    @gluon.jit
    def _issue_chunk(w_dst, e_dst, x_dst, w_ptrs, e_ptrs, x_src, c, n_k, BK: ttgl.constexpr):
        """gluon_common.issue_chunk with _issue_side's H source: the packed W2 rows of K chunk
        min(c, n_k - 1) (clamped: past K a stage nobody reads), then its exponents and H."""
        k0 = ttgl.minimum(c, n_k - 1) * BK
        async_copy.async_copy_global_to_shared(w_dst, w_ptrs + k0 // 2)
        _issue_side(e_dst, x_dst, e_ptrs, x_src, c, n_k, BK)

    @gluon.jit
    def _store_y(acc, c_ptr, cidx_ptr, w_ptr, row0, nrows, n0, N, stride_cm,
                 TOPK: ttgl.constexpr, KS: ttgl.constexpr, BW: ttgl.constexpr,
                 BT: ttgl.constexpr):
        """The epilogue both loads share: out[(p // TOPK) * KS + p % TOPK, n0 + weight row] =
        acc * row_w[p] for the tile's rows (p = c_idx[row])."""
        rn = n0 + ttgl.arange(0, BW, layout=wgmma_rows(BT, 16))
        tk = ttgl.arange(0, BT, layout=wgmma_cols(BT, 16))
        tmask = tk < nrows
        pair = ttgl.load(cidx_ptr + row0 + tk, mask=tmask, other=0)
        crow = ((pair // TOPK) * KS + pair % TOPK).to(ttgl.int64)
        out = acc * ttgl.expand_dims(ttgl.load(w_ptr + pair, mask=tmask, other=0.0), 0)
        c_ptrs = c_ptr + (crow * stride_cm)[None, :] + rn[:, None]
        ttgl.store(c_ptrs, out.to(c_ptr.dtype.element_ty),
                   mask=tmask[None, :] & (rn < N)[:, None])

    @gluon.jit
    def _check_sizes(NW: ttgl.constexpr, BW: ttgl.constexpr, BT: ttgl.constexpr,
                     BK: ttgl.constexpr):
        """The sizes this module's layouts are built for, asserted at compile time by both
        loads' kernels: one warpgroup, 64 weight rows, one of BTS token tiles, 128-column
        chunks."""
        ttgl.static_assert(NW == 4, "one warpgroup")
        ttgl.static_assert(BW == 64, "64 weight rows")
        ttgl.static_assert((BT == 16) | (BT == 32) | (BT == 64) | (BT == 128),
                           "16-, 32-, 64- or 128-token tiles")
        ttgl.static_assert(BK == 128, "128-column chunks")

    @gluon.jit
    def l2_decode_kernel(h_ptr, b_ptr, bs_ptr, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, N, K, G, P,
                         stride_hm, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_cm,
                         TOPK: ttgl.constexpr, KS: ttgl.constexpr, USE_ASM: ttgl.constexpr,
                         BW: ttgl.constexpr, BT: ttgl.constexpr, BK: ttgl.constexpr,
                         NS: ttgl.constexpr, NW: ttgl.constexpr):
        """Program pid: row tile pid // (N / BW) of the tile list (moe.tile_list at BT rows:
        [total, grp[MT], row0[MT], rend[MT]], rend the END OF THE GROUP: the tile's rows are
        row0 .. min(row0 + BT, rend, P) - 1), weight rows (pid % (N / BW)) * BW of W2.
        N % BW == 0, K % BK == 0 (the launcher checks); out-of-range list entries exit before
        any pointer is formed."""
        ttgl.static_assert(NS == 4, "the loop is unrolled for 4 stages")
        _check_sizes(NW, BW, BT, BK)

        # ---- the tile ------------------------------------------------------------------
        skip, g, row0, nrows, pid_n = program_tile(work_ptr, N, MT, G, P, BW, BT)
        if skip:
            return
        n0 = pid_n * BW

        rw = ttgl.arange(0, BW, layout=ttgl.SliceLayout(1, W_CP_L))
        cw = ttgl.arange(0, 64, layout=ttgl.SliceLayout(0, W_CP_L))
        w_ptrs = b_ptr + g * stride_bg + ((n0 + rw).to(ttgl.int64) * stride_bn)[:, None] + \
            cw[None, :]
        e_ptrs, x_src = _side_pointers(h_ptr, bs_ptr, g, n0, row0, nrows, stride_hm,
                                                stride_bsg, stride_bsn, BW, BT, BK)

        # ---- shared memory: NS stages, each its own allocation -------------------------
        w0 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 64], FLAT)
        w1 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 64], FLAT)
        w2 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 64], FLAT)
        w3 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 64], FLAT)
        e0 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 4], FLAT)
        e1 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 4], FLAT)
        e2 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 4], FLAT)
        e3 = ttgl.allocate_shared_memory(ttgl.uint8, [BW, 4], FLAT)
        x0 = ttgl.allocate_shared_memory(ttgl.float16, [BT, BK], X_SMEM)
        x1 = ttgl.allocate_shared_memory(ttgl.float16, [BT, BK], X_SMEM)
        x2 = ttgl.allocate_shared_memory(ttgl.float16, [BT, BK], X_SMEM)
        x3 = ttgl.allocate_shared_memory(ttgl.float16, [BT, BK], X_SMEM)

        # prologue: chunks 0 .. NS - 2 (clamped)
        n_k = K // BK
        _issue_chunk(w0, e0, x0, w_ptrs, e_ptrs, x_src, 0, n_k, BK)
        _issue_chunk(w1, e1, x1, w_ptrs, e_ptrs, x_src, 1, n_k, BK)
        _issue_chunk(w2, e2, x2, w_ptrs, e_ptrs, x_src, 2, n_k, BK)

        acc = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 16))
        for i in range(0, n_k, NS):
            acc = _chunk(i, n_k, w0, e0, x0, w3, e3, x3, acc, w_ptrs, e_ptrs, x_src, USE_ASM,
                         NS, BW, BT, BK)
            if i + 1 < n_k:
                acc = _chunk(i + 1, n_k, w1, e1, x1, w0, e0, x0, acc, w_ptrs, e_ptrs, x_src,
                             USE_ASM, NS, BW, BT, BK)
            if i + 2 < n_k:
                acc = _chunk(i + 2, n_k, w2, e2, x2, w1, e1, x1, acc, w_ptrs, e_ptrs, x_src,
                             USE_ASM, NS, BW, BT, BK)
            if i + 3 < n_k:
                acc = _chunk(i + 3, n_k, w3, e3, x3, w2, e2, x2, acc, w_ptrs, e_ptrs, x_src,
                             USE_ASM, NS, BW, BT, BK)
        async_copy.wait_group(0)  # the clamped re-copies past K (never read)
        _store_y(acc, c_ptr, cidx_ptr, w_ptr, row0, nrows, n0, N, stride_cm, TOPK, KS, BW, BT)

    @gluon.jit
    def _arm(bar, c, n_k, BW: ttgl.constexpr, BK: ttgl.constexpr):
        """Arm a stage barrier for K chunk c (c < n_k, as _tma_rows): one arrival (the init
        count) + the W2 box's bytes. It may precede the copy: the phase completes only when
        the transaction count is back at zero."""
        mbarrier.expect(bar, BW * (BK // 2), pred=c < n_k)

    @gluon.jit
    def _chunk_tma(i, phase, n_k, w_cur, e_cur, x_cur, bar_cur, w_nxt, e_nxt, x_nxt, bar_nxt,
                   acc, w_desc, wrow, e_ptrs, x_src, USE_ASM: ttgl.constexpr,
                   NS: ttgl.constexpr, BW: ttgl.constexpr, BT: ttgl.constexpr,
                   BK: ttgl.constexpr):
        """_chunk with the packed W2 rows on TMA (the decode L1's _chunk_tma with one box per
        stage). Two CTA barriers per chunk, as _chunk: A (every thread done with chunk i - 1,
        so its stage nxt is free: the copy of chunk c = i + NS - 1 goes there at once, on
        bar_nxt, armed one round earlier) and B (every thread past its wait for chunk i's
        weights, so that stage's barrier may be re-armed for chunk i + NS). Triton's membar pass
        sees every op on one mbarrier or stage as a write to that allocation: the copy on
        bar_nxt, the wait and the re-arm on bar_cur are each separated from the last op on
        their barrier by A or B, so it adds no barrier of its own. One proxy fence, between A
        and the copy: after this thread's cp.async wait (its exponents and H of chunk i) and
        before B, which the wgmma follows - the writer-side order of _chunk; and between the
        generic LDS of stage nxt (chunk i - 1) and the async-proxy TMA writing it."""
        c = i + NS - 1
        async_copy.wait_group(NS - 2)
        ttgl.thread_barrier()  # A
        fence_async_shared()
        _tma_rows(w_desc, wrow, c, bar_nxt, w_nxt, n_k, BK)
        mbarrier.wait(bar_cur, phase)  # chunk i's W2 landed, visible to this thread's LDS
        ttgl.thread_barrier()  # B
        _arm(bar_cur, i + NS, n_k, BW, BK)
        _issue_side(e_nxt, x_nxt, e_ptrs, x_src, c, n_k, BK)
        w_words = w_cur._reinterpret(ttgl.int32, [BW, 16], W_WORDS_TMA)
        return _mma_chunk(w_words, e_cur, x_cur, acc, USE_ASM, BW, BT)

    @gluon.jit
    def l2_decode_tma_kernel(h_ptr, w_desc, bs_ptr, c_ptr, cidx_ptr, w_ptr, work_ptr, MT, N, K,
                             G, P, stride_hm, stride_bsg, stride_bsn, stride_cm,
                             TOPK: ttgl.constexpr, KS: ttgl.constexpr, USE_ASM: ttgl.constexpr,
                             BW: ttgl.constexpr, BT: ttgl.constexpr, BK: ttgl.constexpr,
                             NS: ttgl.constexpr, NW: ttgl.constexpr):
        """l2_decode_kernel with the packed W2 rows streamed by TMA: w_desc describes the bank
        as [G N, K / 2] bytes (boxes [BW, BK / 2], NVMMA 64-byte swizzle), expert g's block n0
        at row g N + n0; one mbarrier per stage. NS >= 3 stages of any count (the loop unrolled
        by NS through static_range, every stage its own allocation: constant stage indices, as
        l2_decode_kernel)."""
        ttgl.static_assert(NS >= 3, "a ring of at least 3 stages")
        _check_sizes(NW, BW, BT, BK)

        skip, g, row0, nrows, pid_n = program_tile(work_ptr, N, MT, G, P, BW, BT)
        if skip:
            return
        n0 = pid_n * BW
        wrow = g.to(ttgl.int32) * N + n0  # < G N: the launcher checks that it fits int32
        e_ptrs, x_src = _side_pointers(h_ptr, bs_ptr, g, n0, row0, nrows, stride_hm,
                                                stride_bsg, stride_bsn, BW, BT, BK)
        n_k = K // BK

        # ---- shared memory: the rings as tuples of allocations (stage s = ring[s]) ---------
        w_r = ()
        e_r = ()
        x_r = ()
        bars = ()
        for s in ttgl.static_range(NS):
            w_r = w_r + (ttgl.allocate_shared_memory(ttgl.uint8, [BW, BK // 2], w_desc.layout),)
            e_r = e_r + (ttgl.allocate_shared_memory(ttgl.uint8, [BW, 4], FLAT),)
            x_r = x_r + (ttgl.allocate_shared_memory(ttgl.float16, [BT, BK], X_SMEM),)
            bars = bars + (ttgl.allocate_shared_memory(ttgl.int64, [1],
                                                       mbarrier.MBarrierLayout()),)
        for s in ttgl.static_range(NS):
            mbarrier.init(bars[s], count=1)
        fence_async_shared()  # the initialized barriers, before the TMA unit signals them

        # prologue: every stage armed for its first chunk (0 .. NS - 1), chunks 0 .. NS - 2
        # issued (chunk NS - 1: by chunk 0)
        for s in ttgl.static_range(NS):
            _arm(bars[s], s, n_k, BW, BK)
        for s in ttgl.static_range(NS - 1):
            _tma_rows(w_desc, wrow, s, bars[s], w_r[s], n_k, BK)
            _issue_side(e_r[s], x_r[s], e_ptrs, x_src, s, n_k, BK)

        acc = ttgl.zeros([BW, BT], ttgl.float32, wgmma_acc(BT, 16))
        for i in range(0, n_k, NS):
            phase = (i // NS) & 1  # phases of each stage's barrier completed so far, mod 2
            for s in ttgl.static_range(NS):
                if i + s < n_k:
                    nx: ttgl.constexpr = (s + NS - 1) % NS
                    acc = _chunk_tma(i + s, phase, n_k, w_r[s], e_r[s], x_r[s], bars[s],
                                     w_r[nx], e_r[nx], x_r[nx], bars[nx], acc, w_desc, wrow,
                                     e_ptrs, x_src, USE_ASM, NS, BW, BT, BK)
        # the clamped cp.async re-copies past K (never read); every armed phase was waited for
        async_copy.wait_group(0)
        for s in ttgl.static_range(NS):
            mbarrier.invalidate(bars[s])
        _store_y(acc, c_ptr, cidx_ptr, w_ptr, row0, nrows, n0, N, stride_cm, TOPK, KS, BW, BT)


def _check(h, w2, counts, c_idx, row_w, out, topk: int, ks: int) -> int:
    """The launcher's argument checks (ValueError); returns P, the sorted rows."""
    if not (w2.wfmt == 0 and w2.bk == 32 and w2.bn == 1):
        raise ValueError("l2_gluon_decode takes an MXFP4 bank (E8M0 per 32 columns)")
    N, K = w2.n, w2.k
    if N % BW or K % BK:
        raise ValueError(f"N {N} / K {K} do not fit the {BW}-row block / {BK}-column chunk")
    if h.dtype != torch.float16 or h.dim() != 2 or h.shape[1] != K:
        raise ValueError(f"h must be fp16 [P, {K}]")
    if h.stride(1) != 1 or h.stride(0) % 2 or h.data_ptr() % 4:
        raise ValueError("h rows contiguous, 4-byte aligned (2-fp16 cp.async pieces)")
    if w2.w.stride(1) % 16 or w2.w.data_ptr() % 16 or w2.s.stride(1) % 4 or \
            w2.s.data_ptr() % 4:
        raise ValueError("weight rows must be 16-byte, exponent rows 4-byte aligned")
    return check_l2_pairs(h, counts, c_idx, row_w, out, groups=w2.groups, N=N, topk=topk,
                          ks=ks, names=("c_idx", "row_w", "out"))


def l2_gluon_decode(h, w2, counts, c_idx, row_w, out, *, topk: int, ks: int, max_tiles: int,
                    tiles: torch.Tensor | None = None, use_asm: bool | None = None,
                    load: str | None = None, stages: int | None = None,
                    bt: int | None = None):
    """out[(p // topk) * ks + p % topk] = row_w[p] * (H[r] @ W2[g]^T) for every sorted row r of
    expert g, p = c_idx[r] (moe.gemm role "l2" as routed_experts launches it: out = y.view(T * ks,
    d)); rows of slots no pair maps to are not written. h: fp16 [P, F] in expert-sorted row order;
    w2: moe.Bank MXFP4 [E, d, F / 2] with E8M0 [E, d, F / 32]; counts [E] int32 rows per expert;
    row_w [P] the pair weights (wts.reshape(-1)); out fp32 / bf16 / fp16 [>= T * ks, d] (a
    row-strided view is fine). Row tiles of bt rows (one of BTS, default BT = 16, the decode
    tile; 32 / 64 / 128 for prefill sizes): max_tiles bounds them (routed_experts' formula:
    min(P, P // bt + E)); tiles: moe.tile_list(counts, bt, max_tiles) if already built (else
    built here: one tiny launch, no host sync, CUDA-graph capturable).
    use_asm: the PTX table upcast (default) or its integer-arithmetic twin. load: how the packed
    W2 rows are streamed, "cp.async" or "tma" (default LOAD; routed_experts
    passes MoeConfig.gluon_decode_l2_load; a bank TMA cannot describe takes cp.async unless the
    call asked); stages: the TMA ring's depth (>= 3, default TMA_STAGES). Both loads give the
    same bits at one bt; different bt need not (the wgmma's n changes the tensor core's sum
    order)."""
    if not _IMPORT_OK:
        raise RuntimeError("l2_gluon_decode needs Triton 3.6 Gluon")
    if load is None and stages is None and not _tma_fits(w2):
        load = "cp.async"  # the default load on a bank TMA cannot describe
    load, ns = _load_and_stages(load, stages)
    bt = token_tile(bt, BT, BTS)
    P = _check(h, w2, counts, c_idx, row_w, out, topk, ks)
    if max_tiles == 0 or P == 0:
        return out
    tiles = tile_list(counts, bt, max_tiles, tiles)
    use_asm = True if use_asm is None else bool(use_asm)
    N, K = w2.n, w2.k
    grid = (max_tiles * (N // BW),)
    if load == "tma":
        l2_decode_tma_kernel[grid](
            h, _weight_desc(w2), w2.s, out, c_idx, row_w, tiles, max_tiles, N, K,
            counts.numel(), P, h.stride(0), w2.s.stride(0), w2.s.stride(1), out.stride(0),
            TOPK=topk, KS=ks, USE_ASM=use_asm, BW=BW, BT=bt, BK=BK, NS=ns, NW=NUM_WARPS,
            num_warps=NUM_WARPS)
        return out
    l2_decode_kernel[grid](
        h, w2.w, w2.s, out, c_idx, row_w, tiles, max_tiles, N, K, counts.numel(), P, h.stride(0),
        w2.w.stride(0), w2.w.stride(1), w2.s.stride(0), w2.s.stride(1), out.stride(0),
        TOPK=topk, KS=ks, USE_ASM=use_asm, BW=BW, BT=bt, BK=BK, NS=NS, NW=NUM_WARPS,
        num_warps=NUM_WARPS)
    return out


def _load_and_stages(load: str | None, stages: int | None) -> tuple[str, int]:
    """gluon_common.load_and_stages with this module's LOAD / TMA_STAGES (read per call)."""
    return load_and_stages(load, stages, LOAD, TMA_STAGES, LOADS)
