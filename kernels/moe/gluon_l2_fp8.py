"""The PREFILL routed-expert L2 (the down projection) on FP8 H, Y = row_w x (H W2^T), run by the
warp-specialized L1 kernel (moe_gluon_ws.l1_ws_kernel with EPI 2, "DOWN").

Why: at 8192 tokens the fp16-H L2 (moe_gluon_l2_ws: fp16 wgmma on W2 upcast to exact fp16) took
2.40 ms of the 6.65 ms MegaMoE layer on the H200 (ncu) - half the L1's FLOPs
at 77% of its time, because the fp16 tensor cores run at half the FP8 rate. DeepSeek's own
serving path quantizes H to FP8 before the down projection (the fp8 x fp4 MegaMoE, sglang's
silu_and_mul post-quant; the DeepGEMM grouped FP8 baseline of issue #7 too): with H in E4M3 the
L2 is the L1's GEMM - E4M3 A x MXFP4 weights upcast to E4M3, fp32 partials per 128 columns
promoted by A's scales - and the L1's kernel, with everything tuned for it (row frames, A in
registers, the loader's upcast share), runs it:

- A = the expert-sorted H itself (E4M3 [P, F], its rows are the L1's output rows: no gather, no
  copy), by TMA; its scales [P, F / 128] by sorted row.
- a tile is 128 rows x 256 output columns: "W1" = W2 rows n0 .. n0 + 127, "W3" = rows n0 + 128
  .. n0 + 255 of the same bank (one TMA descriptor; the exponent and frame pointers of "W3" are
  offset by 128 rows here), so each A chunk feeds 256 wgmma columns as in the L1.
- the epilogue multiplies by the pair's combine weight and scatters to y's (token, slot) rows as
  moe_gluon_l2 does (acc x 2^(S - 127) x row_w).

H comes from l1_gluon_ws(out_scale=...): H quantized per row and 128 columns with the numerics of
quantize_act fp8_1x128 (power-of-two scales, codes rounded to E4M3 nearest-even) - the same
quantization the Triton FP8-H path (MoeConfig.fp8_h, moe_jit.quantize_out) and the reference
(kernels.moe.reference.moe_experts(h_fmt="fp8_1x128")) use.

Numerics: per (row, output column) the sum over 128-column chunks of the tensor core's fp32
partial of E4M3 H codes x E4M3 weight codes (exact products; the partial's accumulation is the
tensor core's), times H's chunk scale, then the weight row's power-of-two frame and the combine
weight - the same math as the Triton FP8-H L2 (moe_jit, role l2_fp8h), not its bits (other
wgmma shapes and sum order).
"""
from __future__ import annotations

import torch

from megagraph.kernels.moe import gluon_ws as mw
from megagraph.kernels.moe.gluon_common import tile_list

available = mw.available
BM = mw.BM
BN = mw.BN_WIDE  # "W1" / "W3" rows of a tile: 2 BN = 256 output columns
COLS = 2 * BN
BK = mw.BK
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def down_frames(w2) -> torch.Tensor | None:
    """W2's row frames over all of K (moe_gluon_ws.frames_of), cached per weight (built once at
    warm-up, None on a miss inside a CUDA-graph capture and where a row's exponents span more
    than FRAME_SPAN binades: the kernel then takes per-chunk frames, the same bits)."""
    from megagraph.kernels.gemm import cublas_fp8

    if not w2.s.is_cuda:
        return None

    def build(pairs):
        f = mw.frames_of(pairs[0][1])
        return () if f is None else (f,)

    got = cublas_fp8.derived(((w2.w, w2.s),), "l2_fp8_frames", build)
    return got[0] if got else None


def args_problem(h, h_scale, w2, y, P: int | None = None) -> str | None:
    """Why l2_gluon_ws_fp8 cannot take these arguments, or None (its launcher raises it;
    moe._l2_kernel asks first and falls back to the Triton FP8-H L2): an MXFP4 W2 whose expert
    rows are one TMA stream, d % 256 and F % 128, FP8 H (moe_gluon_ws._fp8_h_problem), y rows
    contiguous in one of OUT_DTYPES."""
    from megagraph.kernels.moe.gluon_decode import _tma_fits

    if not (w2.wfmt == 0 and w2.bk == 32 and w2.bn == 1):
        return "l2_gluon_ws_fp8 takes an MXFP4 bank (E8M0 per 32 columns)"
    N, K = w2.n, w2.k
    if N % COLS or K % BK:
        return f"N {N} / K {K} do not fit the {COLS}-column tile / {BK}-column chunk"
    if not _tma_fits(w2):
        return "the W2 TMA stream needs expert rows one stride apart, G N < 2^31"
    problem = mw._fp8_h_problem(h, h_scale, h.shape[0] if P is None else P, K)
    if problem:
        return problem
    if y.dim() != 2 or y.shape[1] != N or y.stride(1) != 1 or y.dtype not in OUT_DTYPES:
        return f"y [rows, {N}] with contiguous rows in one of {OUT_DTYPES}"
    return None


def l2_gluon_ws_fp8(h, h_scale, w2, counts, srt, row_w, y, *, topk: int, ks: int,
                    max_tiles: int, tiles: torch.Tensor | None = None,
                    frames: torch.Tensor | None | bool = True, stages: int | None = None,
                    bstages: int | None = None, lup: bool | None = None,
                    areg: bool | None = None, ctas: int | None = None,
                    use_asm: bool | None = None) -> torch.Tensor:
    """y[(p // topk) ks + p % topk, :] = row_w[p] x (H[r] W2_e^T) for every expert-sorted row r of
    expert e (p = srt[r]); h [>= P, F] E4M3 and h_scale [>= P, F / 128] f32 from
    l1_gluon_ws(out_scale=...); w2 an MXFP4 moe.Bank [E, d, F / 2]; counts [E] int32; row_w [P]
    f32; y [T ks, d] (rows not routed here are left as they are). max_tiles / tiles as
    l1_gluon_ws. frames: True = down_frames(w2) where it applies (else per-chunk frames), False
    = per-chunk frames, or the [E, d] int32 frames themselves; stages / bstages / lup / areg /
    use_asm: moe_gluon_ws.kernel_consts'; ctas: the persistent grid instead of the SM count."""
    from megagraph.kernels.moe.gluon_common import TensorDescriptor
    from megagraph.kernels.moe.gluon_decode import _weight_desc

    if not mw._IMPORT_OK:
        raise RuntimeError("l2_gluon_ws_fp8 needs Triton 3.6 Gluon")
    P = srt.numel()
    problem = args_problem(h, h_scale, w2, y, P)
    if problem:
        raise ValueError(problem)
    if row_w.numel() < P or row_w.dtype != torch.float32 or not row_w.is_contiguous():
        raise ValueError(f"row_w: f32 [{P}] contiguous, got {row_w.dtype} {tuple(row_w.shape)}")
    if y.shape[0] < -(-P // topk) * ks - (ks - topk):
        raise ValueError(f"y has {y.shape[0]} rows for {P} pairs of top-{topk} in {ks} slots")
    N, K, G = w2.n, w2.k, counts.numel()
    if frames is True:
        frames = down_frames(w2)
    elif frames is False:
        frames = None
    mw._check_frames(None if frames is None else (frames,), G, N, y.device)
    if max_tiles == 0 or P == 0:
        return y
    tiles = tile_list(counts, BM, max_tiles, tiles)
    consts = mw.kernel_consts(topk=topk, has_limit=False,
                              use_asm=True if use_asm is None else bool(use_asm), stages=stages,
                              bstages=bstages, persist=True, a_tma=True, bn=BN,
                              frames=frames is not None, areg=areg, lup=lup, epi=2)
    grid = (min(max_tiles * (N // COLS), int(ctas) if ctas else mw.sm_count(y.device)),)
    w_desc = _weight_desc(w2, BN)
    a_desc = TensorDescriptor(h, [P, K], [h.stride(0), 1], [BM, BK], mw.A_TMA_LAYOUT)
    # "W3" = the 128 rows after "W1"'s: its exponents and frames one BN-row offset on
    f = (frames, frames.view(-1)[BN:]) if frames is not None else (counts, counts)
    mw.l1_ws_kernel[grid](
        h, a_desc, h_scale, srt, w_desc, w2.s, w_desc, w2.s[:, BN:], y, tiles, *f, row_w,
        *(w_desc,) * 5, max_tiles, N, K, G, P, 0.0, h.stride(0), h_scale.stride(0), w2.s.stride(0),
        w2.s.stride(1), y.stride(0), ks, **consts,
        num_warps=mw.NUM_WARPS, maxnreg=mw.launch_maxnreg(consts))
    return y
