"""Shared helpers for the reference-op tests: step metadata builders and naive (loop-based)
dequantizers that do not use megagraph.kernels.formats."""
from __future__ import annotations

import random

import torch

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def step_meta(reqs):
    """reqs: list of (slot, cached, new) → dict of the per-step metadata tensors."""
    positions, token_req = [], []
    for r, (_slot, c, n) in enumerate(reqs):
        positions += list(range(c, c + n))
        token_req += [r] * n
    i64 = torch.int64
    return dict(
        positions=torch.tensor(positions, dtype=i64),
        token_req=torch.tensor(token_req, dtype=i64),
        seq_slots=torch.tensor([s for s, _, _ in reqs], dtype=i64),
        seq_cached=torch.tensor([c for _, c, _ in reqs], dtype=i64),
        seq_new=torch.tensor([n for _, _, n in reqs], dtype=i64),
    )


def random_chunks(length: int, rng: random.Random, max_chunk: int) -> list[int]:
    """Split ``length`` into random chunk sizes in 1..max_chunk (always includes some size-1 steps)."""
    out, done = [], 0
    while done < length:
        n = min(length - done, rng.choice([1, 1, rng.randint(1, max_chunk)]))
        out.append(n)
        done += n
    return out


def e8m0_value(byte: int) -> float:
    return 2.0 ** (byte - 127)


def naive_dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, b: int) -> torch.Tensor:
    """Per-element loop: W[o,i] = float(q[o,i]) · 2^(s[o//b, i//b] − 127)."""
    qf = q.float().tolist()
    sb = scale.view(torch.uint8).tolist()
    O, I = q.shape
    return torch.tensor([[qf[o][i] * e8m0_value(sb[o // b][i // b]) for i in range(I)] for o in range(O)],
                        dtype=torch.float64)


def naive_unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element loop: low nibble = even column, bit 3 = sign, scale per 32 columns."""
    pb = packed.view(torch.uint8).tolist()
    sb = scale.view(torch.uint8).tolist()
    O, half = packed.shape
    out = []
    for o in range(O):
        row = []
        for i in range(2 * half):
            byte = pb[o][i // 2]
            nib = (byte & 0xF) if i % 2 == 0 else (byte >> 4)
            v = E2M1_GRID[nib & 7] * (-1.0 if nib & 8 else 1.0)
            row.append(v * e8m0_value(sb[o][i // 32]))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def random_e8m0(shape, lo: int = 122, hi: int = 130, gen=None) -> torch.Tensor:
    return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)


def random_mxfp4(shape, gen=None) -> torch.Tensor:
    """Random packed-FP4 bytes int8 [..., I/2]."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.int8)
