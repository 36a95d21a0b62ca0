"""kernels/triton fused compressor (V4.1, ratio 2 and 1) vs the reference fused compressor.

CUDA GPU, or the CPU under TRITON_INTERPRET=1; skipped otherwise. The caches start with random
contents (rows the step must not touch have to keep them), the step is the ragged, padded layout of
test_capturable_ops (groups completed across steps through the pending rows, incomplete trailing
groups, pad requests on the scratch slot, an empty request row).

Error bounds: without fake quantization every cache / pending element agrees to 1e-5 relative
(fp32 math in another order). With it, an element can cross a rounding boundary of the format;
at most 2% of the written elements may differ by more than 1e-4, and each by at most 0.7 x the
block's largest magnitude (one E2M1 step at a power-of-two scale is at most 2/3 of the block
amax; an E4M3 or E4M3-scaled step is smaller).
"""
from __future__ import annotations

import pytest
import torch
from cuda_capture import capture
from test_capturable_ops import PADDED, SCRATCH
from triton_run import check_compressor as check
from triton_run import CUDA, DEV, dev_meta, pytestmark, seed  # noqa: F401

from megagraph.kernels.fused.reference import compressor as ref_compressor

S, CAP = 6, 32
ROPE = dict(rope_dim=16, theta=160000.0, yarn_factor=16.0, yarn_original=65536, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0)


def tk():
    from megagraph.kernels.state import triton_compressor as compressor

    return compressor


def case(g, reqs, ratio, dtype, fmts, *, dm=96, dc=128, di=32, s=S, cap=CAP, rope=ROPE):
    m = dev_meta(reqs)
    T = m["positions"].shape[0]
    rn = lambda *sh, sc=1.0: (torch.randn(*sh, generator=g) * sc)  # noqa: E731
    x = rn(T, dm).to(dtype)
    wkv = rn(dc, dm, sc=dm ** -0.5).to(dtype)
    wgate = rn(dc, dm, sc=dm ** -0.5).to(dtype) if ratio > 1 else None
    pk = rn(s, ratio, dc) if ratio > 1 else None
    pg = rn(s, ratio, dc) if ratio > 1 else None
    nw, knw = torch.rand(dc, generator=g) + 0.5, torch.rand(di, generator=g) + 0.5
    wk = rn(di, dc, sc=dc ** -0.5).to(dtype)
    ikey, ckv = rn(s, cap // ratio, di), rn(s, cap // ratio, dc).to(dtype)
    args = [x, wkv, wgate, pk, pg, nw, wk, knw, ikey, ckv, m["positions"], m["token_req"], m["seq_slots"]]
    args = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    kw = dict(ratio=ratio, eps=1e-20, offset=1 - ratio, ikey_fmt=fmts[0], ckv_fmt=fmts[1], **rope)
    return args, kw


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("fmts", [("none", "none"), ("mxfp4", "nvfp4"), ("fp8_e4m3", "mxfp4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_compressor_matches_reference(ratio, fmts, dtype, inplace):
    g = torch.Generator().manual_seed(seed(ratio, fmts, dtype, inplace))
    args, kw = case(g, PADDED, ratio, dtype, fmts)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    want = ref_compressor(*cpu, **kw)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = tk().compressor(*args, **kw, inplace=inplace)
    # the scratch slot's rows are garbage by contract (pad requests share it)
    keep = [s for s in range(S) if s != SCRATCH]
    check([w[keep] for w in want], [x[keep] for x in got], fmts)
    for i, (a, b) in enumerate(zip(args[8:10] + ([args[3], args[4]] if ratio > 1 else []),
                                   before[8:10] + ([before[3], before[4]] if ratio > 1 else []))):
        if inplace:
            assert got[i] is a
        else:
            assert torch.equal(a, b), "functional call wrote its inputs"


gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
REAL_ROPE = dict(rope_dim=64, theta=160000.0, yarn_factor=16.0, yarn_original=65536,
                 yarn_beta_fast=32.0, yarn_beta_slow=1.0)


@gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_real_dims(ratio):
    """V4.1 dims (5120 -> 512 latent, 128 index dims, RoPE 64, MXFP4 keys / NVFP4 KV), decode rows
    at and next to group boundaries plus a 257-token prefill chunk; vs the capturable kernel."""
    from megagraph.kernels.fused.capturable import compressor as cap

    g = torch.Generator().manual_seed(ratio)
    reqs = [(i, c, 1) for i, c in enumerate([0, 1, 2, 3, 126, 127, 4095, 4096, 8190])] + [(9, 301, 257)]
    args, kw = case(g, reqs, ratio, torch.bfloat16, ("mxfp4", "nvfp4"), dm=5120, dc=512, di=128,
                    s=10, cap=16384, rope=REAL_ROPE)
    want = cap(*args, **kw)
    got = tk().compressor(*args, **kw)
    # K = 5120: the pending rows (unquantized GEMM output, |value| ~1, sum|x w| ~45) differ by
    # fp32 summation order, cuBLAS fp32 vs the kernel's bf16-product MMA: ~sqrt(K) 2^-24 45 = 2e-4
    check(want, got, ("mxfp4", "nvfp4"), none_atol=5e-4)


@gpu
def test_captures_in_cuda_graph():
    g = torch.Generator().manual_seed(3)
    reqs = [(i, c, 1) for i, c in enumerate([5, 6, 100, 4001])]
    static, kw = case(g, reqs, 2, torch.bfloat16, ("mxfp4", "nvfp4"), dm=5120, dc=512, di=128,
                      s=4, cap=8192, rope=REAL_ROPE)
    state = [a.clone() for a in (static[8], static[9], static[3], static[4])]
    fn = lambda: tk().compressor(*static, **kw, inplace=True)  # noqa: E731
    graph, _ = capture(fn)
    for a, b in zip((static[8], static[9], static[3], static[4]), state):
        a.copy_(b)
    want = tk().compressor(*static, **kw, inplace=False)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip((static[8], static[9], static[3], static[4]), want):
        assert torch.equal(a, b)
