"""The fused V4.1 compressor on the GPU (Triton): kernels.fused.reference.compressor in three
launches, no host synchronization.

1. proj_gemm: u = x @ wkv^T (and s = x @ wgate^T for ratio > 1) into one fp32 [T, Dc(+Dc)]
   buffer (bf16 tensor-core products, fp32 accumulation: the reference's fp32 GEMM of bf16 values
   up to summation order).
2. compress_rows: per token that completes a group, the softmax-gated pool over the group's rows
   (this step's projections, or the slot's pending rows for members before the step), RMSNorm,
   the compressed-KV row (RoPE at the group's first position, fake quantization, cast to the
   cache dtype) and the index key (latent @ wk^T, k_norm, RoPE, fake quantization), written into
   the caches at entry (p+1)//ratio - 1.
3. pending_write (ratio > 1): each request's trailing incomplete group into the pending rows -
   after step 2 has read the old ones.
With inplace=True the caches and pending rows are updated in place and returned (what a CUDA-graph
runtime with static state wants); otherwise they are copied first.

Numerics: fp32 everywhere after the GEMM; the index-key product runs as tf32x3 (fp32-accurate).
Differences to the reference come from summation order and rsqrt/exp rounding (~1e-6 relative),
which can move a value across a fake-quantization rounding boundary: such an element differs by
one quantization step (E2M1: up to 2x the block scale), in a small fraction of rows (the tests
bound both).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.attention.triton import rope_freqs
from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device

FMT_CODES = {"none": (0, 32), "fp8_e4m3": (1, 32), "mxfp4": (2, 32), "nvfp4": (3, 16)}
ROW_TILE = 16
CHUNK = 32  # channels per step of the pooled-row loops (64 spills on sm_90)


def supports(x: Tensor, wkv: Tensor, wk: Tensor, ratio: int, rope_dim: int) -> bool:
    dc, di = wkv.shape[0], wk.shape[0]
    return (available() and _on_device(x) and ratio >= 1 and dc % CHUNK == 0
            and di >= 16 and di & (di - 1) == 0 and rope_dim % 2 == 0 and rope_dim <= di
            and rope_dim <= dc)


def compressor(x, wkv, wgate, pend_kv, pend_gate, norm_weight, wk, k_norm_weight, ikey, ckv,
               positions, token_req, seq_slots, *, ratio, eps, rope_dim, theta, yarn_factor,
               yarn_original, yarn_beta_fast, yarn_beta_slow, offset, ikey_fmt, ckv_fmt,
               inplace: bool = False):
    rope = dict(rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                yarn_beta_slow=yarn_beta_slow)
    if not supports(x, wkv, wk, ratio, rope_dim):
        from megagraph.kernels.fused.capturable import compressor as fallback

        return fallback(x, wkv, wgate, pend_kv, pend_gate, norm_weight, wk, k_norm_weight, ikey,
                        ckv, positions, token_req, seq_slots, ratio=ratio, eps=eps, offset=offset,
                        ikey_fmt=ikey_fmt, ckv_fmt=ckv_fmt, inplace=inplace, **rope)
    import triton

    from megagraph.kernels.common.capturable import first_last_positions

    from megagraph.kernels.state.triton_compressor_jit import compress_rows, pending_write, proj_gemm

    T, dm = x.shape
    dc, di = wkv.shape[0], wk.shape[0]
    dev = x.device
    if not inplace:
        ikey, ckv = ikey.clone(), ckv.clone()
        if ratio > 1:
            pend_kv, pend_gate = pend_kv.clone(), pend_gate.clone()
    out = (ikey, ckv, pend_kv, pend_gate) if ratio > 1 else (ikey, ckv)
    if T == 0:
        return out
    R = seq_slots.shape[0]
    first, last = first_last_positions(positions, token_req, R)

    # 1. projections
    nproj = 2 if ratio > 1 else 1
    proj = torch.empty(T, nproj * dc, dtype=torch.float32, device=dev)
    x = x if x.stride(-1) == 1 else x.contiguous()
    # tiles without register spills in the sm_90 build (cuobjdump resource usage)
    bm, bn, bk, warps = (64, 128, 64, 8) if T >= 64 else (16, 64, 64, 4)
    for i, w in enumerate((wkv, wgate)[:nproj]):
        w = w if w.stride(-1) == 1 else w.contiguous()
        dot_f32 = INTERPRET or not (x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16))
        proj_gemm[(triton.cdiv(T, bm), triton.cdiv(dc, bn))](
            x, w, proj[:, i * dc:], T, dc, dm, x.stride(0), w.stride(0), proj.stride(0),
            BM=bm, BN=bn, BK=bk, DOT_F32=dot_f32, num_warps=warps, num_stages=3)

    # 2. pooled rows -> caches
    ik_fmt, ik_block = FMT_CODES[ikey_fmt]
    ckv_fmt_c, ckv_block = FMT_CODES[ckv_fmt]
    pk = pend_kv if ratio > 1 else proj
    pg = pend_gate if ratio > 1 else proj
    freqs = rope_freqs(dev, **rope)
    wk_c = wk if wk.stride(-1) == 1 else wk.contiguous()
    compress_rows[(triton.cdiv(T, ROW_TILE),)](
        proj, pk, pg, norm_weight, wk_c, k_norm_weight, freqs, ikey, ckv,
        positions, token_req, seq_slots, first,
        T, float(eps), int(offset), proj.stride(0), pk.stride(0), pk.stride(1), wk_c.stride(0),
        ikey.stride(0), ikey.stride(1), ckv.stride(0), ckv.stride(1),
        DC=dc, DI=di, RATIO=ratio, ROPE_DIM=rope_dim, BT=ROW_TILE, CK=CHUNK,
        IK_FMT=ik_fmt, IK_BLOCK=ik_block, CKV_FMT=ckv_fmt_c, CKV_BLOCK=ckv_block,
        MANUAL_FP8=INTERPRET, PREC="ieee" if INTERPRET else "tf32x3", num_warps=8)

    # 3. pending rows of incomplete groups
    if ratio > 1:
        pending_write[(T,)](proj, pend_kv, pend_gate, positions, token_req, seq_slots, last,
                            proj.stride(0), pend_kv.stride(0), pend_kv.stride(1),
                            DC=dc, RATIO=ratio, BD=CHUNK, num_warps=2)
    return out


compressor.capturable = True

__all__ = ["compressor", "supports"]
