"""Shared test helpers: tiny models with seeded random weights, and step runners.

Weights are random but in the real storage formats (FP8 block-scaled projections, MXFP4 experts,
FP8 Engram rows) unless the config says `weight_format: dense`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from megagraph.graph.ir import Graph
from megagraph.models.build import build_step
from megagraph.models.config import ModelConfig, load_model_config
from megagraph.models.checkpoint.synthetic import random_weights
from megagraph.models.engram import tiny_token_map
from megagraph.models.session import ReferenceSession, SeqChunk, weight_specs

TINY = ("v4.1-flash-tiny", "v4-flash-tiny")


@lru_cache(maxsize=16)
def tiny(model: str = "v4.1-flash-tiny", act_dtype: str = "f32", seed: int = 0, **overrides):
    """(cfg, graph, weights, constants) for a tiny model; cached per arguments."""
    cfg = load_model_config(model).replace(act_dtype=act_dtype, **overrides)
    g = build_step(cfg)
    w = random_weights(weight_specs(g), seed=seed, init_std=cfg.hidden_size ** -0.5, stacked=True)
    return cfg, g, w, constants_for(cfg)


def constants_for(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {"engram_token_map": tiny_token_map(cfg)} if cfg.engram_layers else {}


def session(cfg, g: Graph, w, consts, *, slots: int = 4, capacity: int = 128, impls=None):
    return ReferenceSession(g, w, slots=slots, capacity=capacity, constants=consts, impls=impls)


def random_tokens(n: int, seed: int, vocab: int = 500) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())


__all__ = ["TINY", "tiny", "session", "random_tokens", "SeqChunk", "constants_for"]
