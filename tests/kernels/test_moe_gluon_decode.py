"""The experimental Gluon DECODE L1 (kernels/triton/moe_gluon_decode.py): swapped wgmma (weight
rows = M, <= 16 tokens = N), the MXFP4 weights upcast to E4M3 in registers as the wgmma's A
operand, gathered E4M3 activations as B in shared memory.

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
weights flush. A debug test of isolated pieces (one expert, K = 256) names what fails.

CPU: the kernel is compiled ahead of time for sm_90 when the installed Triton is 3.6
(PYTHONPATH=/tmp/t36): no local memory, the register-A QGMMA 64x16x32 in the K loop, the
per-chunk instruction counts pinned (cuobjdump from Triton's bundle).
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
from megagraph.kernels.triton import moe_gluon_decode as md

GPU_OK = md.available()
gpu = pytest.mark.skipif(not GPU_OK, reason="needs CUDA sm_90 and Triton 3.6 Gluon")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_f32(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2] int8 codes (low nibble = even column) x E8M0 [E, N, K/32] -> fp32 [E, N, K]."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], device=w.device)
    b = w.view(torch.uint8).long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    sc = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)
    return v * sc


def _case(T, E, d, F, k, seed, subset=None, exps=(119, 125)):
    """Random E4M3 activations (power-of-two scales per 128), MXFP4 W1 / W3, random top-k routing
    (distinct experts per token, from `subset` if given: the others stay empty)."""
    from megagraph.kernels.triton import moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    xb = x.view(T, d // 128, 128)
    sc = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1).clamp_min(1e-4) / 448)))
    xq = (xb / sc[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, d).cuda()
    xs = sc.float().cuda()

    def bank():
        w = torch.randint(-128, 128, (E, F, d // 2), dtype=torch.int8, generator=g)
        s = torch.randint(*exps, (E, F, d // 32), dtype=torch.uint8, generator=g)
        return moe.bank(w.cuda(), s.view(torch.float8_e8m0fnu).cuda(), "mxfp4")

    w1, w3 = bank(), bank()
    pool = torch.tensor(subset) if subset else torch.arange(E)
    ids = pool[torch.rand(T, len(pool), generator=g).topk(k, dim=1).indices].cuda()
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    srt = moe.permute(ids.flatten(), counts, E)
    return xq, xs, w1, w3, counts, srt


def _reference(xq, xs, w1, w3, counts, srt, topk, limit):
    """fp32 H of the sorted rows: swiglu(A W1^T, A W3^T) on the exactly dequantized operands."""
    a = (xq.float().view(xq.shape[0], -1, 128) * xs[..., None]).view(xq.shape[0], -1)
    W1, W3 = _mxfp4_f32(w1.w, w1.s), _mxfp4_f32(w3.w, w3.s)
    rows = a[srt.long() // topk]
    out = torch.empty(rows.shape[0], W1.shape[1], device=xq.device)
    r0 = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            gt = rows[r0:r0 + c] @ W1[e].T
            up = (rows[r0:r0 + c] @ W3[e].T).clamp(-limit, limit)
            gt = gt.clamp(max=limit)
            out[r0:r0 + c] = gt * torch.sigmoid(gt) * up
        r0 += c
    return out


def _rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def _max_tiles(P, E):
    return min(P, P // md.BT + E)


@gpu
@pytest.mark.parametrize("T,E,subset", [(1, 8, None), (7, 32, [0, 3, 5, 9, 17, 30]),
                                        (64, 64, None), (64, 16, list(range(0, 16, 2)))])
def test_l1_decode_matches(T, E, subset):
    """T = 64 with 64 experts: ~6 rows per expert (the decode regime); with 8 of 16 experts:
    48 rows per expert, several 16-row tiles per expert (the last partial)."""
    from megagraph.kernels.triton import moe

    d, F, k, limit = 1024, 256, 6, 10.0
    xq, xs, w1, w3, counts, srt = _case(T, E, d, F, k, seed=T + E, subset=subset)
    P = T * k
    out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, out, topk=k, max_tiles=_max_tiles(P, E),
                       limit=limit)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written (or is not finite)"
    ref = _reference(xq, xs, w1, w3, counts, srt, k, limit)
    assert _rel(out, ref) < 2e-3, f"vs fp32 math: {_rel(out, ref):.3e}"
    # the Triton L1 as routed_experts launches it (decode: the swapped 16-row tile)
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    rpg = P / max(1, min(E, P))
    mt1 = min(P, P // moe.pick_config("l1", rpg).bm + E)
    moe.gemm(xq, xs, w1, h, b2=w3, role="l1", rows_per_group=rpg, counts=counts, a_idx=srt,
             topk=k, max_tiles=mt1, limit=limit)
    torch.cuda.synchronize()
    assert _rel(out, h) < 2e-3, f"vs the Triton L1: {_rel(out, h):.3e}"


@gpu
def test_l1_decode_asm_vs_arith_and_tiles():
    """No clamp; exponents 108 .. 127 (rel = e - S over [-13, 6] within a row's chunk: every
    table offset occurs and weights flush): the PTX table upcast and the arithmetic twin give the
    same bits; a prebuilt tile list gives the same output as the one built in the call."""
    from megagraph.kernels.triton import moe

    d, F, k, E, T = 512, 128, 3, 4, 21
    xq, xs, w1, w3, counts, srt = _case(T, E, d, F, k, seed=5, exps=(108, 128))
    P = T * k
    mt = _max_tiles(P, E)
    o1 = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    o2 = torch.full_like(o1, float("nan"))
    o3 = torch.full_like(o1, float("nan"))
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, o1, topk=k, max_tiles=mt, use_asm=True)
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, o2, topk=k, max_tiles=mt, use_asm=False)
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, o3, topk=k, max_tiles=mt,
                       tiles=moe.tile_list(counts, md.BT, mt))
    torch.cuda.synchronize()
    assert torch.isfinite(o2).all(), "arithmetic upcast: an element not written / not finite"
    ref = _reference(xq, xs, w1, w3, counts, srt, k, float("inf"))
    # the reference keeps the flushed weights (rel < -5: below 2^-11 of the row's largest group)
    assert _rel(o2, ref) < 2e-3, f"arithmetic upcast vs fp32 math: {_rel(o2, ref):.3e}"
    assert torch.isfinite(o1).all(), "PTX upcast: an element not written / not finite"
    assert torch.equal(o1, o2), f"PTX vs arithmetic upcast: rel {_rel(o1, o2):.3e}"
    assert torch.equal(o1, o3), "prebuilt tile list differs"


def _dbg_bank(codes: torch.Tensor, exps: torch.Tensor):
    from megagraph.kernels.triton import moe

    return moe.bank(codes.to(torch.int8).cuda(), exps.to(torch.uint8).view(
        torch.float8_e8m0fnu).cuda(), "mxfp4")


def _diagnose(name, out, ref):
    """'' when out matches ref (2e-3 relative, finite), else where it does not: bad rows (tokens)
    / columns (weight rows), the first bad element, the median ratio out / ref (a power of two:
    a scale bug)."""
    out, ref = out.float(), ref.float()
    fin = torch.isfinite(out)
    err = (out - ref).abs() > 2e-3 * ref.abs().amax().clamp_min(1e-30) + 1e-2 * ref.abs()
    bad = err | ~fin
    rel = _rel(torch.where(fin, out, 0), ref)
    if not bad.any() and rel < 2e-3:
        return ""
    r, c = bad.nonzero()[0].tolist() if bad.any() else (0, 0)
    rows = bad.any(1).nonzero().flatten().tolist()
    cols = bad.any(0).nonzero().flatten().tolist()
    ok = fin & (ref.abs() > 1e-3)
    ratio = (out[ok] / ref[ok]).median().item() if ok.any() else float("nan")
    return (f"{name}: rel {rel:.3e}, {int(bad.sum())}/{bad.numel()} bad, {int((~fin).sum())} "
            f"not finite; bad rows {rows[:8]}{'...' if len(rows) > 8 else ''} ({len(rows)}), "
            f"bad cols {cols[:8]}{'...' if len(cols) > 8 else ''} ({len(cols)}); first "
            f"({r}, {c}): {out[r, c].item():.6g} vs {ref[r, c].item():.6g}; median out/ref "
            f"{ratio:.6g}")


@gpu
def test_l1_decode_debug_pieces():
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
    d, F = 256, 64
    g = torch.Generator().manual_seed(7)
    msgs = []

    def run(name, x, xs, c1, e1, c3, e3, topk=1, a_idx=None, limit=None):
        T = x.shape[0]
        a_idx = torch.arange(T * topk, dtype=torch.int32) if a_idx is None else a_idx
        P = a_idx.numel()
        xq = x.to(torch.float8_e4m3fn).cuda()
        xs = xs.float().cuda()
        w1, w3 = _dbg_bank(c1, e1), _dbg_bank(c3, e3)
        counts = torch.tensor([P], dtype=torch.int32, device="cuda")
        srt = a_idx.to(torch.int32).cuda()
        ref = _reference(xq, xs, w1, w3, counts, srt, topk,
                         float("inf") if limit is None else limit)
        for use_asm in (False, True):
            out = torch.full((P, F), float("nan"), dtype=torch.float32, device="cuda")
            try:
                md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, out, topk=topk,
                                   max_tiles=-(-P // md.BT), limit=limit, use_asm=use_asm)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (a launch error names the case)
                msgs.append(f"{name} ({'asm' if use_asm else 'arith'}): {exc!r}"[:400])
                continue
            m = _diagnose(f"{name} ({'asm' if use_asm else 'arith'})", out, ref)
            if m:
                msgs.append(m)

    one_s = torch.ones(16, d // 128)
    c_one = torch.full((1, F, d // 2), 0x22)  # E2M1 1.0 in both nibbles
    c_half = torch.full((1, F, d // 2), 0x11)  # 0.5
    e127 = torch.full((1, F, d // 32), 127)

    def codes():
        return torch.randint(0, 256, (1, F, d // 2), generator=g)

    def randx(T):
        return (torch.randn(T, d, generator=g) * 64).clamp(-448, 448)

    def rexp(lo, hi):
        return torch.randint(lo, hi, (1, F, d // 32), generator=g)

    run("ones", torch.ones(16, d), one_s, c_one, e127, c_half, e127)
    eye = torch.zeros(16, d)
    eye[torch.arange(16), torch.arange(16) * 17] = 1.0
    run("onehot", eye, one_s, codes(), e127, c_one, e127)
    col = torch.arange(d // 2)
    ramp = ((2 * col) % 16) | (((2 * col + 1) % 16) << 4)
    run("col_ramp", torch.ones(1, d), one_s[:1], ramp.expand(1, F, d // 2).clone(), e127,
        c_one, e127)
    run("exps_flat", randx(16), one_s / 64, codes(), torch.full((1, F, d // 32), 120), codes(),
        torch.full((1, F, d // 32), 120))
    run("exps_wide", randx(16), one_s / 64, codes(), rexp(108, 128), codes(), rexp(108, 128))
    sa = torch.exp2(torch.randint(-9, -3, (16, d // 128), generator=g).float())
    run("a_scales", randx(16), sa, codes(), rexp(119, 125), codes(), rexp(119, 125))
    run("rows_5", randx(5), one_s[:5] / 64, codes(), e127 - 6, codes(), e127 - 6)
    perm = torch.randperm(40, generator=g).to(torch.int32)
    run("rows_40", randx(20), torch.full((20, d // 128), 1 / 64), codes(), rexp(119, 125),
        codes(), rexp(119, 125), topk=2, a_idx=perm, limit=10.0)
    assert not msgs, "\n".join(msgs)


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU)
# ---------------------------------------------------------------------------------------------

TYPES = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", aidx_ptr="*i32", b1_ptr="*i8", bs1_ptr="*u8",
             b2_ptr="*i8", bs2_ptr="*u8", c_ptr="*fp16", work_ptr="*i32", MT="i32", N="i32",
             G="i32", P="i32", K="i32", limit="fp32", stride_am="i32", stride_as="i32",
             stride_bg="i32", stride_bn="i32", stride_bsg="i32", stride_bsn="i32",
             stride_cm="i32")


def _sass_loop(sass: str) -> list[str]:
    """The SASS of the last backward branch's body (the K loop: NS chunks unrolled)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    span = None
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
    assert span is not None, "no loop in the SASS"
    return [t.strip() for a, t in ins if span[0] <= a <= span[1]]


def _count(body, pat):
    return sum(1 for t in body if re.search(pat, t))


@pytest.mark.skipif(not md._IMPORT_OK, reason="needs Triton 3.6 with Gluon (PYTHONPATH=/tmp/t36)")
def test_l1_decode_sm90_build(tmp_path):
    """Triton 3.6 sm_90 build at the real shapes' divisibility: no stack / local memory, at most
    128 registers (4 CTAs of 4 warps per SM), and per K chunk (the loop holds NS = 4): 8 register-
    A QGMMA 64x16x32 (W1, W3: 4 k32 steps each), 2 WARPGROUP.ARRIVE, 2 WARPGROUP.DEPBAR (the W1
    wait after the W3 wgmmas are issued), 1 BAR.SYNC, 1 DEPBAR (cp.async wait), 4 LDGSTS.128
    (weights) + 5 LDGSTS (4 of X, 1 of the exponents), 4 LDS.128 (the packed bytes: one per row
    and matrix), no STS (no upcast tile stored), 64 PRMT (16 packs x 4); the loop's instruction
    count is pinned (1407 at the time of writing, +- 8%)."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time Gluon compile API")
    fn = md.l1_decode_kernel
    consts = dict(TOPK=6, HAS_LIMIT=True, USE_ASM=True, BW=md.BW, BT=md.BT, BK=md.BK, NS=md.NS,
                  NKP=64, NW=md.NUM_WARPS)
    sig = {n: ("constexpr" if n in consts else TYPES[n]) for n in fn.arg_names}
    div = [n for n in TYPES if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128), options=dict(num_warps=md.NUM_WARPS))
    assert k.metadata.shared <= 56 * 1024, k.metadata.shared  # 4 CTAs per SM
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this triton")
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert regs <= 128, usage
    sass = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    body = _sass_loop(sass)
    ns = md.NS
    counts = {name: _count(body, pat) for name, pat in [
        ("QGMMA", r"\bQGMMA\.64x16x32\.F32\.E4M3\.E4M3\b"), ("ARRIVE", r"WARPGROUP\.ARRIVE"),
        ("WG_DEPBAR", r"WARPGROUP\.DEPBAR"), ("BAR_SYNC", r"\bBAR\.SYNC"),
        ("DEPBAR", r"^(@\S+\s+)?DEPBAR"), ("LDGSTS128", r"\bLDGSTS\.E\.BYPASS\.128\b"),
        ("LDGSTS", r"\bLDGSTS\.E\s"), ("LDS128", r"\bLDS\.128\b"), ("STS", r"\bSTS"),
        ("PRMT", r"\bPRMT\b")]}
    print(f"\nsm_90 build: {regs} registers, {k.metadata.shared} B shared, K loop "
          f"{len(body)} instructions for {ns} chunks ({len(body) / ns:.0f} per chunk): {counts}")
    assert counts["QGMMA"] == 8 * ns
    assert counts["ARRIVE"] == 2 * ns
    assert counts["WG_DEPBAR"] == 2 * ns
    assert counts["BAR_SYNC"] == ns
    assert counts["DEPBAR"] == ns
    assert counts["LDGSTS128"] == 4 * ns
    assert counts["LDGSTS"] == 5 * ns
    assert counts["LDS128"] == 4 * ns
    assert counts["STS"] == 0
    assert counts["PRMT"] == 64 * ns
    assert abs(len(body) - 1407) <= 0.08 * 1407, len(body)
    # the W1 wgmmas are in flight while W3 is upcast: PRMTs between the first QGMMA of a chunk
    # and its first WARPGROUP.DEPBAR
    chunk = "\n".join(body).split("WARPGROUP.DEPBAR")[0]
    assert "QGMMA" in chunk and len(re.findall(r"\bPRMT\b", chunk.split("QGMMA", 1)[1])) >= 32
