"""The attention, indexer and mHC kernel configs: their defaults make today's choices, an
override through the compiler's channels (--set, a file) changes what choose() says, every fast
kernel the registry loads for their ops takes `kernel_config=`, and nothing under these
families reads the process environment. CPU only: no kernel runs here."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from megagraph.kernels import kernel_config as kc
from megagraph.kernels import registry
from megagraph.kernels.attention.config import AttentionConfig
from megagraph.kernels.indexer.config import IndexerConfig
from megagraph.kernels.mhc.config import MhcConfig

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
FAMILY_DIRS = ("attention", "indexer", "state", "mhc", "dense", "engram", "dspark", "v4",
               "common", "parallel")


def test_families_are_registered():
    fams = kc.families()
    assert fams["attention"] is AttentionConfig and fams["indexer"] is IndexerConfig
    assert fams["mhc"] is MhcConfig
    for key in ("sparse_attn", "sparse_attn_q", "index_scores", "topk_select",
                "candidate_mask", "mega_mhc", "hc_expand"):
        assert key in registry.KERNELS, key
        assert kc.family_of(key) in ("attention", "indexer", "mhc"), key


def test_attention_defaults_pick_todays_launches():
    from megagraph.kernels.attention.triton import AttnLaunch, pick_launch

    cfg = AttentionConfig()
    assert [cfg.choose({"tokens": t})["attention"] for t in (1, 127, 128, 1023, 1024, 8192)] == \
        ["decode", "decode", "wide", "wide", "prefill", "prefill"]
    assert pick_launch(64) == AttnLaunch(16, 32, 4, 2, splits=0, pipe=False)
    assert pick_launch(256) == AttnLaunch(64, 32, 8, 2, splits=0, pipe=False)
    assert pick_launch(8192) == AttnLaunch(16, 32, 4, 2, splits=1, pipe=True)
    assert (cfg.max_splits, cfg.combine_heads) == (8, 16)


def test_attention_override_moves_the_choice():
    cfg = kc.resolve(kc.parse_set(["attention.prefill_tokens=512",
                                   "attention.prefill=[64, 32, 8, 2]",
                                   "attention.prefill_pipe=false"]))["attention"]
    assert cfg.choose({"tokens": 512}) == {"attention": "prefill"}
    from megagraph.kernels.attention.triton import AttnLaunch, pick_launch

    assert pick_launch(512, cfg) == AttnLaunch(64, 32, 8, 2, splits=1, pipe=False)


def test_indexer_defaults_and_overrides():
    d = IndexerConfig()
    v41 = {"tokens": 8192, "k": 512, "columns": 135168, "topk_blocks": 2048, "block": 8,
           "bf16_products": 1}
    assert d.choose(v41) == {"index_scores": "stream", "topk_select": "stream",
                             "candidate_mask": "stream"}
    assert d.choose({**v41, "bf16_products": 0})["index_scores"] == "tile"
    assert (d.index_precision, d.topk_segments, d.stream_max_k) == ("tf32x3", 0, 16384)
    over = kc.resolve({"indexer": {"index_kernel_bf16": "tile", "stream_max_k": 256}})["indexer"]
    assert over.choose(v41) == {"index_scores": "tile", "topk_select": "capturable",
                                "candidate_mask": "capturable"}
    with pytest.raises(kc.KernelConfigError, match="index_precision"):
        kc.resolve({"indexer": {"index_precision": "fp16"}})


def test_mhc_defaults_and_overrides():
    d = MhcConfig()
    assert [d.choose({"tokens": t})["mega_mhc"] for t in (1, 64, 65, 8192)] == \
        ["fused", "fused", "unfused", "unfused"]
    assert MhcConfig(fused="never").choose({"tokens": 1}) == {"mega_mhc": "unfused"}
    assert MhcConfig(fused="always").choose({"tokens": 8192}) == {"mega_mhc": "fused"}
    assert kc.resolve(kc.parse_set(["mhc.fused_tokens=128"]))["mhc"].choose(
        {"tokens": 100}) == {"mega_mhc": "fused"}


@pytest.mark.parametrize("family", ["attention", "indexer", "mhc"])
def test_fast_kernels_take_kernel_config(family):
    """Every fast kernel the registry can load for the family's ops has a keyword-only
    `kernel_config` defaulting to None (the runtime binds the plan's config there)."""
    pytest.importorskip("torch")
    cls = kc.families()[family]
    found = 0
    for key in cls.OPS:
        op = key.partition("[")[0]
        for impl in registry.KERNELS.get(op, []):
            mod = registry.LOADABLE.get(impl.name)
            if mod is None:
                continue
            fn = getattr(importlib.import_module(mod), op)
            p = inspect.signature(fn).parameters.get("kernel_config")
            assert p is not None and p.kind is p.KEYWORD_ONLY and p.default is None, impl.name
            found += 1
    assert found >= len(cls.OPS)


def test_no_environment_reads_under_these_families():
    """Choices come from the plan's configs; the one process-level switch these kernels need
    (Triton's interpreter) is read in configs/process.py."""
    pat = re.compile(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(")
    hits = [f"{p.relative_to(KERNELS)}:{i}" for d in FAMILY_DIRS
            for p in sorted((KERNELS / d).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert hits == []
