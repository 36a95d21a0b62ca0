"""Triton code of the indexer's top-k selection and candidate blocks (imported by
kernels/indexer/triton_topk.py): the streaming exact select (the section below) and the keys it
orders by.

A row is up to hundreds of thousands of entries and does not fit in registers, so each program
reads its segment of the row once, keeps a small buffer of candidates in column order and runs
an exact radix select over that buffer whenever it fills (docs/kernels/indexer.md).
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


# --------------------------------------------------------------------------------------------
# The streaming select: the row read once (topk_select) or twice (candidate_mask: once to
# select the blocks, once to write the [T, C] mask); the exact select runs over a small candidate
# buffer per program.
#
# Stream (topk_stream_rows, cand_stream_rows; grid (T, S): S column segments per row, S > 1 only
# when the rows alone cannot fill the GPU): the program reads its segment in column order, a step
# of BLOCK entries (NBB blocks) at a time, the next step's loads issued before this step's work,
# and appends every entry whose key is above a running threshold `thr` (initially 0: every
# selectable entry) to its buffer of CAP packed (key << 32 | column) int64 entries, in column
# order (stream_append: a cumsum gives the slots). Before a step, if the buffer has no room for a
# whole step, it is tightened (stream_tighten): union_select finds (lo, kth, need) of its KK
# largest - an 8-bit radix select over the buffer, stopping after a digit once the
# candidate bin overshoots KK by at most `slack` - buf_compact keeps exactly the entries that
# selects (stable: still in column order) and thr becomes lo - 1. A tightened buffer holds <= KK
# + slack entries and a step adds <= BLOCK, so CAP >= KK + slack + BLOCK (topk._stream_cap)
# means one tightening always makes room: the buffer cannot overflow, whatever the data (a row of
# one value included: the tie rule keeps the KK lowest columns and thr = that value drops every
# later entry). At the segment's end the buffer is cut to its KK largest exactly (stream_end).
# A second kernel per row (topk_merge_rows / cand_merge_rows) selects over the S buffers and
# writes the output row (topk) or the row's rule for cand_write_rows (candidate_mask).
#
# Why it is exact (the invariant): after every step the buffer holds every entry of the segment
# read so far that is among the KK largest of it by the total order (key descending, column
# ascending - the reference's tie rule), in column order. A tightening keeps every entry with key
# >= lo plus the `need` lowest-column ones equal to kth (exact stop: lo = kth + 1); what it drops
# ranks below KK kept entries. A later entry (a higher column) that is not above thr = lo - 1
# ranks below those same KK entries (a smaller key, or an equal key at a higher column): never
# among the KK largest, so dropping it is exact too. The KK largest of a row are among the union
# of its segments' KK largest, and the merge's select over the union (slack 0, in column order:
# buffers in segment order, each in column order) takes them with the same tie rule: `need`
# entries equal to kth, lowest columns first. Keys are f32_key's (-0.0 == +0.0,
# unselectable entries key 0, never buffered): an exact integer image of the fp32 order.
# --------------------------------------------------------------------------------------------

@triton.jit
def pack(key, idx):
    """int64 buffer entry: key in the high word (entries order by key first), idx (column or
    block, >= 0) in the low word."""
    return ((key.to(tl.uint64) << 32) | idx.to(tl.uint64)).to(tl.int64, bitcast=True)


@triton.jit
def buf_entries(buf, j, n, newest, FORCE: tl.constexpr):
    """(key, idx) of buffer slots j (key 0, idx -1 past n); FORCE: the entry of block `newest`
    keyed as +inf (candidate_mask's forced block)."""
    e = tl.load(buf + j, mask=j < n, other=0).to(tl.uint64, bitcast=True)
    key = (e >> 32).to(tl.uint32)
    idx = tl.where(j < n, (e & 0xFFFFFFFF).to(tl.int32), -1)
    if FORCE:
        key = tl.where((idx == newest) & (j < n), INF_KEY, key)
    return key, idx


@triton.jit
def union_select(bufs, cnts, S, CAP, total, KK, slack, newest, vc, FORCE: tl.constexpr,
                 TB: tl.constexpr):
    """The selection of the KK largest keys among the entries of S buffers (buffer s: bufs + s *
    CAP, cnts[s] entries, all keys > 0; total = their sum; + vc (0 / 1) virtual entry keyed +inf,
    FORCE) as (lo, kth, need): an entry is selected if key >= lo, or key == kth and it is one of
    the first `need` such entries in column order. Needs total + vc >= KK.

    A radix select (8-bit digits, tl.histogram, off-prefix entries and
    padding counted in bin 0 and taken out), over the buffers. After digit P, if the candidate
    bin (the cnt entries matching the prefix, `need` of which are wanted) has at most `slack`
    entries more than wanted, it stops: lo = the bin's lowest key, need = 0 (the whole bin is
    taken: at most KK + slack entries; slack 0: exactly the KK, the bin taken whole because it
    is exactly what is needed)."""
    lanes = tl.arange(0, TB)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    lo = tl.zeros([], dtype=tl.uint32)
    need = KK + tl.zeros([], dtype=tl.int32)
    cnt = total + vc
    done = tl.zeros([], dtype=tl.int32)
    for P in tl.static_range(4):
        if done == 0:
            shift: tl.constexpr = 24 - 8 * P
            hist = tl.zeros([256], dtype=tl.int32)
            padded = tl.zeros([], dtype=tl.int32)
            for s in range(S):
                n = tl.load(cnts + s)
                nb = tl.cdiv(n, TB)
                padded += nb * TB
                for b in range(nb):
                    key, _idx = buf_entries(bufs + s * CAP, b * TB + lanes, n, newest, FORCE)
                    digit = ((key >> shift) & 0xFF).to(tl.int32)
                    if P > 0:
                        digit = tl.where((key >> (shift + 8)) == prefix, digit, 0)
                    hist += tl.histogram(digit, 256)
            vm = vc
            if P > 0:
                vm = vm * (prefix == (INF_KEY >> (shift + 8))).to(tl.int32)
            hist += tl.where(bins == ((INF_KEY >> shift) & 0xFF), vm, 0)
            # bin 0 also counted the padding and the entries off the prefix: all but the
            # (cnt - vm) real matching entries of the `padded` slots
            hist -= tl.where(bins == 0, padded - (cnt - vm), 0)
            d, need, cnt = pick_digit(hist, bins, cnt, need)
            prefix = (prefix << 8) | d.to(tl.uint32)
            if P < 3:
                if cnt - need <= slack:
                    done = 1
                    lo = tl.maximum(prefix << shift, 1)
    kth = tl.where(done != 0, 0, prefix)  # no entry has key 0: no ties taken
    lo = tl.where(done != 0, lo, prefix + 1)
    need = tl.where(done != 0, 0, need)
    return lo, kth, need


@triton.jit
def buf_compact(buf, n, lo, kth, need, TB: tl.constexpr):
    """Keeps the entries of buf[0:n] union_select selected (key >= lo, or the first `need` equal
    to kth), in order, at buf[0:m]; returns m. In place: an entry moves to a slot <= its own, and
    a step's loads complete before its stores (they feed the cumsums), so no unread entry is
    overwritten."""
    lanes = tl.arange(0, TB)
    w = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    for b in range(tl.cdiv(n, TB)):
        j = b * TB + lanes
        e = tl.load(buf + j, mask=j < n, other=0)
        key = (e.to(tl.uint64, bitcast=True) >> 32).to(tl.uint32)
        inb = j < n
        eq = ((key == kth) & inb).to(tl.int32)
        sel = ((key >= lo) & inb) | ((eq != 0) & (ties + tl.cumsum(eq, 0) <= need))
        seli = sel.to(tl.int32)
        tl.store(buf + w + tl.cumsum(seli, 0) - 1, e, mask=sel)
        w += tl.sum(seli, 0)
        ties += tl.sum(eq, 0)
    return w


@triton.jit
def stream_slot(buf_ptr, S, CAP):
    """A stream program's (row, segment, slot, buffer), both streams' kernels alike: row
    program_id(0) (int64: row offsets reach past 2^31 elements), segment program_id(1) of the
    row's S, slot = row * S + segment (its count's index), buffer = the slot's CAP entries."""
    r = tl.program_id(0).to(tl.int64)
    sg = tl.program_id(1)
    slot = r * S + sg
    return r, sg, slot, buf_ptr + slot * CAP


@triton.jit
def stream_tighten(buf, cnt_ptr, n, KK, slack, TB: tl.constexpr):
    """Tightens buf[0:n] (n > KK) to its KK largest entries (up to KK + slack of them, in column
    order) and returns (n, thr): the new count and the stream's new threshold (section comment).
    Called between steps, when the buffer has no room for one more step: no step's entries are
    live across it (registers: the select's, not the step's)."""
    tl.store(cnt_ptr, n)
    tl.debug_barrier()  # the appends (other threads' stores) before the select's loads
    lo, kth, need = union_select(buf, cnt_ptr, 1, 0, n, KK, slack, -1, 0, False, TB)
    tl.debug_barrier()  # every load of the select before the compaction's stores
    n = buf_compact(buf, n, lo, kth, need, TB)
    tl.debug_barrier()  # the compaction's stores before the buffer is read again
    return n, lo - 1


@triton.jit
def stream_append(buf, n, thr, key, idx):
    """One step of the stream: appends the entries (key, idx) with key > thr to buf[n:] in order
    (the caller made room for all of them). Returns the new count."""
    hit = key > thr
    nh = tl.sum(hit.to(tl.int32), 0)
    if nh > 0:
        tl.store(buf + n + tl.cumsum(hit.to(tl.int32), 0) - 1, pack(key, idx), mask=hit)
    return n + nh


@triton.jit
def stream_end(buf, cnt_ptr, n, KK, TB: tl.constexpr):
    """A segment's end: the buffer cut to the segment's KK largest (exactly: slack 0; with one
    segment per row that is the row's selection) and its count stored for the merge kernel."""
    tl.store(cnt_ptr, n)
    tl.debug_barrier()
    if n > KK:
        lo, kth, need = union_select(buf, cnt_ptr, 1, 0, n, KK, 0, -1, 0, False, TB)
        tl.debug_barrier()
        n = buf_compact(buf, n, lo, kth, need, TB)
        tl.store(cnt_ptr, n)


@triton.jit
def topk_finish(bufs, cnts, S, CAP, K, KK, orow, TB: tl.constexpr, BLOCK_K: tl.constexpr):
    """out row orow[0:K]: the columns of the KK largest entries of the S buffers (in column
    order: buffers in segment order, each in column order), then -1. Fewer than KK entries: all
    of them (every entry of a buffer is selectable)."""
    lanes = tl.arange(0, TB)
    total = tl.zeros([], dtype=tl.int32)
    for s in range(S):
        total += tl.load(cnts + s)
    lo = tl.full([], 1, tl.uint32)
    kth = tl.zeros([], dtype=tl.uint32)
    need = tl.zeros([], dtype=tl.int32)
    if total > KK:
        lo, kth, need = union_select(bufs, cnts, S, CAP, total, KK, 0, -1, 0, False, TB)
    base = tl.zeros([], dtype=tl.int32)  # selected entries written so far
    ties = tl.zeros([], dtype=tl.int32)  # entries equal to kth seen so far
    for s in range(S):
        n = tl.load(cnts + s)
        for b in range(tl.cdiv(n, TB)):
            j = b * TB + lanes
            key, idx = buf_entries(bufs + s * CAP, j, n, -1, False)
            inb = j < n
            eq = ((key == kth) & inb).to(tl.int32)
            sel = ((key >= lo) & inb) | ((eq != 0) & (ties + tl.cumsum(eq, 0) <= need))
            seli = sel.to(tl.int32)
            tl.store(orow + base + tl.cumsum(seli, 0) - 1, idx.to(tl.int64), mask=sel)
            base += tl.sum(seli, 0)
            ties += tl.sum(eq, 0)
    for j0 in range(0, K, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        tl.store(orow + j, tl.full([BLOCK_K], -1, tl.int64), mask=(j >= base) & (j < K))


@triton.jit
def row_scores(s_ptr, m_ptr, row_s, row_m, c, C, HAS_MASK: tl.constexpr):
    """fp32 scores of the columns c of a row, -inf where c >= C or the mask is False (for
    stream_keys)."""
    inb = c < C
    x = tl.load(s_ptr + row_s + c, mask=inb, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        x = tl.where(tl.load(m_ptr + row_m + c, mask=inb, other=0) != 0, x, float("-inf"))
    return x


@triton.jit
def stream_keys(x):
    """Keys of loaded scores x: f32_key, and 0 (below every selectable key, so never
    buffered) for -inf and NaN."""
    return tl.where(x > float("-inf"), f32_key(x), 0)


@triton.jit
def row_mask(m_ptr, row_m, c, C):
    """The mask of the columns c of a row (False past C)."""
    return tl.load(m_ptr + row_m + c, mask=c < C, other=0) != 0


@triton.jit
def row_scores_where(s_ptr, row_s, c, C, mk):
    """fp32 scores of the columns c of a row loaded only where mk (-inf elsewhere and past C):
    a masked-out 32-byte sector is never fetched (the candidate mask keeps aligned blocks of 8)."""
    return tl.load(s_ptr + row_s + c, mask=(c < C) & mk, other=float("-inf")).to(tl.float32)


@triton.jit
def topk_stream_rows(s_ptr, m_ptr, buf_ptr, cnt_ptr, C, KK, S, SEG, CAP, slack, stride_s,
                     stride_m, HAS_MASK: tl.constexpr, MASKED_LOADS: tl.constexpr,
                     BLOCK: tl.constexpr, TB: tl.constexpr):
    """Row program_id(0), column segment program_id(1) (of S, SEG columns each, a multiple of
    BLOCK) of kernels.indexer.reference.topk_select, streamed (section comment): the segment's
    keys (unselectable entries: key 0) read once, BLOCK a step, the next step's scores loaded
    before this step's work (twice the bytes in flight per program); at the end the buffer is
    cut to the segment's KK largest (stream_end), for topk_merge_rows.

    MASKED_LOADS (with a mask): scores loaded only where the mask is True (row_scores_where),
    the mask two steps ahead so that the scores' load, which needs it, is issued a step ahead
    like the unmasked one's (the last steps' prefetches past the segment are unused)."""
    r, sg, slot, buf = stream_slot(buf_ptr, S, CAP)
    c0 = sg * SEG
    cols = tl.arange(0, BLOCK)
    row_s = r * stride_s
    row_m = r * stride_m
    n = tl.zeros([], dtype=tl.int32)
    thr = tl.zeros([], dtype=tl.uint32)
    if MASKED_LOADS:
        x = row_scores_where(s_ptr, row_s, c0 + cols, C, row_mask(m_ptr, row_m, c0 + cols, C))
        mk = row_mask(m_ptr, row_m, c0 + BLOCK + cols, C)  # the next step's mask
    else:
        x = row_scores(s_ptr, m_ptr, row_s, row_m, c0 + cols, C, HAS_MASK)
    for b in range(tl.cdiv(tl.minimum(SEG, C - c0), BLOCK)):
        c = c0 + b * BLOCK + cols
        if MASKED_LOADS:
            mk2 = row_mask(m_ptr, row_m, c + 2 * BLOCK, C)
            xn = row_scores_where(s_ptr, row_s, c + BLOCK, C, mk)
            mk = mk2
        else:
            xn = row_scores(s_ptr, m_ptr, row_s, row_m, c + BLOCK, C, HAS_MASK)
        if n > CAP - BLOCK:  # no room for a whole step: tighten first
            n, thr = stream_tighten(buf, cnt_ptr + slot, n, KK, slack, TB)
        n = stream_append(buf, n, thr, stream_keys(x), c)
        x = xn
    stream_end(buf, cnt_ptr + slot, n, KK, TB)


@triton.jit
def topk_merge_rows(out_ptr, buf_ptr, cnt_ptr, K, KK, S, CAP, stride_o, TB: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Row program_id(0): the output row from its S segments' buffers (topk_stream_rows; S == 1:
    the buffer already holds exactly the selection, copied in order, then -1)."""
    r = tl.program_id(0).to(tl.int64)
    topk_finish(buf_ptr + r * S * CAP, cnt_ptr + r * S, S, CAP, K, KK, out_ptr + r * stride_o,
                TB, BLOCK_K)


@triton.jit
def cand_finish(bufs, cnts, nvs, S, CAP, KB, par, BS: tl.constexpr, TB: tl.constexpr):
    """The kept blocks of a row from its S buffers of (unforced block key, block) entries (each
    segment's KB largest) and visible counts nvs[S], as par[0:4] = (lo, kth, kth_blk, newest):
    block j is kept if key_j >= lo, or key_j == kth and j <= kth_blk, with the block `newest`
    (of entry n_vis - 1, -1 if none is visible) keyed +inf (cand_write_rows).

    The forced block: its entry, if buffered, is read as +inf (buf_entries FORCE); if not, a
    virtual +inf entry joins the select (vc). Raising one key moves no other block up, so the
    buffers still hold every block of the forced row's KB largest. kth_blk: the need-th block
    equal to kth in block order, the virtual entry counted at its own place."""
    lanes = tl.arange(0, TB)
    total = tl.zeros([], dtype=tl.int32)
    nvis = tl.zeros([], dtype=tl.int32)
    for s in range(S):
        total += tl.load(cnts + s)
        nvis += tl.load(nvs + s)
    newest = tl.where(nvis > 0, (nvis - 1) // BS, -1)
    found = tl.zeros([], dtype=tl.int32)
    for s in range(S):
        n = tl.load(cnts + s)
        for b in range(tl.cdiv(n, TB)):
            _key, idx = buf_entries(bufs + s * CAP, b * TB + lanes, n, newest, False)
            found += tl.sum(((idx == newest) & (idx >= 0)).to(tl.int32), 0)
    vc = ((found == 0) & (nvis > 0)).to(tl.int32)
    lo = tl.full([], 1, tl.uint32)
    kth = tl.zeros([], dtype=tl.uint32)
    need = tl.zeros([], dtype=tl.int32)
    # the rule is applied to every block of the row (cand_write_rows), not to the buffered ones
    # only, so it must not take in blocks a segment dropped: "keep every selectable block" (lo =
    # 1) only when no segment was cut (a cut segment keeps >= KB entries: the select runs at
    # total + vc == KB too), and the exact select (slack -1: no "whole bin" stop, whose bin may
    # hold dropped blocks). A dropped block ranks below KB buffered ones: below the rule's cut.
    if total + vc >= KB:
        lo, kth, need = union_select(bufs, cnts, S, CAP, total, KB, -1, newest, vc, True, TB)
    kblk = tl.full([], -1, tl.int32)
    if need > 0:
        vce = vc * (kth == INF_KEY).to(tl.int32)  # the virtual entry is one of the ties
        ties = tl.zeros([], dtype=tl.int32)
        below = tl.zeros([], dtype=tl.int32)  # ties before the virtual entry's block
        for s in range(S):
            n = tl.load(cnts + s)
            for b in range(tl.cdiv(n, TB)):
                key, idx = buf_entries(bufs + s * CAP, b * TB + lanes, n, newest, True)
                eq = ((key == kth) & (idx >= 0)).to(tl.int32)
                rank = ties + tl.cumsum(eq, 0) + vce * (idx > newest).to(tl.int32)
                kblk = tl.maximum(kblk, tl.max(tl.where((eq != 0) & (rank == need), idx, -1), 0))
                ties += tl.sum(eq, 0)
                below += tl.sum(eq * (idx < newest).to(tl.int32), 0)
        kblk = tl.where((vce != 0) & (below + 1 == need), newest, kblk)
    tl.store(par + 0, lo.to(tl.int64))
    tl.store(par + 1, kth.to(tl.int64))
    tl.store(par + 2, kblk.to(tl.int64))
    tl.store(par + 3, newest.to(tl.int64))


@triton.jit
def block_scores(s_ptr, row_s, blk, C, block, BLK: tl.constexpr):
    """The [NBB, BLK] tile of scores of the blocks blk of a row (-inf past the block or the row):
    block_keys' loads, for the stream's prefetch."""
    j = tl.arange(0, BLK)
    offs = blk[:, None] * block + j[None, :]
    inb = (j[None, :] < block) & (offs < C)
    return tl.load(s_ptr + row_s + offs, mask=inb, other=float("-inf")).to(tl.float32)


@triton.jit
def cand_stream_rows(s_ptr, buf_ptr, cnt_ptr, nv_ptr, C, KB, S, SEGB, CAP, slack, stride_s,
                     BS: tl.constexpr, BLK: tl.constexpr, NBB: tl.constexpr, TB: tl.constexpr):
    """Row program_id(0), block segment program_id(1) (of S, SEGB blocks each, a multiple of NBB)
    of kernels.indexer.reference.candidate_mask's block select, streamed over the (unforced)
    block keys (block_keys' max, f32_key; 0 for a block without a visible entry), NBB blocks a
    step, the next step's tile loaded first; counts the visible entries. Leaves the segment's KB
    largest blocks and its visible count for cand_merge_rows."""
    r, sg, slot, buf = stream_slot(buf_ptr, S, CAP)
    b0 = sg * SEGB
    lanes = tl.arange(0, NBB)
    n = tl.zeros([], dtype=tl.int32)
    thr = tl.zeros([], dtype=tl.uint32)
    nvis = tl.zeros([], dtype=tl.int32)
    x = block_scores(s_ptr, r * stride_s, b0 + lanes, C, BS, BLK)
    for ch in range(tl.cdiv(tl.minimum(SEGB, tl.cdiv(C, BS) - b0), NBB)):
        blk = b0 + ch * NBB + lanes
        xn = block_scores(s_ptr, r * stride_s, blk + NBB, C, BS, BLK)
        if n > CAP - NBB:  # no room for a whole step: tighten first
            n, thr = stream_tighten(buf, cnt_ptr + slot, n, KB, slack, TB)
        nvis += tl.sum(tl.sum((x > float("-inf")).to(tl.int32), 1), 0)
        n = stream_append(buf, n, thr, stream_keys(tl.max(x, axis=1)), blk)
        x = xn
    tl.store(nv_ptr + slot, nvis)
    stream_end(buf, cnt_ptr + slot, n, KB, TB)


@triton.jit
def cand_merge_rows(buf_ptr, cnt_ptr, nv_ptr, par_ptr, KB, S, CAP, BS: tl.constexpr,
                    TB: tl.constexpr):
    """Row program_id(0): its par from the S segments' buffers (cand_stream_rows)."""
    r = tl.program_id(0).to(tl.int64)
    cand_finish(buf_ptr + r * S * CAP, cnt_ptr + r * S, nv_ptr + r * S, S, CAP, KB,
                par_ptr + r * 4, BS, TB)


@triton.jit
def cand_write_rows(s_ptr, par_ptr, out_ptr, C, stride_s, stride_o, BS: tl.constexpr,
                    BLK: tl.constexpr, NBB: tl.constexpr):
    """Row program_id(0), blocks program_id(1) * NBB ...: out = (block kept, by the row's par from
    cand_finish) & (score > -inf), bytes 0 / 1; every entry of the row written once."""
    r = tl.program_id(0).to(tl.int64)
    lo = tl.load(par_ptr + r * 4).to(tl.uint32)
    kth = tl.load(par_ptr + r * 4 + 1).to(tl.uint32)
    kblk = tl.load(par_ptr + r * 4 + 2).to(tl.int32)
    newest = tl.load(par_ptr + r * 4 + 3).to(tl.int32)
    blk = tl.program_id(1) * NBB + tl.arange(0, NBB)
    key, vis, offs, inb = block_keys(s_ptr, r * stride_s, blk, C, BS, newest, BLK)
    keep = (key >= lo) | ((key == kth) & (blk <= kblk))
    tl.store(out_ptr + r * stride_o + offs, (keep[:, None] & vis).to(tl.uint8), mask=inb)
