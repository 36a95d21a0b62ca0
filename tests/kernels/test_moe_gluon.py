"""The experimental Gluon L1 (kernels/moe/gluon_l1.py): SwiGLU of W1 / W3 on MXFP4 weights,
E4M3 activations gathered per expert-sorted row.

On a CUDA sm_90 device with Triton 3.6's Gluon: l1_gluon against the fp32 math of the same
quantized operands (MXFP4 weights dequantized exactly, A = codes x scale) and against the
Triton L1 launch of routed_experts (moe.gemm), for odd token counts and empty experts, into a
NaN-poisoned output (every row written, finite). Tolerance 2e-3 relative (Frobenius): the
E4M3 weight codes are exact (E2M1 x 2^rel, rel in [1, 6] for these exponents) and fp8 products
are exact, so the error is the fp16 output rounding (2^-11 relative, ~3e-4 rms) plus the
tensor core's fp32 sums; the Triton L1 computes the same formula, so it must agree as tightly.

Each test runs the PTX upcast (per-lane offsets) and, where it says so, the arithmetic one. The
one-program debug launches repeat every launch REPEATS times and compare the bits with the first
launch and the first with the fp32 math (the removed "pack" / bm 64 variants went wrong there on
the H200: moe_gluon's docstring; their tests are in commit f12126b).

On CPU: the GPU tests skip; the launcher's argument checks run on CPU tensors; the kernel is
compiled ahead of time for sm_90 when the installed Triton is 3.6 (make sm90-h200), checking no
local memory, the async wgmma in the K loop, its instruction count, and that every thread's
fence.proxy.async comes before the CTA barrier the wgmma waits at (proxy_fence_problems;
cuobjdump from Triton's bundle).
"""
from __future__ import annotations

import re

import pytest
import torch
from gluon_cases import TYPES, case, debug_cases, diagnose, reference, rel
from megagraph.kernels.moe import gluon_l1 as mg
from sm90_build import gluon_sm90, last_loop, usage_and_sass
from test_triton_moe import ACT, check_routed, routed_case

GPU_OK = mg.available()
gpu = pytest.mark.skipif(not GPU_OK, reason="needs CUDA sm_90 and Triton 3.6 Gluon")

REPEATS = 10  # launches of each one-program debug case (bits compared with the first)


@gpu
@pytest.mark.parametrize("T,E,subset", [(1, 8, None), (37, 8, None), (203, 8, [0, 3, 5]),
                                        (515, 16, None), (1024, 8, [1, 2])])
def test_l1_gluon_matches(T, E, subset):
    from megagraph.kernels.moe import triton as moe

    d, F, k, limit = 1024, 256, 2, 10.0
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=T, subset=subset)
    P = T * k
    max_tiles = min(P, P // mg.BM + E)
    out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, out, topk=k, max_tiles=max_tiles, limit=limit)
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
def test_l1_gluon_no_limit_and_asm_off():
    """No clamp; the arithmetic upcast instead of the PTX one gives the same output bits. The
    E8M0 exponents span 108 .. 127 (not the 6-wide range of _case), so within a row the offsets
    rel = e - S of the 4 groups of a chunk differ by up to 19: every rel in [-6, 6] occurs and
    some clamp at -6 (zero weights), exercising the per-lane offsets rel + 6 that
    moe_jit.FP4_E4M3_ASM reads from every byte (a kernel passing the old signed rel would decode
    rel - 6: off by 2^-6, or garbage for rel <= 0). Run 3 times: the outputs must be equal bit
    for bit."""
    from megagraph.kernels.moe import triton as moe

    d, F, k, E, T = 512, 128, 3, 4, 77
    xq, xs, w1, w3, counts, srt = case(T, E, d, F, k, seed=5, exps=(108, 128))
    P = T * k
    mt = min(P, P // mg.BM + E)
    o1 = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    o2 = torch.full_like(o1, float("nan"))
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, o1, topk=k, max_tiles=mt, use_asm=True)
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, o2, topk=k, max_tiles=mt, use_asm=False)
    for use_asm, first in ((True, o1), (False, o2)):
        for _ in range(2):
            again = torch.full_like(o1, float("nan"))
            mg.l1_gluon(xq, xs, srt, w1, w3, counts, again, topk=k, max_tiles=mt,
                        use_asm=use_asm)
            assert torch.equal(again.nan_to_num(7.0), first.nan_to_num(7.0)), \
                f"use_asm={use_asm}: a repeated launch gave other bits"
    torch.cuda.synchronize()
    assert torch.isfinite(o2).all(), "arithmetic upcast: an element not written / not finite"
    ref = reference(xq, xs, w1, w3, counts, srt, k, float("inf"))
    # the fp32 reference keeps the weights whose rel < -5 (the kernels flush them): relative to
    # the row's largest group they are below 2^-11
    assert rel(o2, ref) < 2e-3, f"arithmetic upcast vs fp32 math: {rel(o2, ref):.3e}"
    if moe.asm_ok(o1.device):
        assert torch.isfinite(o1).all(), "PTX upcast: an element not written / not finite"
        assert torch.equal(o1, o2), f"PTX vs arithmetic upcast: rel {rel(o1, o2):.3e}"


@gpu
@pytest.mark.parametrize("d", [256, 512, 1024])
def test_l1_gluon_debug_pieces(d):
    """GPU debug and determinism: one expert, K = d = 256 / 512 / 1024 (one / two / four loop
    trips), N = 64 (one column tile: one program per row tile, where the removed pack / bm 64
    variants went wrong on the H200), fp32 output, no clamp, each piece isolated, each with the
    arithmetic and the PTX upcast, each launched REPEATS times into a NaN-poisoned output: every
    launch must give the bits of the first, and the first must match the fp32 math (a launch
    with other bits is diagnosed against it too). The failure message lists every case that is off and
    where (rows / columns / scale), so one GPU run says which piece is wrong:
      ones       A = 1, W1 = 1, W3 = 0.5, all scales 1: g = d, u = d / 2 (the data path, the
                 promotion of every chunk, the epilogue)
      onehot     A row r = e_r (r < BM), W random codes, exponents 127: g = W1[:, r]
                 (one B element per output: B's column order / orientation, the A rows)
      exps_flat  random A and codes, every exponent 120 (rel = 6: the upcast offsets, sb)
      exps_wide  exponents 108 .. 127 (per-lane offsets in [-6, 6] and the clamp)
      a_scales   random A with a different A scale per (row, chunk) (sa per chunk)
      rows_37    37 rows (a partial row tile: masks, the store)
      rows_300   300 rows gathered with top-k 2 from 150 tokens in a shuffled order (several
                 row tiles, the last partial; A row = a_idx // topk)
    """
    F = 64
    msgs = []
    cases = debug_cases(mg.BM, 1, 37, 150, d=d)
    for name, topk, limit, (xq, xs, w1, w3, counts, srt, ref) in cases:
        P = srt.numel()
        for use_asm in (False, True):
            outs = []
            for _ in range(REPEATS):
                out = torch.full((P, F), float("nan"), dtype=torch.float32, device="cuda")
                mg.l1_gluon(xq, xs, srt, w1, w3, counts, out, topk=topk,
                            max_tiles=-(-P // mg.BM), limit=limit, use_asm=use_asm)
                outs.append(out)
            torch.cuda.synchronize()
            tag = f"{name} (d {d}, {'ptx' if use_asm else 'arith'})"
            msgs.append(diagnose(tag, outs[0], ref))
            differ = [j for j, o in enumerate(outs)
                      if not torch.equal(outs[0].nan_to_num(7.0), o.nan_to_num(7.0))]
            if differ:
                msgs.append(f"{tag}: launches {differ} of {REPEATS} gave other bits than the "
                            "first")
                msgs += [diagnose(f"{tag}, launch {j}", outs[j], ref) for j in differ[:3]]
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU)
# ---------------------------------------------------------------------------------------------

def test_kernel_consts_and_launcher_checks():
    """kernel_consts: bm 128 with the per-lane upcast (or its arithmetic twin); an unknown
    upcast raises. l1_gluon's argument checks run before any launch (CPU tensors suffice):
    shapes off the tile raise ValueError; banks whose rows are not 4-byte aligned are fine (the
    upcast loads bytes); where Gluon is missing, a valid call says so (RuntimeError) instead of
    launching."""
    from megagraph.kernels.moe import triton as moe

    assert mg.kernel_consts() == dict(USE_ASM=1, BM=128, BN=mg.BN, BK=mg.BK, NSA=mg.NSA, NW=8)
    assert mg.kernel_consts("arith")["USE_ASM"] == 0
    for bad in ("pack", "word"):
        with pytest.raises(ValueError):
            mg.kernel_consts(bad)
    E, d, F, k, T = 2, 256, 128, 2, 3
    w1, w3 = _cpu_banks(d=d, F=F, E=E)
    xq = torch.zeros(T, d).to(torch.float8_e4m3fn)
    xs = torch.ones(T, d // 128)
    counts = torch.tensor([T * k, 0], dtype=torch.int32)
    srt = torch.arange(T * k, dtype=torch.int32)
    out = torch.zeros(T * k, F, dtype=torch.float16)

    def call(**kw):
        args = dict(a_q=xq, a_scale=xs, a_idx=srt, w1=w1, w3=w3, counts=counts, out=out,
                    topk=k, max_tiles=T * k)
        args.update(kw)
        return mg.l1_gluon(**args)

    # a bank of 2-byte-offset rows: d / 2 + 2 bytes per row (a padded view of [E, F, d / 2])
    wide = torch.zeros(E, F, d // 2 + 2, dtype=torch.int8)
    w_odd = moe.bank(wide[..., : d // 2], w1.s.view(torch.float8_e8m0fnu), "mxfp4")
    w_odd3 = moe.bank(wide.clone()[..., : d // 2], w3.s.view(torch.float8_e8m0fnu), "mxfp4")
    assert w_odd.w.stride(1) % 4 == 2
    for kw in (dict(w1=_cpu_banks(d=d, F=96, E=E)[0], w3=_cpu_banks(d=d, F=96, E=E)[1],
                    out=out[:, :96]),
               dict(a_q=xq[:, :128], a_scale=xs[:, :1],
                    w1=_cpu_banks(d=128, F=F, E=E)[0], w3=_cpu_banks(d=128, F=F, E=E)[1]),
               dict(out=out[:-1])):
        with pytest.raises(ValueError):
            call(**kw)
    # the upcast reads bytes: no alignment rule for the packed weights
    if not mg._IMPORT_OK:
        with pytest.raises(RuntimeError):
            call(w1=w_odd, w3=w_odd3)
        with pytest.raises(RuntimeError):
            call()
    assert call(max_tiles=0) is out  # nothing to do: no launch, no Gluon needed


def proxy_fence_problems(body: list[str], chunks: int) -> list[str]:
    """The proxy-fence order of a Gluon kernel's K loop (SASS, one instruction a line): for
    every chunk - a cp.async wait (DEPBAR.LE SB0) followed by the chunk's first wgmma (QGMMA /
    HGMMA) - the fence.proxy.async of the thread's own completed copies (SASS: MEMBAR.ALL.CTA +
    FENCE.VIEW.ASYNC.S) must come after the wait and BEFORE the last BAR.SYNC ahead of the
    wgmma (writer-side: every thread fences, then the CTA barrier the wgmma issuers wait at),
    and no fence may sit between that barrier and the wgmma (the old reader-side order:
    wait, barrier, fence, wgmma). [] when right, else what is wrong; also wrong when the
    number of chunks found is not `chunks`."""
    wait = re.compile(r"^(@!?U?P\w+\s+)?DEPBAR\.LE\s+SB0\b")
    mma = re.compile(r"\b[HQI]GMMA\.")
    bar = re.compile(r"\bBAR\.SYNC\b")
    fence = re.compile(r"\bFENCE\.VIEW\.ASYNC\b")
    waits = [i for i, t in enumerate(body) if wait.search(t)]
    mmas = [i for i, t in enumerate(body) if mma.search(t)]
    probs, found = [], 0
    for w in waits:
        g = next((i for i in mmas if i > w), None)
        if g is None or any(w < v < g for v in waits):
            continue  # no wgmma before the next wait (or the loop's end): not a chunk start
        found += 1
        bars = [i for i in range(w, g) if bar.search(body[i])]
        if not bars:
            probs.append(f"no BAR.SYNC between the cp.async wait ({w}) and the wgmma ({g})")
            continue
        if not any(fence.search(body[i]) for i in range(w, bars[-1])):
            probs.append(f"no FENCE.VIEW.ASYNC between the cp.async wait ({w}) and the barrier "
                         f"({bars[-1]}) before the wgmma ({g}): the fence is not writer-side")
        late = [i for i in range(bars[-1], g) if fence.search(body[i])]
        if late:
            probs.append(f"FENCE.VIEW.ASYNC at {late} after the barrier ({bars[-1]}) before the "
                         f"wgmma ({g}): reader-side")
    if found != chunks:
        probs.append(f"{found} chunks (cp.async wait -> wgmma) in the loop, expected {chunks}")
    return probs


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


def _sm90_build(asm: str = "lane"):
    """l1_kernel compiled ahead of time for sm_90 (the launcher's constexprs for the upcast and
    the 16-divisible arguments of the real shapes): (compiled kernel, resource usage, SASS)."""
    consts = dict(TOPK=6, HAS_LIMIT=True, **mg.kernel_consts(asm))
    k = gluon_sm90(mg.l1_kernel, TYPES, consts, num_warps=consts["NW"])
    usage, sass = usage_and_sass(k)
    return k, usage, sass


def sass_stats(asm: str = "lane") -> dict:
    """Registers, stack, shared memory and the K loop's instruction counts (per chunk pair) of
    the sm_90 build (for reports: python -c 'import test_moe_gluon as t;
    print(t.sass_stats())' with Triton 3.6 on the path)."""
    k, usage, sass = _sm90_build(asm)
    body = last_loop(sass)

    def n(p):
        return len(re.findall(p, body))

    return dict(asm=asm, regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack=int(re.search(r"STACK:(\d+)", usage).group(1)), shared=k.metadata.shared,
                loop_instructions=len(body.splitlines()), QGMMA=n(r"\bQGMMA\b"),
                ARRIVE=n(r"WARPGROUP\.ARRIVE"), DEPBAR=n(r"WARPGROUP\.DEPBAR"),
                BAR_SYNC=n(r"BAR\.SYNC"), FENCE=n(r"FENCE\.VIEW\.ASYNC"), PRMT=n(r"\bPRMT\b"),
                LOP3=n(r"\bLOP3"), LDGSTS=n(r"\bLDGSTS\b"), STS128=n(r"\bSTS\.128\b"),
                FFMA=n(r"\bFFMA\b"), local=len(re.findall(r"\b(LDL|STL)\b", sass)),
                fence_problems=proxy_fence_problems(
                    [t.strip() for t in body.splitlines()], mg.NSA))


# K-loop instructions per chunk pair of the Triton 3.6 sm_90 build (writer-side fence; the
# reader-side build of the seventh session had 1210: one BAR.SYNC fewer per chunk), pinned +- 8%
LOOP_PIN = 1218


@pytest.mark.skipif(not mg._IMPORT_OK, reason="needs Triton 3.6 with Gluon (make sm90-h200)")
def test_l1_gluon_sm90_build():
    """The default build (PTX upcast; the arithmetic twin, a test aid, spills 64 bytes): no
    stack / local memory; per chunk two async wgmma groups (W1, W3: 4 k32 steps each) per
    warpgroup, one wgmma wait, two CTA barriers (Triton's membar barrier after the
    cp.async wait, then the one after every thread's proxy fence: proxy_fence_problems), the
    MMA overlapping the next chunk's upcast stores; the loop's length pinned (LOOP_PIN)."""
    k, usage, sass = _sm90_build("lane")
    assert k.metadata.shared <= 227 * 1024
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    body = last_loop(sass)
    lines = [t.strip() for t in body.splitlines()]
    # per NSA chunks: two async wgmmas (W1, W3: 4 k32 steps each) per chunk and warpgroup, one
    # wait, two barriers
    assert len(re.findall(r"\bQGMMA\b", body)) == 8 * mg.NSA
    assert len(re.findall(r"WARPGROUP\.ARRIVE", body)) == 2 * mg.NSA
    assert len(re.findall(r"WARPGROUP\.DEPBAR", body)) == mg.NSA
    assert len(re.findall(r"BAR\.SYNC", body)) == 2 * mg.NSA
    assert len(re.findall(r"\bLDGSTS\b", body)) >= mg.NSA  # A through cp.async
    assert proxy_fence_problems(lines, mg.NSA) == []
    # the wait comes after the next chunk's upcast stores: the MMA overlaps the upcast
    first = body.split("WARPGROUP.DEPBAR")[0]
    assert "QGMMA" in first and re.search(r"\bSTS\.128\b", first.split("QGMMA")[-1])
    assert abs(len(lines) - LOOP_PIN) <= 0.08 * LOOP_PIN, len(lines)


# ---------------------------------------------------------------------------------------------
# routed_experts' choice of the Gluon L1 (moe._gluon_l1) and the wired-in path
# ---------------------------------------------------------------------------------------------


def _cpu_banks(d=256, F=128, E=4, fmt="mxfp4"):
    from megagraph.kernels.moe import triton as moe

    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (E, F, d // 2), dtype=torch.int8, generator=g)
    s = torch.randint(119, 125, (E, F, d // 32), dtype=torch.uint8, generator=g)
    b = moe.bank(w, s.view(torch.float8_e8m0fnu), fmt)
    return b, moe.bank(w.clone(), s.clone().view(torch.float8_e8m0fnu), fmt)


def test_gluon_l1_choice(monkeypatch):
    """The Gluon L1s run only where they were timed and checked: the fp16-H "l1" role, the
    prefill kernel (moe_gluon.l1_gluon, opt-in: MEGAGRAPH_MOE_GLUON_PREFILL) above 48 rows per
    expert, else above 100 the decode kernel with 64-token tiles (GLUON_WIDE_L1, default), the
    decode kernel
    (moe_gluon_decode.l1_gluon_decode) at <= 12, moe_gemm in between; E4M3 activations with
    scales, MXFP4 banks whose shapes fit the tile (prefill N % 64, K % 256; decode N % 64,
    K % 128), no CONFIG_OVERRIDE for the role, MEGAGRAPH_MOE_GLUON on (and
    MEGAGRAPH_MOE_GLUON_DECODE for the decode kernel), and available() (forced here: the
    predicate's own logic, on any machine)."""
    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe import gluon_decode as md

    for mod in (mg, md):
        monkeypatch.setattr(mod, "available", lambda device=None: True)
    monkeypatch.setattr(moe, "CONFIG_OVERRIDE", {})
    monkeypatch.setattr(moe, "GLUON", True)
    monkeypatch.setattr(moe, "GLUON_DECODE", True)
    monkeypatch.setattr(moe, "GLUON_PREFILL", True)
    w1, w3 = _cpu_banks()
    xq = torch.randn(4, 256).to(torch.float8_e4m3fn)
    xs = torch.rand(4, 2) + 0.5
    h = torch.empty(8, 128, dtype=torch.float16)

    def ok(*a):
        pick = moe._gluon_l1(*a)
        if pick is None:
            return None
        fn = pick[0]
        if hasattr(fn, "func"):  # the wide-tile decode kernel: a partial with bt
            return f"{fn.func.__name__}/bt{fn.keywords['bt']}"
        return fn.__name__

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
    monkeypatch.setattr(moe, "GLUON_PREFILL", False)  # the default: the wide decode tiles
    assert ok(xq, xs, w1, w3, h, "l1", 128.0) == f"l1_gluon_decode/bt{moe.WIDE_BT}"
    assert moe._gluon_l1(xq, xs, w1, w3, h, "l1", 128.0)[1] == moe.WIDE_BT
    assert ok(xq, xs, w1, w3, h, "l1", 100.0) is None  # 48-100 rows: the Triton L1 (timed)
    assert ok(xq, xs, w1, w3, h, "l1", 48.0) is None
    monkeypatch.setattr(moe, "GLUON_WIDE_L1", False)
    assert ok(xq, xs, w1, w3, h, "l1", 128.0) is None
    monkeypatch.setattr(moe, "GLUON_WIDE_L1", True)
    assert ok(xq, xs, w1, w3, h, "l1", 2.0) == "l1_gluon_decode"
    monkeypatch.setattr(moe, "GLUON_PREFILL", True)
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
    runs its L1 on l1_gluon when MEGAGRAPH_MOE_GLUON_PREFILL is on (once) and on moe_gemm when
    off (the default); both against the reference op within test_triton_moe's bound (2e-3,
    fp32 output)."""
    from megagraph.kernels.moe import triton as moe

    monkeypatch.setattr(moe, "GLUON_PREFILL", gluon)
    monkeypatch.setattr(moe, "CUBLAS_PREFILL", False)  # the Triton L1 when Gluon is off
    monkeypatch.setattr(moe, "GLUON_WIDE_L1", False)
    monkeypatch.setattr(moe, "CONFIG_OVERRIDE", {})
    calls = []
    real = mg.l1_gluon
    monkeypatch.setattr(mg, "l1_gluon", lambda *a, **k: calls.append(1) or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(300, 8, 256, 128, 2, seed=77)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"))
    assert len(calls) == (1 if gluon else 0)
