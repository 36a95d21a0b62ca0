"""Step metadata from scheduled chunks (docs/step-convention.md), and padding to a (T, R) bucket.

A captured graph has fixed shapes, so a step of T tokens in R requests is padded to a bucket
(T_b, R_b): the extra R_b - R request rows are pad requests on the scratch slot, with nothing
cached, sharing the T_b - T pad tokens (0-token rows allowed when there are more rows than
tokens). Real requests keep their rows, so real outputs are the leading rows of each output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from megagraph.models.session import SeqChunk, step_metadata

__all__ = ["SeqChunk", "StepBatch", "make_batch", "pad_batch"]


@dataclass(frozen=True)
class StepBatch:
    """The metadata tensors of one step and how many of its tokens/requests are real."""

    meta: dict[str, torch.Tensor]  # token_ids, positions, token_req [T]; seq_* [R] (host, i64)
    num_tokens: int  # real tokens (leading rows of token-shaped outputs)
    num_reqs: int  # real requests (leading rows of request-shaped outputs)

    @property
    def padded_tokens(self) -> int:
        return int(self.meta["token_ids"].shape[0])

    @property
    def padded_reqs(self) -> int:
        return int(self.meta["seq_slots"].shape[0])

    @property
    def last_token_rows(self) -> torch.Tensor:
        """Row of each real request's last new token in token-shaped outputs."""
        return torch.cumsum(self.meta["seq_new"][: self.num_reqs], 0) - 1


def make_batch(chunks: Sequence[SeqChunk], cached: Mapping[int, int]) -> StepBatch:
    meta = step_metadata(chunks, cached)
    return StepBatch(meta, int(meta["token_ids"].shape[0]), len(chunks))


def pad_batch(batch: StepBatch, num_tokens: int, num_reqs: int, *, scratch_slot: int,
              capacity: int, pad_token_id: int = 0) -> StepBatch:
    """`batch` padded to (num_tokens, num_reqs) with pad requests on `scratch_slot`."""
    t, r = batch.padded_tokens, batch.padded_reqs
    pad_t, pad_r = num_tokens - t, num_reqs - r
    if pad_t < 0 or pad_r < 0:
        raise ValueError(f"bucket (T={num_tokens}, R={num_reqs}) is smaller than the step "
                         f"(T={t}, R={r})")
    if pad_t == 0 and pad_r == 0:
        return batch
    if pad_t and not pad_r:
        raise ValueError(f"bucket (T={num_tokens}, R={num_reqs}) has {pad_t} pad tokens but no "
                         "pad request row to hold them")
    counts = [pad_t // pad_r + (i < pad_t % pad_r) for i in range(pad_r)] if pad_r else []
    if counts and counts[0] > capacity:
        raise ValueError(f"{counts[0]} pad tokens in one pad request exceed the slot capacity "
                         f"{capacity}")
    m = batch.meta
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    pos = [p for n in counts for p in range(n)]
    req = [r + i for i, n in enumerate(counts) for _ in range(n)]
    meta = {
        "token_ids": torch.cat([m["token_ids"], torch.full((pad_t,), pad_token_id, dtype=torch.int64)]),
        "positions": torch.cat([m["positions"], i64(pos)]),
        "token_req": torch.cat([m["token_req"], i64(req)]),
        "seq_slots": torch.cat([m["seq_slots"], torch.full((pad_r,), scratch_slot, dtype=torch.int64)]),
        "seq_cached": torch.cat([m["seq_cached"], torch.zeros(pad_r, dtype=torch.int64)]),
        "seq_new": torch.cat([m["seq_new"], i64(counts)]),
    }
    return StepBatch(meta, batch.num_tokens, batch.num_reqs)
