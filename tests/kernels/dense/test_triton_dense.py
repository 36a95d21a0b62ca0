"""kernels/dense/triton_rope.py (RoPE) and kernels/dense/triton_quant.py fake_quant vs the reference: bitwise.

CUDA GPU, or the CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_interp.py runs this file
that way); skipped otherwise. Results are compared as bits (int views: torch.equal would take -0.0
for +0.0). RoPE: the kernel multiplies x by the capturable version's own cos / sin table with
torch's fp32 operations (no FMA contraction: tests/kernels/attention/test_triton_attention_sm90.py checks
the sm_90 SASS has no FFMA), so it is bitwise the capturable version on any device and the
reference where the two share the table (the CPU). fake_quant: the reference's arithmetic exactly
(power-of-two scales from the f32 bits, round-to-nearest-even E4M3 / E2M1 grids, signs as bits).
"""
from __future__ import annotations

import pytest
import torch
from triton_run import CUDA, DEV, pytestmark  # noqa: F401

from megagraph.kernels.dense.capturable import fake_quant as cap_fake_quant, rope as cap_rope
from megagraph.kernels.dense.quant import fake_quant as ref_fake_quant
from megagraph.kernels.dense.rope import rope as ref_rope

YARN = dict(theta=160000.0, yarn_factor=16.0, yarn_original=65536, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0)
PLAIN = dict(theta=10000.0)
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(INT[t.dtype])


def assert_bitwise(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    diff = bits(got) != bits(want)
    assert not bool(diff.any()), (f"{int(diff.sum())} of {diff.numel()} differ, first at "
                                  f"{diff.nonzero()[0].tolist()}: {got.detach().cpu()[diff][:4]} vs "
                                  f"{want.detach().cpu()[diff][:4]}")


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def rope_inputs(g, shape, dtype):
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])[torch.randperm(shape[-1], generator=g)]
    x.view(-1, shape[-1])[0, -6:] = torch.tensor([0.0, -0.0, -0.0, 0.0, -0.0, -0.0])  # signed zeros
    pos = torch.randint(0, 70000, (shape[0],), generator=g)
    pos[0] = 0  # cos 1, sin 0: a*1 - (-0.0)*0 and friends
    return x.to(dtype), pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,rope_dim", [((7, 24), 16), ((5, 3, 24), 24), ((5, 4, 512), 64),
                                            ((3, 128), 64)])
@pytest.mark.parametrize("yarn,inverse,offset", [(True, False, 0), (False, False, 0),
                                                 (True, True, -3), (False, True, 5)])
def test_rope_bitwise(dtype, shape, rope_dim, yarn, inverse, offset):
    from megagraph.kernels.dense.triton_rope import rope

    g = torch.Generator().manual_seed(shape[-1] + 3 * len(shape) + 7 * offset)
    x, pos = rope_inputs(g, shape, dtype)
    kw = dict(YARN if yarn else PLAIN, rope_dim=rope_dim, offset=offset, inverse=inverse)
    got = rope(x.to(DEV), pos.to(DEV), **kw)
    assert_bitwise(got, cap_rope(x.to(DEV), pos.to(DEV), **kw))
    if not CUDA:  # the same table on the CPU; on the GPU torch's frequencies may differ by an ulp
        assert_bitwise(got, ref_rope(x, pos, **kw))


def test_rope_strided_heads_and_fallbacks():
    from megagraph.kernels.dense.triton_rope import rope

    g = torch.Generator().manual_seed(11)
    big, pos = rope_inputs(g, (9, 6, 48), torch.bfloat16)
    x = big[:, 1:5, 8:40]  # heads and tokens with their own strides, a column offset
    kw = dict(YARN, rope_dim=16, offset=-1)
    assert_bitwise(rope(x.to(DEV), pos.to(DEV), **kw), ref_rope(x, pos, **kw))
    xt = big[:, 0, :].t().contiguous().t()  # last-dim stride != 1: copied first
    assert_bitwise(rope(xt.to(DEV), pos.to(DEV), **kw), ref_rope(xt, pos, **kw))
    odd = big[:, 0, :31]  # odd width: the capturable version
    assert_bitwise(rope(odd.to(DEV), pos.to(DEV), **kw), ref_rope(odd, pos, **kw))
    assert rope(big[:0].to(DEV), pos[:0].to(DEV), **kw).shape == (0, 6, 48)
    with pytest.raises(ValueError):
        rope(x.to(DEV), pos.to(DEV), **dict(kw, rope_dim=34))


# ---------------------------------------------------------------------------------------------
# fake quantization
# ---------------------------------------------------------------------------------------------

E2M1_TIES = [0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, 6.0]  # the ties (amax 6: scale 1 / 2^0)
E4M3_TIES = [17.0, -9.5, 0.0029296875, -0.0048828125, 104.0, 448.0, 240.0, -1.0625]  # (amax 448)


def fq_inputs(g, shape, dtype, block):
    """Values over ~12 decades, signed zeros and tiny negatives, blocks whose amax makes the
    scale exact (amax / 448 or / 6 a power of two) holding the E4M3 / E2M1 ties, a block below
    the amax floor."""
    d = shape[-1]
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 6, d)[torch.randperm(d, generator=g)]
    rows = x.view(-1, d)
    rows[0, :6] = torch.tensor([0.0, -0.0, -1e-30, 1e-30, -3e-9, -0.0])
    rows[1, :block] = -0.0
    rows[-1, :block] = torch.tensor(E2M1_TIES * (block // 8 + 1))[:block]
    if d >= 2 * block:
        rows[-1, block:2 * block] = torch.tensor(E4M3_TIES * (block // 8 + 1))[:block]
        rows[-2, :block] = 3.5 * torch.tensor(E4M3_TIES * (block // 8 + 1))[:block] / 448.0
        rows[-2, block:2 * block] = 1e-9 * torch.randn(block, generator=g)
    return x.to(dtype)


@pytest.mark.parametrize("fmt,block", [("fp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16),
                                       ("fp8_e4m3", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7, 512), (5, 128)])
def test_fake_quant_bitwise(fmt, block, dtype, shape):
    from megagraph.kernels.dense.triton_quant import fake_quant

    g = torch.Generator().manual_seed(block + shape[-1] + len(fmt))
    x = fq_inputs(g, shape, dtype, block)
    got = fake_quant(x.to(DEV), fmt=fmt, block=block)
    assert_bitwise(got, ref_fake_quant(x, fmt=fmt, block=block))


def test_fake_quant_fp16_strided_and_fallbacks():
    from megagraph.kernels.dense.triton_quant import fake_quant

    g = torch.Generator().manual_seed(3)
    x = fq_inputs(g, (6, 256), torch.float32, 32).clamp(-6e4, 6e4).half()  # finite in fp16
    for fmt in ("fp8_e4m3", "mxfp4", "nvfp4"):
        assert_bitwise(fake_quant(x.to(DEV), fmt=fmt, block=32), ref_fake_quant(x, fmt=fmt, block=32))
    big = fq_inputs(g, (9, 384), torch.bfloat16, 32)
    xs = big[::2, 64:320]  # strided rows, a column offset
    assert_bitwise(fake_quant(xs.to(DEV), fmt="mxfp4", block=32), ref_fake_quant(xs, fmt="mxfp4", block=32))
    x24 = big[:, :96]  # a block that is not a power of two: the capturable version
    assert_bitwise(fake_quant(x24.to(DEV), fmt="fp8_e4m3", block=24),
                   cap_fake_quant(x24, fmt="fp8_e4m3", block=24))
    assert fake_quant(big[:0].to(DEV), fmt="mxfp4", block=32).shape == (0, 384)
    with pytest.raises(ValueError):
        fake_quant(big[:, :48].to(DEV), fmt="mxfp4", block=32)


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_rope_captures_in_cuda_graph():
    from megagraph.kernels.dense import triton_rope as tr

    x = torch.randn(64, 64, 512, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 65536, (64,), device=DEV)
    kw = dict(YARN, rope_dim=64)
    tr.rope(x, pos, **dict(kw, theta=10000.0))  # compile outside capture (theta is not a constexpr)
    tr._FREQS.clear()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):  # the frequencies made inside the capture: not cached
        y = tr.rope(x, pos, **kw)
    assert not tr._FREQS
    x.copy_(torch.randn_like(x) * 3)
    pos.copy_(torch.randint(0, 65536, (64,), device=DEV))
    gr.replay()
    assert_bitwise(y, cap_rope(x, pos, **kw))
    assert_bitwise(tr.rope(x, pos, **kw), y)  # eager: made and cached now
    assert len(tr._FREQS) == 1


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fake_quant_captures_in_cuda_graph():
    from megagraph.kernels.dense.triton_quant import fake_quant

    x = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    outs = {}
    for fmt in ("fp8_e4m3", "mxfp4"):
        fake_quant(x, fmt=fmt, block=32)  # compile outside capture
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for fmt in ("fp8_e4m3", "mxfp4"):
            outs[fmt] = fake_quant(x, fmt=fmt, block=32)
    x.copy_(torch.randn_like(x) * 3)
    gr.replay()
    for fmt, y in outs.items():
        assert_bitwise(y, ref_fake_quant(x.cpu(), fmt=fmt, block=32))


# ---------------------------------------------------------------------------------------------
# benchmark rows (benchmarks/kernel_rows/dense.py): the code the device run times, at tiny dims
# ---------------------------------------------------------------------------------------------


def test_benchmark_rows_dry_run(monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import kernel_rows
    import kernel_rows.dense as dense

    monkeypatch.setattr(dense, "time_ms", lambda fn, **kw: kernel_rows.time_once_ms(fn, device=DEV))
    rows = dense.device_rows(torch.device(DEV), dense.TINY, (3,), 120.0)
    assert {r["kernel"] for r in rows} == {"triton.rope", "triton.fake_quant"} and len(rows) == 5
    for r in rows:
        assert "error" not in r and r["bitwise_capturable"] and r["ms"] > 0, r
        assert r["rel_err"] == 0.0 or (CUDA and r["kernel"] == "triton.rope" and r["rel_err"] < 1e-2), r
    for name in ("kernel_rows.dense", "kernel_rows"):
        sys.modules.pop(name, None)
