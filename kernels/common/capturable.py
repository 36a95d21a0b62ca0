"""Shared machinery of the capturable kernels: request / tile bookkeeping without host syncs,
static chunking, the "final writer" state update, and dequantization without host constants.

Every helper here derives shapes from input *shapes* only (plus Python-int attributes); index
tensors are computed on the inputs' device and never read back to the host.

Tiling. Ops whose keys are shared by the tokens of one request (ring rows, compressed rows, index
keys) and the MoE (tokens routed to one expert) process their items in *segment-aligned tiles*:
items are sorted by segment (requests are contiguous in the token axis; MoE pairs are sorted by
expert), each segment is cut into tiles of at most `tile` items, and a tile never spans two
segments. With N items in G segments the number of tiles is at most N // tile + G (and at most N),
a static bound, so the tile table has a static shape; unused tile slots are marked empty.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# Elements (fp32) one chunk's largest intermediate may hold. Tests lower it to exercise multi-chunk
# paths; a runtime may raise it. Read at call time.
CHUNK_ELEMS = 1 << 27
# Most tokens one query tile of a request holds (attention / indexer), and most rows of one MoE tile.
MAX_TOKEN_TILE = 64
MAX_EXPERT_TILE = 128
# MoE tiles hold about EXPERT_TILE_FILL * (T*k / E) rows: larger tiles dequantize fewer expert
# copies (at most T*k // M + E of them) at the price of padded GEMM rows.
EXPERT_TILE_FILL = 4

I64 = torch.int64


def chunk_ranges(n: int, per_item: int) -> list[tuple[int, int]]:
    """Static [start, end) ranges over n items so that one range holds <= CHUNK_ELEMS elements
    (at least one item per range)."""
    step = max(1, CHUNK_ELEMS // max(1, per_item))
    return [(s, min(n, s + step)) for s in range(0, n, step)]


# ---------------------------------------------------------------------------------------------
# per-request statistics
# ---------------------------------------------------------------------------------------------


def seg_counts(seg: Tensor, num: int) -> Tensor:
    """Items per segment, i64[num] (scatter-add: no bincount, whose output size is data-dependent)."""
    return torch.zeros(num, dtype=I64, device=seg.device).scatter_add_(0, seg, torch.ones_like(seg))


def first_last_positions(positions: Tensor, token_req: Tensor, num_requests: int) -> tuple[Tensor, Tensor]:
    """Per request: position of its first / last new token (i64[R]); a request without tokens gets
    first = int64 max and last = -1."""
    dev = positions.device
    first = torch.full((num_requests,), torch.iinfo(I64).max, dtype=I64, device=dev)
    first = first.scatter_reduce(0, token_req, positions, reduce="amin")
    last = torch.full((num_requests,), -1, dtype=I64, device=dev)
    last = last.scatter_reduce(0, token_req, positions, reduce="amax")
    return first, last


@dataclass
class Tiles:
    """Segment-aligned tiles over N sorted items (see the module doc).

    seg [NT] segment of each tile (clamped to a valid segment for empty tiles), valid [NT],
    start [NT] first item, length [NT] items in the tile (0 for empty tiles), items [NT, tile] item
    indices (clamped into range), item_valid [NT, tile]; item_tile / item_row [N]: where each item
    sits."""

    tile: int
    seg: Tensor
    valid: Tensor
    start: Tensor
    length: Tensor
    items: Tensor
    item_valid: Tensor
    item_tile: Tensor
    item_row: Tensor

    @property
    def count(self) -> int:
        return self.seg.shape[0]


def tile_size(items: int, segments: int, cap: int) -> int:
    """Tile size for `items` items over `segments` segments: about items / segments, in 1..cap, so
    the padded work (tiles * tile) stays below 2 * items + segments."""
    return max(1, min(cap, items // max(1, segments)))


def count_at_most(ends: Tensor, n: int) -> Tensor:
    """i64[n]: for b = 0..n-1, how many of `ends` are <= b; torch.searchsorted(ends, arange(n),
    right=True) for nondecreasing `ends`, as a scatter-add and a cumsum.

    NOTE: not torch.searchsorted: Inductor's CUDA lowering of searchsorted reads a boundaries
    tensor that is a view at the wrong offset (pytorch/pytorch#182343: off by one, silently) and
    failed to compile inside a whole decode segment on the H200 (torch 2.11; docs/compile.md)."""
    hits = torch.zeros(n + 1, dtype=I64, device=ends.device)
    hits.scatter_add_(0, ends.clamp(0, n), torch.ones_like(ends))
    return torch.cumsum(hits[:n], 0)


def segment_tiles(seg: Tensor, num_segments: int, tile: int) -> Tiles:
    """Tiles of at most `tile` items over the items sorted by segment id seg [N] (values in
    0..num_segments-1, nondecreasing)."""
    dev = seg.device
    n = seg.shape[0]
    nt = min(n, n // tile + num_segments)
    counts = seg_counts(seg, num_segments)
    start = torch.cumsum(counts, 0) - counts
    ntiles = (counts + (tile - 1)) // tile
    tend = torch.cumsum(ntiles, 0)
    toff = tend - ntiles
    b = torch.arange(nt, dtype=I64, device=dev)
    tseg = count_at_most(tend, nt)
    valid = tseg < num_segments
    tseg = tseg.clamp(max=num_segments - 1)
    j = b - toff[tseg]
    tstart = start[tseg] + j * tile
    tlen = torch.where(valid, (counts[tseg] - j * tile).clamp(0, tile), torch.zeros_like(j))
    k = torch.arange(tile, dtype=I64, device=dev)
    items = (tstart[:, None] + k[None, :]).clamp(0, max(n - 1, 0))
    item_valid = k[None, :] < tlen[:, None]
    local = torch.arange(n, dtype=I64, device=dev) - start[seg]
    item_tile = toff[seg] + local // tile
    item_row = local % tile
    return Tiles(tile, tseg, valid, tstart, tlen, items, item_valid, item_tile, item_row)


def request_tiles(token_req: Tensor, num_requests: int) -> Tiles:
    """Query tiles of the step's tokens (each inside one request)."""
    t = token_req.shape[0]
    return segment_tiles(token_req, num_requests, tile_size(t, num_requests, MAX_TOKEN_TILE))


def scatter_rows(buf: Tensor, rows: Tensor, valid: Tensor, values: Tensor) -> None:
    """buf [N+1, ...]: buf[rows[i]] = values[i] where valid, else into the dummy last row."""
    dummy = buf.shape[0] - 1
    idx = torch.where(valid, rows, torch.full_like(rows, dummy))
    buf.index_copy_(0, idx.reshape(-1), values.reshape(-1, *values.shape[valid.dim():]))


def compact(mask: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Indices of the True entries of mask [N] in order, in a static buffer of `capacity` slots:
    (rows i64[capacity] clamped into range, valid bool[capacity]). Entries past `capacity` are
    dropped (callers size capacity by a bound that holds for well-formed steps)."""
    dev = mask.device
    n = mask.shape[0]
    m = mask.to(I64)
    rank = torch.cumsum(m, 0) - m
    target = torch.where(mask & (rank < capacity), rank, torch.full_like(rank, capacity))
    buf = torch.zeros(capacity + 1, dtype=I64, device=dev)
    buf = buf.scatter(0, target, torch.arange(n, dtype=I64, device=dev))[:capacity]
    valid = torch.arange(capacity, dtype=I64, device=dev) < m.sum()
    return buf, valid


# ---------------------------------------------------------------------------------------------
# state writes
# ---------------------------------------------------------------------------------------------


def final_writer_update(buf: Tensor, slot: Tensor, row: Tensor, writer: Tensor, use_new: Tensor,
                        src: Tensor, *, inplace: bool) -> Tensor:
    """Scatter-free-of-races state write: every token t writes buf[slot[t], row[t]] with
    src[writer[t]] (if use_new[t]) or with the slot row's old value. Callers choose writer[t] as the
    *final* writer of that (slot, row) within t's request, so all tokens that hit one row write the
    same value and duplicate indices are harmless (duplicates across requests only happen for the
    shared scratch slot of pad requests)."""
    if slot.shape[0] == 0:
        return buf if inplace else buf.clone()
    old = buf[slot, row]
    new = src[writer.clamp(0, src.shape[0] - 1)].to(buf.dtype)
    val = torch.where(use_new.reshape(-1, *([1] * (new.dim() - 1))), new, old)
    out = buf if inplace else buf.clone()
    out.index_put_((slot, row), val)
    return out


def ring_writers(positions: Tensor, last: Tensor, period: int) -> tuple[Tensor, Tensor]:
    """For a ring of `period` rows: (row p % period, token offset to the request's latest token of
    the same residue); `last` = the token's request's last position."""
    row = torch.remainder(positions, period)
    shift = torch.div(last - positions, period, rounding_mode="floor").clamp(min=0) * period
    return row, shift


# ---------------------------------------------------------------------------------------------
# number formats without host constants
# ---------------------------------------------------------------------------------------------


def e2m1_decode(codes: Tensor) -> Tensor:
    """E2M1 nibble codes (low 4 bits) -> f32, arithmetically (no lookup table to copy to the device).
    Code 8 is -0.0, like formats.e2m1_to_f32."""
    c = codes.to(torch.int32) & 0xF
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).to(torch.float32)) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def e8m0_to_f32(s: Tensor) -> Tensor:
    from megagraph.kernels import formats

    return formats.e8m0_to_f32(s)


def e8m0_ceil_div(x: Tensor, c: float) -> Tensor:
    """Positive finite f32 x -> e8m0 of 2^ceil(log2(x / c)), without dividing (the reference's
    ceil_log2_div: the same bytes under torch.compile's approximate CUDA division)."""
    from megagraph.kernels.dense.quant import ceil_log2_div

    return (ceil_log2_div(x.float(), c) + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def e2m1_pair_table(device) -> Tensor:
    """f32[256, 2]: the two E2M1 values (low nibble first) of every byte, built on `device`."""
    b = torch.arange(256, dtype=torch.int32, device=device)
    return torch.stack((e2m1_decode(b & 0xF), e2m1_decode(b >> 4)), dim=-1)


def unpack_mxfp4(packed: Tensor, scale: Tensor, lut: Tensor | None = None) -> Tensor:
    """(int8 [..., O, I/2], e8m0 [..., O, I/b]) -> f32 [..., O, I] (formats.unpack_mxfp4 with a
    per-byte table built on the device instead of a host lookup table; three full-size
    intermediates)."""
    lut = e2m1_pair_table(packed.device) if lut is None else lut
    nb = scale.shape[-1]
    i = packed.shape[-1] * 2
    vals = lut[packed.view(torch.uint8).to(torch.int32)]  # [..., O, I/2, 2]
    vals = vals.reshape(*packed.shape[:-1], nb, i // nb) * e8m0_to_f32(scale)[..., None]
    return vals.reshape(*packed.shape[:-1], i)


WEIGHT_FORMATS = ("dense", "fp8_block", "mxfp4")


def dequantize(weight: Tensor, scale: Tensor | None, fmt: str, lut: Tensor | None = None, *,
               mxfp4: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """Weights (optionally stacked [E, O, I]) -> f32 (lut: an e2m1_pair_table to reuse across
    calls; mxfp4: the MXFP4 unpack in place of this module's, the reference's for
    kernels.gemm.reference.dequantize_weight)."""
    if fmt == "dense":
        if scale is not None:
            raise ValueError("dense weights take no scale")
        return weight.float()
    if scale is None:
        raise ValueError(f"fmt {fmt!r} needs a scale tensor")
    if fmt == "fp8_block":
        from megagraph.kernels import formats

        return formats.dequantize_fp8_block(weight, scale).float()
    if fmt == "mxfp4":
        return unpack_mxfp4(weight, scale, lut) if mxfp4 is None else mxfp4(weight, scale)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {WEIGHT_FORMATS}")
