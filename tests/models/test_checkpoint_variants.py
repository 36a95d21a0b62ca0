"""Checkpoints as users have them, and DSpark's weights with the model (models/load.py,
models/checkpoint/reader.py).

Real safetensors files from the project's writer with a release config.json beside them
(tests/checkpoints.py), tiny V4.1 (main step + DSpark draft graph) and tiny V4, official layout;
fresh random weights and prompts every run (SEED in the failure message).

* Variants a converter writes: E8M0 scales tagged U8, BF16 tensors widened to F32. Tolerance 0:
  U8 holds the E8M0 bytes unchanged, and F32 holds the BF16 values exactly, which the
  storage-format load rounds back to the very same BF16; so tensors and logits are bit-equal to
  the original checkpoint's, and one line says what was reinterpreted.
* A float wider than declared keeps its precision on the dense reference path (f32 graph) and is
  rounded to the declared BF16 by the storage-format load (its graph's weight types are fixed).
* Still refused, naming file and tensor: a wrong shape, a narrower float, an FP8 weight stored
  as BF16, a missing tensor.
* DSpark: `load_weights(cfg, [step, draft], ckpt)` loads every `mtp.*` tensor; the drafter on
  the dense reference path agrees with the storage path to 1e-4 (fp32 reassociation only, as in
  test_load_weights), drafts equal.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import pytest
import torch

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.models.build import build_step
from megagraph.models.checkpoint import CheckpointError, random_weights, write_checkpoint
from megagraph.models.config import ModelConfig, load_model_config
from megagraph.models.dspark import build_dspark_draft, ring_name
from megagraph.models.load import graph_specs, load_weights
from tests.checkpoints import as_users_have_it, write_model_checkpoint
from tests.tiny import SeqChunk, constants_for, random_tokens, session

SEED = int(torch.randint(0, 2**31 - 1, ()).item())
MODELS = ("v4.1-flash-tiny", "v4-flash-tiny")
NOTE = "megagraph.checkpoint"


@lru_cache(maxsize=8)
def model(name: str, weight_format: str = "release"):
    """(cfg, graphs): the f32 step graph, plus the DSpark draft graph for V4.1."""
    cfg = load_model_config(name).replace(act_dtype="f32", weight_format=weight_format)
    graphs = [build_step(cfg)] + ([build_dspark_draft(cfg)] if cfg.is_v41 else [])
    return cfg, tuple(graphs)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """ckpts(model, variant) -> checkpoint dir; variant: original, u8 (scales), f32 (floats)."""
    root, made = tmp_path_factory.mktemp("variants"), {}

    def get(name: str, variant: str = "original"):
        if (name, variant) not in made:
            cfg, graphs = model(name)
            made[name, variant] = write_model_checkpoint(
                root / f"{name}-{variant}", cfg, graphs, seed=SEED, u8_scales=variant == "u8",
                f32_floats=variant == "f32")
        return made[name, variant]

    return get


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NOTE]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:  # fp8 / e8m0 / packed fp4: compare the bytes
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def run(cfg, g, w, toks) -> list[torch.Tensor]:
    """Prefill `toks`, then one greedy decode step: each step's logits."""
    s = session(cfg, g, w, constants_for(cfg))
    out = [s.step([SeqChunk(0, toks)])]
    out.append(s.step([SeqChunk(0, (int(out[-1][-1].argmax()),))]))
    return out


@pytest.mark.parametrize("variant", ["u8", "f32"])
@pytest.mark.parametrize("name", MODELS)
def test_variant_loads_bit_exact_with_one_line_saying_so(name, variant, ckpts, caplog):
    cfg, graphs = model(name)
    assert ModelConfig.from_hf(ckpts(name)).compress_ratios == cfg.compress_ratios  # real config.json
    with caplog.at_level(logging.WARNING, logger=NOTE):
        orig = load_weights(cfg, graphs, ckpts(name), progress=False)
        assert notes(caplog) == []  # nothing to say about a checkpoint stored as declared
        got = load_weights(cfg, graphs, ckpts(name, variant), progress=False)
    specs = graph_specs(graphs)
    flat = [m for s in specs for m in s.expand()]
    (line,) = notes(caplog)
    assert str(ckpts(name, variant)) in line and "reinterpreted on load" in line
    if variant == "u8":
        n = sum(m.dtype == "e8m0" for m in flat)
        assert f"{n} e8m0 tensor(s) stored as U8 read as their E8M0 bytes (bit-exact" in line
    else:
        n = sum(m.dtype == "bf16" for m in flat)
        assert f"{n} tensor(s) declared BF16 stored as wider F32, rounded to the declared BF16" in line
    assert n > 10 and got.keys() == orig.keys()
    for k in orig:
        assert same(got[k], orig[k]), f"{k} (SEED {SEED})"
    toks = random_tokens(11, SEED, vocab=cfg.vocab_size)
    for a, b in zip(run(cfg, graphs[0], got, toks), run(cfg, graphs[0], orig, toks)):
        assert torch.equal(a, b), f"SEED {SEED}"


def test_wider_floats_keep_their_precision_where_the_graph_is_f32(tmp_path, caplog):
    """Declared-BF16 tensors stored as F32 values BF16 cannot hold: the dense f32 reference
    path returns them exactly; the storage-format path rounds them to BF16, as it says."""
    name = "v4.1-flash-tiny"
    cfg, graphs = model(name)
    w = random_weights(graph_specs(graphs), seed=SEED, init_std=cfg.hidden_size ** -0.5)
    g = torch.Generator().manual_seed(SEED)
    wide = {k: t.float() * (1 + 2.0 ** -10 * torch.randn(t.shape, generator=g)) if t.dtype == torch.bfloat16
            else t for k, t in w.items()}
    names = [k for k, t in w.items() if t.dtype == torch.bfloat16]
    assert any((wide[k].to(torch.bfloat16).float() != wide[k]).any() for k in names)  # the test can fail
    path = write_checkpoint(tmp_path / "wide", wide)
    dense_cfg, dense_graphs = model(name, "dense")
    with caplog.at_level(logging.WARNING, logger=NOTE):
        dense = load_weights(dense_cfg, dense_graphs, path, dequantize=True, progress=False)
        stored = load_weights(cfg, graphs, path, progress=False)
    kept, rounded = notes(caplog)
    assert f"{len(names)} tensor(s) declared BF16 stored as wider F32, kept as F32" in kept
    assert "rounded to the declared BF16" in rounded
    for k in names:
        assert dense[k].dtype == torch.float32 and torch.equal(dense[k], wide[k]), k
        assert torch.equal(stored[k], wide[k].to(torch.bfloat16)), k


@pytest.mark.parametrize("what", ["shape", "narrower", "fp8-as-bf16", "missing"])
def test_still_refused_naming_file_and_tensor(what, tmp_path):
    """On top of a U8-scale + F32 checkpoint (accepted), one real defect each."""
    name = "v4.1-flash-tiny"
    cfg, graphs = model(name)
    w = as_users_have_it(random_weights(graph_specs(graphs), seed=SEED, init_std=0.1),
                         u8_scales=True, f32_floats=True)
    tensor, msg = {
        "shape": ("layers.2.attn.wq_b.weight", r"shape mismatch: expected \[128, 32\], found \[128, 31\]"),
        "narrower": ("layers.0.hc_attn_fn", r"dtype mismatch: expected f32 \(F32 or F64\), found BF16"),
        "fp8-as-bf16": ("mtp.1.attn.wq_a.weight", r"expected fp8e4m3 \(F8_E4M3\), found BF16"),
        "missing": ("mtp.2.confidence_head.proj.weight", r"1 expected tensor\(s\) missing"),
    }[what]
    if what == "shape":
        w[tensor] = w[tensor][:, :-1].contiguous()
    elif what == "missing":
        del w[tensor]
    else:
        w[tensor] = w[tensor].float().to(torch.bfloat16)
    path = write_checkpoint(tmp_path / what, w, max_shard_bytes=4 << 20)
    with pytest.raises(CheckpointError, match=msg) as e:
        load_weights(cfg, graphs, path, progress=False)
    assert e.value.tensor == tensor and tensor in str(e.value)
    where = "model.safetensors.index.json" if what == "missing" else "model-0"
    assert e.value.file.split("/")[-1].startswith(where) and str(path) in e.value.file


def test_dspark_weights_load_with_the_model(ckpts):
    """Every `mtp.*` tensor of the draft graph loads with the step graph's in one call, in the
    storage formats and on the dense reference path; the drafter runs on both."""
    name = "v4.1-flash-tiny"
    cfg, (g, d) = model(name)
    path = ckpts(name)
    w = load_weights(cfg, [g, d], path, progress=False)
    want = random_weights(graph_specs([g, d]), seed=SEED, init_std=cfg.hidden_size ** -0.5, stacked=True)
    assert w.keys() == want.keys() and all(same(w[k], want[k]) for k in want)
    mtp_only = set(d.weights) - set(g.weights)
    assert "mtp.2.confidence_head.proj.weight" in mtp_only and "mtp.2.markov_head.embed.weight" in mtp_only
    dense_cfg, (dg, dd) = model(name, "dense")
    dense = load_weights(dense_cfg, [dg, dd], path, dequantize=True, progress=False)
    assert set(dd.weights) <= dense.keys() and dense["mtp.1.ffn.experts.*.w1.weight"].dtype == torch.float32
    with pytest.warns(UserWarning, match="not in the specs"):  # the step graph's own tensors
        draft_only = load_weights(dense_cfg, dd, path, dequantize=True, progress=False)
    assert all(torch.equal(draft_only[k], dense[k]) for k in dd.weights)

    toks = random_tokens(13, SEED, vocab=cfg.vocab_size)
    outs = []
    for c, graph, draft, weights in ((cfg, g, d, w), (dense_cfg, dg, dd, dense)):
        s = session(c, graph, weights, constants_for(c))
        anchor = int(s.step([SeqChunk(1, toks)])[-1].argmax())
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        outs.append(interpret(draft, {"anchor_ids": i64([anchor]), "seq_slots": i64([1]),
                                      "seq_cached": i64([len(toks)]),
                                      **{ring_name(st): s.state[ring_name(st)]
                                         for st in range(c.num_mtp_layers)}}, weights,
                                      reference_impls()))
    (a, b) = outs
    assert torch.equal(a["drafts"], b["drafts"]), f"SEED {SEED}"
    for k in ("confidence", "logits"):
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4)
    # the confidence head's output is a probability (sigmoid), not a logit (spec §3.9)
    assert ((a["confidence"] > 0) & (a["confidence"] < 1)).all()
