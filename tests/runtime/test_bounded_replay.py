"""Bounded-suffix replay: large prefill steps run the late layers on their last `keep` rows only.

The runtime must equal the reference interpreter running the compiler's prefix and suffix graphs;
the suffix padded to a row bucket (the captured form, run uncaptured on CPU) must equal the
unpadded suffix; against the exact path it is an approximation
(benchmarks/results/cpu/bounded-replay.md). Which steps take it is the plan's rule."""

from __future__ import annotations

import pytest
import torch

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.models.session import initial_state, step_metadata
from megagraph.runtime.plan import ArtifactsError, RunPlan
from megagraph.runtime.replay import keep_rows, rows_graph, takes_replay
from tests.runtime.conftest import make_engine
from tests.tiny import SeqChunk, random_tokens, tiny

MODEL = "v4.1-flash-tiny"
PREFILL = [SeqChunk(0, random_tokens(40, 1)), SeqChunk(1, random_tokens(5, 2))]
STEPS = [  # K = 14 + 5 = 19 kept rows; then 14 + 1 + 14 = 29; then 3 requests, K = 14 + 14 + 9
    PREFILL,
    [SeqChunk(2, random_tokens(30, 3)), SeqChunk(0, (7,)), SeqChunk(1, random_tokens(20, 4))],
    [SeqChunk(3, random_tokens(9, 5)), SeqChunk(2, random_tokens(16, 6)),
     SeqChunk(1, random_tokens(17, 7))],
]


def test_equals_the_interpreter_on_the_replay_graphs(compiled_replay):
    eng = make_engine(compiled_replay, MODEL, bounded_replay="on")
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


def _engines(path, buckets):
    """An engine running the whole suffix eagerly, and one padding its rows part to `buckets`."""
    return (make_engine(path, MODEL, bounded_replay="on"),
            make_engine(path, MODEL, bounded_replay="on", suffix_buckets=buckets))


def test_rows_graph_at_its_own_size_is_the_suffix_bit_for_bit(compiled_replay):
    """The suffix split into an eager row selection and a step-shaped rows graph (what is
    captured) changes nothing: a bucket of exactly K rows has no pad rows."""
    eager, split = _engines(compiled_replay, (19,))
    got, want = split.step(PREFILL), eager.step(PREFILL)
    assert split.replay.counts.captured == 1 and eager.replay.counts.eager == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for k in eager.state:
        assert torch.equal(split.state[k][:4], eager.state[k][:4]), k


def test_padded_to_a_bucket_keeps_the_real_rows(compiled_replay):
    """Padded to row buckets (pad requests on the scratch slot, pad bridge rows zero): the real
    rows equal the unpadded suffix up to the MoE reference kernel's per-expert GEMM, whose row
    count the pad tokens change (measured: <= 1.5e-6 here; every other op is row-exact, as the
    bucket-of-K test shows). State of the real slots likewise; K above the largest bucket
    runs the suffix eagerly."""
    eager, padded = _engines(compiled_replay, (16, 32))
    assert padded.replay.runner.reqs(32) == 4 + 1  # the slots, plus one pad row per 128 tokens
    for chunks in STEPS:
        got, want = padded.step(chunks), eager.step(chunks)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(padded.last_rows, eager.last_rows)
    assert (padded.replay.counts.captured, padded.replay.counts.eager) == (2, 1)  # K 19, 29 | 37
    for k in eager.state:
        torch.testing.assert_close(padded.state[k][:4], eager.state[k][:4], rtol=1e-5, atol=1e-5)


def test_rows_graph_reads_prefix_state_from_its_pool(compiled_replay):
    eng = make_engine(compiled_replay, MODEL, bounded_replay="on", suffix_buckets=(32,))
    g = eng.replay.runner.step.graph
    assert "K" not in g.dims and g.types[g.output_value("logits")].shape[0] == "T"
    assert not [n for n in g.nodes if n.op in ("select_rows", "suffix_meta")]
    assert {"L5.ckv", "L5.ikey"} <= set(g.inputs)  # the compressor's committed pools
    assert set(eng.replay.rows_extra) == {v + ".k" for v in eng.replay.bridge
                                          if eng.plan.graph.types[v].shape[:1] == ("T",)}
    with pytest.raises(ValueError, match="row selection"):
        rows_graph(g, {})


def test_step_size_rule():
    new = lambda *n: torch.tensor(n)  # noqa: E731
    assert not takes_replay(new(14, 3), 14, 0)  # every chunk fits `keep`: nothing to save
    assert takes_replay(new(15, 1), 14, 0)  # CPU plan (no captured graphs): any longer chunk
    assert not takes_replay(new(30, 2), 14, 32)  # 32 tokens fit the captured step graphs
    assert takes_replay(new(30, 3), 14, 32)
    assert not takes_replay(new(*[14] * 4), 14, 32)  # 56 tokens, but no chunk above keep


def test_plan_mode_follows_the_plan(compiled_replay, compiled):
    """compiled_replay is a cpu plan: graphs emitted (--bounded-replay) but default off; an
    h200 plan has them on by default, for steps above its graph token limit only."""
    assert RunPlan.from_artifacts(compiled_replay).replay["default"] == "off"
    assert make_engine(compiled_replay, MODEL).replay is None
    assert "off (plan; graphs in the plan)" in make_engine(compiled_replay, MODEL).replay_summary()
    gpu = make_engine(compiled(MODEL, hw="h200"), MODEL, allow_fallback=True)
    assert gpu.replay is not None and gpu.replay.step_tokens_above == 8192
    assert not gpu.takes_replay(PREFILL) and gpu.step(PREFILL).shape[0] == 45
    assert gpu.replay.counts.captured + gpu.replay.counts.eager == 0
    assert gpu.takes_replay([SeqChunk(0, (1,) * 8000), SeqChunk(1, (2,) * 200)])
    assert make_engine(compiled(MODEL, hw="h200"), MODEL, allow_fallback=True,
                       bounded_replay="off").replay is None


def test_bad_mode_is_refused(compiled_replay):
    with pytest.raises(ValueError, match="bounded_replay must be one of plan, on, off; got True"):
        make_engine(compiled_replay, MODEL, bounded_replay=True)


def test_exact_steps_skip_replay(compiled_replay):
    """A step with a request that wants prompt logprobs runs exactly, replay on or not: one
    logit row per token, equal to the exact engine's bit for bit."""
    exact = make_engine(compiled_replay, MODEL, bounded_replay="off")
    approx = make_engine(compiled_replay, MODEL, bounded_replay="on")
    assert approx.replay_possible and not exact.replay_possible
    assert approx.takes_replay(PREFILL) and not approx.takes_replay(PREFILL, exact=True)
    for chunks in STEPS[:2]:
        got, want = approx.step(chunks, exact=True), exact.step(chunks)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.shape[0] == sum(len(c.tokens) for c in chunks)
    assert approx.replay.counts.eager == 0
    for k in exact.state:
        assert torch.equal(approx.state[k], exact.state[k]), k


def test_close_to_the_exact_path(compiled_replay):
    exact = make_engine(compiled_replay, MODEL)
    approx = make_engine(compiled_replay, MODEL, bounded_replay="on")
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
    eng = make_engine(compiled_replay, MODEL, bounded_replay="on", suffix_buckets=(16, 32))
    out = eng.generate([list(random_tokens(30, 3)), [5, 6]], p)
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert eng.replay.counts.captured == 1


def test_needs_the_graphs(compiled):
    with pytest.raises(ArtifactsError, match="--bounded-replay"):
        make_engine(compiled(MODEL), MODEL, bounded_replay="on")


# -- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_captured_suffix_equals_eager_suffix(tmp_path):
    """The tiny V4.1 compiled for h200: a long step through the engine replays the suffix from
    its captured row buckets, equal to the eager suffix (bf16 plan kernels; the pad rows change
    only the MoE kernels' row counts, so within 2e-2 relative on the logit rows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megagraph.models.config import load_model_config
    from megagraph.passes import compile_model, load_hw_profile
    from megagraph.passes.artifacts import write_artifacts

    cfg = load_model_config(MODEL)
    out = tmp_path / "h200"
    write_artifacts(compile_model(cfg, load_hw_profile("h200")), out)
    kw = dict(device="cuda", act="bf16", capacity=256, allow_fallback=True, bounded_replay="on",
              buckets=(4, 16))
    captured = make_engine(out, MODEL, **kw)
    eager = make_engine(out, MODEL, cuda_graphs=False, **kw)
    assert captured.suffix_report.captured_segments, captured.replay_summary()
    assert "suffix captured" in captured.replay_summary()
    # the rule: above the 8192-token limit in production; here force it for small steps
    for e in (captured, eager):
        e.replay.step_tokens_above = 0
    for chunks in STEPS:
        got, want = captured.step(chunks).float(), eager.step(chunks).float()
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert rel < 2e-2, rel
    assert captured.replay.counts.captured == len(STEPS) and eager.replay.counts.captured == 0


@pytest.mark.gpu
def test_long_prompt_step_uses_the_captured_suffix(tmp_path):
    """By the plan's rule alone (mode "plan", h200 default on): a step above the 8192-token limit
    runs the prefix eagerly and the suffix from its captured bucket; shorter steps do not."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megagraph.models.config import load_model_config
    from megagraph.passes import compile_model, load_hw_profile
    from megagraph.passes.artifacts import write_artifacts

    out = tmp_path / "h200"
    write_artifacts(compile_model(load_model_config(MODEL), load_hw_profile("h200")), out)
    eng = make_engine(out, MODEL, device="cuda", act="bf16", capacity=8448, buckets=(4, 16),
                      allow_fallback=True)
    assert eng.replay is not None and "suffix captured" in eng.replay_summary()
    keep = eng.replay.keep
    logits = eng.step([SeqChunk(0, random_tokens(8200, 9)), SeqChunk(1, random_tokens(40, 10))])
    assert logits.shape[0] == 2 * keep and eng.replay.counts.captured == 1
    assert torch.isfinite(logits.float()).all()
    eng.step([SeqChunk(2, random_tokens(300, 11))])  # below the limit: the exact step path
    assert eng.replay.counts.captured == 1 and eng.replay.counts.eager == 0


def test_generate_and_serve_flags():
    import argparse

    pytest.importorskip("fastapi")  # the serve flags' module imports the server

    from megagraph.runtime.cli import add_arguments
    from megagraph.runtime.server.cli import config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["generate", "a"]).bounded_replay == "plan"
    assert p.parse_args(["generate", "a", "--bounded-replay", "off"]).bounded_replay == "off"
    conf = config_from_args(p.parse_args(["serve", "a", "--bounded-replay", "on"]))
    assert conf.bounded_replay == "on" and conf.engine_config(2).bounded_replay == "on"
    assert config_from_args(p.parse_args(["serve", "a"])).engine_config(2).bounded_replay == "plan"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "a", "--bounded-replay", "yes"])
