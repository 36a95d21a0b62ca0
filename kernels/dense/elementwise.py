"""Small elementwise / gather ops: residual add and embedding lookup."""
from __future__ import annotations

from torch import Tensor


def add(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a + b`` computed in fp32, returned in a.dtype (shapes must broadcast to a's)."""
    return (a.float() + b.float()).to(a.dtype)


def embed(token_ids: Tensor, table: Tensor) -> Tensor:
    """Embedding gather: token_ids i64[T], table [V, d] → table[token_ids] [T, d] (table dtype, no scaling)."""
    return table[token_ids]
