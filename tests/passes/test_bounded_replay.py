"""bounded-replay: emitted by default where the hardware profile says so (GPU profiles; the
step is unchanged either way), the flag overriding; exact when every row is kept / when the
replayed tokens start at position 0, approximate otherwise (error measured in
benchmarks/probes/bounded_replay.py), and skipped with a reason where it cannot apply."""

import pytest
import torch

from benchmarks.probes.bounded_replay import (bounded_graphs, bounded_step, drop_rings, encoder_replay,
                                              keep_rows)
from megagraph.passes import load_hw_profile
from megagraph.passes.bounded_replay import BoundedReplay
from megagraph.passes.encoder_replay import EncoderReplay
from tests.tiny import SeqChunk, random_tokens, session, tiny

PROMPTS = (random_tokens(13, 21), random_tokens(6, 22))


def test_keep_rows_selects_each_requests_tail():
    assert keep_rows([5, 2, 3], 2).tolist() == [3, 4, 5, 6, 8, 9]


def test_off_returns_the_step_unchanged():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    r = BoundedReplay(load_hw_profile("gb300")).run(g)
    assert r.graph is g and r.skipped and "--bounded-replay" in r.note and not r.extra_graphs


@pytest.mark.parametrize("hw, flag, emitted, default", [
    ("cpu", None, False, None), ("cpu", True, True, "off"),
    ("h200", None, True, "on"), ("gb300", None, True, "on"), ("b200", None, True, "on"),
    ("h200", False, False, None)])
def test_plan_default_per_profile(hw, flag, emitted, default):
    """GPU profiles emit the graphs and mark them on by default (used above the graph token
    limit); cpu does not; --bounded-replay / --no-bounded-replay override the emission only."""
    from megagraph.models.config import load_model_config
    from megagraph.passes import CompileOptions, compile_model
    from megagraph.passes.plan import build_plan

    cfg = load_model_config("v4.1-flash-tiny").replace(act_dtype="f32")
    prof = load_hw_profile(hw)
    assert prof.bounded_replay_default == (hw != "cpu")
    c = compile_model(cfg, prof, CompileOptions(bounded_replay=flag))
    assert ("prefill-suffix" in c.extra_graphs) == emitted
    rec = next(r for r in c.records if r.name == "bounded-replay")
    assert (rec.status == "skipped") != emitted
    if flag is None and not emitted:
        assert "profile cpu: bounded_replay_default false" in rec.note
    plan = build_plan(c.graph, c.hw, context=c.options.context, extra=c.extra_graphs, cfg=c.cfg)
    section = plan.get("bounded_replay")
    assert (section or {}).get("default") == default
    if section:
        assert section["step_tokens_above"] == (0 if hw == "cpu" else prof.graph_token_limit)
        assert section["suffix_row_buckets"] == prof.replay_buckets()


def test_no_default_replay_with_expert_parallel():
    from megagraph.passes import CompileOptions

    h200 = load_hw_profile("h200")
    assert CompileOptions().replay_enabled(h200)
    assert not CompileOptions(dp=2, ep=2).replay_enabled(h200)  # every rank runs one graph
    assert not CompileOptions(bounded_replay=False).replay_enabled(h200)
    assert CompileOptions(bounded_replay=True).replay_enabled(load_hw_profile("cpu"))


def test_compile_flag_overrides_the_profile():
    import argparse

    from megagraph.passes.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--model", "m", "--hw", "h200", "--out", "o"]
    assert p.parse_args(base).bounded_replay is None
    assert p.parse_args(base + ["--bounded-replay"]).bounded_replay is True
    assert p.parse_args(base + ["--no-bounded-replay"]).bounded_replay is False


def test_profile_field_must_be_a_bool(tmp_path):
    from megagraph.models.config import ConfigError
    from megagraph.passes.hw import HW_DIR

    text = (HW_DIR / "h200.yaml").read_text().replace("bounded_replay_default: true",
                                                       "bounded_replay_default: sometimes")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match="bounded_replay_default.*true or false"):
        load_hw_profile(bad)


@pytest.mark.parametrize("hw", ("cpu", "gb300"))
def test_keeping_every_row_is_exact(hw):
    cfg, g, w, consts = tiny("v4.1-flash-tiny", "f32")
    step, prefix, suffix, _ = bounded_graphs(g, keep=16, hw=hw)
    exact, approx = (session(cfg, step, w, consts, slots=2, capacity=64) for _ in range(2))
    chunks = [SeqChunk(0, PROMPTS[0]), SeqChunk(1, PROMPTS[1])]
    le = exact.step(chunks)
    la, rows = bounded_step(approx, prefix, suffix, chunks, keep=16)
    assert rows.tolist() == list(range(19))
    assert torch.equal(la, le)
    for k in exact.state:
        assert torch.equal(approx.state[k], exact.state[k]), k


def test_short_keep_is_close_but_not_exact():
    cfg, g, w, consts = tiny("v4.1-flash-tiny", "f32")
    step, prefix, suffix, _ = bounded_graphs(g, keep=cfg.sliding_window)
    exact, approx = (session(cfg, step, w, consts, slots=2, capacity=64) for _ in range(2))
    chunks = [SeqChunk(0, PROMPTS[0]), SeqChunk(1, PROMPTS[1])]
    le = exact.step(chunks)
    la, rows = bounded_step(approx, prefix, suffix, chunks, keep=cfg.sliding_window)
    last = [12, 18]  # each request's last row in the full step
    kept_last = [rows.tolist().index(i) for i in last]
    e, a = le[last], la[kept_last]
    rel = ((a - e).norm(dim=-1) / e.norm(dim=-1)).max().item()
    assert 0 < rel < 0.3
    # request 1 (6 rows <= keep) loses nothing: requests are independent (equal up to the GEMM
    # summation order of a different row count)
    torch.testing.assert_close(la[kept_last[1]], le[18], rtol=1e-5, atol=1e-5)
    # early layers (through the last KV source) are computed on every row: their state is exact
    for k in ("L2.ckv", "L5.ckv", "L5.ikey", "L0.ring"):
        assert torch.equal(approx.state[k], exact.state[k]), k


def test_encoder_replay_from_position_zero_is_exact():
    cfg, g, w, consts = tiny("v4.1-flash-tiny", "f32")
    step, _, _, enc = bounded_graphs(g, keep=cfg.sliding_window)
    prompt = random_tokens(cfg.sliding_window, 31)
    exact, hit = (session(cfg, step, w, consts, slots=1, capacity=64) for _ in range(2))
    for s in (exact, hit):
        s.step([SeqChunk(0, prompt)])
    hist0 = torch.full_like(hit.state["engram_hist"][0], -1)
    drop_rings(hit, 0)
    encoder_replay(hit, enc, 0, prompt, hist0)
    for k in exact.state:
        assert torch.equal(hit.state[k], exact.state[k]), k
    new = random_tokens(3, 32)
    assert torch.equal(hit.step([SeqChunk(0, new)]), exact.step([SeqChunk(0, new)]))


def test_encoder_replay_graph_writes_only_rings():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    enc = EncoderReplay().run(g).extra_graphs["encoder-replay"]
    assert all(lab.endswith(".ring") for lab, _ in enc.outputs)
    ops = enc.op_counts()
    assert "cache_write" not in ops and "compress_pool" not in ops and "route" in ops
    assert ops["fill"] == 1


def test_suffix_runs_only_late_layers_on_kept_rows():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    r = BoundedReplay(load_hw_profile("gb300"), enabled=True, keep=14).run(g)
    suffix, prefix = r.extra_graphs["prefill-suffix"], r.extra_graphs["prefill-prefix"]
    assert "K" in suffix.dims and suffix.type_of(suffix.output_value("logits")).shape[0] == "K"
    layers = {n.outputs[0].split(".")[0] for n in suffix.nodes
              if n.outputs[0].startswith("L") and n.op != "select_rows"}
    assert layers == {"L6", "L7", "L8"}
    assert "logits" not in dict(prefix.outputs)
    assert {lab for lab, _ in prefix.outputs if lab.startswith("bridge.")} >= {"bridge.L5.ffn.streams"}


def test_skips_a_model_without_late_layers():
    pytest.importorskip("megagraph.models.v4")
    _, g, _, _ = tiny("v4-flash-tiny", "bf16")
    r = BoundedReplay(load_hw_profile("gb300"), enabled=True).run(g)
    assert r.graph is g and r.skipped and "no layers after the last KV-source layer" in r.note
