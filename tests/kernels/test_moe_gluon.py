"""The experimental Gluon L1 (kernels/triton/moe_gluon.py): SwiGLU of W1 / W3 on MXFP4 weights,
E4M3 activations gathered per expert-sorted row.

On a CUDA sm_90 device with Triton 3.6's Gluon: l1_gluon against the fp32 math of the same
quantized operands (MXFP4 weights dequantized exactly, A = codes x scale) and against the
Triton L1 launch of routed_experts (moe.gemm), for odd token counts and empty experts, into a
NaN-poisoned output (every row written, finite). Tolerance 2e-3 relative (Frobenius): the
E4M3 weight codes are exact (E2M1 x 2^rel, rel in [1, 6] for these exponents) and fp8 products
are exact, so the error is the fp16 output rounding (2^-11 relative, ~3e-4 rms) plus the
tensor core's fp32 sums; the Triton L1 computes the same formula, so it must agree as tightly.

On CPU: the GPU tests skip; the kernel is compiled ahead of time for sm_90 when the installed
Triton is 3.6 (PYTHONPATH=/tmp/t36 here), checking no local memory and the async wgmma in the
K loop (cuobjdump from Triton's bundle).
"""
from __future__ import annotations

import re

import pytest
import torch
from gluon_cases import TYPES, case, debug_cases, diagnose, reference, rel
from megagraph.kernels.triton import moe_gluon as mg
from sm90_build import gluon_sm90, last_loop, usage_and_sass
from test_triton_moe import ACT, _e4m3_ref_byte, _run_ptx, check_routed, routed_case

GPU_OK = mg.available()
gpu = pytest.mark.skipif(not GPU_OK, reason="needs CUDA sm_90 and Triton 3.6 Gluon")

# (row tile, PTX upcast) variants of l1_gluon: the default (128, "lane") first
VARIANTS = [(128, "lane"), (128, "pack"), (64, "lane"), (64, "pack")]


@gpu
@pytest.mark.parametrize("bm,asm", VARIANTS)
@pytest.mark.parametrize("T,E,subset", [(1, 8, None), (37, 8, None), (203, 8, [0, 3, 5]),
                                        (515, 16, None), (1024, 8, [1, 2])])
def test_l1_gluon_matches(T, E, subset, bm, asm):
    from megagraph.kernels.triton import moe

    d, F, k, limit = 1024, 256, 2, 10.0
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=T, subset=subset)
    P = T * k
    max_tiles = min(P, P // bm + E)
    out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, out, topk=k, max_tiles=max_tiles, limit=limit,
                bm=bm, asm=asm)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written (or is not finite)"
    ref = reference(xq, xs, w1, w3, counts, srt, k, limit)
    assert rel(out, ref) < 2e-3
    # the Triton L1 as routed_experts launches it
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    rpg = P / max(1, min(E, P))
    mt1 = min(P, P // moe.pick_config("l1", rpg).bm + E)
    moe.gemm(xq, xs, w1, h, b2=w3, role="l1", rows_per_group=rpg, counts=counts, a_idx=srt,
             topk=k, max_tiles=mt1, limit=limit)
    assert rel(out, h) < 2e-3


@gpu
@pytest.mark.parametrize("bm,asm", VARIANTS)
def test_l1_gluon_no_limit_and_asm_off(bm, asm):
    """No clamp; the arithmetic upcast instead of the PTX one gives the same output bits. The
    E8M0 exponents span 108 .. 127 (not the 6-wide range of _case), so within a row the offsets
    rel = e - S of the 4 groups of a chunk differ by up to 19: every rel in [-6, 6] occurs and
    some clamp at -6 (zero weights), exercising the per-lane offsets rel + 6 that
    moe_jit.FP4_E4M3_ASM reads from every byte (a kernel passing the old signed rel would decode
    rel - 6: off by 2^-6, or garbage for rel <= 0), and every lookup-table pair of the uniform
    upcast (asm="pack": one offset per int32 word, all 13 offsets, the rel < -5 flush)."""
    from megagraph.kernels.triton import moe

    d, F, k, E, T = 512, 128, 3, 4, 77
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=5, exps=(108, 128))
    P = T * k
    mt = min(P, P // bm + E)
    o1 = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    o2 = torch.full_like(o1, float("nan"))
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, o1, topk=k, max_tiles=mt, use_asm=True, bm=bm,
                asm=asm)
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, o2, topk=k, max_tiles=mt, use_asm=False, bm=bm)
    torch.cuda.synchronize()
    assert torch.isfinite(o2).all(), "arithmetic upcast: an element not written / not finite"
    ref = reference(xq, xs, w1, w3, counts, srt, k, float("inf"))
    # the fp32 reference keeps the weights whose rel < -5 (the kernels flush them): relative to
    # the row's largest group they are below 2^-11
    assert rel(o2, ref) < 2e-3, f"arithmetic upcast vs fp32 math: {rel(o2, ref):.3e}"
    # the uniform upcast has no device check of its own (moe.asm_ok checks the per-lane PTX):
    # this bit-exact comparison is its check
    if asm == "pack" or moe.asm_ok(o1.device):
        assert torch.isfinite(o1).all(), "PTX upcast: an element not written / not finite"
        assert torch.equal(o1, o2), f"PTX ({asm}) vs arithmetic upcast: rel {rel(o1, o2):.3e}"


@gpu
@pytest.mark.parametrize("bm", [128, 64])
def test_l1_gluon_debug_pieces(bm):
    """GPU debug: one expert, K = 256 (2 chunks: one loop trip), N = 64 (one column tile), fp32
    output, no clamp, each piece isolated, each with the arithmetic and both PTX upcasts; the
    failure message lists every case that is off and where (rows / columns / scale), so one
    GPU run says which piece is wrong:
      ones       A = 1, W1 = 1, W3 = 0.5, all scales 1: g = 256, u = 128 (the data path, the
                 promotion of both chunks, the epilogue; out = silu(256) * 128 = 32768)
      onehot     A row r = e_r (r < 128 of K = 256), W random codes, exponents 127: g = W1[:, r]
                 (one B element per output: B's column order / orientation, the A rows)
      exps_flat  random A and codes, every exponent 120 (rel = 6: the upcast offsets, sb)
      exps_wide  exponents 108 .. 127 (per-lane offsets in [-6, 6] and the clamp)
      a_scales   random A with a different A scale per (row, chunk) (sa per chunk)
      rows_37    37 rows (a partial row tile: masks, the store)
      rows_300   300 rows gathered with top-k 2 from 150 tokens in a shuffled order (3 row
                 tiles, the last partial; A row = a_idx // topk)
    """
    F = 64
    msgs = []
    for name, topk, limit, (xq, xs, w1, w3, counts, srt, ref) in debug_cases(128, 1, 37, 150):
        P = srt.numel()
        for mode in ("arith", "lane", "pack"):
            out = torch.full((P, F), float("nan"), dtype=torch.float32, device="cuda")
            mg.l1_gluon(xq, xs, srt, w1, w3, counts, out, topk=topk,
                        max_tiles=-(-P // bm), limit=limit, use_asm=mode != "arith",
                        asm="lane" if mode == "arith" else mode, bm=bm)
            torch.cuda.synchronize()
            msgs.append(diagnose(f"{name} (bm {bm}, {mode})", out, ref))
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU)
# ---------------------------------------------------------------------------------------------

def _pack_ptx_case(w: int, rel6: int) -> tuple[int, int]:
    """(cols 0..3, cols 4..7) E4M3 bytes of int32 word w at offset rel6 by the uniform upcast."""

    la, lb = mg.pack_luts(rel6)
    return _run_ptx(mg.FP4_PACK_ASM_TEXT, [0, 0, w, la, lb])


def test_pack_ptx_bit_logic():
    """The uniform-offset upcast (moe_gluon.FP4_PACK_ASM_TEXT with pack_luts' tables), run by
    test_triton_moe's PTX emulator: for every byte value in every byte of the word and every
    offset rel6 in [0, 12] (one offset for the whole word: its 4 bytes are one row's and one
    scale group's), output byte 2j of a half = the low nibble of its byte j, 2j + 1 = the high
    nibble, each equal to the arithmetic E4M3 byte (test_triton_moe._e4m3_ref_byte, rel < -5
    flushed to signed zero)."""

    g = torch.Generator().manual_seed(11)
    for lane in range(4):
        for b in range(256):
            for rel6 in range(13):
                bs = torch.randint(0, 256, (4,), generator=g).tolist()
                bs[lane] = b
                w = sum(x << (8 * i) for i, x in enumerate(bs))
                lo, hi = _pack_ptx_case(w, rel6)
                got = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [
                    (hi >> (8 * i)) & 0xFF for i in range(4)]
                want = [_e4m3_ref_byte(c, rel6 - 6) for x in bs for c in (x & 0xF, x >> 4)]
                assert got == want, (lane, b, rel6, bs, got, want)


def test_pack_luts_and_word_layout():
    """pack_luts: the tables are the E4M3 codes of the E2M1 magnitudes at each offset (0 for
    magnitude 0 and for rel < -5), every byte in [0, 0x7C] (no carry between bytes); the word
    layout check accepts the kernel's layouts and rejects a byte axis that is not the fastest."""

    for rel6 in range(13):
        la, lb = mg.pack_luts(rel6)
        t = [(la >> (8 * i)) & 0xFF for i in range(4)] + [(lb >> (8 * i)) & 0xFF for i in range(4)]
        assert t == [_e4m3_ref_byte(m, rel6 - 6) for m in range(8)], rel6
        assert max(t) <= 0x7C
    assert mg.word_layout_ok([1, 1, 2], [2, 1, 0], [64, 4, 4])
    assert mg.word_layout_ok([1, 1, 4], [2, 1, 0], [64, 4, 4])
    assert not mg.word_layout_ok([1, 1, 2], [1, 2, 0], [64, 4, 4])
    assert not mg.word_layout_ok([1, 1, 2], [2, 1, 0], [64, 4, 16])


def _sm90_build(bm: int, asm: str, maxnreg: int | None = None):
    """l1_kernel compiled ahead of time for sm_90 (the launcher's constexprs for bm / asm and
    the 16-divisible arguments of the real shapes): (compiled kernel, resource usage, SASS)."""
    consts = dict(TOPK=6, HAS_LIMIT=True, **mg.kernel_consts(bm, asm))
    k = gluon_sm90(mg.l1_kernel, TYPES, consts, num_warps=consts["NW"],
                   **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    usage, sass = usage_and_sass(k)
    return k, usage, sass


def sass_stats(bm: int = 128, asm: str = "lane", maxnreg: int | None = None) -> dict:
    """Registers, stack, shared memory and the K loop's instruction counts (per chunk pair) of
    one variant's sm_90 build (for reports: python -c 'import test_moe_gluon as t;
    print(t.sass_stats(64, "pack"))' with Triton 3.6 on the path)."""
    k, usage, sass = _sm90_build(bm, asm, maxnreg)
    body = last_loop(sass)

    def n(p):
        return len(re.findall(p, body))

    return dict(bm=bm, asm=asm, maxnreg=maxnreg, regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack=int(re.search(r"STACK:(\d+)", usage).group(1)), shared=k.metadata.shared,
                loop_instructions=len(body.splitlines()), QGMMA=n(r"\bQGMMA\b"),
                ARRIVE=n(r"WARPGROUP\.ARRIVE"), DEPBAR=n(r"WARPGROUP\.DEPBAR"),
                BAR_SYNC=n(r"BAR\.SYNC"), PRMT=n(r"\bPRMT\b"), LOP3=n(r"\bLOP3"),
                LDGSTS=n(r"\bLDGSTS\b"), STS128=n(r"\bSTS\.128\b"), FFMA=n(r"\bFFMA\b"),
                local=len(re.findall(r"\b(LDL|STL)\b", sass)))


@pytest.mark.skipif(not mg._IMPORT_OK, reason="needs Triton 3.6 with Gluon (PYTHONPATH=/tmp/t36)")
@pytest.mark.parametrize("bm,asm", VARIANTS)
def test_l1_gluon_sm90_build(bm, asm):
    k, usage, sass = _sm90_build(bm, asm)
    assert k.metadata.shared <= 227 * 1024
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    body = last_loop(sass)
    # per NSA chunks: two async wgmmas (W1, W3: 4 k32 steps each) per chunk and warpgroup, one
    # wait, one barrier
    assert len(re.findall(r"\bQGMMA\b", body)) == 8 * mg.NSA
    assert len(re.findall(r"WARPGROUP\.ARRIVE", body)) == 2 * mg.NSA
    assert len(re.findall(r"WARPGROUP\.DEPBAR", body)) == mg.NSA
    assert len(re.findall(r"BAR\.SYNC", body)) == mg.NSA
    assert len(re.findall(r"\bLDGSTS\b", body)) >= mg.NSA  # A through cp.async
    # the wait comes after the next chunk's upcast stores: the MMA overlaps the upcast
    first = body.split("WARPGROUP.DEPBAR")[0]
    assert "QGMMA" in first and re.search(r"\bSTS\.128\b", first.split("QGMMA")[-1])
    if asm == "pack":  # the uniform upcast: 4 prmt per int32 word (2 lookups, 2 sign spreads)
        # and nothing else: no byte repacking (words carried across the loop, not bytes)
        words = mg.NSA * 2 * mg.BN * (mg.BK // 8) // (32 * mg.TILES[bm]["NW"])  # W1 + W3
        assert len(re.findall(r"\bPRMT\b", body)) == 4 * words


# ---------------------------------------------------------------------------------------------
# routed_experts' choice of the Gluon L1 (moe._gluon_l1) and the wired-in path
# ---------------------------------------------------------------------------------------------


def _cpu_banks(d=256, F=128, E=4, fmt="mxfp4"):
    from megagraph.kernels.triton import moe

    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (E, F, d // 2), dtype=torch.int8, generator=g)
    s = torch.randint(119, 125, (E, F, d // 32), dtype=torch.uint8, generator=g)
    b = moe.bank(w, s.view(torch.float8_e8m0fnu), fmt)
    return b, moe.bank(w.clone(), s.clone().view(torch.float8_e8m0fnu), fmt)


def test_gluon_l1_choice(monkeypatch):
    """The Gluon L1s run only where they were timed and checked: the fp16-H "l1" role, the
    prefill kernel (moe_gluon.l1_gluon) above 48 rows per expert, the decode kernel
    (moe_gluon_decode.l1_gluon_decode) at <= 12, moe_gemm in between; E4M3 activations with
    scales, MXFP4 banks whose shapes fit the tile (prefill N % 64, K % 256; decode N % 64,
    K % 128), no CONFIG_OVERRIDE for the role, MEGAGRAPH_MOE_GLUON on (and
    MEGAGRAPH_MOE_GLUON_DECODE for the decode kernel), and available() (forced here: the
    predicate's own logic, on any machine)."""
    from megagraph.kernels.triton import moe
    from megagraph.kernels.triton import moe_gluon_decode as md

    for mod in (mg, md):
        monkeypatch.setattr(mod, "available", lambda device=None: True)
    monkeypatch.setattr(moe, "CONFIG_OVERRIDE", {})
    monkeypatch.setattr(moe, "GLUON", True)
    monkeypatch.setattr(moe, "GLUON_DECODE", True)
    w1, w3 = _cpu_banks()
    xq = torch.randn(4, 256).to(torch.float8_e4m3fn)
    xs = torch.rand(4, 2) + 0.5
    h = torch.empty(8, 128, dtype=torch.float16)

    def ok(*a):
        pick = moe._gluon_l1(*a)
        return None if pick is None else pick[0].__name__

    assert ok(xq, xs, w1, w3, h, "l1", 128.0) == "l1_gluon"
    assert moe._gluon_l1(xq, xs, w1, w3, h, "l1", 128.0)[1] == mg.BM
    assert ok(xq, xs, w1, w3, h, "l1", 48.0) is None  # the middle range keeps moe_gemm
    assert ok(xq, xs, w1, w3, h, "l1", 12.5) is None
    assert ok(xq, xs, w1, w3, h, "l1", 12.0) == "l1_gluon_decode"
    assert moe._gluon_l1(xq, xs, w1, w3, h, "l1", 1.0)[1] == md.BT
    for rpg in (128.0, 3.0):
        assert ok(xq, xs, w1, w3, h, "l1_fp8h", rpg) is None  # quantizes H: not built here
        assert ok(xq, None, w1, w3, h, "l1", rpg) is None
        assert ok(xq.float(), xs, w1, w3, h, "l1", rpg) is None
        assert ok(xq, xs, w1, w3, h.float(), "l1", rpg) is None  # exact mode / fp32 H
        b1, b3 = _cpu_banks(F=96)  # N = 96: not a multiple of the 64-column tile
        assert ok(xq, xs, b1, b3, h[:, :96], "l1", rpg) is None
    a1, a3 = _cpu_banks(d=128)  # K = 128: not a whole chunk pair (prefill), one chunk (decode)
    assert ok(xq[:, :128], xs[:, :1], a1, a3, h, "l1", 128.0) is None
    assert ok(xq[:, :128], xs[:, :1], a1, a3, h, "l1", 2.0) == "l1_gluon_decode"
    monkeypatch.setattr(moe, "CONFIG_OVERRIDE", {"l1": moe.GemmConfig(64, 64)})
    assert ok(xq, xs, w1, w3, h, "l1", 128.0) is None
    assert ok(xq, xs, w1, w3, h, "l1", 2.0) is None
    monkeypatch.setattr(moe, "CONFIG_OVERRIDE", {})
    monkeypatch.setattr(moe, "GLUON_DECODE", False)
    assert ok(xq, xs, w1, w3, h, "l1", 2.0) is None
    assert ok(xq, xs, w1, w3, h, "l1", 128.0) == "l1_gluon"
    monkeypatch.setattr(moe, "GLUON_DECODE", True)
    monkeypatch.setattr(moe, "GLUON", False)
    assert ok(xq, xs, w1, w3, h, "l1", 128.0) is None
    assert ok(xq, xs, w1, w3, h, "l1", 2.0) is None
    monkeypatch.setattr(moe, "GLUON", True)
    for mod in (mg, md):
        monkeypatch.setattr(mod, "available", lambda device=None: False)
    assert ok(xq, xs, w1, w3, h, "l1", 128.0) is None
    assert ok(xq, xs, w1, w3, h, "l1", 2.0) is None


@gpu
@pytest.mark.parametrize("gluon", [True, False])
def test_routed_experts_prefill_uses_gluon(gluon, monkeypatch):
    """routed_experts at a prefill size (300 tokens, top-2 of 8 experts: 75 rows per expert)
    runs its L1 on l1_gluon when on (once) and on moe_gemm when MEGAGRAPH_MOE_GLUON is off;
    both against the reference op within test_triton_moe's bound (2e-3, fp32 output)."""
    from megagraph.kernels.triton import moe

    monkeypatch.setattr(moe, "GLUON", gluon)
    monkeypatch.setattr(moe, "CONFIG_OVERRIDE", {})
    calls = []
    real = mg.l1_gluon
    monkeypatch.setattr(mg, "l1_gluon", lambda *a, **k: calls.append(1) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(300, 8, 256, 128, 2, seed=77)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"))
    assert len(calls) == (1 if gluon else 0)
