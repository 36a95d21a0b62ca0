"""kernels/triton batched ring copies and Engram hash / gated write vs the reference.

CUDA GPU, or the CPU under TRITON_INTERPRET=1; skipped otherwise. Ring copies and hashes are exact
(copies / integer math); the gate agrees to 1e-5 relative in fp32 (reduction order) and to one
bf16 rounding of the fp32 result for bf16 streams.
"""
from __future__ import annotations

import pytest
import torch
from cuda_capture import capture
from test_capturable_ops import PADDED, SCRATCH
from triton_run import CUDA, DEV, dev_meta, pytestmark, seed  # noqa: F401

from megagraph.kernels.engram.reference import engram_gate as ref_gate, engram_hash as ref_hash
from megagraph.kernels.engram.reference import engram_layout
from megagraph.kernels.fused.reference import ring_update_batched as ref_rings

S = 6


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("pairs", [1, 11])
def test_ring_update_batched_matches_reference(inplace, pairs):
    from megagraph.kernels.state.triton_ring import ring_update_batched

    g = torch.Generator().manual_seed(seed(inplace, pairs))
    m = dev_meta(PADDED)
    T = m["positions"].shape[0]
    ops = []
    for i in range(pairs):  # mixed ring dtypes: grouped launches
        dt = torch.float32 if i % 3 == 0 else torch.bfloat16
        ops += [torch.randn(S, 8, 48, generator=g).to(dt).to(DEV),
                torch.randn(T, 48, generator=g).to(dt).to(DEV)]
    meta3 = (m["positions"], m["token_req"], m["seq_slots"])
    want = ref_rings(*[t.cpu() for t in meta3], *[o.cpu() for o in ops], window=8)
    before = [o.clone() for o in ops[0::2]]
    got = ring_update_batched(*meta3, *ops, window=8, inplace=inplace)
    keep = [s for s in range(S) if s != SCRATCH]
    for a, b, r, r0 in zip(want, got, ops[0::2], before):
        assert torch.equal(a[keep], b.cpu()[keep])
        assert (b is r) if inplace else torch.equal(r, r0)


LAYOUTS = engram_layout([1, 14], None, max_ngram=4, n_heads=8, vocab_start=16_000_000,
                        compressed_vocab=99092)


@pytest.mark.parametrize("table", [1, 14])
def test_engram_hash_matches_reference(table):
    from megagraph.kernels.engram.triton import engram_hash

    lay = LAYOUTS[table]
    g = torch.Generator().manual_seed(table)
    m = dev_meta(PADDED)
    T = m["positions"].shape[0]
    cids = torch.randint(0, 99092, (T,), generator=g)
    cids[::5] = -1  # DEAD positions block older shifts
    hist = torch.randint(-1, 99092, (S, 3), generator=g)
    kw = dict(multipliers=lay.multipliers, primes=lay.primes, offsets=lay.offsets, pad_id=2, max_ngram=4)
    meta = (m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
    want = ref_hash(cids, hist, *[t.cpu() for t in meta], **kw)
    got = engram_hash(cids.to(DEV), hist.to(DEV), *meta, **kw)
    assert torch.equal(want, got.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(4, 320), (4, 5120)])
def test_engram_gate_matches_reference(dtype, dims):
    from megagraph.kernels.engram.triton import engram_gate

    n, d = dims
    g = torch.Generator().manual_seed(seed(dtype, dims))
    T = 7
    H = torch.randn(T, n, d, generator=g).to(dtype)
    kv = torch.randn(T, (n + 1) * d, generator=g).to(dtype)
    qw, kw = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    want = ref_gate(H, kv, qw, kw, eps=1e-20).float()
    got = engram_gate(H.to(DEV), kv.to(DEV), qw.to(DEV), kw.to(DEV), eps=1e-20).float().cpu()
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert ((got - want).abs() <= tol * want.abs() + 1e-5).all()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_capture_in_cuda_graph():
    from megagraph.kernels.engram.triton import engram_gate, engram_hash
    from megagraph.kernels.state.triton_ring import ring_update_batched

    lay = LAYOUTS[1]
    kw = dict(multipliers=lay.multipliers, primes=lay.primes, offsets=lay.offsets, pad_id=2, max_ngram=4)
    m = dev_meta([(i, 10 * i, 1) for i in range(S)])
    meta = (m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
    cids = torch.randint(0, 99092, (S,), device=DEV)
    hist = torch.randint(-1, 99092, (S, 3), device=DEV)
    H = torch.randn(S, 4, 5120, device=DEV).bfloat16()
    kv = torch.randn(S, 5 * 5120, device=DEV).bfloat16()
    qw, kw_ = torch.randn(4, 5120, device=DEV), torch.randn(4, 5120, device=DEV)
    rings = [torch.randn(S, 128, 512, device=DEV).bfloat16() for _ in range(10)]
    kvs = [torch.randn(S, 512, device=DEV).bfloat16() for _ in range(10)]
    ops = [t for pair in zip(rings, kvs) for t in pair]

    def fn():
        ring_update_batched(*meta[:3], *ops, window=128, inplace=True)
        return engram_hash(cids, hist, *meta, **kw), engram_gate(H, kv, qw, kw_, eps=1e-20)

    graph, out = capture(fn)
    cids.copy_(torch.randint(0, 99092, (S,), device=DEV))
    for k in kvs:
        k.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = fn()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    for r, k in zip(rings, kvs):
        assert torch.equal(r[torch.arange(S, device=DEV), m["positions"] % 128], k)
