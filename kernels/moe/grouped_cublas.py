"""The routed experts' first GEMM at prefill sizes on cuBLAS: MXFP4 W1 / W3 upcast to E4M3 with
one scale per row, then torch's rowwise-scaled grouped FP8 GEMM (``scaled_grouped_mm``), then
the SwiGLU (moe_jit.swiglu_rows) into routed_experts' fp16 H. The second GEMM stays the Triton
L2 (it keeps H in fp16: cuBLAS's grouped FP8 GEMM would need E4M3 H, ~3% on the output).

Why: at 8192 tokens (128 rows per expert) the Triton / Gluon L1 runs at ~220 TFLOP/s (10.6 ms on
the H200), while cuBLAS's grouped FP8 GEMM ran the same shape at 700 TFLOP/s (3.3 ms,
benchmarks/results/scaled-mm-probe-h200.md) - on FP8 weights. The experts are MXFP4 and an FP8
copy of them does not fit next to the model (kernels.md), so each call upcasts the touched
experts' W1 / W3 into a scratch buffer first: reading 4.5 GB of FP4 and writing 9.1 GB of FP8
at 384 experts, ~3.3 ms at HBM speed. Prefill only (many rows per expert amortize the upcast);
decode keeps the Gluon kernels.

Numerics. Weights: element E2M1(c) * 2^(e_g - 127) of group g becomes E4M3(E2M1(c) * 2^(e_g - S))
with the row's S = max_g e_g - 6 (headroom: 6 * 2^6 = 384 <= 448) and row scale 2^(S - 127),
through the upcast the Triton / Gluon GEMMs use (exact for e_g - S >= -5; groups further below,
12+ binades under the row's largest, become zero: |error| < 2^-5 * 2^(S - 127), the same rule
the GEMMs apply per K chunk). Activations: x_q (E4M3, power-of-two scales per 128 columns) becomes E4M3 with one
scale per row (the row's largest), the same rule. The GEMM accumulates in fp32 and rounds W1 x,
W3 x to bf16 before the SwiGLU (DeepGEMM's MegaMoE does the same).

Capturable: no host sync (group offsets = cumsum of the device counts); the scratch buffers are
allocated per call (CUDA graphs: from the graph's pool, reused by every layer of the graph).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# From this many rows per expert on (exclusive) the per-call upcast pays: H200, mega_moe with the
# Gluon prefill L2, one run (benchmarks/results/moe-ab-9-h200.md): 14.56 vs 15.78 ms with the
# Triton L1 at 128 rows per expert, 11.54 vs 9.63 ms at 64; crossover ~100 by interpolation
MIN_ROWS_PER_EXPERT = 100
BN, BK = 32, 256  # upcast tile: rows x columns per step
BR, BD = 32, 128  # activation requant tile: rows x columns per step (4 KB in flight)


def _kernels():
    from megagraph.kernels.moe import grouped_cublas_jit as j

    return j.mxfp4_rows_e4m3, j.gather_rows_e4m3


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def upcast_rows(w, counts: Tensor, out: Tensor, out_scale: Tensor) -> None:
    """MXFP4 bank w (moe.Bank: [G, N, K/2] bytes, E8M0 [G, N, K/32]) -> E4M3 out [G, N, K]
    (a view may be strided over G) and fp32 row scales out_scale [G, N], for experts with a
    nonzero count (the others' rows are left as they were: no sorted row reads them)."""
    up, _ = _kernels()
    G, N, K = w.groups, w.n, w.k
    from megagraph.kernels.moe import triton as moe

    up[(G, -(-N // BN))](w.w, w.s, counts, out, out_scale, N, K, w.w.stride(0), w.w.stride(1),
                         w.s.stride(0), w.s.stride(1), out.stride(0), out.stride(1),
                         out_scale.stride(0), NG=_next_pow2(K // 32), BN=BN, BK=BK,
                         USE_ASM=moe.asm_ok(out.device), num_warps=4)


def gather_rows(x_q: Tensor, x_scale: Tensor, srt: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """(A' e4m3 [P, d], scale f32 [P]): the expert-sorted rows of x_q with one scale per row."""
    _, gather = _kernels()
    P, D = srt.numel(), x_q.shape[1]
    a = torch.empty(P, D, dtype=torch.float8_e4m3fn, device=x_q.device)
    sa = torch.empty(P, dtype=torch.float32, device=x_q.device)
    gather[(-(-P // BR),)](x_q, x_scale, srt, a, sa, P, D, x_q.stride(0), x_scale.stride(0),
                           a.stride(0), TOPK=topk, NB=_next_pow2(D // BD), BR=BR, BD=BD,
                           num_warps=4)
    return a, sa


def grouped_l1(a: Tensor, sa: Tensor, wq: Tensor, ws: Tensor, counts: Tensor) -> Tensor:
    """bf16 [P, N] = per expert g: A'[rows of g] (x) diag(sa) @ (wq[g] diag(ws[g]))^T, the rows
    of expert g being the g-th run of counts (cuBLAS rowwise-scaled grouped FP8 GEMM)."""
    F = torch.nn.functional
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return F.scaled_grouped_mm(a, wq.transpose(-2, -1), sa, F.ScalingType.RowWise, ws,
                               F.ScalingType.RowWise, offs=offs, output_dtype=torch.bfloat16)


@functools.cache
def supported(index: int) -> bool:
    """Whether the whole chain (upcast, gather, grouped GEMM) matches fp32 math on CUDA device
    ``index`` for a small case with empty and odd-sized experts (checked once per device)."""
    if not torch.cuda.is_available():
        return False
    if not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        return False
    try:
        err = _check(torch.device("cuda", index))
    except Exception as e:  # noqa: BLE001  (this torch / cuBLAS / GPU rejects the call)
        log.info("moe_grouped_cublas: not used on cuda:%d: %s", index, e)
        return False
    if err >= 1e-2:
        log.warning("moe_grouped_cublas: rel. err %.2e on cuda:%d; not used", err, index)
    return err < 1e-2


def _check(dev) -> float:
    from megagraph.kernels import formats
    from megagraph.kernels.fused import reference as rf

    from megagraph.kernels.moe import triton as moe

    g = torch.Generator(device=dev).manual_seed(3)
    E, N, K, T, k = 4, 64, 256, 37, 2
    w = torch.randn(E * N, K, device=dev, generator=g)
    wq, wsc = formats.quantize_mxfp4(w)
    wq, wsc = wq.view(E, N, K // 2), wsc.view(E, N, K // 32)
    x = torch.randn(T, K, device=dev, generator=g)
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    ids = torch.randint(0, E - 1, (T, k), device=dev, generator=g)  # expert E-1 stays empty
    counts = torch.bincount(ids.reshape(-1), minlength=E).to(torch.int32)
    srt = moe.permute(ids.reshape(-1).to(torch.int32), counts, E)
    b = moe.bank(wq, wsc, "mxfp4")
    out = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=dev)
    osc = torch.empty(E, N, dtype=torch.float32, device=dev)
    upcast_rows(b, counts, out, osc)
    a, sa = gather_rows(xq, xs, srt, k)
    y = grouped_l1(a, sa, out, osc, counts).float()
    wf = formats.unpack_mxfp4(wq, wsc)
    xf = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")
    eid = ids.reshape(-1)[srt.long()]
    want = torch.einsum("pk,pnk->pn", xf[srt.long() // k], wf[eid])
    return float((y - want).norm() / want.norm())


def l1_swiglu(x_q: Tensor, x_scale: Tensor, srt: Tensor, w1, w3, counts: Tensor, h: Tensor, *,
              topk: int, limit: float | None) -> None:
    """routed_experts' L1 into h [P, F] (fp16): upcast W1 / W3 of the touched experts, gather
    and requantize the sorted activation rows, one grouped FP8 GEMM on [W1; W3], SwiGLU."""
    from megagraph.kernels.moe import triton as moe

    G, F, K = w1.groups, w1.n, w1.k
    wq = torch.empty(G, 2 * F, K, dtype=torch.float8_e4m3fn, device=x_q.device)
    ws = torch.empty(G, 2 * F, dtype=torch.float32, device=x_q.device)
    upcast_rows(w1, counts, wq[:, :F], ws[:, :F])
    upcast_rows(w3, counts, wq[:, F:], ws[:, F:])
    a, sa = gather_rows(x_q, x_scale, srt, topk)
    y13 = grouped_l1(a, sa, wq, ws, counts)
    del wq
    P = srt.numel()
    bf = 1024
    moe._jit().swiglu_rows[(P, -(-F // bf))](
        y13, h, F, float(limit or 0.0), y13.stride(0), h.stride(0),
        HAS_LIMIT=limit is not None and limit > 0, BF=bf, num_warps=4)


def applies(x_q: Tensor, w1, w3, h: Tensor, rows_per_group: float,
            min_rows: int = MIN_ROWS_PER_EXPERT) -> bool:
    """routed_experts' L1 goes here: prefill sizes, fp16 H, E4M3 activations, MXFP4 banks with
    one E8M0 per 32 columns, K a multiple of BK, on a device where supported() passed."""
    from megagraph.kernels.moe import triton as moe

    if rows_per_group <= min_rows or moe.INTERPRET:
        return False
    if x_q.dtype != torch.float8_e4m3fn or h.dtype != torch.float16 or not moe.on_device(x_q):
        return False
    if not moe._mxfp4_e8m0_32(w1, w3) or w1.k % BK or w1.k % 128:
        return False
    return supported(x_q.device.index or 0)
