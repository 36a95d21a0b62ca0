"""kernels/moe/grouped_cublas.py: the prefill L1 on cuBLAS's rowwise grouped FP8 GEMM.

CPU (Triton interpreter child, test_triton_interp.py): the MXFP4 -> E4M3 row upcast (bit-exact
against its rule: exact within 11 binades of the row's largest group, zero below) and the
activation row gather / requant (exact wherever the shifted value is a normal E4M3 number, else
within an E4M3 subnormal step of the new scale); experts with no rows left unwritten. GPU: the whole L1 (upcast, gather, grouped
GEMM, SwiGLU) against fp32 math and the Triton L1 (4e-3 relative on norms: the GEMM rounds W1 x
and W3 x to bf16 before the SwiGLU, 2^-9 per element, ~1.5e-3 on the norm, and H is fp16),
routed_experts picking it at prefill sizes, and a CUDA-graph capture."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megagraph.kernels import formats  # noqa: E402
from megagraph.kernels.fused import reference as rf  # noqa: E402
from megagraph.kernels.moe import triton as tm  # noqa: E402
from megagraph.kernels.moe import grouped_cublas as mgc  # noqa: E402

RUNNABLE = torch.cuda.is_available() or tm.INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _bank(E, N, K, seed, spread=4):
    """MXFP4 experts [E, N, K] whose per-32 exponents spread over 2^spread within a row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E * N, K, generator=g)
    w = w * torch.exp2(torch.randint(-spread, 1, (E * N, K // 32), generator=g).float()
                       ).repeat_interleave(32, 1)
    wq, ws = formats.quantize_mxfp4(w)
    return wq.view(E, N, K // 2).to(DEV), ws.view(E, N, K // 32).to(DEV)


# half an E4M3 subnormal step on the GPU (cvt.rn: round to nearest even); a whole step in the
# interpreter, whose fp32 -> float8e4nv cast does not round to nearest (3 * 2^-10 -> 2^-9)
SUBNORMAL_ERR = 2.0 ** -10 if torch.cuda.is_available() else 2.0 ** -9


def _within(got, want, scale):
    """|got - want| <= SUBNORMAL_ERR * scale everywhere, and exact where |want| / scale >= 2^-6
    (a normal E4M3 number times a power of two: no rounding at all)."""
    err = (got - want).abs() / scale
    assert float(err.max()) <= SUBNORMAL_ERR
    normal = want.abs() / scale >= 2.0 ** -6
    assert torch.equal(got[normal], want[normal])


@pytest.mark.parametrize("spread", [2, 16])
def test_upcast_rows(spread):
    """Every element exact where its group's exponent is within 11 of the row's largest (rel =
    e_g - S >= -5, S = max - 6), zero below (spread 16 makes both happen); the row scale is
    2^(S - 127); an expert with no rows is left unwritten."""
    E, N, K = 3, 40, 512
    wq, ws = _bank(E, N, K, seed=spread, spread=spread)
    b = tm.bank(wq, ws, "mxfp4")
    counts = torch.tensor([5, 0, 2], dtype=torch.int32, device=DEV)
    out = torch.full((E, N, K), 0x7F, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    osc = torch.full((E, N), float("nan"), device=DEV)
    mgc.upcast_rows(b, counts, out, osc)
    src = formats.unpack_mxfp4(wq.cpu(), ws.cpu())
    e = ws.cpu().view(torch.uint8).to(torch.int32)  # [E, N, K/32] biased
    S = (e.amax(dim=2) - 6).clamp(min=1)
    keep = (e - S[..., None] >= -5).repeat_interleave(32, dim=2)
    want = torch.where(keep, src, torch.zeros_like(src))
    got = out.cpu().float() * osc.cpu()[..., None]
    for g in (0, 2):
        assert torch.equal(osc.cpu()[g], torch.exp2((S[g] - 127).float()))
        assert torch.equal(got[g], want[g])
    assert spread < 12 or bool((~keep[0]).any())  # the flush is exercised at spread 16
    # the empty expert's rows are untouched (NaN bytes, NaN scales)
    assert bool(torch.isnan(out[1].float()).all()) and bool(torch.isnan(osc[1]).all())


def test_gather_rows():
    T, K, k = 13, 640, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-8, 4, (T, K // 128),
                                                                  generator=g).float()
                                                    ).repeat_interleave(128, 1)
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    srt = torch.randperm(T * k, generator=g).to(torch.int32)
    a, sa = mgc.gather_rows(xq.to(DEV), xs.to(DEV), srt.to(DEV), k)
    src = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")[srt.long() // k]
    assert torch.equal(sa.cpu(), xs[srt.long() // k].amax(dim=1))
    _within(a.cpu().float() * sa.cpu()[:, None], src, sa.cpu()[:, None])


def _routed_case(T, E, d, F, k, seed):
    g = torch.Generator().manual_seed(seed)
    w1, s1 = _bank(E, F, d, seed)
    w3, s3 = _bank(E, F, d, seed + 1)
    x = torch.randn(T, d, generator=g)
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    ids = torch.randint(0, E - 1, (T, k), generator=g)  # the last expert stays empty
    return xq.to(DEV), xs.to(DEV), ids.to(DEV), w1, s1, w3, s3


@gpu
@pytest.mark.parametrize("T", [515, 1024])
def test_l1_matches_fp32_and_triton(T):
    if not mgc.supported(0):
        pytest.skip("cuBLAS rowwise grouped FP8 GEMM not available here (device check)")
    E, d, F, k, lim = 8, 512, 256, 6, 7.0
    xq, xs, ids, w1, s1, w3, s3 = _routed_case(T, E, d, F, k, seed=T)
    counts = torch.bincount(ids.reshape(-1), minlength=E).to(torch.int32)
    srt = tm.permute(ids.reshape(-1).to(torch.int32), counts, E)
    b1, b3 = tm.bank(w1, s1, "mxfp4"), tm.bank(w3, s3, "mxfp4")
    h = torch.full((T * k, F), float("nan"), dtype=torch.float16, device="cuda")
    mgc.l1_swiglu(xq, xs, srt, b1, b3, counts, h, topk=k, limit=lim)
    assert torch.isfinite(h).all(), "a row of H was not written"
    xf = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")[srt.long() // k]
    eid = ids.reshape(-1)[srt.long()]
    w1f, w3f = formats.unpack_mxfp4(w1, s1)[eid], formats.unpack_mxfp4(w3, s3)[eid]
    gt = torch.einsum("pk,pnk->pn", xf, w1f).clamp(max=lim)
    up = torch.einsum("pk,pnk->pn", xf, w3f).clamp(-lim, lim)
    want = torch.nn.functional.silu(gt) * up
    assert float((h.float() - want).norm() / want.norm()) < 4e-3
    ht = torch.full_like(h, float("nan"))
    tm.gemm(xq, xs, b1, ht, b2=b3, role="l1", rows_per_group=T * k / E, counts=counts,
            a_idx=srt, topk=k, max_tiles=T * k // 16 + E, limit=lim)
    assert float((h.float() - ht.float()).norm() / ht.float().norm()) < 4e-3


@gpu
def test_routed_experts_prefill_uses_it_and_captures():
    """The cuBLAS grouped L1 as routed_experts runs it (the Gluon prefill L1s, which go first,
    and FP8 H off): within 1e-2 of the reference, and a CUDA-graph replay gives eager's bits."""
    from megagraph.kernels.moe.config import MoeConfig

    cfg = MoeConfig(fp8_h_prefill=False, gluon_ws_l1=False, gluon_wide_l1=False)
    if not mgc.supported(0):
        pytest.skip("cuBLAS rowwise grouped FP8 GEMM not available here (device check)")
    T, E, d, F, k = 700, 8, 512, 256, 6
    xq, xs, ids, w1, s1, w3, s3 = _routed_case(T, E, d, F, k, seed=4)
    w2, s2 = _bank(E, d, F, seed=9)
    wts = torch.rand(T, k, device="cuda")
    kw = dict(fmt="mxfp4", swiglu_limit=7.0, act_fmt="fp8_1x128", out_dtype="bf16")
    b1, b3 = tm.bank(w1, s1, "mxfp4"), tm.bank(w3, s3, "mxfp4")
    h = torch.empty(T * k, F, dtype=torch.float16, device="cuda")
    assert mgc.applies(xq, b1, b3, h, T * k / E)
    eager = tm.moe_experts_q(xq, xs, ids, wts, w1, s1, w3, s3, w2, s2, **kw, kernel_config=cfg)
    ref = rf.moe_experts_q(xq, xs, ids, wts, w1, s1, w3, s3, w2, s2, **kw)
    assert float((eager.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = tm.moe_experts_q(xq, xs, ids, wts, w1, s1, w3, s3, w2, s2, **kw,
                               kernel_config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
