"""Bad input fails early and clearly: other hardware, mismatched or damaged checkpoints, missing
files, a model that does not fit."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from megagraph.models.checkpoint import CheckpointError, random_weights, write_checkpoint
from megagraph.models.config import load_model_config
from megagraph.runtime.engine import Engine, EngineConfig
from megagraph.runtime.plan import ArtifactsError, RunPlan
from megagraph.runtime.weights import FitError, graph_weight_specs
from tests.runtime.conftest import make_engine
from tests.tiny import SeqChunk, constants_for, random_tokens, tiny

MODEL = "v4.1-flash-tiny"
CONF = dict(max_slots=2, capacity=64, progress=False)
MAP = dict(token_map=constants_for(load_model_config(MODEL))["engram_token_map"])  # no tokenizer here


def test_artifacts_for_another_device(compiled):
    path = compiled(MODEL, hw="h200")
    with pytest.raises(ArtifactsError, match=r"compiled for hardware profile 'h200' \(sm_90\), but "
                                             r"this device is cpu.*--allow-fallback"):
        Engine.from_artifacts(path, **CONF)
    eng = Engine.from_artifacts(path, allow_fallback=True, **CONF)
    assert "artifacts for h200 (sm_90) on cpu" in "\n".join(eng.report.lines())


def test_fallback_names_the_kernels(compiled):
    plan = RunPlan.from_artifacts(compiled(MODEL))
    plan = dataclasses.replace(plan, kernels={**plan.kernels, "linear[fmt=fp8_block]": "deepgemm.fp8_gemm_nt"})
    with pytest.raises(ArtifactsError, match=r"linear\[fmt=fp8_block\] with kernel 'deepgemm.fp8_gemm_nt'"):
        Engine(plan, None, EngineConfig(**CONF))
    eng = Engine(plan, None, EngineConfig(allow_fallback=True, **CONF))
    assert eng.report.kernel_fallbacks == {"linear[fmt=fp8_block]": "deepgemm.fp8_gemm_nt -> "
                                           "reference (no module provides deepgemm.fp8_gemm_nt)"}
    assert "deepgemm.fp8_gemm_nt -> reference" in "\n".join(eng.report.lines())


def _checkpoint(tmp_path, model, drop=None):
    cfg, g, _, _ = tiny(model, act_dtype="f32")
    w = random_weights(graph_weight_specs([g]), seed=0, init_std=cfg.hidden_size ** -0.5)
    if drop:
        w.pop(drop)
    return write_checkpoint(tmp_path / "ckpt", w, max_shard_bytes=8 << 20)


def test_checkpoint_loads_in_storage_format(compiled, tmp_path):
    ckpt = _checkpoint(tmp_path, MODEL)
    eng = Engine.from_artifacts(compiled(MODEL), ckpt, **CONF, **MAP)
    assert eng.weights["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn  # not dequantized
    ref = make_engine(compiled(MODEL), MODEL, **CONF)  # the same seeded values, in memory
    chunks = [SeqChunk(0, (5, 6, 7))]
    torch.testing.assert_close(eng.step(chunks), ref.step(chunks), rtol=0, atol=0)


def test_checkpoint_as_converters_write_it_runs_identically(compiled, tmp_path, caplog):
    """E8M0 scales tagged U8 and BF16 tensors widened to F32: accepted with one line saying so,
    bound in the plan's dtypes, bit-equal logits (the widened values round back exactly)."""
    import logging

    from tests.checkpoints import as_users_have_it

    cfg, g, _, _ = tiny(MODEL, act_dtype="f32")
    w = random_weights(graph_weight_specs([g]), seed=0, init_std=cfg.hidden_size ** -0.5)
    ckpt = write_checkpoint(tmp_path / "ckpt", as_users_have_it(w, u8_scales=True, f32_floats=True),
                            max_shard_bytes=8 << 20)
    with caplog.at_level(logging.WARNING, logger="megagraph.checkpoint"):
        eng = Engine.from_artifacts(compiled(MODEL), ckpt, **CONF, **MAP)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "megagraph.checkpoint"]
    assert "stored as U8 read as their E8M0 bytes" in line and "stored as wider F32, rounded" in line
    assert eng.weights["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert eng.weights["layers.0.attn_norm.weight"].dtype == torch.bfloat16
    ref = make_engine(compiled(MODEL), MODEL, **CONF)  # the same seeded values, as declared
    chunks = [SeqChunk(0, random_tokens(9, int(torch.randint(0, 2**31 - 1, ()))))]
    torch.testing.assert_close(eng.step(chunks), ref.step(chunks), rtol=0, atol=0)


def test_host_resident_tables_are_memory_mapped(tmp_path):
    from megagraph.models.checkpoint import open_checkpoint
    from megagraph.runtime.weights import host_resident, map_tensor

    cfg, g, _, _ = tiny(MODEL, act_dtype="f32")
    host = host_resident(g)
    assert host and all(".engram.embed." in h for h in host)  # read only by engram_lookup
    ck = open_checkpoint(_checkpoint(tmp_path, MODEL))
    specs = [s for s in graph_weight_specs([g]) if s.name in host]
    loaded = ck.load(specs, progress=False, warn_unexpected=False)
    for s in specs:
        mapped = map_tensor(ck.info(s.name), s)
        assert mapped.dtype == loaded[s.name].dtype and torch.equal(mapped.view(torch.uint8),
                                                                    loaded[s.name].view(torch.uint8))


def test_checkpoint_of_another_model_names_a_tensor(compiled, tmp_path):
    ckpt = _checkpoint(tmp_path, "v4-flash-tiny")
    with pytest.raises(CheckpointError, match=r"layers\.\d+\.|embed|head"):
        Engine.from_artifacts(compiled(MODEL), ckpt, **CONF, **MAP)


def test_checkpoint_missing_a_tensor(compiled, tmp_path):
    ckpt = _checkpoint(tmp_path, MODEL, drop="layers.3.attn.wq_b.weight")
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_b\.weight"):
        Engine.from_artifacts(compiled(MODEL), ckpt, **CONF, **MAP)


def test_missing_files(compiled, tmp_path):
    with pytest.raises(ArtifactsError, match="no such directory"):
        Engine.from_artifacts(tmp_path / "nope", **CONF)
    art = tmp_path / "art"
    shutil.copytree(compiled(MODEL), art)
    (art / "plan.yaml").unlink()
    with pytest.raises(ArtifactsError, match="plan.yaml"):
        Engine.from_artifacts(art, **CONF)
    shutil.rmtree(art)
    shutil.copytree(compiled(MODEL), art)
    final = sorted((art / "graph").glob("*.mgir"))[-1]
    final.unlink()
    with pytest.raises(ArtifactsError, match=final.name):
        Engine.from_artifacts(art, **CONF)
    with pytest.raises(CheckpointError, match="not found"):
        Engine.from_artifacts(compiled(MODEL), tmp_path / "no-ckpt", **CONF)


def test_fit_check_fails_before_loading(compiled, tmp_path):
    with pytest.raises(FitError, match=r"(?s)needs [0-9.]+ MiB .* and 1\.0 MiB is available.*layer slice"):
        Engine.from_artifacts(compiled(MODEL), tmp_path / "never-read", memory_budget=1 << 20, **CONF)


def test_full_size_model_says_what_would_fit(compiled):
    path = compiled("v4.1-flash", act="bf16")
    with pytest.raises(FitError) as e:
        Engine.from_artifacts(path, memory_budget=139 << 30, **CONF)
    msg = str(e.value)
    assert "v4.1-flash does not fit" in msg and "139.0 GiB is available" in msg
    assert "a layer slice of at most" in msg and "GPUs" in msg


def test_engram_rows_gathered_in_storage_format():
    """Host-resident Engram tables: the step gathers its rows (FP8 + e8m0 scales) where the table
    lives and dequantizes them where the step runs; same values as dequantizing on the host."""
    from megagraph.kernels import formats
    from megagraph.kernels.capturable_table import CAPTURABLE
    from megagraph.runtime.kernels import gather_on_host, host_rows, on_host

    g = torch.Generator().manual_seed(3)
    table, scale = formats.quantize_fp8_rows(torch.randn(50, 64, generator=g))  # e8m0 per 32
    ids = torch.randint(0, 50, (7, 3), generator=g)
    fn = CAPTURABLE["engram_lookup"]
    want = fn(table, scale, ids)
    rows, sc, local = host_rows(table, scale, ids, torch.device("cpu"))
    assert rows.dtype == table.dtype and rows.shape == (21, 64) and local.max() == 20
    assert torch.equal(fn(rows, sc, local), want)
    assert torch.equal(gather_on_host(fn)(table, scale, ids), want)
    # the node's attributes reach the kernel (an f32 graph's rows are f32)
    want32 = fn(table, scale, ids, out_dtype="f32")
    assert want32.dtype == torch.float32
    assert torch.equal(gather_on_host(fn)(table, scale, ids, out_dtype="f32"), want32)
    if torch.cuda.is_available():
        got = gather_on_host(fn)(table, scale, ids.cuda())
        assert got.device.type == "cuda" and torch.equal(got.cpu(), on_host(fn)(table, scale, ids.cuda()).cpu())
