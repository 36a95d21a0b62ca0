"""Where the Triton kernel tests of the non-MoE families run, shared by their folders: on a CUDA
GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set by test_triton_interp.py's
child processes); `pytestmark` skips a module elsewhere. Plus the seeds and the step layouts on
that device."""
from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch
from test_capturable_ops import meta

from megagraph.configs.process import triton_interpret

INTERP = triton_interpret()
CUDA = torch.cuda.is_available() and not INTERP
DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (CUDA or INTERP),
    reason="needs CUDA + triton, or TRITON_INTERPRET=1")


def seed(*parts) -> int:
    """A stable seed from a case's parameters."""
    return zlib.crc32(repr(parts).encode())


def dev_meta(reqs):
    """test_capturable_ops.meta's step layout on DEV."""
    return {k: v.to(DEV) for k, v in meta(reqs).items()}


COMPRESSOR_BLOCK = {"none": 32, "mxfp4": 32, "nvfp4": 16, "fp8_e4m3": 32}


def check_compressor(got, want, fmts, written_frac=0.02, none_atol=0.0):
    """The compressor's outputs (ikey, ckv, pending rows) against the reference's: exact to
    1e-5 where unquantized, within the format's rounding where quantized. none_atol: extra
    absolute slack for unquantized rows whose GEMM runs over a long K in another summation order
    (fp32 accumulation of K bf16 products: ~sqrt(K) 2^-24 sum|x w|)."""
    names = ("ikey", "ckv", "pend_kv", "pend_gate")
    for i, (a, b) in enumerate(zip(want, got)):
        a, b = a.float().cpu(), b.float().cpu()
        assert a.shape == b.shape and not torch.isnan(b).any(), names[i]
        fmt = fmts[i] if i < 2 else "none"
        close = (a - b).abs() <= 1e-5 * (1 + a.abs()) + none_atol
        if fmt == "none":
            if i == 1 and want[1].dtype == torch.bfloat16:  # one bf16 ulp of the fp32 value
                close = (a - b).abs() <= 2.0 ** -7 * a.abs() + 1e-6
            assert close.all(), names[i]
            continue
        blk = COMPRESSOR_BLOCK[fmt]
        amax = a.reshape(*a.shape[:-1], -1, blk).abs().amax(-1, keepdim=True).expand(
            *a.shape[:-1], a.shape[-1] // blk, blk).reshape(a.shape)
        far = (a - b).abs() > 1e-4 * (1 + a.abs())
        assert far.float().mean() <= written_frac, names[i]
        assert ((a - b).abs() <= 0.7 * amax + 1e-6).all(), names[i]
