"""Forced rejection at every position of a verify block leaves every state tensor of the slot
identical (torch.equal) to a run that never drafted and fed only the accepted tokens.

One numerical caveat, stated where it is checked: a CPU fp32 GEMM over the 6 verify rows and
the same GEMM over `keep` rows may round a row differently in the last bit. Rings and
compressed rows pass through FP8 fake-quantization and come out bit-equal; the compressor's raw
pending rows do not, so those are checked bit-equal to the verify step's own rows (what the
rollback wrote) and within fp32 tolerance (1e-5) of the plain run."""

from __future__ import annotations

import pytest
import torch

from megagraph.runtime.batch import SeqChunk
from megagraph.runtime.speculative.programs import SpecPrograms
from megagraph.runtime.speculative.rollback import Rollback, RollbackError, rules

from tests.tiny import random_tokens

PROMPTS = (13, 10)  # odd and even: the ratio-2 compressors' open groups differ


def _prefill(eng, lens, seed):
    prompts = [random_tokens(n, seed + i, vocab=eng.cfg.vocab_size) for i, n in enumerate(lens)]
    slots = [eng.slots.allocate() for _ in prompts]
    eng.step([SeqChunk(s, p) for s, p in zip(slots, prompts)])
    return slots


def test_every_state_tensor_has_a_rule(engine):
    eng = engine()
    kinds = {r.kind for r in rules(SpecPrograms(eng).verify_graph).values()}
    assert kinds == {"ring", "groups", "pending", "history"}


@pytest.fixture(params=["cpu", "h200"])
def engines(request, compiled):
    """Two engines over one plan: cpu (unfused), or h200's (fused compressor, FP8 activation
    quantization; run here with reference kernels)."""
    from tests.runtime.conftest import make_engine

    path = compiled("v4.1-flash-tiny", request.param)
    kw = {"allow_fallback": True} if request.param != "cpu" else {}
    return lambda: make_engine(path, "v4.1-flash-tiny", **kw)


@pytest.mark.parametrize("keep", range(1, 7))
def test_forced_rejection_restores_state(engines, keep):
    spec, plain = engines(), engines()
    progs = SpecPrograms(spec)
    B = progs.block
    slots = _prefill(spec, PROMPTS, 5)
    assert _prefill(plain, PROMPTS, 5) == slots
    rb = Rollback(progs.verify_graph, spec.state, spec.cfg.sliding_window)
    blocks = [random_tokens(B + 1, 40 + i, vocab=spec.cfg.vocab_size) for i in range(len(slots))]
    keeps = [keep, B + 2 - keep]  # the second request keeps a different prefix
    saved = [rb.save(s, spec.cached[s], B + 1) for s in slots]
    outs = progs.run_verify([SeqChunk(s, b) for s, b in zip(slots, blocks)])
    for i, (sv, k) in enumerate(zip(saved, keeps)):
        rb.restore(sv, k, outs, first_row=i * (B + 1))
        spec.cached[sv.slot] = sv.cached + k
    plain.step([SeqChunk(s, b[:k]) for s, b, k in zip(slots, blocks, keeps)])
    assert spec.cached == plain.cached
    kinds = {n: r.kind for n, r in rb.rules.items()}
    for name, pool in plain.state.items():
        for s in slots:
            if kinds[name] != "pending":
                assert torch.equal(spec.state[name][s], pool[s]), (name, s, keep)
            else:
                torch.testing.assert_close(spec.state[name][s], pool[s], rtol=1e-5, atol=1e-5)
    for i, (s, k) in enumerate(zip(slots, keeps)):  # pending rows: the verify step's own rows
        c = plain.cached[s] - k
        for name in ("L2.pend_kv", "L4.pend_gate"):
            label = f"verify.{name.split('.')[0]}.{name.split('.')[1]}_rows"
            for p in range(max(c, (c + k) // 2 * 2), c + k):
                assert torch.equal(spec.state[name][s, p % 2], outs[label][i * (B + 1) + p - c])
    # and the next step sees the same state
    nxt = [SeqChunk(s, random_tokens(2, 90 + s, vocab=spec.cfg.vocab_size)) for s in slots]
    torch.testing.assert_close(spec.step(nxt), plain.step(nxt), rtol=1e-4, atol=1e-4)


def test_too_many_rows_refused(engine):
    eng = engine()
    rb = Rollback(SpecPrograms(eng).verify_graph, eng.state, eng.cfg.sliding_window)
    with pytest.raises(RollbackError, match="at most the window 8"):
        rb.save(0, 4, 9)
