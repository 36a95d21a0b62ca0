"""Output cut at every token: no markup fragment ever reaches `content` or `reasoning_content`, and
only complete calls are reported, streaming or not. Each cut is finished with `length`, `stop` (EOS
or a stop string) and `abort` (the parser treats every reason but `stop` alike).

The token streams are real assistant turns: the project's encoder (deepseek-recipe through
`ChatPromptBuilder`) renders a conversation whose assistant message has reasoning, content and tool
calls, and the turn's ids are cut out of the prompt. Each prefix of those ids goes through the
incremental detokenizer into the streaming parser (one token at a time), and its decoded text
through the one-shot path.
"""

from __future__ import annotations

import json

import pytest

from megagraph.runtime.chat import ChatOutputParser, ParserOptions, parse_completion

from .conftest import TIME, WEATHER

#: every marker of the format; no part of one may show up in the parsed text
MARKERS = ("</think>", "<think>", "<｜DSML｜", "</｜DSML｜", "｜DSML｜")

REASONING = "The user wants two things.\n\nThe weather, then 東京 time; a < b and </b> are text."
CONTENT = "Checking both <b>now</b> — 😀 a < b."
CALLS = [("get_weather", {"city": 'Paris "Île" </b> & <i> <｜x', "days": 3}),
         ("get_time", {"tz": "Asia/Tokyo\n(東京) \\ end"})]


def _turn_ids(builder, tok, *, reasoning: str, content: str, calls, thinking: bool) -> list[int]:
    """The assistant turn's output ids (after `<｜Assistant｜>` and its `<think>`/`</think>`,
    before EOS), rendered by the encoder inside a follow-up conversation."""
    tool_calls = [{"id": f"c{i}", "type": "function",
                   "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                  for i, (n, a) in enumerate(calls)]
    assistant = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    msgs = [{"role": "user", "content": "weather and time?"}, assistant]
    if tool_calls:
        assistant["tool_calls"] = tool_calls
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in tool_calls]
    msgs.append({"role": "user", "content": "thanks"})
    p = builder.build({"model": builder.config.served_model_name, "messages": msgs,
                       "tools": [WEATHER, TIME], "thinking": {"type": "enabled" if thinking
                                                              else "disabled"}})
    ids = p.prompt_ids
    start = ids.index(tok.special.assistant) + 1
    assert ids[start] == (tok.special.think_start if thinking else tok.special.think_end)
    end = ids.index(tok.special.eos, start)
    return ids[start + 1:end]


def _stream(tok, ids, options, reason):
    """Streaming path: one token at a time through the detokenizer and the parser."""
    det = tok.detokenizer()
    p = ChatOutputParser(options, id_factory=lambda i: f"call_{i}")
    deltas = []
    for t in ids:
        deltas += p.feed(det.push(t))
    deltas += p.feed(det.flush()) + p.finish(reason)
    return p.result(), deltas


def _accumulate(deltas):
    reasoning, content, calls = "", "", {}
    for d in deltas:
        reasoning += d.reasoning_content or ""
        content += d.content or ""
        for t in d.tool_calls:
            assert t.index not in calls, "a call is sent once, whole"
            assert t.id and t.name
            calls[t.index] = (t.name, t.arguments)
    return reasoning, content, [calls[i] for i in sorted(calls)]


def _no_fragment(text: str, where: str) -> None:
    for m in MARKERS:
        assert m not in text, (where, m, text)
        for k in range(2, len(m)):
            assert not text.endswith(m[:k]), (where, m[:k], text)
    assert "｜" not in text, (where, text)  # the test texts have none of their own


def _undecided(rest: str) -> bool:
    """Text the parser may still hold back: newlines, then part of a marker."""
    rest = rest.lstrip("\n")
    return rest == "" or any(m.startswith(rest) for m in
                             ("</think>", "<｜DSML｜ calls>", "<｜DSML｜tool_calls>"))


def _check_cut(tok, ids, k, options, whole, reason):
    text = tok.decode(ids[:k])
    msg, deltas = _stream(tok, ids[:k], options, reason)
    one_shot = parse_completion(text, options, engine_finish_reason=reason,
                                id_factory=lambda i: f"call_{i}")
    at = (k, reason, text[-40:])
    # streaming and non-streaming agree, and the deltas add up to the message
    summary = (msg.reasoning_content, msg.content,
               [(c.name, c.arguments) for c in msg.tool_calls], msg.finish_reason)
    assert summary == (one_shot.reasoning_content, one_shot.content,
                       [(c.name, c.arguments) for c in one_shot.tool_calls],
                       one_shot.finish_reason), at
    assert _accumulate(deltas) == (msg.reasoning_content or "", msg.content,
                                   [(c.name, c.arguments) for c in msg.tool_calls]), at
    assert deltas[-1].finish_reason == msg.finish_reason
    # nothing foreign: each part is a prefix of the uncut message's (a character cut between its
    # byte tokens ends as U+FFFD when the detokenizer is flushed, as in the scheduler); after
    # `stop` trailing newlines are text (the model ended there), as deepseek-recipe keeps them
    reasoning = (msg.reasoning_content or "").removesuffix("\ufffd")
    content = msg.content.removesuffix("\ufffd")
    if reason == "stop":
        reasoning, content = reasoning.rstrip("\n"), content.rstrip("\n")
    _no_fragment(reasoning, "reasoning")
    _no_fragment(content, "content")
    assert (whole.reasoning_content or "").startswith(reasoning), at
    assert whole.content.startswith(content), at
    # only complete calls, exactly those whose invoke closed before the cut
    closed = text.count("</｜DSML｜ invoke>") + text.count("</｜DSML｜invoke>")
    assert [(c.name, c.arguments) for c in msg.tool_calls] == \
        [(c.name, c.arguments) for c in whole.tool_calls[:closed]], at
    for c in msg.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)
    if reason == "stop":
        assert msg.finish_reason == ("tool_calls" if msg.tool_calls else "stop"), at
    else:
        assert msg.finish_reason == reason, at
    # nothing lost that is already decided: the lag is at most a partial marker
    if options.thinking and "</think>" not in text:
        assert msg.content == "" and _undecided(text.lstrip("\n")[len(reasoning):]), at
    elif "｜DSML｜" not in text:
        after = text.split("</think>", 1)[1] if options.thinking else text
        after = after.lstrip("\n")
        assert after.startswith(msg.content) and _undecided(after[len(msg.content):]), at
    else:
        assert msg.content == whole.content, at


TURNS = {  # name: (family, thinking, content, calls)
    "v41_thinking_content_calls": ("v4.1", True, CONTENT, CALLS),
    "v41_thinking_calls_only": ("v4.1", True, "", CALLS[:1]),
    "v41_chat_content_call": ("v4.1", False, CONTENT, CALLS[1:]),
    "v4_thinking_content_calls": ("v4", True, CONTENT, CALLS),
    "v41_thinking_content_only": ("v4.1", True, CONTENT, []),
}


@pytest.mark.parametrize("name", sorted(TURNS))
def test_every_cut_of_an_encoded_turn(name, builder, builder41, tok, tok41):
    family, thinking, content, calls = TURNS[name]
    b, t = (builder41, tok41) if family == "v4.1" else (builder, tok)
    ids = _turn_ids(b, t, reasoning=REASONING, content=content, calls=calls, thinking=thinking)
    options = ParserOptions(thinking=thinking)
    whole = parse_completion(t.decode(ids), options)
    # the uncut turn parses back to the message the encoder rendered
    assert whole.reasoning_content == (REASONING if thinking else None)
    assert whole.content == content and not whole.notes
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    for k in range(len(ids) + 1):
        for reason in ("length", "stop", "abort"):
            _check_cut(t, ids, k, options, whole, reason)


def test_cut_inside_a_forced_block(builder41, tok41):
    """`tool_choice` required without thinking: the prompt opened the block, the output starts
    inside it (cut out of the same encoded turn, after its opener)."""
    ids = _turn_ids(builder41, tok41, reasoning="", content="", calls=CALLS, thinking=False)
    text = tok41.decode(ids)
    opener = "\n\n<｜DSML｜ calls>\n"
    assert text.startswith(opener)
    k0 = next(k for k in range(len(ids) + 1) if tok41.decode(ids[:k]) == opener)
    body = ids[k0:]
    options = ParserOptions(thinking=False, starts_in_tool_calls=True)
    whole = parse_completion(tok41.decode(body), options)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == CALLS
    for k in range(len(body) + 1):
        for reason in ("length", "stop"):
            _check_cut(tok41, body, k, options, whole, reason)
            msg, _ = _stream(tok41, body[:k], options, reason)
            assert msg.content == ""


def test_the_reported_defect():
    """A value cut right at its closing tag by max_tokens: no `</｜DSML` in content, no call."""
    text = ('r</think>Sure.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
            '<｜DSML｜ parameter name="city" string="true">Par</｜DSML')
    for reason in ("length", "stop", "error"):
        msg = parse_completion(text, engine_finish_reason=reason)
        assert (msg.content, msg.tool_calls) == ("Sure.", [])
        assert msg.finish_reason == reason if reason != "stop" else msg.finish_reason == "stop"
        assert any("get_weather" in n and "dropped" in n for n in msg.notes)


def _ends_in_half_tag(text: str) -> bool:
    tail = text[text.rfind("<"):] if "<" in text else ""
    return len(tail) > 1 and ">" not in tail and any(
        tail.startswith(t) or t.startswith(tail) for t in ("<｜DSML｜", "</｜DSML｜"))


def test_stray_tags_are_text_only_when_whole():
    """DSML written outside a block (in the reasoning; without the block opener) is text, as in
    deepseek-recipe, but a cut never leaves half of such a tag either."""
    text = ('I might use <｜DSML｜ invoke name="x"> here.</think>Stray <｜DSML｜ parameter '
            'name="a" string="true">v</｜DSML｜ parameter> end')
    whole = parse_completion(text)
    assert whole.reasoning_content == 'I might use <｜DSML｜ invoke name="x"> here.'
    assert whole.content == ('Stray <｜DSML｜ parameter name="a" string="true">v</｜DSML｜ '
                             'parameter> end') and not whole.tool_calls
    for k in range(len(text) + 1):
        for reason in ("length", "stop"):
            p = ChatOutputParser()
            deltas = [d for ch in text[:k] for d in p.feed(ch)] + p.finish(reason)
            msg = p.result()
            streamed = _accumulate(deltas)
            assert streamed == (msg.reasoning_content, msg.content, [])
            for part, full in ((msg.reasoning_content, whole.reasoning_content),
                               (msg.content, whole.content)):
                assert full.startswith(part) and not _ends_in_half_tag(part), (k, part)
