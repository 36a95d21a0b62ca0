"""Refuse a prompt that cannot fit the context before tokenizing it.

Tokenizing is the one step whose cost grows with the prompt before the context check can run: a
31 MiB prompt took 35-40 s and about 1 GB to tokenize, only to be refused. This module gives a
lower bound on a text's token count from its length alone, so such prompts are refused in
microseconds, and never refuses one that could fit:

For a lossless byte-level tokenizer (byte-level decoder, no normalizer: the tokens' bytes
concatenate back to the text's UTF-8 bytes, as DeepSeek's do), every token covers at most
`max_token_bytes` bytes (the longest token of the vocabulary, added tokens included; 128 for
DeepSeek-V4's), so `tokens >= ceil(utf8_bytes / max_token_bytes)`. A text longer than that
bound allows is certainly too long; anything shorter is tokenized in full (off the event loop),
at most `max_token_bytes * context` bytes of it. Other tokenizers get no early refusal (0).

For chats, the message contents are the counted text: each appears verbatim in the rendered
prompt (tested against the renderer), which adds template tokens to them and drops only past
reasoning, which is not counted.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

from .protocol import context_error


class TokenBound:
    """Lower bounds on token counts for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.max_token_bytes = _max_token_bytes(tokenizer) if tokenizer is not None else None

    def tokens_at_least(self, text: str) -> int:
        """A lower bound on the tokens of `text` (0 without a sound bound)."""
        m = self.max_token_bytes
        if not m:
            return 0
        return -(-len(text.encode("utf-8")) // m)

    def check_prompt(self, text: str, capacity: int, param: str = "prompt",
                     extra_tokens: int = 0) -> None:
        """400 `context_length_exceeded` when `text` (plus `extra_tokens`, e.g. BOS) certainly
        leaves no room for one output token."""
        if not self.max_token_bytes:
            return
        at_least = -(-len(text) // self.max_token_bytes) + extra_tokens  # characters <= bytes
        if at_least < capacity:
            at_least = self.tokens_at_least(text) + extra_tokens
        if at_least >= capacity:
            raise self._error(param, capacity, at_least)

    def check_chat(self, body: Mapping[str, Any], capacity: int) -> None:
        """The same for a chat body: its message contents (and rendered tool texts) together."""
        if not self.max_token_bytes:
            return
        total = sum(len(s.encode("utf-8")) for s in chat_texts(body))
        at_least = -(-total // self.max_token_bytes)
        if at_least >= capacity:
            raise self._error("messages", capacity, at_least)

    @staticmethod
    def _error(param: str, capacity: int, at_least: int):
        e = context_error(param, capacity, at_least, 1)
        e.message = (f"This model's maximum context length is {capacity} tokens, and the "
                     f"{param} alone is at least {at_least} tokens (counted from its length "
                     f"without tokenizing it). Please reduce the length of the {param}.")
        return e


def chat_texts(body: Mapping[str, Any]) -> Iterator[str]:
    """The strings of a chat body that the rendered prompt certainly contains verbatim (or
    JSON-escaped, which only makes them longer): message contents, and the tools' names and
    descriptions when every tool is rendered (tool_choice absent, "auto" or "required")."""
    for m in body.get("messages") or ():
        if not isinstance(m, Mapping):
            continue
        c = m.get("content")
        if isinstance(c, str):
            yield c
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, Mapping) and part.get("type") in (None, "text") \
                        and isinstance(part.get("text"), str):
                    yield part["text"]
    if body.get("tool_choice") in (None, "auto", "required"):
        for t in body.get("tools") or ():
            fn = t.get("function") if isinstance(t, Mapping) else None
            if isinstance(fn, Mapping):
                for k in ("name", "description"):
                    if isinstance(fn.get(k), str):
                        yield fn[k]


def _max_token_bytes(tokenizer) -> int | None:
    """The longest token in bytes, or None when the tokenizer is not lossless byte-level."""
    spec = json.loads(tokenizer.hf.to_str())
    norm = spec.get("normalizer")
    if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        return None
    if not tokenizer._byte_level:
        return None
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
