"""The sparse-attention indexer's top-k selection on the GPU (Triton): kernels.reference.indexer
.topk_select in one launch, one program per row (and the two-level candidate_mask, below).

Why: on the H200, a prefill step of the 5-layer V4.1-Flash slice at 8192 tokens spent 188 ms of
462 ms (41%) in topk_select (benchmarks/results/h200-prefill-8.md, "Top ops"): the reference (also
the capturable kernel) runs torch.topk, an int32 cumulative sum over the whole [T, C] score matrix
(up to ~35K compressed entries per token), a batched searchsorted and a sort, for top-512 rows.

Design (kernels/triton/topk_jit.py): scores become order-preserving uint32 keys (-0.0 as +0.0,
unselectable entries - masked out, -inf, columns past C - as key 0, below every selectable key).
Four radix-select passes of 8-bit digit histograms (tl.histogram, 256 bins) over the row find the
KK-th largest key (KK = min(k, C)) and how many entries equal to it are needed; a fifth pass in
column order writes the selected columns to consecutive slots (running count + in-block cumsum),
then -1 up to k. Each pass re-reads the row from global memory (L2-resident for the rows in
flight); BLOCK columns per step, NUM_WARPS warps.

Exactness: the output is integer, so it must be bitwise the reference's, and it is by
construction, not by tolerance: the keys order the scores exactly as fp32 comparisons do (-0.0 ==
+0.0 folded), the radix select is an exact integer count, and the selection it yields is the
reference's set - every selectable entry when there are at most KK of them (the reference drops
its -inf picks), else the entries above the KK-th value plus the lowest-column entries equal to it
- written in ascending column order, as the reference's final sort leaves them. bf16 / fp16 scores
are widened to fp32 (exact, the reference's `.float()`). NaN scores are outside the contract (here
never selected; torch.topk ranks NaN above everything).

No host synchronization, output shape [T, k] from the arguments' shapes: CUDA-graph capturable.
The capturable kernel (the reference's code) serves: CPU tensors outside the Triton interpreter,
scores other than 2-D fp32 / bf16 / fp16, masks that are not bool, on another device or of more
than 2 dims (a [C] or [1, C] mask is broadcast over the rows, as the reference's masked_fill),
k <= 0, and empty inputs (T == 0 or C == 0).
Registry status "available" on sm_90 (both ops) since tests/kernels/test_triton_topk.py passed on
the H200 (93 cases, tenth session). Measured there (benchmarks/topk_probe.py, one call):
topk_select 5.55 ms against the capturable kernel's 8.30 at 8192 x 34816 (top-512), 0.094 vs
0.788 ms at 64 x 8192; candidate_mask (blocks of 8, top-2048 blocks) 7.0 vs 7.4 and 0.13 vs 0.69
ms. The prefill step of the 5-layer slice: 407.5 -> 387.8 ms at 8192 tokens, 217.2 -> 202.5 ms
at 4096 (benchmarks/results/h200-prefill-10-base.md, -topk.json); the decode step did not move (14.04 vs 14.02
ms at B = 64). The 188 ms above was the eager split's attribution (CUDA events around each node,
with launch gaps), not the graph step's.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .attention import INTERPRET, _on_device, available

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024  # columns per step of a pass (8 per thread at 4 warps)
# topk_select's radix digit: 8 bits by tl.histogram or 4 bits counted by comparison
# (topk_jit.topk_select_rows). 8 on the H200 (benchmarks/topk_probe.py, tenth session, one call):
# 5.55 ms at 8192 x 34816 (top-512) against 14.62 ms at 4 bits and 8.30 ms for the capturable
# torch kernel; 0.094 / 0.181 / 0.788 ms at 64 x 8192. CBLOCK: the columns per step at 4 bits
# ([CBLOCK, 16] compares)
RADIX_BITS = int(os.environ.get("MEGAGRAPH_TOPK_RADIX_BITS", "8"))
if RADIX_BITS not in (4, 8):  # other widths would not tile the 32-bit key: a wrong selection
    raise ValueError(f"MEGAGRAPH_TOPK_RADIX_BITS={RADIX_BITS}: 4 or 8")
CBLOCK = 256
BLOCK_K = 512  # output slots per step of the -1 padding loop
NUM_WARPS = 4


def topk_select(scores: Tensor, mask: Tensor | None = None, *, k: int) -> Tensor:
    """kernels.reference.indexer.topk_select: i64[T, k], per row the columns of the top min(k, C)
    scores (mask False / -inf never selected, ties at the k-th value toward the lower column) in
    ascending order, then -1. NaN scores: outside the contract."""
    ok = (available() and _on_device(scores) and scores.dim() == 2 and scores.dtype in DTYPES
          and k > 0 and scores.shape[0] > 0 and 0 < scores.shape[1] < 2**31 - BLOCK
          and (mask is None or (mask.dtype == torch.bool and mask.device == scores.device
                                and mask.dim() <= 2)))
    if not ok:
        from megagraph.kernels.capturable.indexer import topk_select as fallback

        return fallback(scores, mask, k=k)
    from .topk_jit import topk_select_rows

    T, C = scores.shape
    s = scores if scores.stride(-1) == 1 else scores.contiguous()
    m = None
    if mask is not None:
        m = mask.expand(T, C)  # a broadcast mask keeps its zero strides (no copy)
        if m.stride(-1) != 1:
            m = m.contiguous()
        m = m.view(torch.uint8)
    out = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    topk_select_rows[(T,)](
        s, m if m is not None else s, out, C, k, min(k, C), s.stride(0),
        m.stride(0) if m is not None else 0, out.stride(0),
        HAS_MASK=m is not None, BLOCK=BLOCK if RADIX_BITS == 8 else CBLOCK, BLOCK_K=BLOCK_K,
        RB=RADIX_BITS, num_warps=1 if INTERPRET else NUM_WARPS)
    return out


topk_select.capturable = True


CAND_ELEMS = 1024  # entries per step of candidate_mask (NBB blocks x next_pow2(block) columns)


def candidate_mask(scores: Tensor, *, block: int, topk_blocks: int) -> Tensor:
    """kernels.reference.indexer.candidate_mask in one launch, one program per row: bool[T, C],
    entry c kept if its block of `block` entries is among the top min(topk_blocks, n_blocks) by
    block max (the block of entry n_visible - 1 forced to +inf, blocks without a visible entry
    never kept, ties toward the older block) and its score is > -inf. NaN: outside the contract.

    Why: 27 ms of the same 462 ms 8K-token prefill step (V4.1-Flash: blocks of 8, 2048 of them
    kept, of ~4.4K per row); the reference pads, reduces, scatters, runs torch.topk and a
    cumulative sum over the [T, n_blocks] block scores, then expands to [T, C].
    Design: topk_select's radix select over the row's block keys (kernels/triton/topk_jit.py,
    candidate_mask_rows), each of its five passes recomputing the block maxima from the scores,
    the last one writing every entry of the row once. Integer output: bitwise the reference, by
    the same argument as topk_select's (exact key order, exact counts, the reference's tie rule).
    The capturable kernel serves what topk_select's fallback serves, and block <= 0 or
    topk_blocks <= 0."""
    ok = (available() and _on_device(scores) and scores.dim() == 2 and scores.dtype in DTYPES
          and block > 0 and topk_blocks > 0 and scores.shape[0] > 0
          and 0 < scores.shape[1] < 2**31 - CAND_ELEMS)
    if not ok:
        from megagraph.kernels.capturable.indexer import candidate_mask as fallback

        return fallback(scores, block=block, topk_blocks=topk_blocks)
    import triton

    from .topk_jit import candidate_mask_rows

    T, C = scores.shape
    s = scores if scores.stride(-1) == 1 else scores.contiguous()
    nb = triton.cdiv(C, block)
    blk = triton.next_power_of_2(block)
    out = torch.empty(T, C, dtype=torch.uint8, device=scores.device)  # (bytes 0 / 1)
    candidate_mask_rows[(T,)](
        s, out, C, nb, block, min(topk_blocks, nb), s.stride(0), out.stride(0),
        NBB=max(1, CAND_ELEMS // blk), BLK=blk, num_warps=1 if INTERPRET else NUM_WARPS)
    return out.view(torch.bool)


candidate_mask.capturable = True
