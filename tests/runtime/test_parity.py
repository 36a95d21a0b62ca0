"""The runtime's logits equal the reference interpreter's (ReferenceSession) step by step."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.conftest import make_engine
from tests.tiny import TINY, SeqChunk, random_tokens, session, tiny

STEPS = [  # prefill two requests, decode both, then a mixed step: decode + new prefill + verify rows
    [SeqChunk(0, random_tokens(11, 1)), SeqChunk(1, random_tokens(7, 2))],
    [SeqChunk(0, (17,)), SeqChunk(1, (23,))],
    [SeqChunk(0, (5,)), SeqChunk(2, random_tokens(9, 3)), SeqChunk(1, (31, 32, 33))],
    [SeqChunk(2, (8,)), SeqChunk(0, (9,)), SeqChunk(1, (10,))],
]


def _reference(model):
    cfg, g, w, c = tiny(model, act_dtype="f32")
    return session(cfg, g, w, c, slots=5, capacity=128)


@pytest.mark.parametrize("model", TINY)
def test_logits_equal_reference_interpreter(model, compiled):
    eng = make_engine(compiled(model), model)
    ref = _reference(model)
    for chunks in STEPS:
        got, want = eng.step(chunks), ref.step(chunks)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("model", TINY)
def test_padding_to_buckets_keeps_real_outputs(model, compiled):
    """Steps padded to buckets (pad requests on the scratch slot) give the same real rows,
    up to fp32 summation order of batched matmuls."""
    eng = make_engine(compiled(model), model, buckets=(4, 16, 32))
    ref = _reference(model)
    assert eng.runner is not None and eng.report.buckets == [4, 16, 32]
    for chunks in STEPS:
        got, want = eng.step(chunks), ref.step(chunks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_state_pools_keep_their_addresses(compiled):
    model = TINY[0]
    eng = make_engine(compiled(model), model, buckets=(4, 32))
    ptrs = {k: v.data_ptr() for k, v in eng.state.items()}
    eng.step(STEPS[0])  # padded path
    eng.step([SeqChunk(0, tuple(range(3, 40)))])  # 37 tokens: above the largest bucket -> eager
    assert {k: v.data_ptr() for k, v in eng.state.items()} == ptrs


def test_h200_plan_on_cpu_writes_state_in_place_and_matches_reference(compiled):
    """The h200 plan (Triton kernels; on CPU tensors each falls back to its capturable kernel) run
    with --allow-fallback: the library state kernels (compressor, ring copies) get inplace=True
    where no later node reads the old state, so a step does not copy whole state pools, and the
    logits still equal the reference session's (1e-4: the capturable kernels sum in another order)."""
    from megagraph.kernels.capturable_table import INPLACE_STATE_OPS

    model = TINY[0]
    eng = make_engine(compiled(model, hw="h200"), model, allow_fallback=True)
    lib = {n.outputs[0]: eng.kernels.for_node(n) for n in eng.plan.graph.nodes
           if n.op in INPLACE_STATE_OPS and n.outputs[0] in eng.kernels.opaque}
    assert lib and any(getattr(fn, "keywords", {}).get("inplace") for fn in lib.values())
    ptrs = {k: v.data_ptr() for k, v in eng.state.items()}
    cfg, _, w, c = tiny(model, act_dtype="f32")
    ref = session(cfg, eng.plan.graph, w, c, slots=5, capacity=128)  # the same (h200) graph
    for chunks in STEPS:
        got, want = eng.step(chunks), ref.step(chunks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert {k: v.data_ptr() for k, v in eng.state.items()} == ptrs


def test_buckets_pad_requests_to_slots_not_tokens(compiled):
    """A bucket of b tokens holds max_slots requests plus the pad rows its pad tokens need (at most
    `capacity` pad tokens per pad row), not b request rows: a 32-token bucket of a 2-slot engine
    has 2 + 32/16 rows. Real outputs are unchanged."""
    from megagraph.runtime.engine import bucket_reqs

    assert bucket_reqs((1, 4, 32, 8192), 2, 16) == {1: 1, 4: 3, 32: 4, 8192: 8192 // 16 + 2}
    assert bucket_reqs((8192,), 256, 131072) == {8192: 257}
    model = TINY[0]
    eng = make_engine(compiled(model), model, buckets=(4, 32), max_slots=2, capacity=16)
    assert [eng.runner.reqs(b) for b in (4, 32)] == [3, 4]
    ref = _reference(model)
    for chunks in ([SeqChunk(0, (5,))], [SeqChunk(0, random_tokens(14, 4)), SeqChunk(1, (7, 8))],
                   [SeqChunk(1, (9,))]):
        torch.testing.assert_close(eng.step(chunks), ref.step(chunks), rtol=1e-4, atol=1e-4)
