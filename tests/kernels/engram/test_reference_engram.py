"""Engram: §1.3 layout numbers; engram_hash vs a naive per-position Python-int formulation (one shot
and incremental with engram_hist_update across random chunks, mixed requests, DEAD tokens);
engram_lookup vs naive row dequant; engram_gate vs naive per-stream loops (fp64, tolerance 1e-5)."""
import math
import random
import time

import torch
from _reference_helpers import random_chunks, step_meta

from megagraph.kernels.reference_table import (engram_gate, engram_hash, engram_hist_update, engram_layout,
                                         engram_lookup, token_map)

V41 = dict(max_ngram=4, n_heads=8, vocab_start=16000000, compressed_vocab=99092)


def _layout():
    return engram_layout([1, 14], [384006168, 384016682], **V41)


def test_layout_reproduces_v41_numbers_fast():
    t0 = time.perf_counter()
    L = _layout()
    assert time.perf_counter() - t0 < 1.0
    assert L[1].num_embeddings == 384006168 and L[14].num_embeddings == 384016682
    assert L[1].primes == [
        [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
        [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
        [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]]
    assert L[14].primes == [
        [16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
        [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
        [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]]
    assert L[1].offsets[:3] == [0, 16000057, 32000136] and L[1].offsets[-1] == 368005705
    assert len(L[1].offsets) == 24
    assert L[1].multipliers == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert L[14].multipliers == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    assert all(isinstance(m, int) and m % 2 == 1 for m in L[1].multipliers)
    try:
        engram_layout([1], [384006169], **V41)
    except ValueError:
        pass
    else:
        raise AssertionError("row-count check must fail")


def naive_hash(g, p, lay, pad, K=4):
    """Spec §3.3.2 on the full id history g (−1 = DEAD), with Python ints."""
    tok, blocked = [], False
    for s in range(K):
        src = g[p - s] if p - s >= 0 else -1
        blocked = blocked or p < s or src < 0
        tok.append(pad if blocked else src)
    nh = len(lay.primes[0])
    r = tok[0] * lay.multipliers[0]
    ids = []
    for n in range(1, K):
        r ^= tok[n] * lay.multipliers[n]
        ids += [r % lay.primes[n - 1][h] + lay.offsets[(n - 1) * nh + h] for h in range(nh)]
    return ids


def _attrs(lay, pad):
    return dict(multipliers=lay.multipliers, primes=lay.primes, offsets=lay.offsets, pad_id=pad, max_ngram=4)


def _sequences(rng, lens):
    seqs = {}
    for r, L in lens.items():
        seq = [rng.randrange(99092) for _ in range(L)]
        for _ in range(2):  # a few DEAD (image) positions
            seq[rng.randrange(L)] = -1
        seqs[r] = seq
    return seqs


def test_engram_hash_incremental_equals_oneshot_and_naive():
    rng = random.Random(90)
    lay = _layout()[14]
    pad = 7
    lens = {0: 19, 1: 11, 2: 3}
    slots = {0: 3, 1: 0, 2: 1}
    seqs = _sequences(rng, lens)
    S = 4
    attrs = _attrs(lay, pad)

    # one shot, all requests in one step
    reqs = [(slots[r], 0, lens[r]) for r in lens]
    m = step_meta(reqs)
    cids = torch.tensor([v for r in lens for v in seqs[r]])
    hist0 = torch.randint(0, 99092, (S, 3))  # junk: must not be read for a fresh slot
    ids = engram_hash(cids, hist0, m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"], **attrs)
    assert ids.dtype == torch.int64 and ids.shape == (cids.shape[0], 24)
    start = 0
    oneshot = {}
    for r, L in lens.items():
        oneshot[r] = ids[start:start + L]
        for p in range(L):
            assert ids[start + p].tolist() == naive_hash(seqs[r], p, lay, pad), (r, p)
        start += L
    assert int(ids.min()) >= 0 and int(ids.max()) < lay.num_embeddings  # §8.1

    # incremental: random chunks, requests interleaved, history carried in hist
    hist = torch.full((S, 3), -1, dtype=torch.int64)
    chunks = {r: random_chunks(L, rng, 5) for r, L in lens.items()}
    done = {r: 0 for r in lens}
    got = {r: [] for r in lens}
    while any(chunks.values()):
        order = [r for r in lens if chunks[r]]
        reqs = []
        for r in order:
            reqs.append((slots[r], done[r], chunks[r].pop(0)))
        m = step_meta(reqs)
        cids = torch.tensor([v for (slot, c, n), r in zip(reqs, order) for v in seqs[r][c:c + n]])
        out = engram_hash(cids, hist, m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"], **attrs)
        hist = engram_hist_update(hist, cids, m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"],
                                  m["seq_new"])
        start = 0
        for (slot, c, n), r in zip(reqs, order):
            got[r].append(out[start:start + n])
            done[r] += n
            start += n
            hl = seqs[r][:done[r]][-3:]
            assert hist[slot].tolist() == [-1] * (3 - len(hl)) + hl  # naive history
    for r in lens:
        assert torch.equal(torch.cat(got[r]), oneshot[r])


def test_token_map_and_lookup():
    g = torch.Generator().manual_seed(91)
    tm = torch.randint(0, 50, (100,), generator=g)
    tok = torch.tensor([5, 99, 0, 5])
    assert token_map(tok, tm).tolist() == [tm[5].item(), tm[99].item(), tm[0].item(), tm[5].item()]

    rows, W = 40, 64
    table = (torch.randn(rows, W, generator=g) * 20).to(torch.float8_e4m3fn)
    sb = torch.randint(120, 130, (rows, W // 32), dtype=torch.uint8, generator=g)
    scale = sb.view(torch.float8_e8m0fnu)
    ids = torch.randint(0, rows, (3, 5), generator=g)
    out = engram_lookup(table, scale, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5 * W)
    tf = table.float()
    for t in range(3):
        for c in range(5):
            r = int(ids[t, c])
            for k in range(W):
                ref = tf[r, k].item() * 2.0 ** (int(sb[r, k // 32]) - 127)
                assert out[t, c * W + k].item() == torch.tensor(ref).to(torch.bfloat16).item()
    # in an f32 graph the rows come out f32: the same values (FP8 rows are exact in bf16 and f32)
    out32 = engram_lookup(table, scale, ids, out_dtype="f32")
    assert out32.dtype == torch.float32 and torch.equal(out32, out.float())
    ftab = torch.randn(rows, W, generator=g).to(torch.bfloat16)
    out2 = engram_lookup(ftab, None, ids)
    assert torch.equal(out2, ftab[ids].reshape(3, -1))
    ftab32 = torch.randn(rows, W, generator=g)
    assert torch.equal(engram_lookup(ftab32, None, ids, out_dtype="f32"), ftab32[ids].reshape(3, -1))


def test_engram_gate_matches_naive():
    g = torch.Generator().manual_seed(92)
    T, n, d, eps = 4, 4, 16, 1e-20
    H = (torch.randn(T, n, d, generator=g) * 2).to(torch.bfloat16)
    kv = torch.randn(T, (n + 1) * d, generator=g) * 3
    qw = torch.randn(n, d, generator=g).to(torch.bfloat16)
    kw = torch.randn(n, d, generator=g).to(torch.bfloat16)
    out = engram_gate(H, kv, qw, kw, eps=eps)
    assert out.dtype == torch.bfloat16
    out32 = engram_gate(H.float(), kv, qw, kw, eps=eps)
    gates = set()
    for t in range(T):
        for c in range(n):
            h = H[t, c].double().tolist()
            k = kv[t, c * d:(c + 1) * d].double().tolist()
            w = [qw[c, i].item() * kw[c, i].item() for i in range(d)]
            rho = 1 / math.sqrt(sum(v * v for v in h) / d + eps) / math.sqrt(sum(v * v for v in k) / d + eps)
            z = sum(h[i] * w[i] * k[i] for i in range(d)) * rho / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(z), 1e-6)), z)))
            gates.add(round(gate, 3))
            for i in range(d):
                ref = h[i] + gate * kv[t, n * d + i].item()
                assert math.isclose(out32[t, c, i].item(), ref, rel_tol=1e-5, abs_tol=1e-5)
    assert len(gates) > 4  # gates differ per stream (per-stream normalization)
    torch.testing.assert_close(out.float(), out32, rtol=1e-2, atol=5e-2)
