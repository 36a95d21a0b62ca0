"""Mega-mHC in Triton: the FFN site's mHC front half (mixer projection with RMS statistics,
Sinkhorn, collapse, RMSNorm, activation quantization) writing x, x_q, x_scale straight into the
buffers mega_moe reads; same calling convention and semantics as
kernels.reference.fused.mega_mhc, sync-free and CUDA-graph capturable.

Launches: many tokens (prefill) 2 kernels - mhc_proj (one program per 16 tokens: [16, n*d] x
[n*d, 24] on tensor cores plus the sum of squares) and mhc_finish; few tokens (decode) split the
n*d reduction over programs that each write their partial products to their own [T, 32] slab,
summed in a fixed order by mhc_reduce (+1 launch), so the 7.9 MB projection weight streams
through the whole GPU instead of a few SMs and every run gives the same bits. (Until the fifth
session the partial sums were added atomically, the only float atomics of the decode path: the
likely source of the uncompiled engine's run-to-run differences on the H200 slice, 3e-5 in
decode logits.) mhc_finish: per token the coefficients (2 x 4 sigmoids, 4 x 4 softmax, 20
column and 19 row normalizations in registers), then two passes over d: the collapse (bf16, as
the reference rounds it) with its sum of squares, then the norm and the quantizer (per 128
columns, f32 power-of-two scales; per 32 with e8m0 scales for mxfp8).

Numerics: the projection multiplies bf16 streams with the fp32 weight split into bf16 hi + lo
(products exact, weight error ~2^-17), so m differs from the fp32 reference by summation order
only (~1e-6 relative), in an order fixed for a given T (split K or not). The
coefficients then match to ~1e-6; x to bf16 rounding (an element may round the other way where
the fp32 values straddle a bf16 tie), x_q to one E4M3 step where x differs, x_scale exactly
except where a block's amax sits on a power of two. fp32 streams use "ieee" fp32 products.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .moe import INTERPRET, RDT, available, on_device

ACT_BLOCKS = {"mxfp8": 32, "fp8_1x128": 128}
SPLIT_TOKENS = 256  # below this many tokens, split the projection over K (partial sums)


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def supports(streams: Tensor, fn: Tensor, act_fmt: str) -> bool:
    if not (available() and on_device(streams)) or act_fmt not in ACT_BLOCKS:
        return False
    if streams.dim() != 3 or streams.dtype not in RDT or fn.dim() != 2:
        return False
    _, n, d = streams.shape
    return (n & (n - 1) == 0 and fn.shape == ((2 + n) * n, n * d)
            and d % ACT_BLOCKS[act_fmt] == 0 and (2 + n) * n <= 32)


def mega_mhc(streams, fn, base, scale, mix=None, norm_weight=None, *, eps, hc_eps,
             sinkhorn_iters, norm_eps, act_fmt):
    """kernels.reference.fused.mega_mhc -> (x, x_q, x_scale, pre, post, comb)."""
    if not supports(streams, fn, act_fmt):
        from megagraph.kernels.capturable.fused import mega_mhc as fallback

        return fallback(streams, fn, base, scale, mix, norm_weight, eps=eps, hc_eps=hc_eps,
                        sinkhorn_iters=sinkhorn_iters, norm_eps=norm_eps, act_fmt=act_fmt)
    from . import mhc_jit

    T, n, d = streams.shape
    dev = streams.device
    qb = ACT_BLOCKS[act_fmt]
    e8 = act_fmt == "mxfp8"
    x = torch.empty(T, d, dtype=streams.dtype, device=dev)
    xq = torch.empty(T, d, dtype=torch.float8_e4m3fn, device=dev)
    xs = torch.empty(T, d // qb, dtype=torch.uint8 if e8 else torch.float32, device=dev)
    pre = torch.empty(T, n, dtype=torch.float32, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return x, xq, (xs.view(torch.float8_e8m0fnu) if e8 else xs), pre, post, comb
    h = streams if streams.is_contiguous() else streams.contiguous()
    fnc = fn if fn.stride(-1) == 1 else fn.contiguous()
    kd = n * d
    bm = 16
    bk = 64 if not INTERPRET else 128
    mt = -(-T // bm)
    split = 1
    if T < SPLIT_TOKENS and not INTERPRET:
        split = max(1, min(-(-2 * _sms(dev) // mt), kd // (bk * 4)))
    elif INTERPRET and T < 32:
        split = 2  # the split path is covered by the interpreter tests too
    k_per = -(-kd // (split * bk)) * bk
    split = -(-kd // k_per)
    npad = 32
    m = torch.empty(split, T, npad, dtype=torch.float32, device=dev)
    sq = torch.empty(split, T, dtype=torch.float32, device=dev)
    mhc_jit.mhc_proj[(mt, split)](
        h, fnc, m, sq, T, kd, k_per, kd, fnc.stride(0), NM=(2 + n) * n, NPAD=npad,
        SPLIT_BF16=h.dtype == torch.bfloat16 and not INTERPRET, BM=bm, BK=bk,
        num_warps=4, num_stages=3)
    if split > 1:
        m, sq = reduce_partials(m, sq)
    else:
        m, sq = m[0], sq[0]
    bmf = 1 if T < 4 * _sms(dev) else 4
    mixc = mix.float().contiguous() if mix is not None else pre
    nw = norm_weight.contiguous() if norm_weight is not None else pre
    mhc_jit.mhc_finish[(-(-T // bmf),)](
        m, sq, base.float().contiguous(), scale.float().contiguous(), h, mixc, nw, x, xq, xs,
        pre, post, comb, T, d, float(eps), float(hc_eps), float(norm_eps), kd, x.stride(0),
        xq.stride(0), xs.stride(0), HC=n, NPAD=npad, ITERS=int(sinkhorn_iters),
        HAS_MIX=mix is not None, HAS_NW=norm_weight is not None, E8M0=e8, QB=qb, BM=bmf,
        RDT=RDT[streams.dtype], MANUAL=INTERPRET, num_warps=4)
    return x, xq, (xs.view(torch.float8_e8m0fnu) if e8 else xs), pre, post, comb


mega_mhc.capturable = True


def reduce_partials(part: Tensor, sqp: Tensor) -> tuple[Tensor, Tensor]:
    """([S, T, NPAD], [S, T]) f32 partial sums -> their sums over S, added in the order s = 0..S-1
    (mhc_jit.mhc_reduce; fixed, unlike the atomic adds it replaced)."""
    from . import mhc_jit

    S, T, npad = part.shape
    m = torch.empty(T, npad, dtype=torch.float32, device=part.device)
    sq = torch.empty(T, dtype=torch.float32, device=part.device)
    bm = 16
    mhc_jit.mhc_reduce[(-(-T // bm),)](part, sqp, m, sq, T, S, NPAD=npad, BM=bm, num_warps=4)
    return m, sq


__all__ = ["mega_mhc", "supports"]
