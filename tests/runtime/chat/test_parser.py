"""Output parser: any chunking gives the same result, equal to deepseek-recipe's on well-formed
text; no markup leaks; malformed markup comes back as content, never as an exception."""

from __future__ import annotations

import json
import random
import re

import pytest

from megagraph.runtime.chat import ChatOutputParser, ParserOptions, parse_completion

from .conftest import TIME, WEATHER, recipe_convert, recipe_stream

REASONING = "The user wants the weather in Paris 🌦️ and the time in 東京; call both tools."


def _block(v41: bool, *, parallel: bool = True) -> str:
    sp = " " if v41 else ""
    calls = " calls" if v41 else "tool_calls"
    param = (lambda n, s, v: f'<｜DSML｜{sp}parameter name="{n}" string="{s}">{v}'
             f'</｜DSML｜{sp}parameter>\n')
    out = (f"\n\n<｜DSML｜{calls}>\n<｜DSML｜{sp}invoke name=\"get_weather\">\n"
           + param("city", "true", 'Paris, "Île-de-France" 🇫🇷 <b>&amp;</b>')
           + param("days", "false", "3") + f"</｜DSML｜{sp}invoke>\n")
    if parallel:
        out += (f'<｜DSML｜{sp}invoke name="get_time">\n'
                + param("tz", "true", "Asia/Tokyo\n(東京) \\ end") + f"</｜DSML｜{sp}invoke>\n")
    return out + f"</｜DSML｜{calls}>"


EXAMPLES = {
    "v41_calls": REASONING + "</think>" + _block(True),
    "v41_content_then_call": REASONING + "</think>Let me check both. 😀" + _block(True, parallel=False),
    "v4_calls": REASONING + "</think>" + _block(False),
    "v41_content_only": REASONING + "\n\n</think>\n\nThe answer is **4** — 四. Use `a < b` and "
                        "<tags> freely; ｜DSML｜ alone is text.\n",
    "nested_json_value": REASONING + "</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_time\">\n"
                         '<｜DSML｜ parameter name="opts" string="false">{"a": [1, 2.5, null], '
                         '"b": {"c": "x</y>"}}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
                         "</｜DSML｜ calls>",
}


def _ids(i: int) -> str:
    return f"call_{i}"


def _parse_chunks(chunks, options=ParserOptions(), reason="stop"):
    p = ChatOutputParser(options, id_factory=_ids)
    deltas = []
    for c in chunks:
        deltas += p.feed(c)
    deltas += p.finish(reason)
    return p.result(), deltas


def _summary(msg):
    return (msg.reasoning_content, msg.content,
            [(c.name, c.arguments) for c in msg.tool_calls], msg.finish_reason)


def _check_deltas(deltas, msg):
    """Deltas rebuild the message; no markup in content or arguments; call headers first."""
    content, reasoning, args, seen = "", "", {}, set()
    for d in deltas:
        parts = [d.reasoning_content is not None, d.content is not None, bool(d.tool_calls)]
        assert sum(parts) <= 1
        if d.content is not None:
            assert "｜DSML｜ calls" not in d.content and "</think>" not in d.content
            content += d.content
        if d.reasoning_content is not None:
            reasoning += d.reasoning_content
        for t in d.tool_calls:
            if t.index not in seen:
                assert t.id is not None and t.name is not None
                seen.add(t.index)
            else:
                assert t.id is None and t.name is None
            assert "DSML" not in t.arguments
            args[t.index] = args.get(t.index, "") + t.arguments
        assert json.dumps(d.to_openai())
    assert deltas[-1].finish_reason == msg.finish_reason
    assert content == msg.content
    assert reasoning == (msg.reasoning_content or "")
    assert [args[i] for i in sorted(args)] == [c.arguments for c in msg.tool_calls]


def _recipe(text, *, v41=True, chunks=None):
    """deepseek-recipe's StreamProcessor on the same text, accumulated."""
    body = {"model": "DeepSeek-V4.1-Flash" if v41 else "DeepSeek-V4-Pro",
            "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME]}
    req = recipe_convert(body)
    choice = recipe_stream(req, chunks or [text])
    m = choice["message"]
    return (m.get("reasoning_content"), m.get("content") or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])],
            choice["finish_reason"])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_split_point_matches_one_shot(name):
    text = EXAMPLES[name]
    whole, deltas = _parse_chunks([text])
    _check_deltas(deltas, whole)
    assert not whole.notes
    for k in range(1, len(text)):
        msg, deltas = _parse_chunks([text[:k], text[k:]])
        assert _summary(msg) == _summary(whole), k
        _check_deltas(deltas, msg)
    msg, deltas = _parse_chunks(list(text))  # one character at a time
    assert _summary(msg) == _summary(whole)
    _check_deltas(deltas, msg)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_random_chunkings(name):
    text = EXAMPLES[name]
    whole = _summary(parse_completion(text, id_factory=_ids))
    rng = random.Random(name)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        msg, deltas = _parse_chunks(chunks)
        assert _summary(msg) == whole
        _check_deltas(deltas, msg)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_equals_deepseek_recipe(name):
    text = EXAMPLES[name]
    v41 = not name.startswith("v4_")
    ours = parse_completion(text, id_factory=_ids)
    mine = (ours.reasoning_content, ours.content,
            [(c.name, c.arguments) for c in ours.tool_calls], ours.finish_reason)
    assert mine == _recipe(text, v41=v41)
    assert mine == _recipe(text, v41=v41, chunks=list(text))
    for c in ours.tool_calls:
        json.loads(c.arguments)
    if ours.tool_calls:
        assert json.loads(ours.tool_calls[0].arguments) == \
            {"city": 'Paris, "Île-de-France" 🇫🇷 <b>&amp;</b>', "days": 3} or name == \
            "nested_json_value"


def test_first_call_values():
    msg = parse_completion(EXAMPLES["v41_calls"], id_factory=_ids)
    assert msg.reasoning_content == REASONING and msg.content == ""
    assert [c.id for c in msg.tool_calls] == ["call_0", "call_1"]
    assert [json.loads(c.arguments) for c in msg.tool_calls] == [
        {"city": 'Paris, "Île-de-France" 🇫🇷 <b>&amp;</b>', "days": 3},
        {"tz": "Asia/Tokyo\n(東京) \\ end"}]
    assert msg.finish_reason == "tool_calls"
    m = msg.to_openai()
    assert m["tool_calls"][1] == {"index": 1, "id": "call_1", "type": "function", "function": {
        "name": "get_time", "arguments": msg.tool_calls[1].arguments}}


def test_a_call_is_reported_whole_when_its_invoke_closes():
    text = EXAMPLES["v41_calls"]
    closes = [m.end() for m in re.finditer("</｜DSML｜ invoke>", text)]
    p = ChatOutputParser(id_factory=_ids)
    seen = []
    for k, ch in enumerate(text, 1):
        for d in p.feed(ch):
            for t in d.tool_calls:
                seen.append((k, t.index, t.id, t.name, json.loads(t.arguments)))
    assert [(k, i, cid, n) for k, i, cid, n, _ in seen] == [
        (closes[0], 0, "call_0", "get_weather"), (closes[1], 1, "call_1", "get_time")]
    assert seen[1][4] == {"tz": "Asia/Tokyo\n(東京) \\ end"}


MALFORMED = {
    "unknown_tag": "r</think>Hi\n\n<｜DSML｜ calls>\n<｜DSML｜ foo>bar</｜DSML｜ foo>\n</｜DSML｜ calls> tail",
    "bad_attr": 'r</think>Hi\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke nme="get_weather">\n'
                "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
    "single_quotes": "r</think><｜DSML｜ calls>\n<｜DSML｜ invoke name='get_weather'>\n</｜DSML｜ invoke>\n"
                     "</｜DSML｜ calls>",
    "bad_string_attr": 'r</think><｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ '
                       'parameter name="city" string="maybe">P</｜DSML｜ parameter>\n</｜DSML｜ '
                       "invoke>\n</｜DSML｜ calls>",
    "missing_string_attr": 'r</think><｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ '
                           'parameter name="city">P</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ '
                           "calls>",
    "text_in_block": 'r</think><｜DSML｜ calls>\nhello <｜DSML｜ invoke name="x">\n</｜DSML｜ invoke>\n'
                     "</｜DSML｜ calls>",
    "unterminated_tag": "r</think>Sure.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\"" + "x" * 3000,
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_markup_becomes_content(name):
    text = MALFORMED[name]
    whole = parse_completion(text, id_factory=_ids)
    assert whole.tool_calls == [] and whole.notes
    assert whole.reasoning_content == "r"
    raw = text[len("r</think>"):]
    assert whole.content == raw  # nothing lost, nothing invented
    assert whole.finish_reason == "stop"
    for k in range(1, len(text), 3 if len(text) < 500 else 97):
        msg, _ = _parse_chunks([text[:k], text[k:]])
        assert _summary(msg) == _summary(whole)
    msg, _ = _parse_chunks(list(text))
    assert _summary(msg) == _summary(whole)


def test_break_after_a_complete_call():
    good = ('<｜DSML｜ invoke name="get_time">\n<｜DSML｜ parameter name="tz" string="true">UTC'
            "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n")
    text = "r</think>\n\n<｜DSML｜ calls>\n" + good + "<｜DSML｜ bogus>x</｜DSML｜ calls>"
    msg = parse_completion(text, id_factory=_ids)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("get_time",
                                                                            {"tz": "UTC"})]
    assert msg.content == "\n<｜DSML｜ bogus>x</｜DSML｜ calls>" and msg.notes  # raw, unlost
    assert "after complete calls" in msg.notes[0]


def test_invalid_json_value_becomes_string():
    text = ('r</think><｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
            '<｜DSML｜ parameter name="days" string="false">three</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="n" string="false">NaN</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="ok" string="false"> [1, {"a": true}] </｜DSML｜ parameter>\n'
            "</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    msg = parse_completion(text)
    assert json.loads(msg.tool_calls[0].arguments) == {"days": "three", "n": "NaN",
                                                       "ok": [1, {"a": True}]}
    assert len(msg.notes) == 2 and "days" in msg.notes[0]


def test_markup_inside_reasoning_stays_reasoning():
    text = "I could write <｜DSML｜ calls> here.</think>Answer."
    msg = parse_completion(text)
    assert (msg.reasoning_content, msg.content) == ("I could write <｜DSML｜ calls> here.",
                                                    "Answer.")


def test_text_after_block_and_stray_think_end():
    msg = parse_completion("r</think>a</think>b" + _block(True, parallel=False) + "\n\n more")
    # a stray </think> is dropped (as deepseek-recipe does); text after the block is kept
    # (deepseek-recipe drops it), whitespace right after the block is not
    assert msg.content == "abmore" and len(msg.tool_calls) == 1
    assert any("</think>" in n for n in msg.notes)


def test_options():
    block = _block(True, parallel=False)
    # thinking off: the output is content from the first character
    msg = parse_completion("\n\nHello" + block, ParserOptions(thinking=False))
    assert (msg.reasoning_content, msg.content, len(msg.tool_calls)) == (None, "Hello", 1)
    # no tools declared: DSML is ordinary content
    text = "Hi" + block
    msg = parse_completion(text, ParserOptions(thinking=False, parse_tool_calls=False))
    assert msg.content == text and not msg.tool_calls
    # tool_choice required without thinking: the prompt opened the block
    inner = block.split("calls>\n", 1)[1]
    msg = parse_completion(inner, ParserOptions(thinking=False, starts_in_tool_calls=True))
    assert msg.content == "" and [c.name for c in msg.tool_calls] == ["get_weather"]
    # prefix continuation keeps leading newlines
    msg = parse_completion("\n\nmore", ParserOptions(thinking=False, strip_leading_newlines=False))
    assert msg.content == "\n\nmore"


def test_recipe_parsing_options_mapping():
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER], "tool_choice": "required", "thinking": {"type": "disabled"}}
    o = ParserOptions.from_recipe(recipe_convert(body).parsing_options)
    assert o == ParserOptions(thinking=False, starts_in_tool_calls=True)
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}]}
    o = ParserOptions.from_recipe(recipe_convert(body).parsing_options)
    assert o == ParserOptions(thinking=True, parse_tool_calls=False)


def test_token_stream_through_detokenizer(tok):
    """Real ids (｜DSML｜ and </think> as special tokens, emoji split over byte tokens) through
    the incremental detokenizer into the parser, one token at a time."""
    text = EXAMPLES["v41_content_then_call"]
    ids = tok.encode(text) + [tok.special.eos]
    assert tok.special.dsml in ids and tok.special.think_end in ids
    det = tok.detokenizer()
    p = ChatOutputParser(id_factory=_ids)
    deltas = []
    for i in ids:
        piece = det.push(i)
        assert "\ufffd" not in piece
        deltas += p.feed(piece)
    deltas += p.feed(det.flush()) + p.finish()
    msg = p.result()
    assert _summary(msg) == _summary(parse_completion(text, id_factory=_ids))
    _check_deltas(deltas, msg)
    assert msg.content == "Let me check both. 😀"
