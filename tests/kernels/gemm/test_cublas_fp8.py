"""kernels/gemm/cublas_fp8.py: the reblocked weights (CPU, exact bounds) and the cuBLAS block-scaled
FP8 GEMM against fp32 math (GPU; skipped without CUDA).

Tolerances: the reblock is exact wherever a shifted element stays a normal E4M3 number and off by
at most REBLOCK_ABS_ERR (2^-10) times the new scale elsewhere (half the E4M3 subnormal step), so
the CPU tests assert that bound exactly. The cuBLAS call accumulates exact FP8 products in fp32:
Hopper's FP8 MMA accumulates each 128-column block at reduced precision before promoting to fp32:
2.0e-4 relative to fp32 math of the same operands measured on the H200, so CHECK_REL (2e-3)
is asserted; bf16 output adds one bf16 rounding (2^-9 relative per element: 1e-2 asserted on
norms, the project's bf16 bound)."""
from __future__ import annotations

import pytest
import torch

from megagraph.kernels.gemm import cublas_fp8 as cb
from megagraph.kernels.gemm.config import GemmConfig
from megagraph.kernels import formats
from megagraph.kernels.fused import reference as rf

CUDA = torch.cuda.is_available()


def _weight(N, K, block, spread, seed, device="cpu"):
    """An FP8-block weight whose sub-block scales differ by up to 2^spread (trained weights'
    blocks differ; equal scales would make the reblock trivially exact)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device) * 0.02
    nb, kb = -(-N // block), K // block
    f = torch.exp2(torch.randint(-spread, 1, (nb, kb), generator=g, device=device).float())
    w = w * f.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)
    return formats.quantize_fp8_block(w, block)


def _new_scale(s, form, N, K):
    per = s if form == "1x128" else s.t()[:, :K // 128].repeat_interleave(128, 0)[:N]
    return per.repeat_interleave(128, 1)


@pytest.mark.parametrize("form", cb.FORMS)
@pytest.mark.parametrize("N,K,spread", [(256, 512, 6), (384, 1280, 3), (128, 256, 12)])
def test_reblock_error_bound(form, N, K, spread):
    wq, ws = _weight(N, K, 32, spread, seed=N + K)
    w2, s2, exact = cb.reblock(wq, ws, form)
    assert w2.dtype == torch.float8_e4m3fn and w2.shape == (N, K)
    src = formats.dequantize_fp8_block(wq, ws)
    got = cb.dequant_reblocked(w2, s2, form)
    scale = _new_scale(s2, form, N, K)
    err = (got - src).abs() / scale
    assert float(err.max()) <= cb.REBLOCK_ABS_ERR
    assert not exact and float(err.max()) > 0  # spread >= 3: some elements did re-round
    # every new scale is the largest sub-block scale it covers (a power of two), never smaller
    e_src = formats.e8m0_to_f32(ws).repeat_interleave(32, 0)[:N].repeat_interleave(32, 1)
    assert bool((scale >= e_src).all())
    assert bool((torch.log2(s2.float()) == torch.log2(s2.float()).round()).all())
    # elements whose shifted value is a normal E4M3 number (>= 2^-6) are exact
    normal = src.abs() / scale >= 2.0 ** -6
    assert torch.equal(got[normal], src[normal])


def test_reblock_exact_for_128_blocks_and_layouts():
    N, K = 256, 384
    wq, ws = _weight(N, K, 128, 6, seed=3)
    w2, s2, exact = cb.reblock(wq, ws, "1x128")
    assert exact and w2 is wq  # no copy: the scales only expand per row
    assert s2.shape == (N, K // 128) and s2.stride() == (1, N)
    assert torch.equal(cb.dequant_reblocked(w2, s2, "1x128"), formats.dequantize_fp8_block(wq, ws))
    w3, s3, exact3 = cb.reblock(wq, ws, "128x128")
    assert exact3 and s3.shape == (4, 2)  # K/128 = 3 padded to 4, then transposed
    assert torch.equal(cb.dequant_reblocked(w3, s3, "128x128"),
                       formats.dequantize_fp8_block(wq, ws))


def test_reblock_rejects_bad_input():
    wq, ws = _weight(128, 256, 32, 2, seed=1)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cb.reblock(wq.float(), ws)
    with pytest.raises(ValueError, match="multiple of 128"):
        cb.reblock(wq[:, :96].contiguous(), ws[:, :3].contiguous())
    with pytest.raises(ValueError, match="unknown form"):
        cb.reblock(wq, ws, "1x32")
    w5, s5 = _weight(96, 256, 32, 2, seed=2)
    with pytest.raises(ValueError, match="128x128 needs"):
        cb.reblock(w5, s5, "128x128")


def test_cpu_tensors_keep_the_caller_kernel():
    wq, ws = _weight(128, 256, 32, 2, seed=4)
    xq, xs = rf.quantize_act(torch.randn(3, 256), act_fmt="fp8_1x128")
    assert cb.prepare((wq, ws)) is None
    assert cb.linear(xq, xs, [(wq, ws)], torch.bfloat16) is None


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _form():
    form = cb.supported(0)
    if form is None:
        pytest.skip("this torch / cuBLAS / GPU takes no block-scaled FP8 form (device check)")
    return form


@gpu
@pytest.mark.parametrize("M", [1, 5, 64, 300])
@pytest.mark.parametrize("N,K", [(1280, 5120), (512, 2304)])
def test_linear_matches_fp32_math(M, N, K):
    form = _form()
    wq, ws = _weight(N, K, 32, 3, seed=M + N, device="cuda")
    x = torch.randn(M, K, device="cuda")
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    xf = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")
    cw = cb.prepare((wq, ws))
    assert cw is not None and cw.form == form
    want = xf @ cb.dequant_reblocked(cw.w, cw.s, form).t()
    y32 = cb.matmul(xq, xs, cw, torch.float32)
    assert y32.shape == (M, N)
    assert float((y32 - want).norm() / want.norm()) < cb.CHECK_REL
    y = cb.linear(xq, xs, [(wq, ws)], torch.bfloat16)
    src = xf @ formats.dequantize_fp8_block(wq, ws).t()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert float((y.float() - src).norm() / src.norm()) < 1e-2


def test_prefill_form_picks_by_rows():
    """GemmConfig.prefill_form: cublas_form_prefill from cublas_prefill_rows rows on, the
    device default (None) below and where cublas_form_prefill is "" (off)."""
    cfg = GemmConfig()
    assert cfg.cublas_form_prefill == "128x128"
    assert cfg.prefill_form(cfg.cublas_prefill_rows) == "128x128"
    assert cfg.prefill_form(cfg.cublas_prefill_rows - 1) is None
    assert GemmConfig(cublas_form_prefill="").prefill_form(1 << 20) is None
    assert cb.form_ok(0, "4x4") is False  # an unknown recipe is never taken


@gpu
@pytest.mark.parametrize("form", ["1x128", "128x128"])
def test_linear_with_an_explicit_form(form):
    """linear(form=...) for both recipes whatever the device default: [W1; W3] stacked (two
    pairs) against fp32 math of the reblocked weight within CHECK_REL and of the 32 x 32
    source within 1e-2 (bf16 out); each form its own cached copy; 1000 rows (a prefill-sized
    call's tiles, cuBLAS's padding to rows of 4)."""
    if not cb.form_ok(0, form):
        pytest.skip(f"this torch / cuBLAS / GPU does not take the {form} form")
    p1 = _weight(512, 1024, 32, 3, seed=1, device="cuda")
    p3 = _weight(384, 1024, 32, 3, seed=2, device="cuda")
    x = torch.randn(1002, 1024, device="cuda")
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    xf = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")
    cw = cb.prepare(p1, p3, form=form)
    assert cw is not None and cw.form == form and cw.n == 896
    assert cb.prepare(p1, p3, form=form) is cw
    other = "1x128" if form == "128x128" else "128x128"
    if cb.form_ok(0, other):
        assert cb.prepare(p1, p3, form=other) is not cw
    want = xf @ cb.dequant_reblocked(cw.w, cw.s, form).t()
    y32 = cb.linear(xq, xs, [p1, p3], torch.float32, form=form)
    assert float((y32 - want).norm() / want.norm()) < cb.CHECK_REL
    src = xf @ torch.cat([formats.dequantize_fp8_block(*p) for p in (p1, p3)]).t()
    y = cb.linear(xq, xs, [p1, p3], torch.bfloat16, form=form)
    assert float((y.float() - src).norm() / src.norm()) < 1e-2


@gpu
def test_prepare_falls_back_to_the_default_form():
    """A recipe the weights do not fit (128 x 128 on N = 200 rows) or the device does not take
    gives the device's default recipe, not None: the form is a speed choice."""
    form = _form()
    cw = cb.prepare(_weight(200, 1024, 32, 3, seed=5, device="cuda"), form="128x128")
    assert cw is not None and cw.form == form
    cw = cb.prepare(_weight(256, 1024, 32, 3, seed=6, device="cuda"), form="4x4")
    assert cw is not None and cw.form == form


@gpu
def test_cache_and_version():
    _form()
    wq, ws = _weight(256, 512, 32, 3, seed=9, device="cuda")
    a = cb.prepare((wq, ws))
    assert cb.prepare((wq, ws)) is a
    wq.view(torch.uint8)[0, 0] ^= 1  # an in-place change bumps the version: rebuilt
    b = cb.prepare((wq, ws))
    assert b is not a


@gpu
def test_capture_after_warmup_and_miss_inside_capture():
    _form()
    wq, ws = _weight(256, 512, 32, 3, seed=11, device="cuda")
    xq, xs = rf.quantize_act(torch.randn(8, 512, device="cuda"), act_fmt="fp8_1x128")
    eager = cb.linear(xq, xs, [(wq, ws)], torch.bfloat16)  # warm-up: reblocked and cached
    w_new, s_new = _weight(256, 512, 32, 3, seed=12, device="cuda")  # never used before
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = cb.linear(xq, xs, [(wq, ws)], torch.bfloat16)
            miss = cb.prepare((w_new, s_new))  # first use inside a capture: the caller's kernel
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert miss is None
    assert torch.equal(out, eager)


@gpu
def test_linear_q_takes_cublas():
    """moe.linear_q routes FP8-block weights to cuBLAS where the device check passed: same
    result as cublas_fp8.linear, within bf16 of the reference op."""
    from megagraph.kernels.moe import triton as tm

    _form()
    wq, ws = _weight(1280, 5120, 32, 3, seed=13, device="cuda")
    xq, xs = rf.quantize_act(torch.randn(64, 5120, device="cuda"), act_fmt="fp8_1x128")
    kw = dict(fmt="fp8_block", act_fmt="fp8_1x128", out_dtype="bf16")
    y = tm.linear_q(xq, xs, wq, ws, **kw)
    assert torch.equal(y, cb.linear(xq, xs, [(wq, ws)], torch.bfloat16))
    ref = rf.linear_q(xq, xs, wq, ws, **kw)
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@gpu
@pytest.mark.parametrize("T", [1, 5, 64, 300])
def test_shared_expert_l1_on_cublas(T):
    """swiglu_mlp_q with FP8-block weights: [W1; W3] on cuBLAS (fp32 out) + the SwiGLU kernel,
    W2 as an exact bf16 copy on cuBLAS bf16 (bf16 H); within bf16 of the fp32 reference op (1e-2
    on norms)."""
    from megagraph.kernels.moe import triton as tm

    _form()
    d, F = 1024, 384
    w1, s1 = _weight(F, d, 32, 3, seed=T, device="cuda")
    w3, s3 = _weight(F, d, 32, 3, seed=T + 1, device="cuda")
    w2, s2 = _weight(d, F, 32, 3, seed=T + 2, device="cuda")
    x = torch.randn(T, d, device="cuda") * 4
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    b1, b3 = tm.bank(w1, s1, "fp8_block"), tm.bank(w3, s3, "fp8_block")
    assert tm._cublas_l1(xq, xs, b1, b3) is not None  # the cuBLAS paths are the ones taken
    w2b = tm._bf16_w2(tm.bank(w2, s2, "fp8_block"))
    assert w2b is not None and torch.equal(w2b.float(), formats.dequantize_fp8_block(w2, s2))
    kw = dict(fmt="fp8_block", swiglu_limit=7.0, act_fmt="fp8_1x128", out_dtype="bf16")
    y = tm.swiglu_mlp_q(xq, xs, w1, s1, w3, s3, w2, s2, **kw)
    ref = rf.swiglu_mlp_q(xq, xs, w1, s1, w3, s3, w2, s2, **kw)
    assert y.shape == ref.shape and torch.isfinite(y).all()
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@gpu
@pytest.mark.parametrize("T", [256, 517])
def test_grouped_linear_on_cublas(T):
    """grouped_linear_q (block-diagonal, wo_a-like) at >= cublas_grouped_min_rows: one cuBLAS
    GEMM per group; each group's columns within bf16 of the reference (a group left unwritten
    would show there)."""
    from megagraph.kernels.moe import triton as tm

    _form()
    G, o, k = 4, 256, 512
    w, s = _weight(G * o, k, 32, 3, seed=T, device="cuda")
    xq, xs = rf.quantize_act(torch.randn(T, G * k, device="cuda"), act_fmt="fp8_1x128")
    kw = dict(groups=G, fmt="fp8_block", act_fmt="fp8_1x128", out_dtype="bf16")
    assert T >= GemmConfig().cublas_grouped_min_rows
    y = tm.grouped_linear_q(xq, xs, w, s, **kw)
    ref = rf.grouped_linear_q(xq, xs, w, s, **kw)
    assert torch.isfinite(y).all()
    for g in range(G):  # each group's columns on their own (a skipped group would show here)
        a, r = y[:, g * o:(g + 1) * o].float(), ref[:, g * o:(g + 1) * o].float()
        assert float((a - r).norm() / r.norm()) < 1e-2
