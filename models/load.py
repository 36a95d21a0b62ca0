"""Weights for a model's graphs from a checkpoint directory (official release layout or a
transformers-saved V4 checkpoint).

The graphs are the step graph and, for a V4.1 model with DSpark stages, the draft graph
(`models.dspark.build_dspark_draft`): pass both and the drafter's `mtp.*` weights load with the
model in one pass over the shards (tensors both read, `embed.weight` and `head.weight`, once).

Two modes:
* storage format: the graphs declare release formats (FP8 + scales, MXFP4 experts) and get the
  tensors as stored (the runtime's mode: kernels dequantize); a float stored wider than declared
  is rounded to the declared dtype, because these graphs' weight types are fixed;
* reference path: `dequantize=True` with graphs built from `cfg.replace(weight_format="dense")`:
  FP8/MXFP4 pairs are dequantized while streaming shard by shard, so the dense reference graphs run
  on the released weights without ever holding a shard in memory twice; a float stored wider than
  the release declares (F32 for BF16) keeps its precision up to the dense graph's own dtype.

docs/python-api.md shows the whole recipe (config, graphs, weights, prefill and decode).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from megagraph.graph.types import TORCH_DTYPES
from megagraph.graph.ir import Graph

from .build import build_step
from .checkpoint import CheckpointError, WeightSpec, load_hf_layout, open_checkpoint, weight_name_for_scale
from .config import ModelConfig
from .session import weight_specs


def checkpoint_layout(path: str | Path) -> str:
    """'official' or 'transformers', from the tensor names the checkpoint holds."""
    ck = open_checkpoint(path)
    keys = list(ck.keys())
    if any(k.startswith(("model.layers.", "lm_head.", "model.embed_tokens")) for k in keys):
        return "transformers"
    return "official"


def load_weights(cfg: ModelConfig, graphs: Graph | Sequence[Graph], path: str | Path, *,
                 dequantize: bool = False, progress: bool = True) -> dict[str, torch.Tensor]:
    """Tensors for every weight `graphs` declare (one graph or several: the step graph and the
    DSpark draft graph), validated (name, shape, dtype) before any data is read."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(str(path), "checkpoint path does not exist")
    specs = graph_specs([graphs] if isinstance(graphs, Graph) else list(graphs))
    if checkpoint_layout(path) == "transformers":
        return load_hf_layout(path, specs)
    if not dequantize:
        return open_checkpoint(path).load(specs, progress=progress)
    if cfg.weight_format != "dense":
        raise ValueError("dequantize=True needs the dense graph: build it from "
                         "cfg.replace(weight_format='dense')")
    release = release_specs(cfg, {s.name for s in specs})
    loaded = open_checkpoint(path).load(release, dequantize=True, progress=progress, keep_wider=True)
    out = {}
    for s in specs:
        if s.name not in loaded:
            raise CheckpointError(str(path), "not produced by dequantization", tensor=s.name)
        out[s.name] = loaded[s.name].to(TORCH_DTYPES[s.dtype])
    return out


def graph_specs(graphs: Sequence[Graph]) -> list[WeightSpec]:
    """Every weight the graphs read, once, in first-use order; a name two graphs declare with
    different shapes or dtypes is an error (the graphs are of different models)."""
    seen: dict[str, WeightSpec] = {}
    for g in graphs:
        for s in weight_specs(g):
            prev = seen.setdefault(s.name, s)
            if prev != s:
                raise ValueError(f"weight {s.name} is {prev.dtype}{list(prev.shape)} in one graph and "
                                 f"{s.dtype}{list(s.shape)} in {g.name}: graphs of different models?")
    return list(seen.values())


def release_specs(cfg: ModelConfig, names: set[str]) -> list[WeightSpec]:
    """The release-format specs (FP8/MXFP4 + scales as stored) behind the dense weights `names`:
    from the release builds of the step graph and, with DSpark stages, the draft graph."""
    rel = cfg.replace(weight_format="release")
    graphs = [build_step(rel)]
    if rel.is_v41 and rel.num_mtp_layers > 0:
        from .dspark import build_dspark_draft

        graphs.append(build_dspark_draft(rel))
    return [s for s in graph_specs(graphs)
            if s.name in names or (s.name.endswith(".scale") and weight_name_for_scale(s.name) in names)]


def checkpoint_config(path: str | Path) -> ModelConfig | None:
    """The checkpoint's own config.json as a ModelConfig, if it has one."""
    p = Path(path) / "config.json"
    if not p.exists():
        return None
    return ModelConfig.from_hf(p)


def describe(path: str | Path) -> dict:
    """Summary for error messages and `inspect`: layout, tensor count, total bytes."""
    ck = open_checkpoint(path)
    return {"layout": checkpoint_layout(path), "tensors": len(list(ck.keys())),
            "total_bytes": ck.total_size, "metadata": json.loads(json.dumps(ck.metadata()))}
