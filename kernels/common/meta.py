"""Helpers over the per-step metadata of docs/step-convention.md (not ops)."""
from __future__ import annotations

import torch
from torch import Tensor


def request_spans(token_req: Tensor, num_requests: int) -> list[tuple[int, int]]:
    """[(start, count)] per request row 0..R−1 (requests are contiguous in the token axis)."""
    counts = torch.bincount(token_req, minlength=num_requests).tolist()
    spans, start = [], 0
    for n in counts:
        spans.append((start, n))
        start += n
    return spans


def live_requests(token_req: Tensor, seq_slots: Tensor, seq_cached: Tensor | None = None):
    """(start, count, slot, cached) of each request row with new tokens, in row order (cached is
    None without seq_cached): the per-request loop of the reference kernels."""
    for r, (start, n) in enumerate(request_spans(token_req, seq_slots.shape[0])):
        if n:
            yield start, n, int(seq_slots[r]), None if seq_cached is None else int(seq_cached[r])


def first_positions(positions: Tensor, token_req: Tensor, num_requests: int) -> Tensor:
    """Position of each request's first new token (= seq_cached), i64[R]; requests with no token get
    a large sentinel."""
    big = torch.full((num_requests,), torch.iinfo(torch.int64).max, dtype=torch.int64,
                     device=positions.device)
    return big.scatter_reduce(0, token_req, positions, reduce="amin")


def last_positions(positions: Tensor, token_req: Tensor, num_requests: int) -> Tensor:
    """Position of each request's last new token, i64[R] (−1 for a request with no token)."""
    init = torch.full((num_requests,), -1, dtype=torch.int64, device=positions.device)
    return init.scatter_reduce(0, token_req, positions, reduce="amax")
