"""Bounded-suffix replay: long prompt chunks run the late layers on their last `keep` rows only.

The runtime must equal the reference interpreter running the compiler's prefix and suffix graphs;
against the exact path it is an approximation (benchmarks/results/cpu/bounded-replay.md)."""

from __future__ import annotations

import pytest
import torch

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.models.session import initial_state, step_metadata
from megagraph.runtime.plan import ArtifactsError, RunPlan
from megagraph.runtime.replay import keep_rows
from tests.runtime.conftest import make_engine
from tests.tiny import SeqChunk, random_tokens, tiny

MODEL = "v4.1-flash-tiny"
PREFILL = [SeqChunk(0, random_tokens(40, 1)), SeqChunk(1, random_tokens(5, 2))]


def test_equals_the_interpreter_on_the_replay_graphs(compiled_replay):
    eng = make_engine(compiled_replay, MODEL, bounded_replay=True)
    got = eng.step(PREFILL)
    plan = RunPlan.from_artifacts(compiled_replay)
    pre, suf = (plan.extra_graphs[plan.replay["graphs"][k]] for k in ("prefix", "suffix"))
    _, _, w, c = tiny(MODEL, act_dtype="f32")
    meta = step_metadata(PREFILL, {})
    state = initial_state(plan.graph, slots=5, capacity=128)
    out = interpret(pre, {**meta, **state, **c}, w, reference_impls())
    made = {v: lab for lab, v in pre.outputs}
    env = {k: meta[k] for k in meta if k in suf.inputs}
    env["keep_rows"] = keep_rows(meta["seq_new"], plan.replay["keep"])
    env.update({v: out[made[v]] for v in suf.inputs if v in made})
    env.update({k: state[k] for k in suf.inputs if k in state and k not in env})
    want = interpret(suf, env, w, reference_impls())["logits"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.shape[0] == plan.replay["keep"] + 5  # request 0 keeps `keep` rows, request 1 all 5


def test_close_to_the_exact_path(compiled_replay):
    exact = make_engine(compiled_replay, MODEL)
    approx = make_engine(compiled_replay, MODEL, bounded_replay=True)
    full, part = exact.step(PREFILL), approx.step(PREFILL)
    a, b = part[approx.last_rows], full[exact.last_rows]
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < 0.05  # measured ~1e-2 (see docstring)
    for tok in (7, 8):
        chunks = [SeqChunk(0, (tok,)), SeqChunk(1, (tok + 1,))]
        a, b = approx.step(chunks), exact.step(chunks)
        assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < 0.05


def test_generate_with_bounded_replay(compiled_replay):
    from megagraph.runtime.sampling import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = make_engine(compiled_replay, MODEL, bounded_replay=True).generate(
        [list(random_tokens(30, 3)), [5, 6]], p)
    assert [len(o.token_ids) for o in out] == [3, 3]


def test_needs_the_graphs(compiled):
    with pytest.raises(ArtifactsError, match="--bounded-replay"):
        make_engine(compiled(MODEL), MODEL, bounded_replay=True)
