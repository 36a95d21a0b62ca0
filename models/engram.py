"""Engram (V4.1 layers 1 and 14): n-gram hash memory gated into every residual stream (spec §3.3).

The compressed token map (tokenizer-derived, 99,092 classes for the release tokenizer) is a graph
input, not a weight: it is not in the checkpoint. Hash constants (primes, offsets, multipliers)
are derived from the config and become op attributes, so dumps show them.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from megagraph.graph.types import T

from .blocks import Step
from .config import ModelConfig


@lru_cache(maxsize=8)
def _layouts(cfg: ModelConfig):
    from megagraph.kernels.engram.reference import engram_layout

    return engram_layout(list(cfg.engram_layers), list(cfg.engram_num_embeddings),
                         max_ngram=cfg.engram_max_ngram, n_heads=cfg.engram_n_heads,
                         vocab_start=cfg.engram_vocab_size,
                         compressed_vocab=cfg.engram_compressed_vocab_size)


def engram_layouts(cfg: ModelConfig):
    """{layer: EngramLayout}; raises if the primes do not reproduce engram_num_embeddings."""
    return _layouts(cfg)


def engram_prologue(s: Step) -> str:
    """Compressed ids of this step's tokens, and the history state update (once per step)."""
    cfg, b = s.cfg, s.b
    # tokenizer-derived, not in the checkpoint; must map the pad id to itself (see tiny_token_map)
    table = b.input("engram_token_map", T("i64", cfg.vocab_size))
    cids = b.op("token_map", s.meta["token_ids"], table, name="engram.cids")
    hist = s.state("engram_hist", "S", cfg.engram_max_ngram - 1, dtype="i64")
    s.update("engram_hist", b.op("engram_hist_update", hist, cids,
                                 *s.m("positions", "token_req", "seq_slots", "seq_cached", "seq_new"),
                                 name="engram_hist.next"))
    return cids


def engram_block(s: Step, layer: int, table_index: int, streams: str, cids: str) -> str:
    cfg, b = s.cfg, s.b
    lay = engram_layouts(cfg)[layer]
    pfx = f"layers.{layer}.engram"
    rows, width = cfg.engram_num_embeddings[table_index], cfg.engram_head_dim
    cols = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    ids = b.op("engram_hash", cids, "engram_hist",
               *s.m("positions", "token_req", "seq_slots", "seq_cached"),
               multipliers=lay.multipliers, primes=lay.primes, offsets=lay.offsets,
               pad_id=cfg.engram_pad_token_id, max_ngram=cfg.engram_max_ngram, name="ids")
    if s.w.release:
        table = b.weight(f"{pfx}.embed.weight", T("fp8e4m3", rows, width))
        scale = b.weight(f"{pfx}.embed.scale", T("e8m0", rows, width // 32))
    else:
        table, scale = b.weight(f"{pfx}.embed.weight", T(cfg.act_dtype, rows, width)), None
    # rows in the activation dtype (the op's default, bf16, is left implicit so bf16 dumps keep
    # their text); the wkv GEMM then stays in it too (linear's output follows its input)
    e = b.op("engram_lookup", table, scale, ids, out_dtype=None if s.act == "bf16" else s.act,
             name="rows")
    kv = s.linear(e, s.w.fp8(f"{pfx}.wkv", (cfg.hc_mult + 1) * cfg.hidden_size, cols * width), name="kv")
    qw = s.w.tensor(f"{pfx}.q_weight", cfg.hc_mult, cfg.hidden_size)
    kw = s.w.tensor(f"{pfx}.k_weight", cfg.hc_mult, cfg.hidden_size)
    return b.op("engram_gate", streams, kv, qw, kw, eps=cfg.rms_norm_eps, name="streams")


def tiny_token_map(cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    """A deterministic stand-in for the tokenizer-derived map (tiny models have no tokenizer).

    Like the real map it numbers classes by first appearance over increasing token ids, so the
    special ids 0..pad keep their own classes (tokenmap[pad] == pad, which engram_hash relies on:
    its `pad_id` attribute is the compressed pad id)."""
    g = torch.Generator().manual_seed(seed)
    n_special = cfg.engram_pad_token_id + 1
    raw = torch.randint(n_special, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=g)
    raw[:n_special] = torch.arange(n_special)
    first: dict[int, int] = {}
    return torch.tensor([first.setdefault(int(v), len(first)) for v in raw], dtype=torch.int64)
