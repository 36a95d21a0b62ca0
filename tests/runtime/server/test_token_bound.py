"""The length bound that refuses oversize prompts untokenized never refuses one that fits: for
texts made to be few tokens per byte (long runs the vocabulary has as single tokens, digits, CJK,
emoji, special-token spellings), the real token count is at least the bound; and for chats, every
string the bound counts is in the rendered prompt, whose token count is at least the bound."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("deepseek_recipe")

from megagraph.runtime.chat import ChatFormatConfig, ChatPromptBuilder, Tokenizer  # noqa: E402
from megagraph.runtime.server.token_bound import TokenBound, chat_texts  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled_v4()


@pytest.fixture(scope="module")
def bound(tok):
    return TokenBound(tok)


def test_the_bound_is_the_longest_token(tok, bound):
    assert bound.max_token_bytes == max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
    assert bound.max_token_bytes >= 64  # runs of dots and spaces are single long tokens


TEXTS = ["." * 5000, " " * 4096, "-" * 3000, "=" * 777, "\n" * 999, "a" * 4000, "0" * 4000,
         "的" * 3000, "\U0001F600" * 500, "<｜end▁of▁sentence｜>" * 50, "word " * 1000,
         " " * 127 + "x" + "." * 129, "\t" * 300 + "\r\n" * 300, "ab" * 2000]


@pytest.mark.parametrize("text", TEXTS, ids=lambda t: f"{t[:3]!r}x{len(t)}")
def test_tokens_are_never_fewer_than_the_bound(tok, bound, text):
    assert len(tok.encode(text)) >= bound.tokens_at_least(text) > 0


def test_random_texts_are_never_fewer_tokens_than_the_bound(tok, bound):
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    runs = st.builds(lambda c, n: c * n, st.sampled_from(list(". -=_*#~0\n\t的a ")),
                     st.integers(1, 400))

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(st.lists(st.one_of(runs, st.text(max_size=50)), max_size=12).map("".join))
    def check(text):
        assert len(tok.encode(text)) >= bound.tokens_at_least(text)

    check()


def test_a_prompt_at_the_bound_is_refused_and_one_under_it_is_not(bound):
    m = bound.max_token_bytes
    bound.check_prompt("." * (m * 99), 101, extra_tokens=1)  # >= 99 + BOS tokens: 1 left
    with pytest.raises(Exception) as e:
        bound.check_prompt("." * (m * 99 + 1), 101, extra_tokens=1)  # >= 100 + BOS: none left
    assert getattr(e.value, "code", None) == "context_length_exceeded"


CHATS = [
    {"messages": [{"role": "system", "content": "  be brief  "},
                  {"role": "user", "content": "..." * 300},
                  {"role": "assistant", "content": "A1", "reasoning_content": "R" * 50},
                  {"role": "user", "content": [{"type": "text", "text": " part one "},
                                               {"type": "text", "text": "part two"}]},
                  {"role": "developer", "content": "dev"}]},
    {"messages": [{"role": "user", "content": "call it"},
                  {"role": "assistant", "content": "ok", "tool_calls": [
                      {"id": "c1", "type": "function",
                       "function": {"name": "get_w", "arguments": "{\"city\": \"P\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny " * 40},
                  {"role": "user", "content": "and now?"}],
     "tools": [{"type": "function", "function": {
         "name": "get_w", "description": "Weather \"now\"\n in é " * 20,
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]},
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tool_choice", [None, "auto", "required"])
@pytest.mark.parametrize("chat", CHATS, ids=["roles", "tools"])
def test_chat_bound_counts_only_what_the_prompt_contains(tok, bound, chat, thinking,
                                                         tool_choice):
    b = ChatPromptBuilder(tok, ChatFormatConfig(family="v4", served_model_name="m"))
    body = {**chat, "thinking": thinking}
    if tool_choice is not None and "tools" in chat:
        body["tool_choice"] = tool_choice
    p = b.build(body)
    for s in chat_texts(body):
        assert s in p.prompt_text or json.dumps(s, ensure_ascii=False)[1:-1] in p.prompt_text
    counted = sum(len(s.encode()) for s in chat_texts(body))
    assert len(p.prompt_ids) >= -(-counted // bound.max_token_bytes)
    assert len(p.prompt_text.encode()) >= counted
