"""Dense bf16 / fp16 linears (`linear` with fmt "dense": the LM head, the indexers' head-weight
projections) on cuBLAS's half-precision GEMM with fp32 accumulation and fp32 output
(``torch.mm(..., out_dtype=torch.float32)``), instead of the capturable kernel's fp32 GEMM on a
per-call fp32 copy of the weight.

Why: the reference computes ``(x.float() @ W.float().t()).to(x.dtype)``. The capturable kernel
does exactly that on the GPU: every decode step converts the 1.3 GB bf16 LM head of V4.1-Flash
to a 2.6 GB fp32 copy and runs an fp32 (non-tensor-core) GEMM - ~2.9 ms of a 24.4 ms decode step
of the 5-layer slice at B = 128 on the H200 (benchmarks/results/h200-decode-9.md, op `linear`).

Exactness without an fp32 GEMM: every product of two bf16 (or two fp16) numbers is exact in fp32,
so a half-precision GEMM that accumulates in fp32 gives the reference's sum up to its order. When x
itself is fp32 (the LM head reads the final norm cast to fp32), x is split into three half-
precision pieces x = hi + mid + lo (hi = x rounded to the weight's dtype, mid = the rest rounded,
lo = what is left, rounded): for bf16 the three 8-bit significands cover fp32's 24 bits, so the
split is exact for every finite x whose pieces stay normal (all but values within ~2^16 of bf16's
smallest normal), and y = hi W^T + mid W^T + lo W^T is again the reference's sum in another
order. The three pieces go through ONE GEMM as 3M stacked rows (the weight is read once: at
decode sizes the GEMM stays bound by reading W), and their three results are added in fp32.
fp16 weights: fp16's exponent range is narrow, so fp32 activations are not split (the capturable
kernel runs); half-precision x with fp16 weights uses the plain GEMM.

The device check (``supported``) compares the call with fp32 math on random inputs once per
device; where it fails or ``torch.mm`` has no ``out_dtype`` (older torch), the capturable kernel
runs. Registry status "available" on sm_90, where its tests passed on the H200
(tests/kernels/test_cublas_dense.py, benchmarks/results/h200-kernel-tests.md); "unvalidated" on
other CUDA devices (MEGAGRAPH_UNVALIDATED_KERNELS=1). GemmConfig.cublas_dense switches it off.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from megagraph.kernels.gemm.config import GemmConfig

log = logging.getLogger(__name__)

CHECK_REL = 1e-5  # fp32 summation order over K <= 8192 products, against fp32 math
HALF = (torch.bfloat16, torch.float16)


def split3(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (fp32, [M, K]) as three `dtype` pieces stacked along M ([3M, K]): hi, mid, lo with
    hi + mid + lo == x exactly for bf16 (module docstring)."""
    hi = x.to(dtype)
    r = x - hi.float()
    mid = r.to(dtype)
    lo = (r - mid.float()).to(dtype)
    return torch.cat([hi, mid, lo], 0)


def split_matmul(x: Tensor, w: Tensor, mm) -> Tensor:
    """fp32 [M, N] = x @ w^T through `mm(a, b) -> fp32 a @ b` on half-precision operands: x in
    w's dtype directly, fp32 x split in three (bf16 weights only)."""
    if x.dtype == w.dtype:
        return mm(x, w.t())
    M = x.shape[0]
    y = mm(split3(x, w.dtype), w.t())
    return (y[:M] + y[M:2 * M]) + y[2 * M:]


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


_SUPPORTED: dict[int, bool] = {}


def supported(index: int) -> bool:
    """Does cuBLAS's half-precision GEMM with fp32 output match fp32 math on CUDA device
    `index` (both input dtypes, odd shapes)? Checked once per device, outside any CUDA-graph
    capture (during a capture before the check it says no, uncached: the capturable kernel is
    captured; the runtime warms up eagerly first)."""
    if index not in _SUPPORTED:
        if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            return False
        _SUPPORTED[index] = _check(index)
    return _SUPPORTED[index]


def _check(index: int) -> bool:
    dev = torch.device("cuda", index)
    g = torch.Generator(device=dev).manual_seed(11)
    try:
        for xdt in (torch.bfloat16, torch.float32):
            x = torch.randn(37, 1000, device=dev, generator=g).to(xdt)
            w = torch.randn(203, 1000, device=dev, generator=g).to(torch.bfloat16)
            want = x.double() @ w.double().t()
            got = split_matmul(x, w, _mm_f32)
            torch.cuda.synchronize(dev)
            err = float((got.double() - want).norm() / want.norm())
            if err > CHECK_REL:
                log.warning("cublas_dense: rel. err %.2e (x %s) on cuda:%d; not used", err, xdt,
                            index)
                return False
    except (RuntimeError, TypeError) as e:  # no out_dtype in this torch, or cuBLAS refuses
        log.info("cublas_dense: not available on cuda:%d: %s", index, e)
        return False
    return True


def applies(x: Tensor, weight: Tensor, scale: Tensor | None, fmt: str) -> bool:
    """This path takes the call: CUDA, a dense 2-D half-precision weight with no scale, x in its
    dtype or fp32 (fp32 only with bf16 weights), on a device where supported() passed."""
    if fmt not in ("dense", None) or scale is not None or weight.dim() != 2:
        return False
    if weight.device.type != "cuda" or weight.dtype not in HALF or x.device != weight.device:
        return False
    if not (x.dtype == weight.dtype or (x.dtype == torch.float32 and weight.dtype == torch.bfloat16)):
        return False
    return x.shape[-1] == weight.shape[1] and supported(weight.device.index or 0)


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None, *, fmt: str = "dense",
           kernel_config: GemmConfig | None = None) -> Tensor:
    """kernels.gemm.reference.linear: y = x @ W^T in fp32, cast to x.dtype; the capturable
    kernel where applies() says no or kernel_config.cublas_dense is off."""
    if not ((kernel_config or GemmConfig()).cublas_dense and applies(x, weight, scale, fmt)):
        from megagraph.kernels.dense.capturable import linear as fallback

        return fallback(x, weight, scale, fmt=fmt)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = split_matmul(x2, weight, _mm_f32)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


linear.capturable = True  # static shapes, no host sync (the device check runs at warm-up)
