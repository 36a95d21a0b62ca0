"""Weights for a step graph from a checkpoint directory (official release layout or a
transformers-saved V4 checkpoint).

Two modes:
* storage format: the graph declares release formats (FP8 + scales, MXFP4 experts) and gets the
  tensors exactly as stored (the runtime's mode: kernels dequantize);
* reference path: `dequantize=True` with a graph built from `cfg.replace(weight_format="dense")`:
  FP8/MXFP4 pairs are dequantized while streaming shard by shard, so the dense reference graph runs
  on the released weights without ever holding a shard in memory twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megagraph.graph.interp import TORCH_DTYPES
from megagraph.graph.ir import Graph

from .build import build_step
from .checkpoint import CheckpointError, load_hf_layout, open_checkpoint
from .config import ModelConfig
from .session import weight_specs


def checkpoint_layout(path: str | Path) -> str:
    """'official' or 'transformers', from the tensor names the checkpoint holds."""
    ck = open_checkpoint(path)
    keys = list(ck.keys())
    if any(k.startswith(("model.layers.", "lm_head.", "model.embed_tokens")) for k in keys):
        return "transformers"
    return "official"


def load_weights(cfg: ModelConfig, g: Graph, path: str | Path, *, dequantize: bool = False,
                 progress: bool = True) -> dict[str, torch.Tensor]:
    """Tensors for every weight `g` declares, validated (name, shape, dtype) before any data is read."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(str(path), "checkpoint path does not exist")
    specs = weight_specs(g)
    if checkpoint_layout(path) == "transformers":
        return load_hf_layout(path, specs)
    if not dequantize:
        return open_checkpoint(path).load(specs, progress=progress)
    if cfg.weight_format != "dense":
        raise ValueError("dequantize=True needs the dense graph: build it from "
                         "cfg.replace(weight_format='dense')")
    release = weight_specs(build_step(cfg.replace(weight_format="release")))
    loaded = open_checkpoint(path).load(release, dequantize=True, progress=progress)
    out = {}
    for s in specs:
        if s.name not in loaded:
            raise CheckpointError(str(path), "not produced by dequantization", tensor=s.name)
        out[s.name] = loaded[s.name].to(TORCH_DTYPES[s.dtype])
    return out


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
