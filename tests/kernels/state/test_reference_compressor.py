"""compress_pool + cache_write vs a naive per-group formulation; random chunking across steps (with
several requests interleaved in each step) ≡ one-shot. Tolerance: fp32 vs fp64 naive 1e-5; chunked vs
one-shot exact up to 1e-6 (same arithmetic, different gathers)."""
import math
import random

import pytest
import torch
from _reference_helpers import random_chunks, step_meta

from megagraph.kernels.reference_table import cache_write, compress_pool

DC = 8


def naive_groups(u, s, ratio):
    """Latent of every complete group of the full sequence: channel-wise softmax(s)-weighted sum of u."""
    L = u.shape[0]
    out = []
    for gi in range(L // ratio):
        row = []
        for ch in range(DC):
            ss = [s[gi * ratio + k, ch].item() for k in range(ratio)]
            mx = max(ss)
            e = [math.exp(v - mx) for v in ss]
            row.append(sum(e[k] / sum(e) * u[gi * ratio + k, ch].item() for k in range(ratio)))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(-1, DC)


def _run_step(reqs, u_full, s_full, slots_of, pend_kv, pend_gate, cache, ratio):
    m = step_meta(reqs)
    u = torch.cat([u_full[r][c:c + n] for r, (_, c, n) in reqs_with_ids(reqs, slots_of)])
    s = torch.cat([s_full[r][c:c + n] for r, (_, c, n) in reqs_with_ids(reqs, slots_of)])
    lat, pk, pg = compress_pool(u, s, pend_kv, pend_gate, m["positions"], m["token_req"], m["seq_slots"],
                                ratio=ratio)
    cache = cache_write(cache, lat, m["positions"], m["token_req"], m["seq_slots"], ratio=ratio)
    return m, lat, pk, pg, cache


def reqs_with_ids(reqs, slots_of):
    inv = {v: k for k, v in slots_of.items()}
    return [(inv[slot], (slot, c, n)) for slot, c, n in reqs]


@pytest.mark.parametrize("ratio", [2, 4])
def test_compress_pool_chunked_equals_oneshot_and_naive(ratio):
    rng = random.Random(60 + ratio)
    g = torch.Generator().manual_seed(60 + ratio)
    lens = {0: 23, 1: 17, 2: 9}
    slots_of = {0: 2, 1: 0, 2: 3}
    S, C = 4, 12
    u_full = {r: torch.randn(L, DC, generator=g) for r, L in lens.items()}
    s_full = {r: torch.randn(L, DC, generator=g) * 2 for r, L in lens.items()}
    naive = {r: naive_groups(u_full[r], s_full[r], ratio) for r in lens}

    # one shot: all requests in a single step
    reqs = [(slots_of[r], 0, lens[r]) for r in lens]
    pend0 = torch.randn(S, ratio, DC, generator=g)  # junk: a fresh slot's pending must never be read
    m, lat, _, _, cache1 = _run_step(reqs, u_full, s_full, slots_of, pend0, pend0.clone(),
                                     torch.zeros(S, C, DC), ratio)
    assert lat.dtype == torch.float32 and lat.shape == (sum(lens.values()), DC)
    start = 0
    for r, L in lens.items():
        p = torch.arange(L)
        done = (p + 1) % ratio == 0
        assert torch.all(lat[start:start + L][~done] == 0)
        torch.testing.assert_close(lat[start:start + L][done].double(), naive[r], rtol=1e-5, atol=1e-6)
        n_ent = L // ratio
        torch.testing.assert_close(cache1[slots_of[r], :n_ent].double(), naive[r], rtol=1e-5, atol=1e-6)
        start += L

    # chunked: random chunk sizes, requests interleaved across steps
    chunks = {r: random_chunks(L, rng, 7) for r, L in lens.items()}
    done = {r: 0 for r in lens}
    pk, pg = torch.randn(S, ratio, DC, generator=g), torch.randn(S, ratio, DC, generator=g)
    cache = torch.zeros(S, C, DC)
    lat_by_req = {r: [] for r in lens}
    while any(chunks.values()):
        order = [r for r in lens if chunks[r] and rng.random() < 0.8] or [r for r in lens if chunks[r]]
        reqs = []
        for r in order:
            n = chunks[r].pop(0)
            reqs.append((slots_of[r], done[r], n))
        m, lat, pk, pg, cache = _run_step(reqs, u_full, s_full, slots_of, pk, pg, cache, ratio)
        start = 0
        for r, (_, c, n) in zip(order, reqs):
            lat_by_req[r].append(lat[start:start + n])
            done[r] += n
            start += n
    for r, L in lens.items():
        torch.testing.assert_close(torch.cat(lat_by_req[r]), _oneshot_rows(u_full[r], s_full[r], ratio),
                                   rtol=1e-6, atol=1e-6)
        n_ent = L // ratio
        torch.testing.assert_close(cache[slots_of[r], :n_ent], cache1[slots_of[r], :n_ent], rtol=1e-6, atol=1e-6)
        assert torch.all(cache[slots_of[r], n_ent:] == 0)


def _oneshot_rows(u, s, ratio):
    m = step_meta([(0, 0, u.shape[0])])
    pend = torch.zeros(1, ratio, DC)
    lat, _, _ = compress_pool(u, s, pend, pend, m["positions"], m["token_req"], m["seq_slots"], ratio=ratio)
    return lat


def test_pending_rows_hold_trailing_group():
    g = torch.Generator().manual_seed(62)
    ratio = 4
    m = step_meta([(1, 0, 6), (0, 5, 2)])  # slot 1: positions 0..5 → 4,5 pending; slot 0: 5,6 → pending 5,6
    u, s = torch.randn(8, DC, generator=g), torch.randn(8, DC, generator=g)
    pk0 = torch.randn(2, ratio, DC, generator=g)
    pg0 = torch.randn(2, ratio, DC, generator=g)
    lat, pk, pg = compress_pool(u, s, pk0, pg0, m["positions"], m["token_req"], m["seq_slots"], ratio=ratio)
    assert torch.equal(pk[1, 0], u[4]) and torch.equal(pk[1, 1], u[5])
    assert torch.equal(pk[0, 1], u[6]) and torch.equal(pk[0, 2], u[7])
    assert torch.equal(pg[0, 2], s[7]) and torch.equal(pk[0, 0], pk0[0, 0])  # pos 4 of slot 0 untouched
    # only slot 1's position 3 completes a group (slot 0's group 4..7 still lacks position 7)
    assert torch.all(lat[[0, 1, 2, 4, 5, 6, 7]] == 0) and torch.all(lat[3] != 0)


def test_ratio_one_passthrough_and_cache_write():
    g = torch.Generator().manual_seed(63)
    m = step_meta([(1, 3, 2), (0, 0, 3)])
    u = torch.randn(5, DC, generator=g).to(torch.bfloat16)
    lat, pk, pg = compress_pool(u, None, None, None, m["positions"], m["token_req"], m["seq_slots"], ratio=1)
    assert lat.dtype == torch.float32 and torch.equal(lat, u.float()) and pk is None and pg is None
    cache = torch.randn(2, 8, DC).to(torch.bfloat16)
    out = cache_write(cache, lat, m["positions"], m["token_req"], m["seq_slots"], ratio=1)
    ref = cache.clone()
    for t, (slot, p) in enumerate([(1, 3), (1, 4), (0, 0), (0, 1), (0, 2)]):
        ref[slot, p] = lat[t].to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
