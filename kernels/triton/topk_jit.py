"""Triton code of the indexer's top-k selection and candidate blocks (imported by
kernels/triton/topk.py).

One program per row: four 8-bit radix-select passes find the KK-th largest key of the row (KK =
min(k, C)), one last pass in column order writes the selection. Every pass re-reads the row
(scores, and the mask where there is one) from global memory: a row is up to hundreds of
thousands of entries and does not fit in registers. candidate_mask_rows runs the same select over
the row's block maxima (recomputed from the scores in each pass: no scratch buffer, no barrier).
"""
from __future__ import annotations

import triton
import triton.language as tl

SIGN = tl.constexpr(0x80000000)  # the sign bit of an fp32 (and of the uint32 keys)
INF_KEY = tl.constexpr(0xFF800000)  # f32_key(+inf)


@triton.jit
def f32_key(x):
    """uint32 keys ordered as the fp32 values x (key(a) > key(b) <=> a > b, NaN aside)."""
    b = x.to(tl.uint32, bitcast=True)
    # -0.0 -> +0.0: the reference compares values (-0.0 == +0.0 is a tie, decided by column),
    # while their bit patterns would order -0.0 below +0.0. Done on the bits, not as x + 0.0,
    # which a compiler allowed to ignore signed zeros could drop.
    b = tl.where(b == SIGN, 0, b)
    # negative: flip every bit (larger magnitude -> smaller key); positive: set the sign bit
    # (above every negative). Monotone over all non-NaN fp32 values, +-inf included.
    return tl.where((b & SIGN) != 0, ~b, b | SIGN)


@triton.jit
def pick_digit(hist, bins, cnt, need):
    """One radix-select step: hist [NBINS] counts the cnt keys matching the prefix by their next
    digit; the need-th largest of them has digit d = the largest d with sum(hist[d:]) >= need
    (suffix sums are non-increasing in d, so d + 1 is how many of them reach need).
    Returns (d, its rank among the keys with that digit, how many keys have it)."""
    suffix = cnt - tl.cumsum(hist, 0) + hist
    d = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    gt = tl.sum(tl.where(bins > d, hist, 0), 0)  # matching keys above digit d
    return d, need - gt, tl.sum(tl.where(bins == d, hist, 0), 0)


@triton.jit
def row_keys(s_ptr, m_ptr, row_s, row_m, c, C, HAS_MASK: tl.constexpr):
    """uint32 keys of the columns c of a row, ordered as the fp32 scores (key(a) > key(b) <=>
    a > b), and 0 for the columns that can never be selected (c >= C, masked out, -inf; NaN too).

    Why 0 for those: every selectable score is > -inf, whose key is 0x007FFFFF, so 0 is below
    every selectable key and the radix select needs no mask (kernel docstring)."""
    inb = c < C
    x = tl.load(s_ptr + row_s + c, mask=inb, other=float("-inf")).to(tl.float32)
    ok = inb & (x > float("-inf"))
    if HAS_MASK:
        ok = ok & (tl.load(m_ptr + row_m + c, mask=inb, other=0) != 0)
    return tl.where(ok, f32_key(x), 0)


@triton.jit
def topk_select_rows(s_ptr, m_ptr, out_ptr, C, K, KK, stride_s, stride_m, stride_o,
                     HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                     RB: tl.constexpr):
    """Row program_id(0) of kernels.reference.indexer.topk_select: out[row, :] = the columns of
    the KK largest selectable scores in ascending column order (ties at the KK-th value: the
    lowest columns), -1 after them up to K columns.

    Radix select over the row's C keys (row_keys: unselectable columns have key 0): pass p builds
    the 256-bin histogram of digit p (bits 31-24, 23-16, 15-8, 7-0) of the keys whose higher
    digits equal the prefix chosen so far, and picks the digit of the `need`-th largest of them.
    After four passes `kth` is the KK-th largest key of the row, `need` how many of the entries
    equal to it the selection takes (the rest of the KK are the entries above it).
    kth == 0 means fewer than KK selectable entries: every selectable entry (key > 0) is taken and
    none of the key-0 ones, as the reference drops its -inf picks.

    RB: the digit's bits. 8: four passes of tl.histogram (shared-memory atomics); 4: eight
    passes counting the 16 digits by comparison and reduction (no atomics, 16 compares per key
    and pass): the same kth, need, selection. Expected to avoid the atomics' contention (most
    keys of a pass share one bin), it was 2.6x slower on the H200 (topk.RADIX_BITS).
    """
    r = tl.program_id(0).to(tl.int64)
    row_s = r * stride_s
    row_m = r * stride_m
    row_o = r * stride_o
    cols = tl.arange(0, BLOCK)
    NBINS: tl.constexpr = 1 << RB
    bins = tl.arange(0, NBINS)
    nblocks = tl.cdiv(C, BLOCK)
    padded = nblocks * BLOCK
    prefix = tl.full([], 0, tl.uint32)  # the digits of kth chosen so far
    need = KK  # rank of kth among the entries matching the prefix (1 = the largest)
    cnt = C  # entries matching the prefix (pass 0: the whole row)
    for p in tl.static_range(32 // RB):
        shift = 32 - RB * (p + 1)  # constexpr: p is static
        hist = tl.zeros([NBINS], dtype=tl.int32)
        for b in range(nblocks):
            c = b * BLOCK + cols
            key = row_keys(s_ptr, m_ptr, row_s, row_m, c, C, HAS_MASK)
            digit = ((key >> shift) & (NBINS - 1)).to(tl.int32)
            if RB == 8:
                if p > 0:
                    # entries off the prefix go to bin 0 and are taken out of it below (one
                    # subtraction instead of a histogram mask)
                    digit = tl.where((key >> (shift + RB)) == prefix, digit, 0)
                hist += tl.histogram(digit, NBINS)
            else:
                on = c < C
                if p > 0:
                    on = on & ((key >> (shift + RB)) == prefix)
                hit = (digit[:, None] == bins[None, :]) & on[:, None]
                hist += tl.sum(hit.to(tl.int32), 0)
        if RB == 8:
            # bin 0 also counted the padded columns c >= C (key 0) and the entries off the
            # prefix: padded - cnt of them, so the histogram counts exactly the cnt matching ones
            hist -= tl.where(bins == 0, padded - cnt, 0)
        d, need, cnt = pick_digit(hist, bins, cnt, need)
        prefix = (prefix << RB) | d.to(tl.uint32)
    kth = prefix
    need = tl.where(kth == 0, 0, need)
    # column order: entry c is selected if key > kth, or key == kth and it is one of the first
    # `need` such entries (the lowest columns: the reference's tie rule); its output slot is the
    # number of selected entries before it (a running count + an in-block inclusive cumsum)
    base = tl.zeros([], dtype=tl.int32)  # selected entries written so far
    ties = tl.zeros([], dtype=tl.int32)  # entries equal to kth seen so far
    for b in range(nblocks):
        c = b * BLOCK + cols
        key = row_keys(s_ptr, m_ptr, row_s, row_m, c, C, HAS_MASK)
        eq = (key == kth).to(tl.int32)
        sel = (key > kth) | ((eq != 0) & (ties + tl.cumsum(eq, 0) <= need))
        seli = sel.to(tl.int32)
        pos = base + tl.cumsum(seli, 0) - 1
        tl.store(out_ptr + row_o + pos, c.to(tl.int64), mask=sel)
        base += tl.sum(seli, 0)
        ties += tl.sum(eq, 0)
    # -1 in the slots after the selection, up to K (every output element written once)
    for j0 in range(0, K, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + row_o + j, tl.full([BLOCK_K], -1, tl.int64), mask=(j >= base) & (j < K))


@triton.jit
def block_keys(s_ptr, row_s, blk, C, block, newest, BLK: tl.constexpr):
    """Blocks blk [NBB] of a row: the f32_key of each block's max score (0 where it has no
    visible entry, or past the row: never kept), the block `newest` at +inf's key; and the
    [NBB, BLK] tile's visibility (score > -inf), columns and in-row mask."""
    j = tl.arange(0, BLK)
    offs = blk[:, None] * block + j[None, :]
    inb = (j[None, :] < block) & (offs < C)
    x = tl.load(s_ptr + row_s + offs, mask=inb, other=float("-inf")).to(tl.float32)
    vis = inb & (x > float("-inf"))
    mx = tl.max(x, axis=1)
    key = tl.where(mx > float("-inf"), f32_key(mx), 0)
    key = tl.where(blk == newest, INF_KEY, key)
    return key, vis, offs, inb


@triton.jit
def candidate_mask_rows(s_ptr, out_ptr, C, NB, block, KB, stride_s, stride_o,
                        NBB: tl.constexpr, BLK: tl.constexpr):
    """Row program_id(0) of kernels.reference.indexer.candidate_mask: out[row, c] = (c's block is
    one of the KB kept blocks) & (score[c] > -inf), as bytes 0 / 1.

    Block score = max of its `block` entries; the block of entry n_vis - 1 (n_vis = the row's
    visible count: the newest entry where visibility is a prefix) forced to +inf; keep the KB
    largest block scores > -inf, ties toward the lower block (take_topk). The radix select of
    topk_select_rows over the NB block keys (NBB blocks of BLK >= block entries per step), each
    pass recomputing the block maxima from the scores. n_vis is only known after the first pass,
    so that pass histograms the unforced keys and then moves the newest block's count from its
    own digit to +inf's (its max re-read from one block)."""
    r = tl.program_id(0).to(tl.int64)
    row_s = r * stride_s
    row_o = r * stride_o
    lanes = tl.arange(0, NBB)
    bins = tl.arange(0, 256)
    nchunks = tl.cdiv(NB, NBB)
    padded = nchunks * NBB
    need = KB  # rank of the KB-th largest block key among those matching the prefix
    cnt = NB  # blocks matching the prefix
    hist = tl.zeros([256], dtype=tl.int32)
    nvis = tl.zeros([], dtype=tl.int32)
    for b in range(nchunks):
        key, vis, offs, inb = block_keys(s_ptr, row_s, b * NBB + lanes, C, block, -1, BLK)
        nvis += tl.sum(tl.sum(vis.to(tl.int32), 1), 0)
        hist += tl.histogram(((key >> 24) & 0xFF).to(tl.int32), 256)
    newest = tl.where(nvis > 0, (nvis - 1) // block, -1)  # no forced block in an empty row
    one = tl.maximum(newest, 0) + tl.arange(0, 1)  # (block 0 when there is none: unused then)
    okey, _ovis, _ooffs, _oinb = block_keys(s_ptr, row_s, one, C, block, -1, BLK)
    od = tl.sum(((okey >> 24) & 0xFF).to(tl.int32), 0)
    moved = tl.where(bins == (INF_KEY >> 24), 1, 0) - tl.where(bins == od, 1, 0)
    hist += moved * (nvis > 0).to(tl.int32)
    # bin 0 also counted the padded blocks (past NB): take them out (padded - NB of them)
    hist -= tl.where(bins == 0, padded - cnt, 0)
    d, need, cnt = pick_digit(hist, bins, cnt, need)
    prefix = d.to(tl.uint32)
    for p in tl.static_range(1, 4):
        shift = 24 - 8 * p  # constexpr: p is static
        hist = tl.zeros([256], dtype=tl.int32)
        for b in range(nchunks):
            key, _pvis, _poffs, _pinb = block_keys(s_ptr, row_s, b * NBB + lanes, C, block, newest,
                                                BLK)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            # blocks off the prefix go to bin 0 and are taken out of it below
            digit = tl.where((key >> (shift + 8)) == prefix, digit, 0)
            hist += tl.histogram(digit, 256)
        hist -= tl.where(bins == 0, padded - cnt, 0)
        d, need, cnt = pick_digit(hist, bins, cnt, need)
        prefix = (prefix << 8) | d.to(tl.uint32)
    kth = prefix
    need = tl.where(kth == 0, 0, need)  # fewer than KB blocks with a score > -inf: all of them
    # block order: keep the blocks above kth and the first `need` equal to it (lowest blocks);
    # every entry of the row written once (keep & visible)
    ties = tl.zeros([], dtype=tl.int32)  # blocks equal to kth seen so far
    for b in range(nchunks):
        key, vis, offs, inb = block_keys(s_ptr, row_s, b * NBB + lanes, C, block, newest, BLK)
        eq = (key == kth).to(tl.int32)
        keep = (key > kth) | ((eq != 0) & (ties + tl.cumsum(eq, 0) <= need))
        ties += tl.sum(eq, 0)
        tl.store(out_ptr + row_o + offs, (keep[:, None] & vis).to(tl.uint8), mask=inb)
