"""The experimental Gluon DECODE L1 (kernels/moe/gluon_decode.py): swapped wgmma (weight
rows = M, <= bt tokens = N: 16 at decode, 32 / 64 for prefill sizes), the MXFP4 weights upcast
to E4M3 in registers as the wgmma's A operand, gathered E4M3 activations as B in shared
memory.

GPU (CUDA sm_90 + Triton 3.6 Gluon, else skipped): l1_gluon_decode against the fp32 math of the
same quantized operands (MXFP4 dequantized exactly, A = codes x scale) and against the Triton
L1 launch of routed_experts at decode (moe.gemm role "l1": the swapped 16-row tile), T in
{1, 7, 64} with empty experts, into NaN-poisoned outputs (every valid element written, finite).
Tolerance 2e-3 relative (Frobenius): with the exponents used (a 6-wide range per row) every
E4M3 weight code is exact (E2M1 x 2^rel, rel in [0, 6]) and fp8 x fp8 products are exact in
the tensor core, so the error is the fp16 rounding of H (2^-11 relative, ~3e-4 rms) plus fp32
sum order; the Triton L1 computes the same formula (the same codes, the same per-chunk
promotion), so the two must agree as tightly. The PTX table upcast and its integer-arithmetic
twin give bit-identical outputs (the same E4M3 codes) also on 20-wide exponent spreads where
weights flush. A debug test of isolated pieces (one expert, K = 256) names what fails. Every
GPU test runs both loads of the packed weights (load="tma", the default, and "cp.async"); the
TMA variant is also checked bit for bit against the cp.async kernel (explicit per-expert row
counts: tiles of 1..16 rows, experts of > 16 rows, empty experts, odd token counts, 3 / 4 / 6
stages, K of fewer chunks than stages), over repeated launches and inside a CUDA graph. The
wider token tiles (bt = 32 / 64, md.BTS: prefill sizes) run through the same tests (matches,
asm vs arith, bit-stable) and their own (tiles of 1..bt rows, experts of > bt rows, empty
experts, odd token counts, both loads at 3 / 4 stages with the same bits at one bt; repeated
launches, CUDA graph); across bt only within the bound (the wgmma's n sets the sum order).

CPU: the kernel is compiled ahead of time for sm_90 when the installed Triton is 3.6
(make sm90-h200): no local memory, the register-A QGMMA 64x16x32 in the K loop, the per-chunk
instruction counts pinned, every thread's fence.proxy.async before the CTA barrier the wgmma
waits at (test_moe_gluon.proxy_fence_problems; cuobjdump from Triton's bundle); the same for the
TMA variant (its K loop: 2 UTMALDG, 1 mbarrier try-wait, 1 expect per chunk, no LDGSTS.128, the
same QGMMA / PRMT / LDS.128 as the cp.async kernel); both at bt = 32 / 64 (<= 255 registers, no
spills, QGMMA 64xbtx32). The launcher's load / stages / bt checks and the host TMA descriptor
of a bank run on the CPU.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from gluon_cases import bt_rows, case, check_bt_build, check_chunks, check_load_and_stages
from gluon_cases import check_repeats_and_graph, check_same_chunk_math, check_weight_desc
from gluon_cases import debug_cases, decode_copies, diagnose, gluon_build, gluon_gpu
from gluon_cases import proxy_fence_problems, reference, rel, rows_case, TYPES
from megagraph.kernels.moe import gluon_decode as md
from sm90_build import SYNC_COUNTS, build_stats, loop_instructions
from test_triton_moe import ACT, FP16_H, check_routed, routed_case

gpu = gluon_gpu(md)
build = gluon_build(md)


def _max_tiles(P, E, bt=md.BT):
    """routed_experts' bound on the row tiles of bt rows."""
    return min(P, P // bt + E)


@gpu
@pytest.mark.parametrize("bt", md.BTS)
@pytest.mark.parametrize("load", md.LOADS)
@pytest.mark.parametrize("T,E,subset", [(1, 8, None), (7, 32, [0, 3, 5, 9, 17, 30]),
                                        (64, 64, None), (64, 16, list(range(0, 16, 2)))])
def test_l1_decode_matches(T, E, subset, load, bt):
    """T = 64 with 64 experts: ~6 rows per expert (the decode regime); with 8 of 16 experts:
    48 rows per expert, several 16-row tiles per expert (the last partial; one partial tile at
    bt = 64). Every token tile bt within the bound of both references."""
    from megagraph.kernels.moe import triton as moe

    d, F, k, limit = 1024, 256, 6, 10.0
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=T + E, subset=subset, distinct=True)
    P = T * k
    out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, out, topk=k,
                       max_tiles=_max_tiles(P, E, bt), limit=limit, load=load, bt=bt)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written (or is not finite)"
    ref = reference(xq, xs, w1, w3, counts, srt, k, limit)
    assert rel(out, ref) < 2e-3, f"vs fp32 math: {rel(out, ref):.3e}"
    # the Triton L1 as routed_experts launches it (decode: the swapped 16-row tile)
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    rpg = P / max(1, min(E, P))
    mt1 = min(P, P // moe.pick_tile("l1", rpg).bm + E)
    moe.gemm(xq, xs, w1, h, b2=w3, role="l1", rows_per_group=rpg, counts=counts, a_idx=srt,
             topk=k, max_tiles=mt1, limit=limit)
    torch.cuda.synchronize()
    assert rel(out, h) < 2e-3, f"vs the Triton L1: {rel(out, h):.3e}"


@gpu
@pytest.mark.parametrize("bt", md.BTS)
@pytest.mark.parametrize("load", md.LOADS)
def test_l1_decode_asm_vs_arith_and_tiles(load, bt):
    """No clamp; exponents 108 .. 127 (rel = e - S over [-13, 6] within a row's chunk: every
    table offset occurs and weights flush): the PTX table upcast and the arithmetic twin give the
    same bits; a prebuilt tile list gives the same output as the one built in the call; at every
    token tile bt."""
    from megagraph.kernels.moe import triton as moe

    d, F, k, E, T = 512, 128, 3, 4, 21
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=5, exps=(108, 128), distinct=True)
    P = T * k
    mt = _max_tiles(P, E, bt)
    o1 = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    o2 = torch.full_like(o1, float("nan"))
    o3 = torch.full_like(o1, float("nan"))
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, o1, topk=k, max_tiles=mt, use_asm=True,
                       load=load, bt=bt)
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, o2, topk=k, max_tiles=mt, use_asm=False,
                       load=load, bt=bt)
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, o3, topk=k, max_tiles=mt,
                       tiles=moe.tile_list(counts, bt, mt), load=load, bt=bt)
    torch.cuda.synchronize()
    assert torch.isfinite(o2).all(), "arithmetic upcast: an element not written / not finite"
    ref = reference(xq, xs, w1, w3, counts, srt, k, float("inf"))
    # the reference keeps the flushed weights (rel < -5: below 2^-11 of the row's largest group)
    assert rel(o2, ref) < 2e-3, f"arithmetic upcast vs fp32 math: {rel(o2, ref):.3e}"
    assert torch.isfinite(o1).all(), "PTX upcast: an element not written / not finite"
    assert torch.equal(o1, o2), f"PTX vs arithmetic upcast: rel {rel(o1, o2):.3e}"
    assert torch.equal(o1, o3), "prebuilt tile list differs"


@gpu
@pytest.mark.parametrize("gluon,load", [(True, "cp.async"), (True, "tma"), (False, "cp.async")])
def test_routed_experts_decode_uses_gluon(gluon, load, monkeypatch):
    """routed_experts at a decode size (24 tokens, top-6 of 48 experts: 3 rows per expert) runs
    its L1 on l1_gluon_decode when on (once; with MoeConfig.gluon_decode_load) and on moe_gemm
    when MoeConfig.gluon_decode is off; both against the reference op within test_triton_moe's
    bound (2e-3, fp32 output)."""
    cfg = dataclasses.replace(FP16_H, gluon_decode=gluon, gluon_decode_load=load)
    calls = []
    real = md.l1_gluon_decode
    monkeypatch.setattr(md, "l1_gluon_decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(24, 48, 512, 128, 6, seed=91)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"), cfg)
    assert len(calls) == (1 if gluon else 0)


@gpu
@pytest.mark.parametrize("wide", [True, False])
def test_routed_experts_prefill_uses_wide_tiles(wide, monkeypatch):
    """routed_experts at a prefill size (600 tokens, top-2 of 8 experts: 150 rows per expert)
    runs its L1 on l1_gluon_decode with 64-token tiles by TMA when gluon_wide_l1 is on (the
    default; once) and not when off (the cuBLAS / Triton L1); both against the reference op
    within test_triton_moe's bound (fp32 output). The warp-specialized L1, which goes first,
    off."""
    cfg = dataclasses.replace(FP16_H, gluon_wide_l1=wide, gluon_ws_l1=False)
    calls = []
    real = md.l1_gluon_decode
    monkeypatch.setattr(md, "l1_gluon_decode",
                        lambda *a, **k: calls.append(k.get("bt")) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(600, 8, 256, 128, 2, seed=77)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"), cfg)
    assert calls == ([cfg.wide_bt] if wide else [])


@gpu
@pytest.mark.parametrize("load", md.LOADS)
def test_l1_decode_debug_pieces(load):
    """GPU debug: one expert, K = 256 (2 chunks), N = 64 (one weight block), fp32 output, no
    clamp, each piece isolated, each with the PTX and the arithmetic upcast; the message lists
    every case that is off and where:
      ones       A = 1, W1 = 1, W3 = 0.5, scales 1: g = 256, u = 128 (data path, promotion of
                 both chunks, epilogue)
      onehot     token r = e_{17 r} (16 tokens): g = W1[:, 17 r] - one weight column per token
                 (the k permutation pi of the A registers and of the X copy, nibble order)
      col_ramp   token 0 = 1 in every column, W1 code of column c = c % 16 (all codes, signs)
      exps_flat  random A and codes, every exponent 120 (rel = 6: the table, sb)
      exps_wide  exponents 108 .. 127 (every offset, the flush)
      a_scales   a different A scale per (token, chunk) (sa per chunk from shared memory)
      rows_5     5 tokens (masks, the zero-filled X rows, the store)
      rows_40    40 rows gathered with top-k 2 from 20 tokens in a shuffled order (3 row tiles,
                 the last partial; A row = a_idx // topk)
    """
    F = 64
    msgs = []
    cases = debug_cases(16, 17, 5, 20, ramp=True)
    for name, topk, limit, (xq, xs, w1, w3, counts, srt, ref) in cases:
        P = srt.numel()
        for use_asm in (False, True):
            out = torch.full((P, F), float("nan"), dtype=torch.float32, device="cuda")
            try:
                md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, out, topk=topk,
                                   max_tiles=-(-P // md.BT), limit=limit, use_asm=use_asm,
                                   load=load)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (a launch error names the case)
                msgs.append(f"{name} ({'asm' if use_asm else 'arith'}): {exc!r}"[:400])
                continue
            msgs.append(diagnose(f"{name} ({'asm' if use_asm else 'arith'})", out, ref))
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU)
# ---------------------------------------------------------------------------------------------



@build
def test_l1_decode_sm90_build():
    """Triton 3.6 sm_90 build at the real shapes' divisibility: no stack / local memory, at most
    128 registers (4 CTAs of 4 warps per SM), and per K chunk (the loop holds NS = 4): 8 register-
    A QGMMA 64x16x32 (W1, W3: 4 k32 steps each), 2 WARPGROUP.ARRIVE, 2 WARPGROUP.DEPBAR (the W1
    wait after the W3 wgmmas are issued), 2 BAR.SYNC (Triton's membar barrier after the cp.async
    wait, then the one after every thread's proxy fence: the fence is writer-side,
    proxy_fence_problems), 1 DEPBAR (cp.async wait), 4 LDGSTS.128 (weights) +
    5 LDGSTS (4 of X, 1 of the exponents), 4 LDS.128 (the packed bytes: one per row and
    matrix), no STS (no upcast tile stored), 64 PRMT (16 packs x 4); the loop's instruction
    count is pinned (1231 with the sign-by-prmt table, 3 SASS a pack shorter; 1423
    with the byte-spread table, 1407 with the old reader-side fence and one barrier per chunk;
    +- 8%)."""
    consts = dict(TOPK=6, HAS_LIMIT=True, USE_ASM=True, BW=md.BW, BT=md.BT, BK=md.BK, NS=md.NS,
                  NKP=64, NW=md.NUM_WARPS)
    regs, shared, body, counts = _build_stats(md.l1_decode_kernel, TYPES, consts,
                                              loop=loop_instructions)
    assert shared <= 56 * 1024, shared  # 4 CTAs per SM
    assert regs <= 128, regs
    per_chunk = dict(QGMMA=8, ARRIVE=2, WG_DEPBAR=2, BAR_SYNC=2, DEPBAR=1, LDGSTS128=4,
                     LDGSTS=5, LDS128=4, STS=0, PRMT=64)
    check_chunks("cp.async", regs, shared, body, counts, md.NS, per_chunk)
    assert abs(len(body) - 1231) <= 0.08 * 1231, len(body)
    # the W1 wgmmas are in flight while W3 is upcast: PRMTs between the first QGMMA of a chunk
    # and its first WARPGROUP.DEPBAR
    chunk = "\n".join(body).split("WARPGROUP.DEPBAR")[0]
    assert "QGMMA" in chunk and len(re.findall(r"\bPRMT\b", chunk.split("QGMMA", 1)[1])) >= 32


@gpu
@pytest.mark.parametrize("bt", md.BTS)
@pytest.mark.parametrize("load", md.LOADS)
@pytest.mark.parametrize("T,E,d,F", [(2, 1, 256, 64), (64, 64, 1024, 256)])
def test_l1_decode_bit_stable(T, E, d, F, load, bt):
    """20 launches of one call give the same bits, and the first matches the fp32 math: one
    program (one expert, <= 16 rows, one 64-row block, 2 chunks: where the prefill kernel's
    removed pack / bm 64 variants went wrong, kernels/moe/gluon_l1.py) and a multi-program
    decode grid; at every token tile bt."""
    k = min(6, E)
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=13, distinct=True)
    P = T * k
    first = None
    for _ in range(20):
        out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
        md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, out, topk=k,
                           max_tiles=_max_tiles(P, E, bt), limit=10.0, load=load, bt=bt)
        if first is None:
            first = out
        else:
            assert torch.equal(out.nan_to_num(7.0), first.nan_to_num(7.0)), "bits differ"
    assert torch.isfinite(first).all()
    ref = reference(xq, xs, w1, w3, counts, srt, k, 10.0)
    assert rel(first, ref) < 2e-3, f"vs fp32 math: {rel(first, ref):.3e}"


# ---------------------------------------------------------------------------------------------
# the TMA load of the packed weights (load="tma")
# ---------------------------------------------------------------------------------------------

# (rows per expert, tokens, top-k, d, F, exponent range, limit)
TMA_CASES = {
    # every tile size 1..16 (one tile per expert) and an empty expert; 47 tokens (odd)
    "tiles_1_16": (list(range(1, 17)) + [0], 47, 3, 1024, 256, (119, 125), 10.0),
    # experts of 17, 40 and 33 rows (2-3 tiles, the last partial) between empty ones; 33 tokens
    "big_experts": ([0, 17, 40, 0, 33, 5, 0], 33, 3, 1024, 128, (119, 125), 10.0),
    # K = 256: 2 chunks, fewer than the stages (the predicated-off copies past K); no clamp,
    # exponents over a 20-wide range (every table offset, flushed weights)
    "short_k_wide_exps": ([3, 0, 16, 1, 9], 11, 3, 256, 64, (108, 128), None),
}


@gpu
@pytest.mark.parametrize("stages", [3, 4, 6])
@pytest.mark.parametrize("name", list(TMA_CASES))
def test_l1_decode_tma_same_bits(name, stages):
    """load="tma" (at 3, 4 and 6 stages) gives the cp.async kernel's bits into NaN-poisoned
    outputs (every valid row written, finite), and both match the fp32 math."""
    rows, T, k, d, F, exps, limit = TMA_CASES[name]
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=len(name) + stages,
                                               exps=exps)
    P = sum(rows)
    mt = _max_tiles(P, len(rows))
    outs = {}
    for load, ns in (("cp.async", None), ("tma", stages)):
        out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
        md.l1_gluon_decode(xq, xs, a_idx, w1, w3, counts, out, topk=k, max_tiles=mt,
                           limit=limit, load=load, stages=ns)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{load}: an element not written / not finite"
        outs[load] = out
    assert torch.equal(outs["tma"], outs["cp.async"]), \
        f"tma vs cp.async: rel {rel(outs['tma'], outs['cp.async']):.3e}"
    ref = reference(xq, xs, w1, w3, counts, a_idx, k, float("inf") if limit is None else limit)
    assert rel(outs["tma"], ref) < 2e-3, f"vs fp32 math: {rel(outs['tma'], ref):.3e}"


@gpu
def test_l1_decode_tma_repeat_and_graph():
    """20 eager TMA launches give the cp.async kernel's bits every time, and the TMA launch
    captured in a CUDA graph (tile list built inside the capture, host descriptors filled at
    capture) replays the same bits into a re-poisoned output."""
    rows, T, k, d, F = [5, 0, 16, 23, 1, 2, 0, 7], 29, 3, 1024, 256
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=77)
    P = sum(rows)
    mt = _max_tiles(P, len(rows))

    def launch(out, load):
        md.l1_gluon_decode(xq, xs, a_idx, w1, w3, counts, out, topk=k, max_tiles=mt,
                           limit=10.0, load=load)

    want = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    launch(want, "cp.async")
    check_repeats_and_graph(lambda out: launch(out, "tma"), torch.full_like(want, float("nan")),
                            want, torch.equal, lambda o, w: f"rel {rel(o, w):.3e}")


def test_l1_decode_load_args():
    """The launcher's load / stages checks (check_load_and_stages) and its token tiles: the
    decode tile BT = 16 by default, tiles outside BTS refused."""
    check_load_and_stages(md)
    assert md.BT == 16 and md._token_tile(None) == 16
    assert [md._token_tile(bt) for bt in md.BTS] == [16, 32, 64]
    for bt in (8, 48, 128):
        with pytest.raises(ValueError):
            md._token_tile(bt)


@build
def test_l1_decode_weight_desc():
    """The host TMA descriptor of a W1 / W3 bank ([E F, d / 2]): check_weight_desc."""
    check_weight_desc(md)


def _tma_types():
    """TYPES for l1_decode_tma_kernel: the descriptors in place of the weight pointers and
    their strides (the jit's signature string of a gluon TensorDescriptor)."""
    desc = f"tensordesc<u8[{md.BW}, {md.BK // 2}],{md.W_TMA_LAYOUT!r}>"
    types = {n: t for n, t in TYPES.items()
             if n not in ("b1_ptr", "b2_ptr", "stride_bg", "stride_bn")}
    return dict(types, w1_desc=desc, w3_desc=desc)


SASS_COUNTS = [("QGMMA", r"\bQGMMA\.64x16x32\.F32\.E4M3\.E4M3\b")] + SYNC_COUNTS


def _build_stats(kernel, types, consts, **kw):
    """sm90_build.build_stats with this kernel family's patterns and warps."""
    return build_stats(kernel, types, consts, SASS_COUNTS, md.NUM_WARPS, **kw)


@build
def test_l1_decode_tma_sm90_build():
    """Triton 3.6 sm_90 build of l1_decode_tma_kernel at TMA_STAGES (3) next to the cp.async
    kernel's: no stack / local memory, <= 128 registers and <= 56 KB shared (4 CTAs per SM), and
    per K chunk: the cp.async kernel's math (8 QGMMA, 2 ARRIVE, 2 WARPGROUP.DEPBAR, 4 LDS.128,
    64 PRMT, no STS), 2 BAR.SYNC (A: stage free; B: every thread past its mbarrier wait - no
    membar barrier between the copies / expect on one mbarrier), 1 cp.async wait, 5 4-byte
    LDGSTS (X, exponents) and no LDGSTS.128 (the weights left cp.async), 2 UTMALDG (W1, W3),
    1 mbarrier try-wait, 1 expect (the re-arm), 1 proxy fence - writer-side for X
    (proxy_fence_problems) and the only one (Triton adds none of its own before the copies);
    the loop's instruction count per chunk pinned (the loop is unrolled by the stage count:
    1551 at 4 stages, 1141 at 3 when written, ~388 / ~380 per chunk; ~332 per chunk at 3 with
    the sign-by-prmt table, +- 8%; cp.async 1231 / 4)."""
    consts = dict(TOPK=6, HAS_LIMIT=True, USE_ASM=True, BW=md.BW, BT=md.BT, BK=md.BK, NKP=64,
                  NW=md.NUM_WARPS)
    ns = md.TMA_STAGES
    tma = _build_stats(md.l1_decode_tma_kernel, _tma_types(), dict(consts, NS=ns))
    cp = _build_stats(md.l1_decode_kernel, TYPES, dict(consts, NS=md.NS))
    check_same_chunk_math("tma", tma, ns, cp, md.NS,
                          ("QGMMA", "ARRIVE", "WG_DEPBAR", "LDS128", "PRMT", "STS"))
    regs, shared, body, c = tma
    assert regs <= 128 and shared <= 56 * 1024, (regs, shared)
    per_chunk = dict(BAR_SYNC=2, DEPBAR=1, LDGSTS128=0, LDGSTS=5, UTMALDG=2, TRYWAIT=1,
                     EXPECT=1, FENCE=1)
    assert {n: c[n] for n in per_chunk} == {n: v * ns for n, v in per_chunk.items()}, c
    assert abs(len(body) / ns - 332) <= 0.08 * 332, len(body)
    assert proxy_fence_problems(body, ns) == []


@build
@pytest.mark.parametrize("stages", [3, 5, 6, 8])
def test_l1_decode_tma_sm90_build_stages(stages):
    """Other ring depths build the same chunk (per-chunk counts as at TMA_STAGES), with no
    stack / spills; registers and shared memory printed (6 and 8 stages: > 128 registers and
    > 56 KB, so 3 and 2 CTAs per SM)."""
    consts = dict(TOPK=6, HAS_LIMIT=True, USE_ASM=True, BW=md.BW, BT=md.BT, BK=md.BK, NKP=64,
                  NW=md.NUM_WARPS, NS=stages)
    regs, shared, body, c = _build_stats(md.l1_decode_tma_kernel, _tma_types(), consts)
    per_chunk = dict(QGMMA=8, BAR_SYNC=2, UTMALDG=2, TRYWAIT=1, EXPECT=1, FENCE=1, PRMT=64)
    check_chunks("tma", regs, shared, body, c, stages, per_chunk)


# ---------------------------------------------------------------------------------------------
# wider token tiles (bt = 32 / 64: prefill sizes)
# ---------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("d", [256, 1024])
@pytest.mark.parametrize("bt", md.BTS)
def test_l1_decode_bt_rows(bt, d):
    """The token tile bt on bt_rows (an odd token count; K of 2 chunks - fewer than the stages
    - and of 8), into NaN-poisoned fp16 outputs: every row written, within 2e-3 of the fp32
    math; cp.async and TMA at 3 and 4 stages give the same bits at one bt (one math code path);
    against the bt = 16 output only within the bound (other bits allowed: the wgmma's n sets the
    tensor core's sum order)."""
    rows, k, F = bt_rows(bt), 3, 128
    P = sum(rows)
    T = (P // k + 8) | 1  # odd
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=bt + d)
    ref = reference(xq, xs, w1, w3, counts, a_idx, k, 10.0)
    outs = {}
    for tile, load, ns in ((bt, "cp.async", None), (bt, "tma", 3), (bt, "tma", 4),
                           (16, "tma", 3)):
        out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
        md.l1_gluon_decode(xq, xs, a_idx, w1, w3, counts, out, topk=k,
                           max_tiles=_max_tiles(P, len(rows), tile), limit=10.0, load=load,
                           stages=ns, bt=tile)
        torch.cuda.synchronize()
        name = f"bt {tile} {load} {ns}"
        assert torch.isfinite(out).all(), f"{name}: an element not written / not finite"
        assert rel(out, ref) < 2e-3, f"{name} vs fp32 math: {rel(out, ref):.3e}"
        outs[name] = out
    want = outs[f"bt {bt} cp.async None"]
    for name in (f"bt {bt} tma 3", f"bt {bt} tma 4"):
        assert torch.equal(outs[name], want), f"{name} vs cp.async: rel {rel(outs[name], want)}"
    assert rel(want, outs["bt 16 tma 3"]) < 2e-3


@gpu
@pytest.mark.parametrize("bt", [32, 64])
def test_l1_decode_bt_repeat_and_graph(bt):
    """At bt 32 / 64 (TMA, the default load): 20 eager launches give the same bits, and the
    launch captured in a CUDA graph (tile list of bt rows built inside the capture) replays
    them into a re-poisoned output."""
    rows, T, k, d, F = [5, 0, bt, 2 * bt + 3, 1, 2, 0, 7], 2 * bt + 11, 3, 1024, 256
    xq, xs, w1, w3, counts, a_idx = rows_case(rows, T, k, d, F, seed=bt)
    P = sum(rows)

    def launch(out):
        md.l1_gluon_decode(xq, xs, a_idx, w1, w3, counts, out, topk=k,
                           max_tiles=_max_tiles(P, len(rows), bt), limit=10.0, load="tma",
                           bt=bt)

    want = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    launch(want)
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
    ref = reference(xq, xs, w1, w3, counts, a_idx, k, 10.0)
    assert rel(want, ref) < 2e-3, f"vs fp32 math: {rel(want, ref):.3e}"
    check_repeats_and_graph(launch, torch.full_like(want, float("nan")), want, torch.equal,
                            lambda o, w: f"rel {rel(o, w):.3e}")


@build
@pytest.mark.parametrize("kernel,stages", [("tma", 3), ("tma", 4), ("cp.async", 4)])
@pytest.mark.parametrize("bt", [32, 64])
def test_l1_decode_sm90_build_bt(bt, kernel, stages):
    """The wider token tiles build: no stack / local memory (_build_stats), <= 255 registers,
    and per K chunk the BT = 16 chunk with the wgmma at n = bt (8 QGMMA 64xbtx32), the same
    upcast (64 PRMT, 4 LDS.128, no STS), barriers, fence order and weight copies (TMA: 2 UTMALDG,
    1 try-wait, 1 expect; cp.async: 4 LDGSTS.128), and bt / 4 + 1 4-byte LDGSTS (the X rows:
    4 bytes per thread and row group, and the exponents). Registers, shared memory and CTAs per
    SM printed (when written: bt 32 157 / 160 / 166 registers, 2-3 CTAs; bt 64 247 / 241 /
    253, 2 CTAs)."""
    consts = dict(TOPK=6, HAS_LIMIT=True, USE_ASM=True, BW=md.BW, BT=bt, BK=md.BK, NKP=64,
                  NW=md.NUM_WARPS, NS=stages)
    tma = kernel == "tma"
    stats = _build_stats(md.l1_decode_tma_kernel if tma else md.l1_decode_kernel,
                         _tma_types() if tma else TYPES, consts)
    per_chunk = dict(QGMMA=8, ARRIVE=2, WG_DEPBAR=2, BAR_SYNC=2, DEPBAR=1, LDS128=4, STS=0,
                     PRMT=64, FENCE=1, LDGSTS=bt // 4 + 1, **decode_copies(kernel, 2, 4))
    check_bt_build(kernel, bt, stages, stats,
                   ("QGMMA", rf"\bQGMMA\.64x{bt}x32\.F32\.E4M3\.E4M3\b"), per_chunk)


def test_proxy_fence_problems():
    """The fence-order check on hand-written loops: the writer-side order passes (with or
    without Triton's own barrier right after the wait); the old reader-side order (wait,
    barrier, fence, wgmma) and a fence-less chunk fail."""
    new = ["DEPBAR.LE SB0, 0x0", "BAR.SYNC.DEFER_BLOCKING 0x0", "MEMBAR.ALL.CTA",
           "FENCE.VIEW.ASYNC.S", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDGSTS.E.BYPASS.128 [R1], [R2]",
           "WARPGROUP.ARRIVE", "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT",
           "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA 0x100"]
    assert proxy_fence_problems(new, 1) == []
    assert proxy_fence_problems(new[:1] + new[2:], 1) == []  # one barrier, after the fence
    assert proxy_fence_problems(new + new, 2) == []
    assert proxy_fence_problems(new, 2)  # chunk count
    old = new[:2] + new[2:4] + new[5:]  # wait, barrier, fence, wgmma
    assert any("writer-side" in p for p in proxy_fence_problems(old, 1))
    assert any("reader-side" in p for p in proxy_fence_problems(old, 1))
    assert proxy_fence_problems(new[:2] + new[4:], 1)  # no fence at all
    hg = [t.replace("QGMMA.64x64x32.F32.E4M3.E4M3", "HGMMA.64x16x16.F32") for t in new]
    assert proxy_fence_problems(hg, 1) == []
    assert proxy_fence_problems([t.replace("SB0, 0x0", "SB0, 0x2") for t in old], 1)
