"""Tiny checkpoints as users have them: official-layout safetensors written by the project's own
writer, a `config.json` in the release's spelling beside them, and the variants tools produce
(E8M0 scales tagged U8, BF16 tensors widened to F32).

The config.json is the inverse of models/hf_config.py for the fields a release config carries
(V4.1 nested under `text_config`, V4 flat); numerics knobs (`act_dtype`, `quantize_kv`) are ours
and not in it, so `ModelConfig.from_hf` gives their defaults.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from megagraph.graph.ir import Graph
from megagraph.models.checkpoint import random_weights, write_checkpoint
from megagraph.models.config import ModelConfig
from megagraph.models.hf_config import DIRECT
from megagraph.models.load import graph_specs


def hf_config(cfg: ModelConfig) -> dict:
    """`cfg` as a release config.json (official key spelling)."""
    ours = {v: k for k, v in DIRECT.items()}
    text = {ours[f]: v for f, v in cfg.to_dict().items() if f in ours and v not in (None, [])}
    text.update(qk_rope_head_dim=cfg.rope_head_dim, compress_ratios=list(cfg.compress_ratios),
                rope_scaling={"type": "yarn", "factor": cfg.yarn_factor,
                              "original_max_position_embeddings": cfg.yarn_original,
                              "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow})
    quant = ({"quant_method": "fp8", "weight_block_size": [cfg.fp8_block, cfg.fp8_block],
              "scale_fmt": "ue8m0", "expert_dtype": "fp4"} if cfg.weight_format == "release" else None)
    if cfg.is_v41:
        out = {"_name_or_path": cfg.name, "model_type": "deepseek_v41", "text_config": text}
    else:
        out = {"_name_or_path": cfg.name, "model_type": "deepseek_v4", **text}
    if quant:
        out["quantization_config"] = quant
    return out


def as_users_have_it(tensors: dict[str, torch.Tensor], *, u8_scales: bool = False,
                     f32_floats: bool = False) -> dict[str, torch.Tensor]:
    """The same tensors as a converter writes them: E8M0 bytes as uint8 (same bytes), BF16
    widened to F32 (lossless)."""
    out = {}
    for k, t in tensors.items():
        if u8_scales and t.dtype == torch.float8_e8m0fnu:
            t = t.view(torch.uint8)
        elif f32_floats and t.dtype == torch.bfloat16:
            t = t.float()
        out[k] = t
    return out


def write_model_checkpoint(path: Path, cfg: ModelConfig, graphs: Sequence[Graph], *, seed: int,
                           u8_scales: bool = False, f32_floats: bool = False,
                           max_shard_bytes: int = 4 << 20) -> Path:
    """Random weights for every tensor `graphs` read (init std d^-1/2, the tests' seeded values)
    in the official layout, plus config.json; returns `path`."""
    w = random_weights(graph_specs(graphs), seed=seed, init_std=cfg.hidden_size ** -0.5)
    write_checkpoint(path, as_users_have_it(w, u8_scales=u8_scales, f32_floats=f32_floats),
                     max_shard_bytes=max_shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return path


SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")


def write_tiny_tokenizer(path: Path, cfg: ModelConfig, *, variants: int = 100) -> Path:
    """A real tokenizer.json (a `tokenizers` WordLevel model, whitespace pre-tokenizer) whose
    Engram token map has exactly `cfg.engram_compressed_vocab_size` classes: the 3 specials, words
    w0, w1, ... (one class each), `variants` upper-case twins W0, W1, ... that the map's
    normalization (Lowercase) folds into their word's class, and the empty text of every id past
    the tokenizer's vocabulary (one class). Returns the file's path."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    n_words = cfg.engram_compressed_vocab_size - len(SPECIALS) - 1
    if not 0 < variants <= n_words:
        raise ValueError(f"variants must be in 1..{n_words}")
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(n_words)})
    vocab.update({f"W{i}": len(SPECIALS) + n_words + i for i in range(variants)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[2]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    path = Path(path)
    if path.suffix != ".json":
        path = path / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
