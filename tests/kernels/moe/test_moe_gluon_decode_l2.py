"""The experimental Gluon DECODE L2 (kernels/moe/gluon_decode_l2.py): swapped wgmma (64
weight rows of W2 = M, <= bt tokens = N: 16 at decode, 32 / 64 / 128 for prefill sizes), the
MXFP4 weights upcast to fp16 in registers as the wgmma's A operand, the fp16 H rows as B in
shared memory, the weighted scatter to the (token, slot) rows of y.

CPU: the PTX table upcast (FP16_TABLE_ASM_TEXT) run by a small PTX emulator, bit-exact against
fp16 values computed by torch for every byte in every byte lane, every offset rel in [-13, 6]
(the flush below -5, signs, -0); the k permutation (the kernel's assembly order A_ORDER replayed
on column indices) is a bijection, equals h_column (the H copy's order) and keeps dot products.
With Triton 3.6 importable (make sm90-h200) the kernel is compiled ahead of time for sm_90: no
local memory, registers, the register-A HGMMA 64x16x16 in the K loop, instruction counts per
chunk pinned, every thread's fence.proxy.async before the CTA barrier the wgmma waits at
(test_moe_gluon.proxy_fence_problems); the same for the TMA variant (its K loop: 1 UTMALDG,
1 mbarrier try-wait, 1 expect per chunk, no LDGSTS.128, the same HGMMA / PRMT / LDS.128 as the
cp.async kernel) at 3 .. 8 stages. The launcher's load / stages checks and the bank's TMA
descriptor run on the CPU.

GPU (CUDA sm_90 + Triton 3.6 Gluon, else skipped): l2_gluon_decode against the fp32 math of the
same operands (H's fp16 values x exactly dequantized W2, times row_w, scattered) and against
moe.gemm role "l2" as routed_experts launches it, into NaN-poisoned y: T in {1, 7, 64} with
empty experts, an expert with > 16 rows (several row tiles), ks > topk (the unrouted slots stay
NaN: exactly the routed slots are written), fp32 and bf16 outputs. Tolerance 2e-3 relative
(Frobenius) for fp32 y: H is an exact fp16 input, the weight codes e2m1 x 2^rel are exact fp16
(rel in [0, 5] with the exponents used: nothing flushes), fp16 x fp16 products are exact in the
tensor core and summed in fp32, so the error is fp32 sum order (~1e-6); the bound is the L1
tests' (the Triton L2 computes the same formula and must agree as tightly). bf16 y: 1e-2 (one
bf16 rounding, 2^-9 relative). The PTX upcast and its integer-arithmetic twin give bit-identical
outputs also on exponents 108 .. 127 (every offset, weights flushed). Every GPU test runs both
loads of the packed W2 rows (load="cp.async", the default, and "tma"); the TMA variant is also
checked bit for bit against the cp.async kernel (explicit per-expert row counts: tiles of 1..16
rows, experts of > 16 rows, empty experts, odd token counts, unrouted slots left NaN, 3 / 4 / 6
stages, K of fewer chunks than stages), over repeated launches and inside a CUDA graph. The
wider token tiles (bt = 32 / 64 / 128, ml2.BTS: prefill sizes) run through the same tests
(matches, asm vs arith, bit-stable) and their own (tiles of 1..bt rows, experts of > bt rows,
empty experts, odd token counts, unrouted slots left NaN, both loads - TMA at 3 / 4 stages -
with the same bits at one bt; repeated launches, CUDA graph); across bt only within the bound
(the wgmma's n sets the sum order). CPU: both kernels build at bt = 32 / 64 / 128 (<= 255
registers, no spills, HGMMA 64xbtx16, the BT = 16 chunk's barriers, fence order and upcast).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from gluon_cases import bt_rows, check_bt_build, check_chunks, check_l2_out, check_load_and_stages
from gluon_cases import check_repeats_and_graph, check_same_chunk_math, check_weight_desc
from gluon_cases import dbg_l2_case, decode_copies, diagnose, E2M1, explicit_rows, gluon_build
from gluon_cases import gluon_gpu, l2_case, l2_reference, proxy_fence_problems, rel
from megagraph.kernels.gemm.config import Tile
from megagraph.kernels.moe import gluon_decode_l2 as ml2
from megagraph.kernels.moe.config import MoeConfig
from sm90_build import SYNC_COUNTS, build_stats, loop_instructions
from test_triton_moe import ACT, FP16_H, _prmt, check_routed, pinned, routed_case

gpu = gluon_gpu(ml2)
build = gluon_build(ml2)


# ---------------------------------------------------------------------------------------------
# the PTX table upcast, emulated (CPU)
# ---------------------------------------------------------------------------------------------

M32 = 0xFFFFFFFF


def _parse(asm: str) -> list[tuple[str, list[str]]]:
    """The instructions of an inline-asm text as (opcode, operands), braces / .reg dropped."""
    ops = []
    for line in asm.strip().splitlines():
        line = line.strip().rstrip(";")
        if line and line not in "{}" and not line.startswith(".reg"):
            op, rest = line.split(None, 1)
            ops.append((op, [x.strip() for x in rest.split(",")]))
    return ops


def _run(ops, operands: list[int], n_out: int) -> list[int]:
    """Run the integer PTX subset of FP16_TABLE_ASM_TEXT (and / or / shl / shr / prmt with
    register or immediate operands) on $n = operands[n]; the first n_out registers."""
    regs = {f"${i}": v for i, v in enumerate(operands)}

    def val(x):
        return regs[x] if x in regs else int(x, 0) & M32

    for op, a in ops:
        if op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "or.b32":
            regs[a[0]] = val(a[1]) | val(a[2])
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << int(a[2], 0)) & M32
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2], 0)
        elif op == "prmt.b32":
            regs[a[0]] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        else:
            raise AssertionError(f"unknown PTX op {op}")
    return [regs[f"${i}"] for i in range(n_out)]


def _tables(r: int) -> tuple[int, int]:
    """The kernel's table words at offset r (ttgl.where(rel < -5, 0, TABLE + rel * STEP))."""
    if r < -5:
        return 0, 0
    return (ml2.TABLE_A + r * ml2.STEP_A) & M32, (ml2.TABLE_B + r * ml2.STEP_B) & M32


def fp16_ref(r: int, rel_min: int = -5) -> list[int]:
    """fp16 bits of every E2M1 code 0..15 times 2^r, computed by torch; (signed) zero for
    r < rel_min (the flush: -5 here, -13 in the prefill L2's test). Asserts the values are
    exact (normal) fp16."""
    vals = torch.tensor([(-1.0 if c & 8 else 1.0) * E2M1[c & 7] * 2.0 ** r * (r >= rel_min)
                         for c in range(16)], dtype=torch.float64)
    h = vals.to(torch.float16)
    assert torch.equal(h.double(), vals), r
    return (h.view(torch.int16).long() & 0xFFFF).tolist()


def check_table_lanes(ops, r: int, ta: int, tb: int, ref: list[int], g) -> None:
    """FP16_TABLE_ASM_TEXT (ops = _parse of it) with table words ta, tb at offset r: for every
    byte value in every byte lane of the word (random bytes from the generator g in the other
    lanes), output register j = fp16 of byte j's low nibble (bits 0..15) and high nibble
    (16..31) as ref (fp16_ref(r)) says, bit for bit."""
    for lane in range(4):
        for b in range(256):
            bs = torch.randint(0, 256, (4,), generator=g).tolist()
            bs[lane] = b
            w = sum(x << (8 * i) for i, x in enumerate(bs))
            got = _run(ops, [0, 0, 0, 0, w, ta, tb], 4)
            want = [ref[x & 0xF] | (ref[x >> 4] << 16) for x in bs]
            assert got == want, (r, lane, b, [hex(x) for x in got], [hex(x) for x in want])


def test_fp16_table_asm_bit_exact():
    """FP16_TABLE_ASM_TEXT with the kernel's tables: for every byte value in every byte lane of
    the word (random bytes in the other lanes) and every rel in [-13, 6], output register j =
    fp16 of byte j's low nibble (bits 0..15) and high nibble (16..31), equal to torch's fp16
    of e2m1 x 2^rel bit for bit (signs and -0 included, zero below rel -5)."""
    ops = _parse(ml2.FP16_TABLE_ASM_TEXT)
    g = torch.Generator().manual_seed(3)
    for r in range(-13, 7):
        ta, tb = _tables(r)
        check_table_lanes(ops, r, ta, tb, fp16_ref(r), g)


def e4m3_ref(r: int) -> list[int]:
    """E4M3 bytes of every E2M1 code 0..15 times 2^r, computed by torch (signed zero below r =
    -5: moe_gluon_decode's flush); asserts the values are exact in E4M3."""
    vals = torch.tensor([(-1.0 if c & 8 else 1.0) * E2M1[c & 7] * 2.0 ** r * (r >= -5)
                         for c in range(16)], dtype=torch.float32)
    q = vals.to(torch.float8_e4m3fn)
    assert torch.equal(q.float(), vals), r
    return q.view(torch.uint8).tolist()


def test_fp4_table_asm_bit_exact():
    """moe_gluon_decode's E4M3 table upcast (FP4_TABLE_ASM_TEXT: signs by one prmt of the word
    and the word << 4), emulated here as the fp16 table is: with the kernel's table words (upcast_packs_rel: 0x3C383000 / 0x4C484440 plus rel
    x 0x08080800 / 0x08080808, both zero below rel -5), for every byte value in every byte lane
    of the word (random bytes in the other lanes) and every rel in [-9, 6], output $0 = the E4M3
    bytes of nibbles 0..3 (byte j = nibble j), $1 = nibbles 4..7, equal to torch's E4M3 of e2m1 x
    2^rel bit for bit (signs, -0 for code 8 and flushed negatives)."""
    from megagraph.kernels.moe import gluon_decode as md

    ops = _parse(md.FP4_TABLE_ASM_TEXT)
    g = torch.Generator().manual_seed(5)
    for r in range(-9, 7):
        ta, tb = ((0, 0) if r < -5 else ((0x3C383000 + r * 0x08080800) & M32,
                                         (0x4C484440 + r * 0x08080808) & M32))
        ref = e4m3_ref(r)
        for lane in range(4):
            for b in range(256):
                bs = torch.randint(0, 256, (4,), generator=g).tolist()
                bs[lane] = b
                w = sum(x << (8 * i) for i, x in enumerate(bs))
                nib = [(w >> (4 * n)) & 0xF for n in range(8)]
                want = [sum(ref[nib[4 * h + j]] << (8 * j) for j in range(4)) for h in (0, 1)]
                got = _run(ops, [0, 0, w, ta, ta, ta, ta, tb, tb, tb, tb], 2)
                assert got == want, (r, lane, b, [hex(x) for x in got], [hex(x) for x in want])


# ---------------------------------------------------------------------------------------------
# the k permutation (CPU)
# ---------------------------------------------------------------------------------------------


def _assembled_columns() -> torch.Tensor:
    """The chunk column at each wgmma k position as _upcast assembles the A operand: thread t's
    word kk, byte j (pair q = 4 kk + j of group t), half i holds column 32 t + 2 q + i; the
    kernel's joins ([t, kk] x i x (j % 2) x (j // 2)), permute A_ORDER and reshape, replayed
    with torch.stack (ttgl.join: a new minor dimension) on these indices."""
    t = torch.arange(4)[:, None]
    kk = torch.arange(4)[None, :]

    def reg(j):  # [1 row, t, kk, i]: the two halves of register j
        return torch.stack([(32 * t + 2 * (4 * kk + j) + i)[None] for i in (0, 1)], dim=-1)

    lo = torch.stack([reg(0), reg(1)], dim=-1)
    hi = torch.stack([reg(2), reg(3)], dim=-1)
    return torch.stack([lo, hi], dim=-1).permute(ml2.A_ORDER).reshape(128)


def test_k_permutation():
    """The A operand's k order: (1) a bijection of the 128 chunk columns; (2) the wgmma A
    fragment's: k position 16 s + 8 h + 2 t + i belongs to the thread of lane % 4 = t, whose
    table is group t's, so its column is in scale group t; (3) equal to h_column, the order in
    which the kernel copies H (so both operands are permuted alike); (4) a dot product over the
    permuted operands equals the plain one (integers: exact)."""
    cols = _assembled_columns()
    kpos = torch.arange(128)
    assert torch.equal(cols.sort().values, kpos)
    assert torch.equal(cols // 32, (kpos // 2) % 4)
    assert torch.equal(cols, ml2.h_column(kpos))
    assert [ml2.h_column(int(k)) for k in kpos] == cols.tolist()
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-64, 64, (8, 128), generator=g)
    h = torch.randint(-64, 64, (16, 128), generator=g)
    assert torch.equal(w[:, cols] @ h[:, ml2.h_column(kpos)].T, w @ h.T)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


# the inputs (gluon_cases.l2_case: here on the GPU, pair weights in [0, 1)) and the fp32 math
# (gluon_cases.l2_reference): the same helpers as the prefill L2's test


def _max_tiles(P, E, bt=ml2.BT):
    """routed_experts' bound on the row tiles of bt rows."""
    return min(P, P // bt + E)


@gpu
@pytest.mark.parametrize("bt", ml2.BTS)
@pytest.mark.parametrize("load", ml2.LOADS)
@pytest.mark.parametrize("T,E,subset,ks,dtype", [
    (1, 8, None, 6, torch.float32),
    (7, 32, [0, 3, 5, 9, 17, 30], 8, torch.float32),
    (64, 64, None, 6, torch.float32),
    (64, 64, None, 7, torch.bfloat16),
    (64, 16, list(range(0, 16, 2)), 6, torch.float32),
    (64, 16, list(range(0, 16, 2)), 8, torch.bfloat16)])
def test_l2_decode_matches(T, E, subset, ks, dtype, load, bt):
    """T = 64 of 64 experts: ~6 rows per expert (the decode regime); T = 7 of 6 experts in a
    subset of 32 (the others empty); 8 of 16 experts: 48 rows per expert (3 row tiles each at
    bt = 16, one partial tile from bt = 64); ks > topk: the slots topk .. ks - 1 stay NaN.
    F = 640: 5 chunks (one pass of the 4-stage unrolled loop and a partial one). Every token
    tile bt within the bound of both references."""
    d, F, k = 512, 640, 6
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=T + E + ks, subset=subset)
    P = T * k
    y = torch.full((T, ks, d), float("nan"), dtype=dtype, device="cuda")
    ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y.view(T * ks, d), topk=k, ks=ks,
                        max_tiles=_max_tiles(P, E, bt), load=load, bt=bt)
    torch.cuda.synchronize()
    assert torch.isfinite(y[:, :k]).all(), "a routed slot was not written (or is not finite)"
    assert torch.isnan(y[:, k:]).all(), "an unrouted slot was written"
    check_l2_out(y, h, w2, counts, srt, wts, ks,
                                2e-3 if dtype == torch.float32 else 1e-2)


@gpu
@pytest.mark.parametrize("bt", ml2.BTS)
@pytest.mark.parametrize("load", ml2.LOADS)
def test_l2_decode_asm_vs_arith_and_tiles(load, bt):
    """Exponents 108 .. 127 (rel over [-13, 6] within a row's chunk: every table offset occurs
    and weights flush): the PTX table upcast and the arithmetic twin give the same bits; a
    prebuilt tile list gives the same output as the one built in the call; at every token
    tile bt."""
    from megagraph.kernels.moe import triton as moe

    d, F, k, E, T = 256, 384, 3, 4, 21
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=5, exps=(108, 128))
    P = T * k
    mt = _max_tiles(P, E, bt)
    outs = []
    for kw in (dict(use_asm=True), dict(use_asm=False),
               dict(tiles=moe.tile_list(counts, bt, mt))):
        y = torch.full((P, d), float("nan"), dtype=torch.float32, device="cuda")
        ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y, topk=k, ks=k, max_tiles=mt,
                            load=load, bt=bt, **kw)
        outs.append(y)
    torch.cuda.synchronize()
    asm, arith, pre = outs
    assert torch.isfinite(arith).all(), "arithmetic upcast: an element not written / not finite"
    ref = l2_reference(h, w2, counts, srt, wts, k).view(P, d)
    # the reference keeps the flushed weights (rel < -5: below 2^-11 of the row's largest group)
    assert rel(arith, ref) < 2e-3, f"arithmetic upcast vs fp32 math: {rel(arith, ref):.3e}"
    assert torch.isfinite(asm).all(), "PTX upcast: an element not written / not finite"
    assert torch.equal(asm, arith), f"PTX vs arithmetic upcast: rel {rel(asm, arith):.3e}"
    assert torch.equal(asm, pre), "prebuilt tile list differs"


@gpu
@pytest.mark.parametrize("load", ml2.LOADS)
def test_l2_decode_debug_pieces(load):
    """GPU debug: one expert, K = 256 (2 chunks), d = 64 (one weight block), fp32 y, topk = ks
    = 1, row_w = 1 unless said, each piece with the PTX and the arithmetic upcast; the message
    lists every case that is off and where:
      ones       H = 1, W2 = 1 (codes 0x22), exponents 127: y = 256 (data path, promotion)
      onehot     H row r = e_(17 r) (16 rows): y = W2[:, 17 r] (the k permutation of the A
                 registers and of the H copy, nibble order)
      col_ramp   one row, W2 code of column c = c % 16 (every code and sign), H = 2 on the
                 positive codes, 1 on the negative ones
      exps_wide  random H and codes, exponents 108 .. 127 (every offset, the flush)
      rows_5     5 rows (the masks, the store)
      rows_40    40 rows (3 row tiles, the last partial), topk 2, ks 3, a shuffled pair order
                 and random row_w (the scatter, the weights)"""
    d, F = 64, 256
    g = torch.Generator().manual_seed(7)

    def codes():
        return torch.randint(0, 256, (1, d, F // 2), generator=g)

    e127 = torch.full((1, d, F // 32), 127)
    eye = torch.zeros(16, F)
    eye[torch.arange(16), torch.arange(16) * 17] = 1.0
    col = torch.arange(F // 2)
    ramp = (((2 * col) % 16) | (((2 * col + 1) % 16) << 4)).expand(1, d, F // 2)
    cases = [("ones", torch.ones(16, F), torch.full((1, d, F // 2), 0x22), e127, 1, 1, None),
             ("onehot", eye, codes(), e127, 1, 1, None),
             ("col_ramp", torch.where(torch.arange(F) % 16 < 8, 2.0, 1.0)[None], ramp, e127,
              1, 1, None),
             ("exps_wide", torch.randn(16, F, generator=g), codes(),
              torch.randint(108, 128, (1, d, F // 32), generator=g), 1, 1, None),
             ("rows_5", torch.randn(5, F, generator=g), codes(), e127 - 6, 1, 1, None),
             ("rows_40", torch.randn(40, F, generator=g), codes(), e127 - 4, 2, 3,
              torch.randperm(40, generator=g))]
    msgs = []
    for name, x, c, e, k, ks, perm in cases:
        P = x.shape[0]
        h, w2, counts, srt, wts, ref = dbg_l2_case(x, c, e, k, ks, perm, g)
        for use_asm in (False, True):
            y = torch.full((P // k * ks, d), float("nan"), device="cuda")
            tag = f"{name} ({'asm' if use_asm else 'arith'})"
            try:
                ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y, topk=k, ks=ks,
                                    max_tiles=-(-P // ml2.BT), use_asm=use_asm, load=load)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (a launch error names the case)
                msgs.append(f"{tag}: {exc!r}"[:400])
                continue
            routed = torch.isfinite(ref[:, 0])
            msgs.append(diagnose(tag, y[routed], ref[routed]))
            if torch.isfinite(y[~routed]).any():
                msgs.append(f"{tag}: an unrouted slot was written")
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


def test_launcher_checks():
    """The launcher's argument checks run before any launch (CPU tensors suffice): fp16 H only,
    K a multiple of 128, ks >= topk, enough out rows for the scatter."""
    from megagraph.kernels.moe import triton as moe

    if not ml2._IMPORT_OK:
        with pytest.raises(RuntimeError):
            ml2.l2_gluon_decode(None, None, None, None, None, None, topk=1, ks=1, max_tiles=1)
        return
    E, d, F, k, T = 2, 64, 256, 2, 3
    w2 = moe.bank(torch.zeros(E, d, F // 2, dtype=torch.int8),
                  torch.full((E, d, F // 32), 127, dtype=torch.uint8), "mxfp4")
    counts = torch.tensor([T * k, 0], dtype=torch.int32)
    srt = torch.arange(T * k, dtype=torch.int32)
    wts = torch.ones(T * k)
    h = torch.zeros(T * k, F, dtype=torch.float16)
    out = torch.zeros(T * k, d)
    bad = [dict(h=h.float()), dict(h=torch.zeros(T * k, F - 128, dtype=torch.float16)),
           dict(ks=1), dict(out=torch.zeros(T * k - 1, d)), dict(out=out.to(torch.int32)),
           dict(c_idx=srt.long()), dict(bt=48)]
    for kw in bad:
        args = dict(h=h, w2=w2, counts=counts, c_idx=srt, row_w=wts, out=out, ks=k)
        args.update(kw)
        ks = args.pop("ks")
        with pytest.raises(ValueError):
            ml2.l2_gluon_decode(**args, topk=k, ks=ks, max_tiles=_max_tiles(T * k, E))


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU)
# ---------------------------------------------------------------------------------------------

TYPES = dict(h_ptr="*fp16", b_ptr="*i8", bs_ptr="*u8", c_ptr="*fp32", cidx_ptr="*i32",
             w_ptr="*fp32", work_ptr="*i32", MT="i32", N="i32", K="i32", G="i32", P="i32",
             stride_hm="i32", stride_bg="i32", stride_bn="i32", stride_bsg="i32",
             stride_bsn="i32", stride_cm="i32")




@build
@pytest.mark.parametrize("use_asm", [True, False])
def test_l2_decode_sm90_build(use_asm):
    """Triton 3.6 sm_90 build at the real shapes' divisibility: no stack / local memory; with the
    PTX upcast at most 96 registers (91 at the time of writing: 5 CTAs of 4 warps per SM) and,
    per K chunk (the loop holds NS = 4): 8 register-A HGMMA 64x16x16 (fp16, 8 k16 steps),
    1 WARPGROUP.ARRIVE, 1 WARPGROUP.DEPBAR, 2 BAR.SYNC (Triton's membar barrier after the
    cp.async wait, then the one after every thread's proxy fence: writer-side,
    proxy_fence_problems), 1 DEPBAR (cp.async wait), 2 LDGSTS.128 (weights) + 9 LDGSTS
    (8 of H, 1 of the exponents), 2 LDS.128 (the packed words: one per row), no STS (no upcast
    tile stored), 64 PRMT (8 words x (2 table + 2 sign + 4 spread): the fp16 halves' joins
    cost no repacking), the loop's instruction count pinned (846 for 4 chunks at the time of
    writing, ~212 per chunk, +- 8%; 830 with the old reader-side fence). The arithmetic twin:
    built, no spills, the same fence order."""
    consts = dict(TOPK=6, KS=6, USE_ASM=use_asm, BW=ml2.BW, BT=ml2.BT, BK=ml2.BK, NS=ml2.NS,
                  NW=ml2.NUM_WARPS)
    regs, shared, body, counts = _build_stats(ml2.l2_decode_kernel, TYPES, consts,
                                              loop=loop_instructions)
    assert shared <= 40 * 1024, shared
    per_chunk = dict(HGMMA=8, ARRIVE=1, WG_DEPBAR=1, BAR_SYNC=2, DEPBAR=1, LDGSTS128=2,
                     LDGSTS=9, LDS128=2, STS=0)
    check_chunks(f"cp.async ({'asm' if use_asm else 'arith'})", regs, shared, body, counts,
                 ml2.NS, per_chunk)
    if use_asm:
        assert regs <= 96, regs
        assert counts["PRMT"] == 64 * ml2.NS
        assert abs(len(body) - 846) <= 0.08 * 846, len(body)


# ---------------------------------------------------------------------------------------------
# routed_experts' choice of the Gluon decode L2 (MoeConfig.l2_candidates, moe._l2_kernel)
# ---------------------------------------------------------------------------------------------


def l2_pick(h, w2, y, cfg, rpg=3.0, fp8_h=False):
    """The L2 routed_experts runs for these tensors under cfg: (name, launch, row tile) of the
    first candidate that takes them (moe._first_fit over cfg.l2_candidates)."""
    from megagraph.kernels.moe import triton as moe

    return moe._first_fit("L2", cfg.l2_candidates(rpg, fp8_h),
                          lambda n: moe._l2_kernel(n, h, None, w2, y, cfg))


def test_gluon_l2_choice(monkeypatch):
    """The Gluon decode L2 runs where it was checked: the fp16-H "l2" role at <= 12 rows per
    expert, an MXFP4 W2 with E8M0 per 32 whose shape fits (d % 64, F % 128), y fp32 / bf16 /
    fp16, MoeConfig.gluon and gluon_decode_l2 on, no pinned "l2" tile, and available() (forced
    here: the predicate's own logic, on any machine)."""
    from megagraph.kernels.moe import triton as moe

    monkeypatch.setattr(ml2, "available", lambda device=None: True)
    cfg = MoeConfig()
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (4, 128, 128), dtype=torch.int8, generator=g)
    s = torch.randint(119, 125, (4, 128, 8), dtype=torch.uint8, generator=g)
    w2 = moe.bank(w, s.view(torch.float8_e8m0fnu), "mxfp4")  # d = 128, F = 256
    h = torch.randn(12, 256).half()
    y = torch.empty(2, 7, 128)

    def ok(h, w2, y, cfg=cfg, rpg=3.0, fp8_h=False):
        name, launch, _ = l2_pick(h, w2, y, cfg, rpg, fp8_h)
        return launch.func.__name__ if name == "gluon_decode_l2" else name

    assert ok(h, w2, y) == "l2_gluon_decode"
    assert l2_pick(h, w2, y, cfg)[2] == ml2.BT
    assert ok(h, w2, y.bfloat16()) == "l2_gluon_decode"
    assert ok(h, w2, y, rpg=12.5) == "triton"  # middle / prefill sizes: not this kernel
    assert ok(h, w2, y, fp8_h=True) == "triton"  # FP8 H: not this kernel
    assert ok(h.float(), w2, y) == "triton"  # exact mode / fp32 H
    assert ok(h, w2, y.double()) == "triton"
    w2b = moe.bank(w[:, :96], s[:, :96].view(torch.float8_e8m0fnu), "mxfp4")  # d = 96
    assert ok(h, w2b, y[..., :96]) == "triton"
    w2c = moe.bank(w[..., :64], s[..., :4].view(torch.float8_e8m0fnu), "mxfp4")  # F = 128
    assert ok(h[:, :128], w2c, y) == "l2_gluon_decode"
    assert ok(h, w2, y, cfg=pinned(MoeConfig(), l2=Tile(16, 64))) == "triton"
    for flag in ("gluon", "gluon_decode_l2"):
        assert ok(h, w2, y, cfg=dataclasses.replace(cfg, **{flag: False})) == "triton"
    monkeypatch.setattr(ml2, "available", lambda device=None: False)
    assert ok(h, w2, y) == "triton"


@gpu
@pytest.mark.parametrize("gluon,load", [(True, "cp.async"), (True, "tma"), (False, "cp.async")])
def test_routed_experts_decode_uses_gluon_l2(gluon, load, monkeypatch):
    """routed_experts at a decode size (24 tokens, top-6 of 48 experts: 3 rows per expert) runs
    its L2 on l2_gluon_decode when on (once per output dtype; with MoeConfig.gluon_decode_l2_load)
    and on moe_gemm when gluon_decode_l2 is off; fp32 and bf16 outputs against the reference op
    within test_triton_moe's bounds (2e-3 / 1e-2)."""
    cfg = dataclasses.replace(FP16_H, gluon_decode_l2=gluon, gluon_decode_l2_load=load)
    calls = []
    real = ml2.l2_gluon_decode
    monkeypatch.setattr(ml2, "l2_gluon_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(24, 48, 512, 128, 6, seed=93)
    for out_dtype in ("f32", "bf16"):
        check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                                  out_dtype=out_dtype), cfg)
    assert len(calls) == (2 if gluon else 0)


@gpu
@pytest.mark.parametrize("bt", ml2.BTS)
@pytest.mark.parametrize("load", ml2.LOADS)
@pytest.mark.parametrize("T,E,d,F", [(2, 1, 64, 256), (64, 64, 1024, 640)])
def test_l2_decode_bit_stable(T, E, d, F, load, bt):
    """20 launches of one call give the same bits, and the first matches the fp32 math: one
    program (one expert, <= 16 rows, one 64-row block) and a multi-program decode grid
    (test_moe_gluon_decode's twin); at every token tile bt."""
    k = min(6, E)
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=17)
    P = T * k
    first = None
    for _ in range(20):
        y = torch.full((T * (k + 1), d), float("nan"), dtype=torch.float32, device="cuda")
        ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y, topk=k, ks=k + 1,
                            max_tiles=_max_tiles(P, E, bt), load=load, bt=bt)
        if first is None:
            first = y
        else:
            assert torch.equal(y.nan_to_num(7.0), first.nan_to_num(7.0)), "bits differ"
    y = first.view(T, k + 1, d)
    assert torch.isfinite(y[:, :k]).all()
    ref = l2_reference(h, w2, counts, srt, wts, k + 1)
    assert rel(y[:, :k], ref[:, :k]) < 2e-3, f"vs fp32 math: {rel(y[:, :k], ref[:, :k]):.3e}"


# ---------------------------------------------------------------------------------------------
# the TMA load of the packed W2 rows (load="tma")
# ---------------------------------------------------------------------------------------------

def _rows_case(rows, T, k, d, F, seed, exps=(119, 125)):
    """l2_case's data with EXPLICIT rows per expert (`rows`, zeros = empty experts): sorted row
    r is pair c_idx[r] of T tokens x top-k, c_idx a random choice of distinct pairs (the other
    pairs' slots stay unwritten). On the GPU: (h [P, F], w2, counts, c_idx, wts [T, k])."""
    h, w2, _, _, wts = l2_case(T, len(rows), d, F, k, seed=seed, exps=exps)
    c_idx, counts = explicit_rows(rows, T, k, seed)
    return h[:sum(rows)], w2, counts, c_idx, wts


def _bits(y):
    """y's bits as integers (NaN poison included: torch.equal on floats says NaN != NaN)."""
    return y.view({4: torch.int32, 2: torch.int16}[y.element_size()])


# (rows per expert, tokens, top-k, d, F, exponent range, slots per token, y dtype)
TMA_CASES = {
    # every tile size 1..16 (one tile per expert) and an empty expert; 47 tokens (odd); F = 640:
    # 5 chunks (one pass of a 3 / 4-stage ring and a partial one)
    "tiles_1_16": (list(range(1, 17)) + [0], 47, 3, 256, 640, (119, 125), 4, torch.float32),
    # experts of 17, 40 and 33 rows (2-3 tiles, the last partial) between empty ones; 33 tokens
    "big_experts": ([0, 17, 40, 0, 33, 5, 0], 33, 3, 128, 384, (119, 125), 3, torch.bfloat16),
    # F = 256: 2 chunks, fewer than the stages (the predicated-off copies past K); exponents over
    # a 20-wide range (every table offset, flushed weights)
    "short_k_wide_exps": ([3, 0, 16, 1, 9], 11, 3, 64, 256, (108, 128), 5, torch.float32),
}


@gpu
@pytest.mark.parametrize("stages", [3, 4, 6])
@pytest.mark.parametrize("name", list(TMA_CASES))
def test_l2_decode_tma_same_bits(name, stages):
    """load="tma" (at 3, 4 and 6 stages) gives the cp.async kernel's bits into NaN-poisoned y
    (exactly the slots of the tile's pairs written, finite), and both match the fp32 math."""
    rows, T, k, d, F, exps, ks, dtype = TMA_CASES[name]
    h, w2, counts, c_idx, wts = _rows_case(rows, T, k, d, F, seed=len(name) + stages, exps=exps)
    P = sum(rows)
    mt = _max_tiles(P, len(rows))
    ref = l2_reference(h, w2, counts, c_idx, wts, ks).view(T * ks, d)
    routed = torch.isfinite(ref[:, 0])
    outs = {}
    for load, ns in (("cp.async", None), ("tma", stages)):
        y = torch.full((T * ks, d), float("nan"), dtype=dtype, device="cuda")
        ml2.l2_gluon_decode(h, w2, counts, c_idx, wts.reshape(-1), y, topk=k, ks=ks,
                            max_tiles=mt, load=load, stages=ns)
        torch.cuda.synchronize()
        assert torch.isfinite(y[routed]).all(), f"{load}: a pair's slot not written / not finite"
        assert torch.isnan(y[~routed]).all(), f"{load}: a slot of no pair was written"
        outs[load] = y
    assert torch.equal(_bits(outs["tma"]), _bits(outs["cp.async"])), \
        f"tma vs cp.async: rel {rel(outs['tma'][routed], outs['cp.async'][routed]):.3e}"
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    err = rel(outs["tma"][routed], ref[routed])
    assert err < tol, f"vs fp32 math: {err:.3e}"


@gpu
def test_l2_decode_tma_repeat_and_graph():
    """20 eager TMA launches give the cp.async kernel's bits every time, and the TMA launch
    captured in a CUDA graph (tile list built inside the capture, host descriptor filled at
    capture) replays the same bits into a re-poisoned y."""
    rows, T, k, d, F, ks = [5, 0, 16, 23, 1, 2, 0, 7], 29, 3, 256, 640, 4
    h, w2, counts, c_idx, wts = _rows_case(rows, T, k, d, F, seed=77)
    P = sum(rows)
    mt = _max_tiles(P, len(rows))

    def launch(y, load):
        ml2.l2_gluon_decode(h, w2, counts, c_idx, wts.reshape(-1), y, topk=k, ks=ks,
                            max_tiles=mt, load=load)

    want = torch.full((T * ks, d), float("nan"), dtype=torch.float32, device="cuda")
    launch(want, "cp.async")
    check_repeats_and_graph(lambda y: launch(y, "tma"), torch.full_like(want, float("nan")),
                            want, lambda a, b: torch.equal(_bits(a), _bits(b)))


def test_l2_decode_load_args():
    """The launcher's load / stages checks (check_load_and_stages) and its token tiles: the
    decode tile BT = 16 by default, tiles outside BTS refused."""
    from megagraph.kernels.moe.gluon_common import token_tile

    check_load_and_stages(ml2)
    assert ml2.BT == 16 and token_tile(None, ml2.BT, ml2.BTS) == 16
    assert [token_tile(bt, ml2.BT, ml2.BTS) for bt in ml2.BTS] == [16, 32, 64, 128]
    for bt in (8, 48, 256):
        with pytest.raises(ValueError):
            token_tile(bt, ml2.BT, ml2.BTS)


@build
def test_l2_decode_weight_desc():
    """The host TMA descriptor of a W2 bank ([E d, F / 2]): check_weight_desc (a bank that does
    not fit: the default load falls back to cp.async)."""
    check_weight_desc(ml2)


def _tma_types():
    """TYPES for l2_decode_tma_kernel: the descriptor in place of the weight pointer and its
    strides (the jit's signature string of a gluon TensorDescriptor)."""
    desc = f"tensordesc<u8[{ml2.BW}, {ml2.BK // 2}],{ml2.W_TMA_LAYOUT!r}>"
    types = {n: t for n, t in TYPES.items() if n not in ("b_ptr", "stride_bg", "stride_bn")}
    return dict(types, w_desc=desc)


SASS_COUNTS = [("HGMMA", r"\bHGMMA\.64x16x16\.F32\b")] + SYNC_COUNTS


def _build_stats(kernel, types, consts, **kw):
    """sm90_build.build_stats with this kernel family's patterns and warps."""
    return build_stats(kernel, types, consts, SASS_COUNTS, ml2.NUM_WARPS, **kw)


# per K chunk of the TMA kernel, besides the cp.async kernel's math: 2 BAR.SYNC (A: stage
# free; B: every thread past its mbarrier wait - Triton's membar adds none), 1 cp.async wait,
# 9 4-byte LDGSTS (8 of H, 1 of the exponents) and no LDGSTS.128 (W2 left cp.async), 1 UTMALDG,
# 1 mbarrier try-wait, 1 expect (the re-arm), 1 proxy fence (the only one: Triton adds none)
TMA_PER_CHUNK = dict(BAR_SYNC=2, DEPBAR=1, LDGSTS128=0, LDGSTS=9, UTMALDG=1, TRYWAIT=1,
                     EXPECT=1, FENCE=1)


@build
@pytest.mark.parametrize("use_asm", [True, False])
def test_l2_decode_tma_sm90_build(use_asm):
    """Triton 3.6 sm_90 build of l2_decode_tma_kernel at TMA_STAGES (3) next to the cp.async
    kernel's: no stack / local memory, <= 40 KB shared, and per K chunk the cp.async kernel's
    math (8 HGMMA, 1 ARRIVE, 1 WARPGROUP.DEPBAR, 2 LDS.128, the same PRMT, no STS) plus
    TMA_PER_CHUNK; the fence writer-side for H (proxy_fence_problems). With the PTX upcast
    <= 96 registers (5 CTAs of 4 warps per SM, as the cp.async kernel: 91 at the time of
    writing) and the loop's instruction count pinned (705 for 3 chunks at the time of writing,
    ~235 per chunk, +- 8%; cp.async ~212). The arithmetic twin: built, no spills, the same
    chunk."""
    consts = dict(TOPK=6, KS=6, USE_ASM=use_asm, BW=ml2.BW, BT=ml2.BT, BK=ml2.BK,
                  NW=ml2.NUM_WARPS)
    ns = ml2.TMA_STAGES
    tma = _build_stats(ml2.l2_decode_tma_kernel, _tma_types(), dict(consts, NS=ns))
    cp = _build_stats(ml2.l2_decode_kernel, TYPES, dict(consts, NS=ml2.NS))
    check_same_chunk_math(f"tma {'asm' if use_asm else 'arith'}", tma, ns, cp, ml2.NS,
                          ("HGMMA", "ARRIVE", "WG_DEPBAR", "LDS128", "PRMT", "STS"))
    regs, shared, body, c = tma
    assert shared <= 40 * 1024, shared
    assert {n: c[n] for n in TMA_PER_CHUNK} == {n: v * ns for n, v in TMA_PER_CHUNK.items()}, c
    assert proxy_fence_problems(body, ns) == []
    if use_asm:
        assert regs <= 96, regs
        assert abs(len(body) - 705) <= 0.08 * 705, len(body)


@build
@pytest.mark.parametrize("stages", [4, 5, 6, 8])
def test_l2_decode_tma_sm90_build_stages(stages):
    """Other ring depths build the same chunk (per-chunk counts as at TMA_STAGES), with no
    stack / spills; registers and shared memory printed (98 .. 110 registers at 4 .. 8 stages
    at the time of writing: 4 CTAs per SM)."""
    consts = dict(TOPK=6, KS=6, USE_ASM=True, BW=ml2.BW, BT=ml2.BT, BK=ml2.BK,
                  NW=ml2.NUM_WARPS, NS=stages)
    regs, shared, body, c = _build_stats(ml2.l2_decode_tma_kernel, _tma_types(), consts)
    per_chunk = dict(TMA_PER_CHUNK, HGMMA=8, PRMT=64, LDS128=2)
    check_chunks("tma", regs, shared, body, c, stages, per_chunk)


# ---------------------------------------------------------------------------------------------
# wider token tiles (bt = 32 / 64 / 128: prefill sizes)
# ---------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("F", [256, 640])
@pytest.mark.parametrize("bt", ml2.BTS)
def test_l2_decode_bt_rows(bt, F):
    """The token tile bt on bt_rows (an odd token count, top-3 into 4 slots per token; K of 2
    chunks - fewer than the stages - and of 5), into NaN-poisoned fp32 y: exactly the slots of
    the pairs written (finite; the others stay NaN), within 2e-3 of the fp32 math; cp.async and
    TMA at 3 and 4 stages give the same bits at one bt (one math code path); against the
    bt = 16 output only within the bound (other bits allowed: the wgmma's n sets the tensor
    core's sum order)."""
    rows, k, ks, d = bt_rows(bt), 3, 4, 128
    P = sum(rows)
    T = (P // k + 8) | 1  # odd
    h, w2, counts, c_idx, wts = _rows_case(rows, T, k, d, F, seed=bt + F)
    ref = l2_reference(h, w2, counts, c_idx, wts, ks).view(T * ks, d)
    routed = torch.isfinite(ref[:, 0])
    outs = {}
    for tile, load, ns in ((bt, "cp.async", None), (bt, "tma", 3), (bt, "tma", 4),
                           (16, "cp.async", None)):
        y = torch.full((T * ks, d), float("nan"), dtype=torch.float32, device="cuda")
        ml2.l2_gluon_decode(h, w2, counts, c_idx, wts.reshape(-1), y, topk=k, ks=ks,
                            max_tiles=_max_tiles(P, len(rows), tile), load=load, stages=ns,
                            bt=tile)
        torch.cuda.synchronize()
        name = f"bt {tile} {load} {ns}"
        assert torch.isfinite(y[routed]).all(), f"{name}: a pair's slot not written / not finite"
        assert torch.isnan(y[~routed]).all(), f"{name}: a slot of no pair was written"
        err = rel(y[routed], ref[routed])
        assert err < 2e-3, f"{name} vs fp32 math: {err:.3e}"
        outs[name] = y
    want = outs[f"bt {bt} cp.async None"]
    for name in (f"bt {bt} tma 3", f"bt {bt} tma 4"):
        assert torch.equal(_bits(outs[name]), _bits(want)), \
            f"{name} vs cp.async: rel {rel(outs[name][routed], want[routed]):.3e}"
    assert rel(want[routed], outs["bt 16 cp.async None"][routed]) < 2e-3


@gpu
@pytest.mark.parametrize("load", ml2.LOADS)
@pytest.mark.parametrize("bt", [32, 64, 128])
def test_l2_decode_bt_repeat_and_graph(bt, load):
    """At bt 32 / 64 / 128 (each load at its default stages): 20 eager launches give the same
    bits, and the launch captured in a CUDA graph (tile list of bt rows built inside the
    capture) replays them into a re-poisoned y."""
    rows, k, ks, d, F = [5, 0, bt, 2 * bt + 3, 1, 2, 0, 7], 3, 4, 256, 640
    T = (sum(rows) // k + 5) | 1
    h, w2, counts, c_idx, wts = _rows_case(rows, T, k, d, F, seed=bt)
    P = sum(rows)

    def launch(y):
        ml2.l2_gluon_decode(h, w2, counts, c_idx, wts.reshape(-1), y, topk=k, ks=ks,
                            max_tiles=_max_tiles(P, len(rows), bt), load=load, bt=bt)

    want = torch.full((T * ks, d), float("nan"), dtype=torch.float32, device="cuda")
    launch(want)
    torch.cuda.synchronize()
    ref = l2_reference(h, w2, counts, c_idx, wts, ks).view(T * ks, d)
    routed = torch.isfinite(ref[:, 0])
    assert torch.isfinite(want[routed]).all() and torch.isnan(want[~routed]).all()
    assert rel(want[routed], ref[routed]) < 2e-3, \
        f"vs fp32 math: {rel(want[routed], ref[routed]):.3e}"
    check_repeats_and_graph(launch, torch.full_like(want, float("nan")), want,
                            lambda a, b: torch.equal(_bits(a), _bits(b)))


@build
@pytest.mark.parametrize("kernel,stages", [("tma", 3), ("tma", 4), ("cp.async", 4)])
@pytest.mark.parametrize("bt", [32, 64, 128])
def test_l2_decode_sm90_build_bt(bt, kernel, stages):
    """The wider token tiles build: no stack / local memory (_build_stats), <= 255 registers,
    and per K chunk the BT = 16 chunk with the wgmma at n = bt (8 HGMMA 64xbtx16), the same
    upcast (64 PRMT, 2 LDS.128, no STS), barriers (2 BAR.SYNC: the H copy is one cp.async op
    per stage, so Triton's membar adds none), fence order and W2 copies (TMA: 1 UTMALDG,
    1 try-wait, 1 expect; cp.async: 2 LDGSTS.128), and bt / 2 + 1 4-byte LDGSTS (H: 4 bytes
    per thread, row and 64-column half; the exponents). Registers, shared memory and CTAs per
    SM printed (when written: bt 32 107 / 116 / 113 registers at tma 3 / tma 4 / cp.async 4;
    bt 64 147 / 156 / 153; bt 128 232 / 237 / 236, 2 / 1 / 1 CTAs per SM)."""
    consts = dict(TOPK=6, KS=6, USE_ASM=True, BW=ml2.BW, BT=bt, BK=ml2.BK, NW=ml2.NUM_WARPS,
                  NS=stages)
    tma = kernel == "tma"
    stats = _build_stats(ml2.l2_decode_tma_kernel if tma else ml2.l2_decode_kernel,
                         _tma_types() if tma else TYPES, consts)
    per_chunk = dict(HGMMA=8, ARRIVE=1, WG_DEPBAR=1, BAR_SYNC=2, DEPBAR=1, LDS128=2, STS=0,
                     PRMT=64, FENCE=1, LDGSTS=bt // 2 + 1, **decode_copies(kernel, 1, 2))
    check_bt_build(kernel, bt, stages, stats, ("HGMMA", rf"\bHGMMA\.64x{bt}x16\.F32\b"),
                   per_chunk)
