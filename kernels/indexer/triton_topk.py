"""The sparse-attention indexer's top-k selection and two-level candidate mask on the GPU
(Triton): kernels.indexer.reference.topk_select / candidate_mask, bitwise.

Design (kernels/indexer/triton_topk_jit.py, docs/kernels/indexer.md): scores become
order-preserving uint32 keys (-0.0 as +0.0; unselectable entries - masked out, -inf, past C - as
key 0, below every selectable key). Each program streams its segment of a row once, appending the
entries above a running threshold to a small buffer of candidates kept in column order; when the
buffer cannot take another step, an exact 8-bit radix select over it keeps its KK largest (KK =
min(k, C)) and raises the threshold. Rows are cut into segments when the rows alone cannot fill
the GPU (decode); a merge kernel per row then selects over its segments' buffers and writes the
output in ascending column order, then -1 up to k. candidate_mask runs the same select over the
row's block maxima and writes the [T, C] mask in a third kernel.

Exactness: integer output, bitwise the reference's by construction: the keys order the scores
exactly as fp32 comparisons do, the selects are exact integer counts, and the tie rule is the
reference's (the lowest columns at the k-th value). bf16 / fp16 scores are widened to fp32
(exact, the reference's `.float()`). NaN scores are outside the contract (never selected here).

No host synchronization; the output shape and the scratch (buffers, counts) follow from the
arguments' shapes: CUDA-graph capturable. The capturable kernel (the reference's code) serves
CPU tensors outside the Triton interpreter, scores other than 2-D fp32 / bf16 / fp16, masks that
are not bool, on another device or of more than 2 dims (a [C] or [1, C] mask is broadcast over
the rows), k <= 0, empty inputs, block <= 0 or topk_blocks <= 0, and what the stream select does
not take (IndexerConfig.choose: more than stream_max_k kept entries, rows near 2^31 columns).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device
from megagraph.kernels.indexer.config import IndexerConfig

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_K = 512  # output slots per step of the -1 padding loop
WARPS = 4


def topk_select(scores: Tensor, mask: Tensor | None = None, *, k: int,
                kernel_config: IndexerConfig | None = None) -> Tensor:
    """kernels.indexer.reference.topk_select: i64[T, k], per row the columns of the top min(k, C)
    scores (mask False / -inf never selected, ties at the k-th value toward the lower column) in
    ascending order, then -1. NaN scores: outside the contract."""
    cfg = kernel_config or IndexerConfig()
    ok = (available() and _on_device(scores) and scores.dim() == 2 and scores.dtype in DTYPES
          and k > 0 and scores.shape[0] > 0 and scores.shape[1] > 0
          and (mask is None or (mask.dtype == torch.bool and mask.device == scores.device
                                and mask.dim() <= 2))
          and cfg.choose({"k": k, "columns": scores.shape[1]})["topk_select"] == "stream")
    if not ok:
        from megagraph.kernels.indexer.capturable import topk_select as fallback

        return fallback(scores, mask, k=k)
    T, C = scores.shape
    s = scores if scores.stride(-1) == 1 else scores.contiguous()
    m = None
    if mask is not None:
        m = mask.expand(T, C)  # a broadcast mask keeps its zero strides (no copy)
        if m.stride(-1) != 1:
            m = m.contiguous()
        m = m.view(torch.uint8)
    out = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    _topk_stream(s, m, out, k, cfg)
    return out


topk_select.capturable = True


def candidate_mask(scores: Tensor, *, block: int, topk_blocks: int,
                   kernel_config: IndexerConfig | None = None) -> Tensor:
    """kernels.indexer.reference.candidate_mask: bool[T, C], entry c kept if its block of `block`
    entries is among the top min(topk_blocks, n_blocks) by block max (the block of entry
    n_visible - 1 forced to +inf, blocks without a visible entry never kept, ties toward the
    older block) and its score is > -inf. NaN: outside the contract.

    Why a kernel: the reference pads, reduces, scatters, runs torch.topk and a cumulative sum
    over the [T, n_blocks] block scores, then expands to [T, C] (7.4 ms at 8192 x 34816, blocks
    of 8, 2048 kept, on the H200). Integer output: bitwise the reference, by topk_select's
    argument."""
    cfg = kernel_config or IndexerConfig()
    ok = (available() and _on_device(scores) and scores.dim() == 2 and scores.dtype in DTYPES
          and block > 0 and topk_blocks > 0 and scores.shape[0] > 0 and scores.shape[1] > 0
          and cfg.choose({"topk_blocks": topk_blocks, "block": block,
                          "columns": scores.shape[1]})["candidate_mask"] == "stream")
    if not ok:
        from megagraph.kernels.indexer.capturable import candidate_mask as fallback

        return fallback(scores, block=block, topk_blocks=topk_blocks)
    import triton

    T, C = scores.shape
    s = scores if scores.stride(-1) == 1 else scores.contiguous()
    nb = triton.cdiv(C, block)
    out = torch.empty(T, C, dtype=torch.uint8, device=scores.device)  # (bytes 0 / 1)
    _cand_stream(s, out, block, min(topk_blocks, nb), cfg)
    return out.view(torch.bool)


candidate_mask.capturable = True


def _stream_cap(kk: int, step: int, cfg: IndexerConfig) -> tuple[int, int]:
    """(buffer entries per program, tightening slack). A tightened buffer holds <= kk + slack
    entries and one step appends <= step: cap >= kk + slack + step, so one tightening always
    makes room (the buffer never overflows, whatever the data). slack: a quarter of the spare
    room (a tightening may stop at a digit whose bin overshoots kk by that much)."""
    cap = max(cfg.stream_cap, kk + step)
    return cap, (cap - kk - step) // 4


def _segments(T: int, C: int, length: int, unit: int, dev: torch.device,
              cfg: IndexerConfig) -> tuple[int, int]:
    """(S, units per segment) for `length` items of a row in steps of `unit` (topk_segments, or:
    one segment unless the rows alone give fewer than 4 programs per SM, then as many as bring
    them there with segments of >= stream_seg_min columns)."""
    import triton

    from megagraph.kernels.common.triton import sm_count

    if cfg.topk_segments > 0:
        S = cfg.topk_segments
    else:
        S = max(1, min(triton.cdiv(4 * sm_count(dev), T), C // cfg.stream_seg_min))
    seg = triton.cdiv(triton.cdiv(length, S), unit) * unit
    return triton.cdiv(length, seg), seg


def _warps() -> int:
    return 1 if INTERPRET else WARPS


def _topk_stream(s: Tensor, m: Tensor | None, out: Tensor, k: int, cfg: IndexerConfig) -> None:
    """topk_select: topk_stream_rows over (T, S) row segments, each leaving its
    segment's KK largest in a buffer, then topk_merge_rows writing `out` from them (S == 1: a
    copy). Scratch: buffers i64[T * S * cap] and counts i32[T * S], from the shapes (nothing
    initialized: every slot read is written first)."""
    from megagraph.kernels.indexer.triton_topk_jit import topk_merge_rows, topk_stream_rows

    T, C = s.shape
    kk = min(k, C)
    S, seg = _segments(T, C, C, cfg.stream_block, s.device, cfg)
    cap, slack = _stream_cap(kk, cfg.stream_block, cfg)
    buf = torch.empty(T * S * cap, dtype=torch.int64, device=s.device)
    cnt = torch.empty(T * S, dtype=torch.int32, device=s.device)
    topk_stream_rows[(T, S)](
        s, m if m is not None else s, buf, cnt, C, kk, S, seg, cap, slack, s.stride(0),
        m.stride(0) if m is not None else 0, HAS_MASK=m is not None,
        MASKED_LOADS=m is not None and cfg.stream_masked_loads, BLOCK=cfg.stream_block,
        TB=cfg.stream_tb,
        num_warps=_warps())
    topk_merge_rows[(T,)](out, buf, cnt, k, kk, S, cap, out.stride(0), TB=cfg.stream_merge_tb,
                          BLOCK_K=BLOCK_K, num_warps=_warps())


def _cand_stream(s: Tensor, out: Tensor, block: int, kb: int, cfg: IndexerConfig) -> None:
    """candidate_mask: cand_stream_rows over (T, S) segments of block keys, each
    leaving its segment's KB largest blocks, cand_merge_rows selecting the row's (the forced block
    applied), then cand_write_rows writes every entry of `out` (u8 [T, C]) from the rows'
    selections (par: i64[T, 4]). The block size is a constexpr (aligned block loads)."""
    import triton

    from megagraph.kernels.indexer.triton_topk_jit import (cand_merge_rows, cand_stream_rows,
                                                           cand_write_rows)

    T, C = s.shape
    nb = triton.cdiv(C, block)
    blk = triton.next_power_of_2(block)
    nbb = max(1, cfg.cand_stream_elems // blk)
    S, segb = _segments(T, C, nb, nbb, s.device, cfg)
    cap, slack = _stream_cap(kb, nbb, cfg)
    dev = s.device
    buf = torch.empty(T * S * cap, dtype=torch.int64, device=dev)
    cnt = torch.empty(T * S, dtype=torch.int32, device=dev)
    nv = torch.empty(T * S, dtype=torch.int32, device=dev)
    par = torch.empty(T * 4, dtype=torch.int64, device=dev)
    cand_stream_rows[(T, S)](s, buf, cnt, nv, C, kb, S, segb, cap, slack, s.stride(0), BS=block,
                             BLK=blk, NBB=nbb, TB=cfg.stream_tb, num_warps=_warps())
    cand_merge_rows[(T,)](buf, cnt, nv, par, kb, S, cap, BS=block, TB=cfg.cand_merge_tb,
                          num_warps=_warps())
    wnbb = max(1, cfg.cand_write_elems // blk)
    cand_write_rows[(T, triton.cdiv(nb, wnbb))](s, par, out, C, s.stride(0), out.stride(0),
                                                BS=block, BLK=blk, NBB=wnbb, num_warps=_warps())
