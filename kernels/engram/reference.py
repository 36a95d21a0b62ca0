"""Engram n-gram hash memory (spec §1.3 layout, §3.3.2 hashing, §3.3.3 lookup and gated write)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from megagraph.graph.types import TORCH_DTYPES

# ----------------------------------------------------------------------------------------------------
# layout (host-side helper, not an op)
# ----------------------------------------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller–Rabin (exact for n < 3.3·10²⁴)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    """Hash layout of one Engram layer (plain Python ints, usable directly as op attributes).

    primes[n−2][h] for order n and head h; offsets[c] (c = (n−2)·n_heads + h) = exclusive prefix sum of
    the primes in column order; multipliers[0..max_ngram−1] (odd int64); num_embeddings = Σ primes.
    """

    layer_id: int
    primes: list[list[int]]
    offsets: list[int]
    multipliers: list[int]
    num_embeddings: int


def engram_layout(layer_ids: list[int], num_embeddings_check: list[int] | None = None, *,
                  max_ngram: int, n_heads: int, vocab_start: int,
                  compressed_vocab: int) -> dict[int, EngramLayout]:
    """Bucket primes, offsets and hash multipliers of every Engram layer (spec §1.3).

    For each layer (in order), order n = 2..max_ngram, head h: the smallest prime ≥ vocab_start not
    used by any earlier (layer, order, head) (search restarts at vocab_start for every order).
    Multipliers: ``numpy.random.default_rng(10007·layer_id).integers(0, max(1, (2**63−1) //
    compressed_vocab // 2), size=max_ngram, dtype=int64) · 2 + 1``. If num_embeddings_check is given,
    each layer's row total must equal it (ValueError otherwise).
    """
    used: set[int] = set()
    out: dict[int, EngramLayout] = {}
    bound = max(1, (2**63 - 1) // compressed_vocab // 2)
    for li, layer in enumerate(layer_ids):
        primes: list[list[int]] = []
        for _n in range(2, max_ngram + 1):
            row, cand = [], vocab_start - 1
            for _h in range(n_heads):
                cand += 1
                while cand in used or not is_prime(cand):
                    cand += 1
                used.add(cand)
                row.append(cand)
            primes.append(row)
        flat = [p for row in primes for p in row]
        offsets = [0]
        for p in flat[:-1]:
            offsets.append(offsets[-1] + p)
        rng = np.random.default_rng(10007 * layer)
        mult = (rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1).tolist()
        total = sum(flat)
        if num_embeddings_check is not None and total != num_embeddings_check[li]:
            raise ValueError(f"engram layer {layer}: primes sum to {total}, "
                             f"expected {num_embeddings_check[li]}")
        out[layer] = EngramLayout(layer, primes, offsets, [int(m) for m in mult], total)
    return out


# ----------------------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------------------


def token_map(token_ids: Tensor, table: Tensor) -> Tensor:
    """Compressed token ids: ``table[token_ids]`` (table i64[V]; token_ids i64[T] → i64[T])."""
    return table[token_ids]


def engram_hash(cids: Tensor, hist: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
                seq_cached: Tensor, *, multipliers: list[int], primes: list, offsets: list[int],
                pad_id: int, max_ngram: int) -> Tensor:
    """N-gram hash row ids i64[T, (max_ngram−1)·n_heads] (spec §3.3.2).

    cids i64[T]: compressed ids of this step's tokens; hist i64[S, max_ngram−1]: ids of the slot's
    previous positions c−max_ngram+1 … c−1 (most recent last). A negative id (in cids or hist) is
    DEAD/absent. pad_id is the COMPRESSED pad id (tokenmap[engram_pad_token_id]). primes:
    [max_ngram−1][n_heads] (nested or flat), offsets: [(max_ngram−1)·n_heads].
    For shift s = 0..max_ngram−1: src = id at position p−s (this step if ≥ c, else hist; absent if
    p−s < 0); once a shift is absent/DEAD every older shift is pad too; tok[s] = pad if blocked else src.
    ``h = tok[0]·m[0]``; for n = 1..: ``h ^= tok[n]·m[n]``; column (n−1)·n_heads + j =
    ``h mod primes[n−1][j] + offsets[col]`` (int64; no overflow for valid ids).
    """
    K = max_ngram
    dev = cids.device
    T = cids.shape[0]
    P = torch.tensor(primes, dtype=torch.int64, device=dev).reshape(K - 1, -1)
    n_heads = P.shape[1]
    O = torch.tensor(offsets, dtype=torch.int64, device=dev).reshape(K - 1, n_heads)
    m = [int(v) for v in multipliers]
    slots = seq_slots[token_req]
    c = seq_cached[token_req]
    t_idx = torch.arange(T, device=dev)
    blocked = torch.zeros(T, dtype=torch.bool, device=dev)
    pad = torch.full((T,), pad_id, dtype=torch.int64, device=dev)
    out = torch.empty(T, (K - 1) * n_heads, dtype=torch.int64, device=dev)
    h = None
    for s in range(K):  # loop over n-gram shifts (constant), vectorized over tokens
        q = positions - s
        src = cids[(t_idx - s).clamp(min=0)].to(torch.int64)
        if s > 0:
            hidx = ((K - 1) - (c - q)).clamp(0, K - 2)
            src = torch.where(q >= c, src, hist[slots, hidx].to(torch.int64))
        src = torch.where(q >= 0, src, torch.full_like(src, -1))
        blocked = blocked | (src < 0)
        tok = torch.where(blocked, pad, src)
        term = tok * m[s]
        h = term if h is None else torch.bitwise_xor(h, term)
        if s >= 1:
            out[:, (s - 1) * n_heads:s * n_heads] = torch.remainder(h[:, None], P[s - 1][None, :]) + O[s - 1][None, :]
    return out


def engram_hist_update(hist: Tensor, cids: Tensor, positions: Tensor, token_req: Tensor,
                       seq_slots: Tensor, seq_cached: Tensor, seq_new: Tensor) -> Tensor:
    """Advance the Engram history: for each request, hist'[slot] = the ids of positions
    c+n−K+1 … c+n−1 (K−1 = hist width, most recent last; n = seq_new), taken from this step's cids
    where ≥ c, else from the old hist; −1 where the position is < 0. Returns a new tensor."""
    K1 = hist.shape[1]
    T = cids.shape[0]
    out = hist.clone()
    if K1 == 0 or T == 0:
        return out
    dev = hist.device
    c, n = seq_cached, seq_new
    start = torch.cumsum(n, 0) - n
    j = torch.arange(K1, device=dev)
    q = (c + n - K1)[:, None] + j[None, :]  # [R, K1]
    step_idx = (start[:, None] + q - c[:, None]).clamp(0, T - 1)
    old_idx = (j[None, :] + n[:, None]).clamp(max=K1 - 1)
    val = torch.where(q >= c[:, None], cids[step_idx].to(hist.dtype),
                      hist[seq_slots[:, None], old_idx])
    val = torch.where(q >= 0, val, torch.full_like(val, -1))
    out[seq_slots] = val
    return out


def engram_lookup(table: Tensor, scale: Tensor | None, ids: Tensor, *, out_dtype: str = "bf16") -> Tensor:
    """Gather and dequantize Engram rows: ids i64[T, C] → out_dtype[T, C·W] (the activation dtype).

    table: float8_e4m3fn [rows, W] with scale e8m0 [rows, W/32] (one per 32 columns of each row), or a
    float table [rows, W] with scale None. Rows are concatenated in column order c = 0..C−1.
    Dequantized in fp32, then converted (exact for FP8 rows in bf16 and f32).
    """
    flat = ids.reshape(-1)
    rows = table[flat]
    if scale is None:
        vals = rows.float()
    else:
        from megagraph.kernels import formats  # lazy

        vals = formats.dequantize_fp8_rows(rows, scale[flat])
    return vals.reshape(ids.shape[0], -1).to(TORCH_DTYPES[out_dtype])


def engram_gate(H: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, *, eps: float) -> Tensor:
    """Gated Engram write into all streams (spec §3.3.3).

    H [T, n, d]; kv [T, (n+1)·d] = wkv·e (keys first: K = kv[:, :n·d] as [n, d], value = kv[:, n·d:]);
    q_weight, k_weight [n, d]. Per stream c:
    ``z = Σ(H_c ⊙ q_c⊙k_c ⊙ K_c) · rsqrt(mean(H_c²)+eps) · rsqrt(mean(K_c²)+eps) / sqrt(d)``,
    ``gate = σ(sign(z)·sqrt(max(|z|, 1e-6)))``, ``H'_c = H_c + gate·value``.
    fp32 math, returns H.dtype.
    """
    T, n, d = H.shape
    hf = H.float()
    kvf = kv.float()
    K = kvf[:, :n * d].reshape(T, n, d)
    val = kvf[:, n * d:]
    w = q_weight.float() * k_weight.float()
    rho = torch.rsqrt(hf.pow(2).mean(-1) + eps) * torch.rsqrt(K.pow(2).mean(-1) + eps)  # [T, n]
    z = (hf * w[None] * K).sum(-1) * rho / (d ** 0.5)
    gate = torch.sigmoid(torch.sign(z) * torch.sqrt(z.abs().clamp(min=1e-6)))
    return (hf + gate[:, :, None] * val[:, None, :]).to(H.dtype)
