"""Views, casts and row selection: ops that move no math, only layout."""

from __future__ import annotations

import torch
from torch import Tensor

from megagraph.graph.types import TORCH_DTYPES


def split_heads(x: Tensor, *, heads: int) -> Tensor:
    """[T, H*D] -> [T, H, D]."""
    return x.reshape(x.shape[0], heads, x.shape[1] // heads)


def merge_heads(x: Tensor) -> Tensor:
    """[T, H, D] -> [T, H*D]."""
    return x.reshape(x.shape[0], -1)


def cast(x: Tensor, *, dtype: str) -> Tensor:
    return x.to(TORCH_DTYPES[dtype])


def select_last(x: Tensor, seq_new: Tensor) -> Tensor:
    """Row of each request's last new token (requests are contiguous in the step)."""
    last = (torch.cumsum(seq_new, 0) - 1).clamp(min=0)  # an empty request row gets row 0 (unused)
    return x.index_select(0, last)


STRUCTURAL = {"split_heads": split_heads, "merge_heads": merge_heads, "cast": cast,
              "select_last": select_last}
