"""The sparse-attention indexer's top-k selection on the GPU (Triton): kernels.indexer.reference
.topk_select in one launch, one program per row (and the two-level candidate_mask, below).

Why: on the H200, a prefill step of the 5-layer V4.1-Flash slice at 8192 tokens spent 188 ms of
462 ms (41%) in topk_select (benchmarks/results/h200-prefill-8.md, "Top ops"): the reference (also
the capturable kernel) runs torch.topk, an int32 cumulative sum over the whole [T, C] score matrix
(up to ~35K compressed entries per token), a batched searchsorted and a sort, for top-512 rows.

Design (kernels/indexer/triton_topk_jit.py): scores become order-preserving uint32 keys (-0.0 as +0.0,
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

Two kernel variants (VARIANT, or variant= per call; the same output bitwise): "radix", above and
the default, and "stream" (topk_jit.py's streaming section, docs/kernels/topk.md): each
row read once (candidate_mask: twice, the second time to write the mask) into a small buffer of
candidates per program, kept in column order and tightened by the same radix select whenever it
fills (it cannot overflow: a row of one value included), rows cut into segments when T is small
(decode), a merge kernel per row selecting over its segments' buffers. Why: at the V4.1 ratio-1
prefill size (8192 x 135168) the radix variant reads 4.4 GB five times, ~21 ms per call on the
H200. Proposal: make "stream" the default once benchmarks/topk_probe.py has timed it faster on
the H200 (it has not run on a GPU yet).

No host synchronization, output shape [T, k] from the arguments' shapes: CUDA-graph capturable.
The stream variant's scratch (buffers, counts) is sized from the shapes too.
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

from megagraph.kernels.attention.triton import INTERPRET, _on_device, available

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

# The kernel variant of both ops: "radix" (the kernels above: every radix digit re-reads the row,
# 4 + 1 reads) or "stream" (topk_jit's streaming section: the row read once by topk_select, twice
# by candidate_mask; the exact select over a small candidate buffer per program). "stream" is the
# default since the eleventh session: on the H200 (benchmarks/results/topk-probe-11-h200.md, one
# call) top-512 at 8192 x 135168 20.7 -> 4.5 ms, candidate_mask 26.2 -> 5.4 ms, 64 x 135168
# 0.86 -> 0.13 ms, every output bitwise the radix kernel's; its GPU tests passed in that session
# (docs/kernels/topk.md). MEGAGRAPH_TOPK_VARIANT=radix restores the radix kernels.
# Read at each call (the probe and the tests switch it); topk_select / candidate_mask also take
# variant=.
VARIANT = os.environ.get("MEGAGRAPH_TOPK_VARIANT", "stream")
VARIANTS = ("radix", "stream")
if VARIANT not in VARIANTS:
    raise ValueError(f"MEGAGRAPH_TOPK_VARIANT={VARIANT}: one of {VARIANTS}")
# stream: entries per step of the row (topk_select), buffer entries per program (at least KK +
# STREAM_BLOCK + the tightening slack: _stream_cap), buffer entries per step of its select /
# compaction (register pressure: TB 256 keeps the sm_90 stream kernels at <= 128 registers, no
# spills) and of the merge kernels' (one program per row; ptxas spilled a few scalars of the
# candidate merge at 512 and 1024 on Triton 3.9 / 3.6: tests/kernels/test_triton_topk_sm90.py),
# warps; segments per row (0: enough programs for the GPU when T is small, rows cut
# into segments of at least STREAM_SEG_MIN columns; else that many); candidate_mask's entries per
# step of the stream and of the mask write
STREAM_BLOCK = 1024
STREAM_CAP = 4096
STREAM_TB = 256
STREAM_MERGE_TB = 512
CAND_MERGE_TB = 256
STREAM_WARPS = 4
STREAM_SEG_MIN = 16384
SEGMENTS = int(os.environ.get("MEGAGRAPH_TOPK_SEGMENTS", "0"))
CAND_STREAM_ELEMS = 2048
CAND_WRITE_ELEMS = 4096
# stream: the largest k (topk_select) / kept blocks (candidate_mask) it takes (its buffers grow
# with them: T * S * (k + step) * 8 bytes); above, or for rows near 2^31 columns, the call runs
# the radix variant
STREAM_MAX_K = 16384
# stream, with a mask: load a score only where the mask is True (a masked-out 32-byte sector is
# never read: ~1/8 of the score bytes under V4.1's candidate mask) instead of every score
STREAM_MASKED_LOADS = True


def topk_select(scores: Tensor, mask: Tensor | None = None, *, k: int,
                variant: str | None = None) -> Tensor:
    """kernels.indexer.reference.topk_select: i64[T, k], per row the columns of the top min(k, C)
    scores (mask False / -inf never selected, ties at the k-th value toward the lower column) in
    ascending order, then -1. NaN scores: outside the contract. variant: VARIANT's choice (None:
    VARIANT itself); the same output either way."""
    ok = (available() and _on_device(scores) and scores.dim() == 2 and scores.dtype in DTYPES
          and k > 0 and scores.shape[0] > 0 and 0 < scores.shape[1] < 2**31 - BLOCK
          and (mask is None or (mask.dtype == torch.bool and mask.device == scores.device
                                and mask.dim() <= 2)))
    if not ok:
        from megagraph.kernels.indexer.capturable import topk_select as fallback

        return fallback(scores, mask, k=k)
    from megagraph.kernels.indexer.triton_topk_jit import topk_select_rows

    T, C = scores.shape
    s = scores if scores.stride(-1) == 1 else scores.contiguous()
    m = None
    if mask is not None:
        m = mask.expand(T, C)  # a broadcast mask keeps its zero strides (no copy)
        if m.stride(-1) != 1:
            m = m.contiguous()
        m = m.view(torch.uint8)
    out = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    if _variant(variant) == "stream" and _stream_fits(min(k, C), C):
        _topk_stream(s, m, out, k)
        return out
    topk_select_rows[(T,)](
        s, m if m is not None else s, out, C, k, min(k, C), s.stride(0),
        m.stride(0) if m is not None else 0, out.stride(0),
        HAS_MASK=m is not None, BLOCK=BLOCK if RADIX_BITS == 8 else CBLOCK, BLOCK_K=BLOCK_K,
        RB=RADIX_BITS, num_warps=1 if INTERPRET else NUM_WARPS)
    return out


topk_select.capturable = True


CAND_ELEMS = 1024  # entries per step of candidate_mask (NBB blocks x next_pow2(block) columns)


def candidate_mask(scores: Tensor, *, block: int, topk_blocks: int,
                   variant: str | None = None) -> Tensor:
    """kernels.indexer.reference.candidate_mask in one launch, one program per row: bool[T, C],
    entry c kept if its block of `block` entries is among the top min(topk_blocks, n_blocks) by
    block max (the block of entry n_visible - 1 forced to +inf, blocks without a visible entry
    never kept, ties toward the older block) and its score is > -inf. NaN: outside the contract.

    Why: 27 ms of the same 462 ms 8K-token prefill step (V4.1-Flash: blocks of 8, 2048 of them
    kept, of ~4.4K per row); the reference pads, reduces, scatters, runs torch.topk and a
    cumulative sum over the [T, n_blocks] block scores, then expands to [T, C].
    Design: topk_select's radix select over the row's block keys (kernels/indexer/triton_topk_jit.py,
    candidate_mask_rows), each of its five passes recomputing the block maxima from the scores,
    the last one writing every entry of the row once. Integer output: bitwise the reference, by
    the same argument as topk_select's (exact key order, exact counts, the reference's tie rule).
    The capturable kernel serves what topk_select's fallback serves, and block <= 0 or
    topk_blocks <= 0. variant: as topk_select's ("stream": _cand_stream)."""
    ok = (available() and _on_device(scores) and scores.dim() == 2 and scores.dtype in DTYPES
          and block > 0 and topk_blocks > 0 and scores.shape[0] > 0
          and 0 < scores.shape[1] < 2**31 - CAND_ELEMS)
    if not ok:
        from megagraph.kernels.indexer.capturable import candidate_mask as fallback

        return fallback(scores, block=block, topk_blocks=topk_blocks)
    import triton

    from megagraph.kernels.indexer.triton_topk_jit import candidate_mask_rows

    T, C = scores.shape
    s = scores if scores.stride(-1) == 1 else scores.contiguous()
    nb = triton.cdiv(C, block)
    blk = triton.next_power_of_2(block)
    out = torch.empty(T, C, dtype=torch.uint8, device=scores.device)  # (bytes 0 / 1)
    if _variant(variant) == "stream" and _stream_fits(min(topk_blocks, nb), C):
        _cand_stream(s, out, block, min(topk_blocks, nb))
        return out.view(torch.bool)
    candidate_mask_rows[(T,)](
        s, out, C, nb, block, min(topk_blocks, nb), s.stride(0), out.stride(0),
        NBB=max(1, CAND_ELEMS // blk), BLK=blk, num_warps=1 if INTERPRET else NUM_WARPS)
    return out.view(torch.bool)


candidate_mask.capturable = True


# the streaming variant (VARIANT "stream"; topk_jit.py's streaming section)

def _variant(variant: str | None) -> str:
    v = VARIANT if variant is None else variant
    if v not in VARIANTS:
        raise ValueError(f"topk variant {v!r}: one of {VARIANTS}")
    return v


def _stream_fits(kk: int, C: int) -> bool:
    """Whether the stream variant takes the call (STREAM_MAX_K; its column arithmetic, a few
    steps past C, in int32)."""
    return kk <= STREAM_MAX_K and C < 2**31 - 4 * max(STREAM_BLOCK, CAND_STREAM_ELEMS)


def _stream_cap(kk: int, step: int) -> tuple[int, int]:
    """(buffer entries per program, tightening slack). A tightened buffer holds <= kk + slack
    entries and one step appends <= step: cap >= kk + slack + step, so one tightening always
    makes room (the buffer never overflows, whatever the data). slack: a quarter of the spare
    room (a tightening may stop at a digit whose bin overshoots kk by that much)."""
    cap = max(STREAM_CAP, kk + step)
    return cap, (cap - kk - step) // 4


def _segments(T: int, C: int, length: int, unit: int, dev: torch.device) -> tuple[int, int]:
    """(S, units per segment) for `length` items of a row in steps of `unit` (SEGMENTS, or: one
    segment unless the rows alone give fewer than 4 programs per SM, then as many as bring them
    there with segments of >= STREAM_SEG_MIN columns)."""
    import triton

    from megagraph.kernels.attention.triton import sm_count

    if SEGMENTS > 0:
        S = SEGMENTS
    else:
        S = max(1, min(triton.cdiv(4 * sm_count(dev), T), C // STREAM_SEG_MIN))
    seg = triton.cdiv(triton.cdiv(length, S), unit) * unit
    return triton.cdiv(length, seg), seg


def _warps() -> int:
    return 1 if INTERPRET else STREAM_WARPS


def _topk_stream(s: Tensor, m: Tensor | None, out: Tensor, k: int) -> None:
    """topk_select's stream variant: topk_stream_rows over (T, S) row segments, each leaving its
    segment's KK largest in a buffer, then topk_merge_rows writing `out` from them (S == 1: a
    copy). Scratch: buffers i64[T * S * cap] and counts i32[T * S], from the shapes (nothing
    initialized: every slot read is written first)."""
    from megagraph.kernels.indexer.triton_topk_jit import topk_merge_rows, topk_stream_rows

    T, C = s.shape
    kk = min(k, C)
    S, seg = _segments(T, C, C, STREAM_BLOCK, s.device)
    cap, slack = _stream_cap(kk, STREAM_BLOCK)
    buf = torch.empty(T * S * cap, dtype=torch.int64, device=s.device)
    cnt = torch.empty(T * S, dtype=torch.int32, device=s.device)
    topk_stream_rows[(T, S)](
        s, m if m is not None else s, buf, cnt, C, kk, S, seg, cap, slack, s.stride(0),
        m.stride(0) if m is not None else 0, HAS_MASK=m is not None,
        MASKED_LOADS=m is not None and STREAM_MASKED_LOADS, BLOCK=STREAM_BLOCK, TB=STREAM_TB,
        num_warps=_warps())
    topk_merge_rows[(T,)](out, buf, cnt, k, kk, S, cap, out.stride(0), TB=STREAM_MERGE_TB,
                          BLOCK_K=BLOCK_K, num_warps=_warps())


def _cand_stream(s: Tensor, out: Tensor, block: int, kb: int) -> None:
    """candidate_mask's stream variant: cand_stream_rows over (T, S) segments of block keys, each
    leaving its segment's KB largest blocks, cand_merge_rows selecting the row's (the forced block
    applied), then cand_write_rows writes every entry of `out` (u8 [T, C]) from the rows' selections (par:
    i64[T, 4]). The block size is a constexpr (aligned block loads)."""
    import triton

    from megagraph.kernels.indexer.triton_topk_jit import cand_merge_rows, cand_stream_rows, cand_write_rows

    T, C = s.shape
    nb = triton.cdiv(C, block)
    blk = triton.next_power_of_2(block)
    nbb = max(1, CAND_STREAM_ELEMS // blk)
    S, segb = _segments(T, C, nb, nbb, s.device)
    cap, slack = _stream_cap(kb, nbb)
    dev = s.device
    buf = torch.empty(T * S * cap, dtype=torch.int64, device=dev)
    cnt = torch.empty(T * S, dtype=torch.int32, device=dev)
    nv = torch.empty(T * S, dtype=torch.int32, device=dev)
    par = torch.empty(T * 4, dtype=torch.int64, device=dev)
    cand_stream_rows[(T, S)](s, buf, cnt, nv, C, kb, S, segb, cap, slack, s.stride(0), BS=block,
                             BLK=blk, NBB=nbb, TB=STREAM_TB, num_warps=_warps())
    cand_merge_rows[(T,)](buf, cnt, nv, par, kb, S, cap, BS=block, TB=CAND_MERGE_TB,
                          num_warps=_warps())
    wnbb = max(1, CAND_WRITE_ELEMS // blk)
    cand_write_rows[(T, triton.cdiv(nb, wnbb))](s, par, out, C, s.stride(0), out.stride(0),
                                                BS=block, BLK=blk, NBB=wnbb, num_warps=_warps())
