"""Row chunking of the reference ops (not an op).

The reference kernels build whole [rows, ...] temporaries (attention scores [rows, heads, keys],
index dots [rows, heads, entries], selection masks [rows, entries]); at prefill sizes (4K new tokens
over 128K cached) one of them is tens of GiB. Processing the rows in passes bounds them. Chunk sizes
are static Python ints (no host sync), so the capturable ops that reuse the selections stay
CUDA-graph capturable. Every row goes through the same ops: inputs that fit one pass run exactly as
before, and on CPU the passes give bitwise the one-pass result (tests/kernels/common/test_reference_chunks.py);
a GPU BLAS may pick another GEMM kernel for a smaller product, i.e. another fp32 summation order.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ROW_CHUNK_ELEMS = 1 << 28  # elements of the largest per-pass temporary: ~1 GiB in fp32


def row_slices(start: int, stop: int, row_elems: int) -> list[slice]:
    """Slices covering rows [start, stop) such that a temporary of ``row_elems`` elements per row
    holds at most ROW_CHUNK_ELEMS elements per slice (at least one row each; the last is ragged)."""
    rows = max(1, ROW_CHUNK_ELEMS // max(1, row_elems))
    return [slice(r0, min(stop, r0 + rows)) for r0 in range(start, stop, rows)]


def by_rows(fn: Callable[..., Tensor], row_elems: int, first: Tensor, *rest: Tensor | None) -> Tensor:
    """``fn(first, *rest)`` over row chunks of every argument (None passes through), concatenated
    along rows; one call when all rows fit a single chunk."""
    chunks = row_slices(0, first.shape[0], row_elems)
    if len(chunks) <= 1:
        return fn(first, *rest)
    return torch.cat([fn(first[sl], *[None if x is None else x[sl] for x in rest]) for sl in chunks])
