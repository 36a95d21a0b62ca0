"""The experimental Gluon PREFILL L2 (kernels/moe/gluon_l2.py): 128 expert-sorted H rows x
128 output columns per program, the MXFP4 W2 chunk upcast to exact fp16 (one frame per W2 row)
under the async wgmma of the chunk before, the weighted scatter to the (token, slot) rows of y.

CPU: the PTX table upcast (moe_gluon_decode_l2.FP16_TABLE_ASM_TEXT) run by the decode L2 test's
PTX emulator with this kernel's tables, bit-exact against torch's fp16 of e2m1 x 2^rel for every
byte in every byte lane and every rel in [-20, 13] (the flush below -13, signs, -0), and its
Python twin fp16_bits; one whole chunk upcast as the kernel assembles it (the joins / halves /
reshape of _upcast_store replayed with torch.stack) equal to torch's dequantization in column
order; the kernel's numerics modelled in torch (per-row frame, exact fp16 weights, fp32 sums
per 128-row tile, the epilogue) against the fp32 math the GPU tests use (which runs this file's
case / reference helpers on the CPU); the launcher's argument checks. With Triton 3.6
importable (make sm90-h200) the kernel is compiled ahead of time for sm_90: no local memory,
<= 128 registers and <= 113 KB of shared memory (two CTAs per SM), per chunk 4 HGMMA.64x128x16
chained on one accumulator with one wgmma group left in flight (WARPGROUP.DEPBAR.LE gsb0, 0x1),
the fence order (gluon_cases.proxy_fence_problems), the upcast stores before the wait, the
K loop's instruction count pinned.

GPU (CUDA sm_90 + Triton 3.6 Gluon, else skipped): l2_gluon against the fp32 math of the same
operands (H's fp16 values x exactly dequantized W2, times the pair weight, scattered) and
against moe.triton_l2 (the Triton L2 as routed_experts launches it) at prefill sizes (odd token
counts, empty experts, experts of several 128-row tiles, ks > topk: unrouted slots stay NaN,
every routed one written), fp32 / bf16 / fp16 y; tolerance 2e-3 relative (Frobenius) for fp32
y (H exact fp16, every weight an exact fp16, exact products, fp32 sums: the error is sum order,
~1e-6), 1e-2 for bf16 / fp16 (one rounding). The PTX table and its arithmetic twin give the same
bits (also on 20-binade exponent spreads); every multi-launch case repeats its launch
(REPEATS) and compares bits (a nondeterministic pipeline shows as changed bits); a
debug test of isolated pieces (one expert) names what fails.
"""
from __future__ import annotations

import re

import gluon_cases
import pytest
import torch
from gluon_cases import check_l2_out, dbg_l2_case, diagnose, E2M1, gluon_build, gluon_gpu
from gluon_cases import l2_debug_pieces, L2_PREFILL_CASES, l2_reference, proxy_fence_problems, rel
from megagraph.kernels.moe import gluon_l2 as mgl
from sm90_build import count, gluon_sm90, loop_instructions, usage_and_sass
from test_moe_gluon_decode_l2 import _parse, _run, check_table_lanes, fp16_ref

gpu = gluon_gpu(mgl)
build = gluon_build(mgl)


REPEATS = 10  # launches of each repeated case (bits compared with the first)
M32 = 0xFFFFFFFF
DEV = "cuda"  # the GPU tests' device (module-level, read at call time)


def _sync():
    if torch.cuda.is_available() and DEV == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# inputs and the fp32 reference (device-agnostic: the CPU tests run them too)
# ---------------------------------------------------------------------------------------------


def l2_case(T, E, d, F, k, seed, subset=None, exps=(119, 125), device=None, scale=2.0):
    """gluon_cases.l2_case on `device` (DEV) with pair weights in [0.25, 1.25): (h, w2, counts,
    srt, wts [T, k]); the fp32 math is gluon_cases.l2_reference (both shared with the decode
    L2's test)."""
    return gluon_cases.l2_case(T, E, d, F, k, seed, subset=subset, exps=exps,
                               device=DEV if device is None else device, scale=scale,
                               wts_lo=0.25)


def _max_tiles(P, E):
    return min(P, P // mgl.BM + E)


def frame_weights(w2) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weights in torch: (exact fp16 e2m1 x 2^(e - S0) [E, d, F] with rel < REL_MIN
    flushed, the frames' scales 2^(S0 - 127) [E, d] fp32), S0 = max(max_k e - REL_MAX, 1) per
    W2 row (moe_gluon_l2's numerics)."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64, device=w2.w.device)
    b = w2.w.view(torch.uint8).long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    e = w2.s.long()
    s0 = (e.amax(-1) - mgl.REL_MAX).clamp_min(1)
    r = (e - s0[..., None]).repeat_interleave(32, dim=-1)
    wq = torch.where(r < mgl.REL_MIN, 0.0, v * torch.exp2(r.double()))
    w16 = wq.to(torch.float16)
    assert torch.equal(w16.double(), wq), "a frame weight is not an exact fp16"
    return w16, torch.exp2(s0.double() - 127).float()


def emulate_l2(h, w2, counts, srt, wts, ks):
    """moe_gluon_l2's numerics in torch (the model the GPU kernel must match up to fp32 sum
    order): per 128-row tile of each expert, acc = H_tile (fp16 values) @ W16^T in fp32, y row
    = (acc * 2^(S0 - 127)) * wts[p]; NaN in the unrouted slots."""
    T, k = wts.shape
    w16, sb = frame_weights(w2)
    y = torch.full((T * ks, w2.n), float("nan"), device=h.device)
    r0 = 0
    for e, c in enumerate(counts.tolist()):
        for t0 in range(r0, r0 + c, mgl.BM):
            t1 = min(t0 + mgl.BM, r0 + c)
            p = srt[t0:t1].long()
            acc = h[t0:t1].float() @ w16[e].float().T
            y[(p // k) * ks + p % k] = (acc * sb[e][None, :]) * wts.reshape(-1)[p, None].float()
        r0 += c
    return y.view(T, ks, -1)


# ---------------------------------------------------------------------------------------------
# the upcast (CPU)
# ---------------------------------------------------------------------------------------------


def test_table_upcast_frame_bit_exact():
    """FP16_TABLE_ASM_TEXT with this kernel's tables (mgl.tables: the decode L2's table words,
    flushed below REL_MIN = -13 instead of -5): for every byte value in every byte lane of the
    word (random bytes in the other lanes) and every rel in [-20, 13], output register j = fp16
    of byte j's low nibble (bits 0..15) and high nibble (16..31), equal to torch's fp16 of
    e2m1 x 2^rel bit for bit (signs and -0 included, zero below rel -13, 6 x 2^13 = 49152 at the
    top); the Python twin fp16_bits (the formula of the kernel's arithmetic upcast) agrees."""
    from megagraph.kernels.moe import gluon_decode_l2 as ml2

    ops = _parse(ml2.FP16_TABLE_ASM_TEXT)
    g = torch.Generator().manual_seed(11)
    for r in range(-20, mgl.REL_MAX + 1):
        ref = fp16_ref(r, mgl.REL_MIN)  # torch's fp16, flushed below REL_MIN
        assert [mgl.fp16_bits(c, r) for c in range(16)] == ref, r
        ta, tb = mgl.tables(r)
        check_table_lanes(ops, r, ta, tb, ref, g)
    assert mgl.fp16_bits(7, mgl.REL_MAX) == 0x7A00  # 49152: the largest frame weight
    assert mgl.frame(127) == 114 and mgl.frame(5) == 1


def upcast_chunk(codes: torch.Tensor, exps: torch.Tensor, s0: torch.Tensor,
                 use_table: bool = True) -> torch.Tensor:
    """One chunk upcast as _upcast_store does it, on the CPU: codes uint8 [BN, 32] (the chunk's
    packed bytes of each row), exps [BN, 2] (its E8M0 exponents), s0 [BN] (the rows' frames) ->
    fp16 [BN, 64]. The words (thread = (row, group): 4 little-endian int32), the 4 fp16x2
    registers per word (the PTX table, emulated, or fp16_bits), then the kernel's assembly
    replayed with torch.stack for ttgl.join (a new minor dimension): join(join(r0, r2),
    join(r1, r3)), its halves (join(low, high)), row-major reshape to [BN, 64]."""
    from megagraph.kernels.moe import gluon_decode_l2 as ml2

    ops = _parse(ml2.FP16_TABLE_ASM_TEXT)
    BN = codes.shape[0]
    words = codes.contiguous().view(torch.int32).view(BN, 2, 4).long() & M32
    regs = torch.zeros(BN, 2, 4, 4, dtype=torch.long)
    for n in range(BN):
        for gr in range(2):
            rl = int(exps[n, gr]) - int(s0[n])
            ta, tb = mgl.tables(rl)
            for kk in range(4):
                w = int(words[n, gr, kk])
                if use_table:
                    out = _run(ops, [0, 0, 0, 0, w, ta, tb], 4)
                else:
                    bts = [(w >> (8 * j)) & 0xFF for j in range(4)]
                    out = [mgl.fp16_bits(b & 0xF, rl) | (mgl.fp16_bits(b >> 4, rl) << 16)
                           for b in bts]
                regs[n, gr, kk] = torch.tensor(out)
    r0, r1, r2, r3 = regs.unbind(-1)
    x32 = torch.stack([torch.stack([r0, r2], -1), torch.stack([r1, r3], -1)], -1)
    x = torch.stack([x32 & 0xFFFF, x32 >> 16], -1)  # _halves: (low, high)
    x = x.reshape(BN, mgl.BK)
    return (x - ((x & 0x8000) << 1)).to(torch.int16).view(torch.float16)


@pytest.mark.parametrize("use_table", [True, False])
def test_chunk_upcast_column_order(use_table):
    """A whole chunk (128 W2 rows x 64 columns) upcast as the kernel assembles it equals torch's
    dequantization e2m1 x 2^(e - s0) in column order (byte B of a row -> columns 2B (low nibble),
    2B + 1), flushed below rel -13; the rows' frames from random row maxima, exponents spread
    over 30 binades below them (every rel in [-17, 13] occurs)."""
    g = torch.Generator().manual_seed(5)
    BN = mgl.BN
    codes = torch.randint(0, 256, (BN, mgl.BK // 2), dtype=torch.uint8, generator=g)
    emax = torch.randint(30, 250, (BN,), generator=g)
    s0 = torch.tensor([mgl.frame(int(m)) for m in emax])
    exps = (emax[:, None] - torch.randint(0, 31, (BN, 2), generator=g)).clamp_min(0)
    got = upcast_chunk(codes, exps, s0, use_table)
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    b = codes.long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)  # [BN, 64]
    r = (exps - s0[:, None]).repeat_interleave(32, dim=-1)
    # signed zeros where flushed (the kernel keeps the sign bit), exact fp16 elsewhere
    want = (v * torch.where(r < mgl.REL_MIN, 0.0, torch.exp2(r.double()))).to(torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert (r < mgl.REL_MIN).any() and (r == mgl.REL_MAX).any()


def test_kernel_model_matches_fp32_math():
    """The kernel's numerics (emulate_l2: per-row frame, exact fp16 weights, fp32 sums per
    128-row tile, (acc x frame) x weight) against the fp32 math the GPU tests hold the kernel to,
    on the CPU with the GPU tests' own helpers (l2_case, l2_reference): the sum-order-only
    difference (< 1e-5) at the usual exponents and at a 20-binade spread (nothing flushes), and
    < 1e-6 where rows span 60 binades (weights more than 26 binades below a row's largest
    flush: below 2^-26 of it); the unrouted slots (ks > topk) are NaN in both."""
    k, ks = 3, 7
    for exps, tol in (((119, 125), 1e-5), ((108, 128), 1e-5), ((60, 121), 1e-6)):
        h, w2, counts, srt, wts = l2_case(200, 8, 256, 384, k, seed=3, subset=[0, 2, 3, 7],
                                          exps=exps, device="cpu")
        ref = l2_reference(h, w2, counts, srt, wts, ks)
        emu = emulate_l2(h, w2, counts, srt, wts, ks)
        assert torch.isnan(ref[:, k:]).all() and torch.isnan(emu[:, k:]).all()
        assert torch.isfinite(emu[:, :k]).all()
        assert rel(emu[:, :k], ref[:, :k]) < tol, (exps, rel(emu[:, :k], ref[:, :k]))
    assert int(counts.max()) > mgl.BM  # an expert of several row tiles


def test_kernel_consts_and_launcher_checks():
    """kernel_consts; the launcher's argument checks run before any launch (CPU tensors
    suffice): fp16 H only, K a multiple of 192 (3 stages of 64: with moe.bank's K % 128, K %
    384 in practice), d a multiple of 128, 16-byte
    aligned H / W2 rows, int32 counts / srt, ks >= topk, enough y rows for the scatter, a float
    weight vector; y may be [T, ks, d] or its [T * ks, d] view; nothing to do (max_tiles 0)
    returns without a launch; where Gluon is missing a valid call raises RuntimeError."""
    assert mgl.kernel_consts(2304) == dict(KGI=5, USE_ASM=True, BM=128, BN=128, BK=64, NS=3,
                                           NW=8, DIAG=0)
    assert mgl.kernel_consts(2304, diag=mgl.DIAG_BITS["w"] | mgl.DIAG_BITS["a"])["DIAG"] == 5
    assert mgl.kernel_consts(384, False)["USE_ASM"] is False
    assert [mgl.kernel_consts(k)["KGI"] for k in (384, 512, 768, 1152)] == [1, 1, 2, 3]
    base, bad = gluon_cases.l2_arg_case(mgl.BM)

    def call(**kw):
        return mgl.l2_gluon(**{**base, **kw})

    for kw in bad:
        with pytest.raises(ValueError):
            call(**kw)
    assert call(max_tiles=0) is not None  # nothing to do: no launch, no Gluon needed
    y = base["y"]
    assert call(max_tiles=0).shape == (y.shape[0] * y.shape[1], y.shape[2])  # y's 2-d view
    if not mgl._IMPORT_OK:
        with pytest.raises(RuntimeError):
            call()
        with pytest.raises(RuntimeError):
            call(y=y.view(-1, y.shape[2]), wts=base["wts"].reshape(-1))


def test_l2_pair_checks_name_the_callers_arguments():
    """gluon_common.check_l2_pairs, the pair checks both L2 launchers share: it returns P for a
    valid call, and each refusal names the argument as the launcher calls it (the prefill L2's
    srt / wts / y here, the decode L2's c_idx / row_w / out)."""
    from megagraph.kernels.moe.gluon_common import check_l2_pairs

    g = torch.Generator().manual_seed(7)
    T, k, ks, d, E = 5, 2, 3, 128, 4
    P = T * k
    h = torch.randn(P + 1, 256, generator=g).half()
    counts = torch.randint(0, 4, (E,), generator=g, dtype=torch.int32)
    srt = torch.randperm(P, generator=g).to(torch.int32)
    wts = torch.rand(P, generator=g)
    y = torch.randn(T * ks, d, generator=g)
    ok = dict(groups=E, N=d, topk=k, ks=ks)
    for names in (("srt", "wts", "y"), ("c_idx", "row_w", "out")):
        assert check_l2_pairs(h, counts, srt, wts, y, **ok, names=names) == P
        idx, w, out = names
        for args, what in (((h, counts, srt.long(), wts, y), idx),
                           ((h[: P - 1], counts, srt, wts, y), idx),
                           ((h, counts, srt, wts[:-1], y), w),
                           ((h, counts, srt, wts.to(torch.int32), y), w),
                           ((h, counts, srt, wts, y.double()), out),
                           ((h, counts, srt, wts, y[:, :64]), out),
                           ((h, counts, srt, wts, y[: (T - 1) * ks + 1]), out)):
            with pytest.raises(ValueError, match=f"^{what}"):
                check_l2_pairs(*args, **ok, names=names)
        with pytest.raises(ValueError, match="^counts"):
            check_l2_pairs(h, torch.zeros(E + 1, dtype=torch.int32), srt, wts, y, **ok,
                           names=names)
        with pytest.raises(ValueError, match="need 1 <= topk <= ks"):
            check_l2_pairs(h, counts, srt, wts, y, **{**ok, "ks": 1}, names=names)


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU, Triton 3.6)
# ---------------------------------------------------------------------------------------------

TYPES = dict(h_ptr="*fp16", b_ptr="*i8", bs_ptr="*u8", c_ptr="*bf16", cidx_ptr="*i32",
             w_ptr="*fp32", work_ptr="*i32", MT="i32", N="i32", K="i32", G="i32", P="i32",
             stride_hm="i32", stride_bg="i32", stride_bn="i32", stride_bsg="i32",
             stride_bsn="i32", stride_cm="i32")

# K-loop instructions for NS = 3 chunks of the Triton 3.6 sm_90 build (PTX table upcast, bf16
# y), pinned +- 8%
LOOP_PIN = 337




def sm90_build(use_asm: bool = True, out: str = "*bf16"):
    """l2_kernel compiled ahead of time for sm_90 at V4.1-Flash's F = 2304 (mega_moe's y: bf16,
    ks = 7 slots of top-6):
    (compiled kernel, registers, stack, SASS, the K loop's instructions)."""
    consts = dict(TOPK=6, KS=7, **mgl.kernel_consts(2304, use_asm))
    k = gluon_sm90(mgl.l2_kernel, dict(TYPES, c_ptr=out), consts, num_warps=mgl.NUM_WARPS)
    usage, sass = usage_and_sass(k)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    return k, regs, stack, sass, [t.strip() for t in loop_instructions(sass)]


@build
def test_l2_sm90_build_diag():
    """The DIAG bits (timing diagnosis only) build without spills, and DIAG = 0 is exactly the
    default kernel (the bits are constexpr-guarded: the same SASS)."""
    base, _, _, sass, _ = sm90_build()
    consts = dict(TOPK=6, KS=7, **mgl.kernel_consts(2304, True, diag=0))
    k0 = gluon_sm90(mgl.l2_kernel, dict(TYPES, c_ptr="*bf16"), consts, num_warps=mgl.NUM_WARPS)
    strip = lambda t: re.sub(r"/\*[0-9a-f]{4,}\*/", "", t)  # noqa: E731  (addresses)
    assert strip(usage_and_sass(k0)[1]) == strip(sass)
    for diag in (1, 2, 4, 7):
        consts = dict(TOPK=6, KS=7, **mgl.kernel_consts(2304, True, diag=diag))
        k = gluon_sm90(mgl.l2_kernel, dict(TYPES, c_ptr="*bf16"), consts,
                       num_warps=mgl.NUM_WARPS)
        usage, dsass = usage_and_sass(k)
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, (diag, usage)
        assert not re.search(r"\b(LDL|STL)\b", dsass), diag


# what the build tests count in the K loop (one SASS instruction a line)
LOOP_PATTERNS = [
    ("HGMMA", r"\bHGMMA\.64x128x16\.F32\b"), ("HGMMA_any", r"\b[HQI]GMMA\."),
    ("ARRIVE", r"WARPGROUP\.ARRIVE"), ("WG_DEPBAR", r"WARPGROUP\.DEPBAR"),
    ("WG_DEPBAR_1", r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b"), ("BAR_SYNC", r"\bBAR\.SYNC"),
    ("DEPBAR", r"^(@\S+\s+)?DEPBAR\.LE\s+SB0"), ("FENCE", r"FENCE\.VIEW\.ASYNC"),
    ("LDGSTS128", r"\bLDGSTS\.E\.BYPASS\.128\b"), ("LDGSTS", r"\bLDGSTS\b"),
    ("LDG128", r"\bLDG\.E\.128\b"), ("LDG_U8", r"\bLDG\.E\.U8\b"), ("LDG", r"\bLDG\."),
    ("STS128", r"\bSTS\.128\b"), ("STS", r"\bSTS\."), ("LDS_REAL", r"^(?!@!PT).*\bLDS\b"),
    ("PRMT", r"\bPRMT\b")]


def sass_stats(use_asm: bool = True, out: str = "*bf16") -> dict:
    """Registers, shared memory and the K loop's counts of the sm_90 build (for reports:
    python -c 'import test_moe_gluon_l2 as t; print(t.sass_stats())' from tests/kernels with
    Triton 3.6 on the path)."""
    k, regs, stack, sass, body = sm90_build(use_asm, out)
    return dict(use_asm=use_asm, regs=regs, stack=stack, shared=k.metadata.shared,
                local=len(re.findall(r"\b(LDL|STL)\b", sass)), loop_instructions=len(body),
                chunks=mgl.NS, kernel_instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S",
                                                                  sass)),
                **{n: count(body, p) for n, p in LOOP_PATTERNS},
                fence_problems=proxy_fence_problems(body, mgl.NS))


@build
@pytest.mark.parametrize("use_asm", [True, False])
def test_l2_gluon_sm90_build(use_asm):
    """Triton 3.6 sm_90 build at the real shapes' divisibility, bf16 y: no stack / local memory;
    per K chunk (the loop holds NS = 3): 4 HGMMA.64x128x16 (fp16, 4 k16 steps) per warpgroup
    chained on the accumulator, 1 WARPGROUP.ARRIVE, 1 WARPGROUP.DEPBAR that leaves ONE group in
    flight (gsb0, 0x1: the loop never drains the tensor cores), 2 BAR.SYNC (Triton's membar
    barrier after the cp.async wait, then the one after every thread's proxy fence:
    proxy_fence_problems) and ONE fence (it also covers the thread's upcast stores of the
    chunk before), 1 cp.async wait, 4 LDGSTS.128 (H), 1 LDG.128 (the thread's 4 packed
    words) + 1 LDG.U8 (its exponent), 4 STS.128 (the upcast fp16, one per word) and no other
    shared store, no shared load (no layout conversion in the loop); the upcast stores come
    after the chunk's first HGMMA and before its wait (the MMA overlaps the upcast). The PTX
    table build: <= 128 registers and <= 113 KB of shared memory (two CTAs of 8 warps per SM:
    124 registers, 98816 B at the time of writing), 32 PRMT per chunk (4 words x 8), the loop's
    length pinned (LOOP_PIN: 337 for 3 chunks, ~112 per chunk). The arithmetic twin (a test
    aid): no spills, the same pipeline."""
    k, regs, stack, sass, body = sm90_build(use_asm)
    assert stack == 0 and not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills)"
    ns = mgl.NS
    c = {n: count(body, p) for n, p in LOOP_PATTERNS}
    print(f"\nsm_90 build ({'asm' if use_asm else 'arith'}): {regs} registers, "
          f"{k.metadata.shared} B shared, K loop {len(body)} instructions for {ns} chunks "
          f"({len(body) / ns:.0f} per chunk): {c}")
    assert c["HGMMA"] == 4 * ns and c["HGMMA_any"] == 4 * ns
    assert c["ARRIVE"] == ns
    assert c["WG_DEPBAR"] == ns and c["WG_DEPBAR_1"] == ns, "a wgmma wait drains in the loop"
    assert c["BAR_SYNC"] == 2 * ns
    assert c["FENCE"] == ns
    assert c["DEPBAR"] == ns
    assert c["LDGSTS128"] == 4 * ns and c["LDGSTS"] == 4 * ns
    assert c["LDG128"] == ns and c["LDG_U8"] == ns and c["LDG"] == 2 * ns
    assert c["STS128"] == 4 * ns and c["STS"] == 4 * ns
    assert c["LDS_REAL"] == 0, "shared loads in the K loop (a layout conversion?)"
    assert proxy_fence_problems(body, ns) == []
    # per chunk: the first HGMMA, then the upcast stores, then the wgmma wait
    text = "\n".join(body)
    for part in text.split("WARPGROUP.DEPBAR")[:ns]:
        tail = part.split("WARPGROUP.ARRIVE")[-1]
        assert "HGMMA" in tail and re.search(r"\bSTS\.128\b", tail.split("HGMMA", 1)[1]), \
            "the upcast stores do not overlap the chunk's wgmma"
    assert regs <= 255
    if use_asm:
        assert regs <= 128, f"{regs} registers: no longer two CTAs per SM"
        assert k.metadata.shared <= 113 * 1024, k.metadata.shared
        assert c["PRMT"] == 32 * ns
        assert abs(len(body) - LOOP_PIN) <= 0.08 * LOOP_PIN, len(body)


@build
@pytest.mark.parametrize("out", ["*fp32", "*fp16"])
def test_l2_gluon_sm90_build_outputs(out):
    """The fp32 and fp16 y builds (the GPU tests' and mega_moe's other dtypes): no spills, the
    same K loop (only the epilogue's store differs)."""
    _, regs, stack, sass, body = sm90_build(True, out)
    assert stack == 0 and not re.search(r"\b(LDL|STL)\b", sass)
    assert regs <= 128 and abs(len(body) - LOOP_PIN) <= 0.08 * LOOP_PIN, (regs, len(body))
    assert proxy_fence_problems(body, mgl.NS) == []


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _launch(h, w2, counts, srt, wts, ks, dtype, repeats=1, **kw):
    """l2_gluon into NaN-poisoned y [T, ks, d] of `dtype`, `repeats` times; returns the outputs
    (each a fresh poisoned y) after a synchronize."""
    T, k = wts.shape
    P = T * k
    outs = []
    for _ in range(repeats):
        y = torch.full((T, ks, w2.n), float("nan"), dtype=dtype, device=DEV)
        mgl.l2_gluon(h, w2, counts, srt, wts, y, topk=k, ks=ks,
                     max_tiles=_max_tiles(P, counts.numel()), **kw)
        outs.append(y)
    _sync()
    return outs


def _differ(outs) -> list[int]:
    return [j for j, o in enumerate(outs)
            if not torch.equal(outs[0].float().nan_to_num(7.0), o.float().nan_to_num(7.0))]


@gpu
@pytest.mark.parametrize("T,E,k,subset,ks,dtype,d,F", L2_PREFILL_CASES)
def test_l2_gluon_matches(T, E, k, subset, ks, dtype, d, F):
    """Prefill sizes: ~100 rows per expert (T 203, top-4 of 8), a partial tile; 58 per expert
    at K = 1152 (6 loop trips of 3 chunks); 7 of 16 experts (the rest empty) at 441 rows each (4
    row tiles, the last partial) into bf16 y with ks 7 > topk; 225 rows per expert at K = 768
    into fp16 y; one token (rows < 48: the kernel is correct at any size); 384 rows per
    expert at the real F = 2304 (36 chunks). NaN-poisoned y: every routed slot written, no
    other; vs the fp32 math and vs moe.triton_l2; REPEATS launches give the same bits."""
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=T + E + ks, subset=subset)
    outs = _launch(h, w2, counts, srt, wts, ks, dtype, repeats=REPEATS)
    y = outs[0]
    assert torch.isfinite(y[:, :k]).all(), "a routed slot was not written (or is not finite)"
    assert torch.isnan(y[:, k:].float()).all(), "an unrouted slot was written"
    assert not _differ(outs), f"launches {_differ(outs)} of {REPEATS} gave other bits"
    check_l2_out(y, h, w2, counts, srt, wts, ks,
                                2e-3 if dtype == torch.float32 else 1e-2)


@gpu
def test_l2_gluon_asm_vs_arith_and_tiles():
    """Exponents 108 .. 127 (a 20-binade spread in every row: rel over [-6, 13]): the PTX table
    upcast and the arithmetic twin give the same bits; a prebuilt tile list gives the bits of the
    one built in the call; y matches the kernel's torch model (emulate_l2, 1e-5: sum order
    only) and the fp32 math (nothing flushes at this spread). (moe.triton_l2 flushes weights 11
    binades below their chunk's largest here: not compared.)"""
    from megagraph.kernels.moe import triton as moe

    d, F, k, E, T = 256, 384, 3, 4, 171
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=5, exps=(108, 128))
    P = T * k
    asm, = _launch(h, w2, counts, srt, wts, k, torch.float32, use_asm=True)
    arith, = _launch(h, w2, counts, srt, wts, k, torch.float32, use_asm=False)
    pre, = _launch(h, w2, counts, srt, wts, k, torch.float32,
                   tiles=moe.tile_list(counts, mgl.BM, _max_tiles(P, E)))
    assert torch.isfinite(arith).all(), "arithmetic upcast: an element not written / not finite"
    assert torch.isfinite(asm).all(), "PTX upcast: an element not written / not finite"
    assert torch.equal(asm, arith), f"PTX vs arithmetic upcast: rel {rel(asm, arith):.3e}"
    assert torch.equal(asm, pre), "prebuilt tile list differs"
    emu = emulate_l2(h, w2, counts, srt, wts, k)
    assert rel(asm, emu) < 1e-5, f"vs the kernel's model: {rel(asm, emu):.3e}"
    ref = l2_reference(h, w2, counts, srt, wts, k)
    assert rel(asm, ref) < 2e-3, f"vs fp32 math: {rel(asm, ref):.3e}"


@gpu
@pytest.mark.parametrize("K", [384, 768, 1152])
def test_l2_gluon_debug_pieces(K):
    """GPU debug and determinism: one expert, K = 384 / 768 / 1152 (two / four / six loop trips
    of 3 chunks), d = 256 (two column tiles), fp32 y, topk = ks = 1 and wts = 1 unless said;
    each piece with the PTX and the arithmetic upcast, each launched REPEATS times into
    NaN-poisoned y: every launch must give the bits of the first, the first must match the fp32
    math (a launch with other bits is diagnosed too). The message lists every case that is off
    and where (rows / columns / the median ratio: a power of two is a scale bug):
      ones       H = 1, W2 = 1 (codes 0x22), exponents 127: y = K (the data path, the frame:
                 weights 2^13 in fp16, 2^-13 in the epilogue)
      onehot     H row r = e_(c(r)), c(r) = r (2 K / 128 + 1) mod K (128 rows): y[r] =
                 W2[:, c(r)] (B's column order / orientation, the chunks, A's rows)
      col_ramp   one row, W2 code of column c = c % 16 (every code and sign), H = 2 on the
                 positive codes, 1 on the negative ones
      exps_flat  random H and codes, every exponent 120 (rel = 13 everywhere)
      exps_wide  exponents 108 .. 127 (rel in [-6, 13]: the per-(row, group) tables)
      exps_flush exponents 60 .. 127 (rows span 60 binades: rel < -13 flushes; below 2^-26 of
                 a row's largest weight, so the fp32 math still matches)
      frame_lo   exponents 2 .. 11 (the frame clamps at S0 = 1, the epilogue's 2^(S0 - 127)
                 at its smallest, 2^-126; H ~ 2^10 keeps y a normal fp32, ~2^-100; every
                 weight a normal fp32 in the reference too; compared x 2^100, exact)
      rows_37    37 rows (a partial row tile: the A copy masks, the store masks)
      rows_300   300 rows (3 row tiles, the last partial), topk 2, ks 3, a shuffled pair
                 order and random weights (the scatter, the weights, unrouted slots stay NaN)"""
    d = 256
    g = torch.Generator().manual_seed(7)
    cases = l2_debug_pieces(K, mgl.BM, g)
    msgs = []
    for name, x, c, e, k, ks, perm in cases:
        h, w2, counts, srt, wts, ref = dbg_l2_case(x, c, e, k, ks, perm, g, DEV)
        routed = torch.isfinite(ref[:, 0])
        for use_asm in (False, True):
            tag = f"{name} (K {K}, {'asm' if use_asm else 'arith'})"
            try:
                outs = [o.view(-1, d) for o in
                        _launch(h, w2, counts, srt, wts, ks, torch.float32, repeats=REPEATS,
                                use_asm=use_asm)]
            except Exception as exc:  # noqa: BLE001  (a launch error names the case)
                msgs.append(f"{tag}: {exc!r}"[:400])
                continue
            # frame_lo's y (~2^-100) is scaled by 2^100 (exact) for the norms in diagnose
            sc = 2.0 ** 100 if name == "frame_lo" else 1.0
            msgs.append(diagnose(tag, outs[0][routed] * sc, ref[routed] * sc))
            if torch.isfinite(outs[0][~routed]).any():
                msgs.append(f"{tag}: an unrouted slot was written")
            differ = _differ(outs)
            if differ:
                msgs.append(f"{tag}: launches {differ} of {REPEATS} gave other bits than the "
                            "first")
                msgs += [diagnose(f"{tag}, launch {j}", outs[j][routed] * sc, ref[routed] * sc)
                         for j in differ[:3]]
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


@gpu
@pytest.mark.parametrize("T,E,d,F", [(120, 1, 128, 384), (2048, 64, 1024, 768)])
def test_l2_gluon_bit_stable(T, E, d, F):
    """REPEATS launches of one call give the same bits and the first matches the fp32 math: one
    program (one expert of 120 rows, one column tile) and a multi-program prefill grid (192
    rows per expert: 2 row tiles each, 8 column tiles), bf16 y with ks = topk + 1."""
    k = min(6, E)
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=17)
    outs = _launch(h, w2, counts, srt, wts, k + 1, torch.bfloat16, repeats=REPEATS)
    assert not _differ(outs), f"launches {_differ(outs)} of {REPEATS} gave other bits"
    y = outs[0]
    assert torch.isfinite(y[:, :k]).all() and torch.isnan(y[:, k:].float()).all()
    ref = l2_reference(h, w2, counts, srt, wts, k + 1)
    assert rel(y[:, :k], ref[:, :k]) < 1e-2, f"vs fp32 math: {rel(y[:, :k], ref[:, :k]):.3e}"


@gpu
@pytest.mark.parametrize("on", [True, False])
def test_routed_experts_prefill_uses_gluon_l2(on, monkeypatch):
    """routed_experts at a prefill size (300 tokens, top-2 of 8 experts: 75 rows per expert, d
    256, F 384) runs its L2 on l2_gluon when MoeConfig.gluon_prefill_l2 is on (once; its ws
    twin, tested in test_moe_gluon_l2_ws, off) and on the Triton L2 when off; both within
    test_triton_moe's bound of the reference op (check_routed)."""
    import dataclasses

    from test_triton_moe import ACT, FP16_H, check_routed, routed_case

    cfg = dataclasses.replace(FP16_H, gluon_prefill_l2=on, gluon_prefill_l2_ws=False)
    calls = []
    real = mgl.l2_gluon
    monkeypatch.setattr(mgl, "l2_gluon", lambda *a, **k: calls.append(1) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(300, 8, 256, 384, 2, seed=78)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"), cfg)
    assert len(calls) == (1 if on else 0)

