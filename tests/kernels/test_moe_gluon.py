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

import os
import re
import subprocess

import pytest
import torch
from megagraph.kernels.triton import moe_gluon as mg

GPU_OK = mg.available()
gpu = pytest.mark.skipif(not GPU_OK, reason="needs CUDA sm_90 and Triton 3.6 Gluon")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_f32(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2] int8 codes (low nibble = even column) x E8M0 [E, N, K/32] -> fp32 [E, N, K]."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], device=w.device)
    b = w.view(torch.uint8).long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    sc = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)
    return v * sc


def _case(T, E, d, F, k, seed, subset=None):
    from megagraph.kernels.triton import moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    xb = x.view(T, d // 128, 128)
    sc = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1).clamp_min(1e-4) / 448)))
    xq = (xb / sc[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, d).cuda()
    xs = sc.float().cuda()

    def bank():
        w = torch.randint(-128, 128, (E, F, d // 2), dtype=torch.int8, generator=g)
        s = torch.randint(119, 125, (E, F, d // 32), dtype=torch.uint8, generator=g)
        return moe.bank(w.cuda(), s.view(torch.float8_e8m0fnu).cuda(), "mxfp4")

    w1, w3 = bank(), bank()
    pool = torch.tensor(subset) if subset else torch.arange(E)
    ids = pool[torch.randint(0, len(pool), (T, k), generator=g)].cuda()
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


@gpu
@pytest.mark.parametrize("T,E,subset", [(1, 8, None), (37, 8, None), (203, 8, [0, 3, 5]),
                                        (515, 16, None), (1024, 8, [1, 2])])
def test_l1_gluon_matches(T, E, subset):
    from megagraph.kernels.triton import moe

    d, F, k, limit = 1024, 256, 2, 10.0
    xq, xs, w1, w3, counts, srt = _case(T, E, d, F, k, seed=T, subset=subset)
    P = T * k
    max_tiles = min(P, P // mg.BM + E)
    out = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, out, topk=k, max_tiles=max_tiles, limit=limit)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written (or is not finite)"
    ref = _reference(xq, xs, w1, w3, counts, srt, k, limit)
    assert _rel(out, ref) < 2e-3
    # the Triton L1 as routed_experts launches it
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    rpg = P / max(1, min(E, P))
    mt1 = min(P, P // moe.pick_config("l1", rpg).bm + E)
    moe.gemm(xq, xs, w1, h, b2=w3, role="l1", rows_per_group=rpg, counts=counts, a_idx=srt,
             topk=k, max_tiles=mt1, limit=limit)
    assert _rel(out, h) < 2e-3


@gpu
def test_l1_gluon_no_limit_and_asm_off():
    """No clamp; the arithmetic upcast instead of the PTX one gives the same output bits."""
    d, F, k, E, T = 512, 128, 3, 4, 77
    xq, xs, w1, w3, counts, srt = _case(T, E, d, F, k, seed=5)
    P = T * k
    mt = min(P, P // mg.BM + E)
    o1 = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    o2 = torch.full_like(o1, float("nan"))
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, o1, topk=k, max_tiles=mt, use_asm=True)
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, o2, topk=k, max_tiles=mt, use_asm=False)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)
    ref = _reference(xq, xs, w1, w3, counts, srt, k, float("inf"))
    assert _rel(o1, ref) < 2e-3


# ---------------------------------------------------------------------------------------------
# ahead-of-time sm_90 build (CPU)
# ---------------------------------------------------------------------------------------------

TYPES = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", aidx_ptr="*i32", b1_ptr="*i8", bs1_ptr="*u8",
             b2_ptr="*i8", bs2_ptr="*u8", c_ptr="*fp16", work_ptr="*i32", MT="i32", N="i32",
             K="i32", limit="fp32", stride_am="i32", stride_as="i32", stride_bg="i32",
             stride_bn="i32", stride_bsg="i32", stride_bsn="i32", stride_cm="i32")


def _sass_loop(sass: str) -> str:
    """The SASS of the last backward branch's body (the K loop)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    span = None
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
    assert span is not None, "no loop in the SASS"
    return "\n".join(t for a, t in ins if span[0] <= a <= span[1])


@pytest.mark.skipif(not mg._IMPORT_OK, reason="needs Triton 3.6 with Gluon (PYTHONPATH=/tmp/t36)")
def test_l1_gluon_sm90_build(tmp_path):
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time Gluon compile API")
    fn = mg.l1_kernel
    consts = dict(TOPK=6, HAS_LIMIT=True, USE_ASM=True, BM=mg.BM, BN=mg.BN, BK=mg.BK, NSA=mg.NSA,
                  NW=mg.NUM_WARPS)
    sig = {n: ("constexpr" if n in consts else TYPES[n]) for n in fn.arg_names}
    # what the launcher's arguments specialize to at the real shapes (16-divisible)
    div = [n for n in TYPES if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128), options=dict(num_warps=mg.NUM_WARPS))
    assert k.metadata.shared <= 227 * 1024
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this triton")
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    sass = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    body = _sass_loop(sass)
    # per NSA chunks: two async wgmmas (W1, W3: 4 k32 steps each) per chunk, one wait, one barrier
    assert len(re.findall(r"\bQGMMA\b", body)) == 8 * mg.NSA
    assert len(re.findall(r"WARPGROUP\.ARRIVE", body)) == 2 * mg.NSA
    assert len(re.findall(r"WARPGROUP\.DEPBAR", body)) == mg.NSA
    assert len(re.findall(r"BAR\.SYNC", body)) == mg.NSA
    assert len(re.findall(r"\bLDGSTS\b", body)) >= mg.NSA  # A through cp.async
    # the wait comes after the next chunk's upcast stores: the MMA overlaps the upcast
    first = body.split("WARPGROUP.DEPBAR")[0]
    assert "QGMMA" in first and re.search(r"\bSTS\.128\b", first.split("QGMMA")[-1])
