"""Where a run's Engram token map comes from (V4.1 step graphs read it as `engram_token_map`).

The map sends each token id to the class of its normalized text (spec §3.3.1), so it belongs to
the model's tokenizer and is not in the checkpoint. A map of another tokenizer, or a random one,
hashes every n-gram to other table rows: the model runs and its outputs are wrong, with nothing
to show for it. So the map comes from, in this order:

1. the caller: `Engine(..., token_map=tensor)` (checked against the model: one class per token
   id, classes below `engram_compressed_vocab_size`, the pad id its own class);
2. the tokenizer named by `--tokenizer PATH` (`EngineConfig.tokenizer`): a tokenizer.json, or
   the directory holding one;
3. the checkpoint's own `tokenizer.json`, beside the weights;
4. for random weights only, the deterministic stand-in `models.engram.tiny_token_map` (the
   values the tests use; the tiny models have no tokenizer of their own).

Weights from a checkpoint, or given as tensors, with none of 1-3 refuse to start, saying what to
pass. Whatever the source, the start-up report names it (`engram token map: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megagraph.models.config import ModelConfig


class TokenMapError(ValueError):
    """No token map can be derived, or a given one does not fit the model; says what to pass."""


@dataclass(frozen=True)
class TokenMapSource:
    """Where the map will come from: "given", "tokenizer" (with its path) or "stand-in"."""

    kind: str
    path: Path | None = None

    def describe(self) -> str:
        if self.kind == "given":
            return "given by the caller (Engine token_map)"
        if self.kind == "tokenizer":
            return f"derived from {self.path}"
        return ("stand-in (models.engram.tiny_token_map, seed 0): random weights, no tokenizer; "
                "not the model's map")


def tokenizer_file(path: str | Path) -> Path:
    """A tokenizer.json path, or the directory holding one; FileNotFoundError naming it."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no such file"
                                + (" (the directory has no tokenizer.json)" if Path(path).is_dir() else ""))
    return p


def token_map_source(cfg: ModelConfig, *, given: bool, tokenizer: str | Path | None,
                     ckpt_dir: Path | None, origin: str) -> TokenMapSource:
    """Decide (without reading the tokenizer) where the map comes from; raise TokenMapError when
    weights from a checkpoint (`origin` "checkpoint") or given tensors ("given") have no tokenizer.
    A path that is no checkpoint at all (missing, no index) is left to the weight loader's error."""
    if given:
        return TokenMapSource("given")
    if tokenizer is not None:
        return TokenMapSource("tokenizer", tokenizer_file(tokenizer))
    if ckpt_dir is not None and (ckpt_dir / "tokenizer.json").is_file():
        return TokenMapSource("tokenizer", ckpt_dir / "tokenizer.json")
    if origin == "random":
        return TokenMapSource("stand-in")
    if origin == "checkpoint" and not _looks_like_checkpoint(ckpt_dir):
        return TokenMapSource("stand-in")  # never used: loading the weights fails, naming the path
    what = (f"{ckpt_dir}: the checkpoint has no tokenizer.json beside it" if origin == "checkpoint"
            else "the weights are given as tensors and no tokenizer is named")
    raise TokenMapError(
        f"{what}, and {cfg.name}'s Engram layers need the token map derived from the model's "
        "tokenizer (spec §3.3.1; a stand-in map gives wrong outputs): pass --tokenizer PATH (the "
        "model's tokenizer.json, or the directory holding it); from Python "
        "EngineConfig(tokenizer=PATH) or Engine(..., token_map=tensor)")


def _looks_like_checkpoint(d: Path | None) -> bool:
    from megagraph.models.checkpoint.reader import INDEX_NAME, SINGLE_NAME

    return d is not None and ((d / INDEX_NAME).is_file() or (d / SINGLE_NAME).is_file())


def token_map_from_tokenizer(path: str | Path, cfg: ModelConfig) -> torch.Tensor:
    """The model's map from its tokenizer.json (or the directory holding it): i64[vocab_size].
    Raises ValueError naming the file when its class count is not the model's."""
    from .tokenizer import Tokenizer, compressed_token_map

    return compressed_token_map(Tokenizer(tokenizer_file(path), cfg), cfg)


def check_token_map(m: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A caller's map as the graph reads it (i64[vocab_size] on the CPU), or TokenMapError."""
    where = "Engine token_map"
    if not isinstance(m, torch.Tensor):
        raise TokenMapError(f"{where}: expected a torch.Tensor, got {type(m).__name__}")
    if m.dtype.is_floating_point or m.dtype == torch.bool or m.dtype.is_complex:
        raise TokenMapError(f"{where}: expected integer class ids, got dtype {m.dtype}")
    if tuple(m.shape) != (cfg.vocab_size,):
        raise TokenMapError(f"{where}: expected shape [{cfg.vocab_size}] (one class per token id of "
                            f"{cfg.name}), got {list(m.shape)}")
    m = m.detach().to("cpu", torch.int64)
    lo, hi = int(m.min()), int(m.max())
    if lo < 0 or hi >= cfg.engram_compressed_vocab_size:
        raise TokenMapError(f"{where}: class ids must lie in 0..{cfg.engram_compressed_vocab_size - 1} "
                            f"(engram_compressed_vocab_size), got {lo}..{hi}")
    pad = cfg.engram_pad_token_id
    if int(m[pad]) != pad:
        raise TokenMapError(f"{where}: token {pad} (engram_pad_token_id) must be its own class {pad} "
                            f"(the hash pads with it), got {int(m[pad])}")
    return m


def stand_in_token_map(cfg: ModelConfig) -> torch.Tensor | None:
    """The stand-in for a model with Engram layers (None without): for callers that pass random
    weights as tensors (benchmarks, tests) and say so by passing this map."""
    from megagraph.models.engram import tiny_token_map

    return tiny_token_map(cfg) if cfg.engram_layers else None


def build_token_map(src: TokenMapSource, cfg: ModelConfig, given: torch.Tensor | None) -> torch.Tensor:
    """The map `src` names (i64[vocab_size] on the CPU)."""
    if src.kind == "given":
        return check_token_map(given, cfg)
    if src.kind == "tokenizer":
        return token_map_from_tokenizer(src.path, cfg)
    from megagraph.models.engram import tiny_token_map

    return tiny_token_map(cfg)


__all__ = ["TokenMapError", "TokenMapSource", "build_token_map", "check_token_map",
           "stand_in_token_map", "token_map_from_tokenizer", "token_map_source", "tokenizer_file"]
