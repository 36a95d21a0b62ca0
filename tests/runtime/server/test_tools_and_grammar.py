"""Tool calls and structured output through the server, with random tiny weights: constrained
decoding is the only reason the output is well formed.

The raw model text is rebuilt from the logprobs' token bytes, so the server's parsed tool calls
can be compared with what deepseek-recipe parses from the same text.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest

from ..chat.conftest import recipe_stream
from .conftest import MODEL, wait_idle

dr = pytest.importorskip("deepseek_recipe")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["ada", "alan", "grace"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "admin": {"type": "boolean"}}, "required": ["name", "age", "admin"],
    "additionalProperties": False}


def _raw_text(choice) -> str:
    raw = b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode("utf-8", "replace")
    return raw.removesuffix("<｜end▁of▁sentence｜>")


def _recipe_calls(body: dict, text: str) -> list[tuple[str, str]]:
    """deepseek-recipe's StreamProcessor on `text` for the same request."""
    opts = dr.ConversionOptions().with_model_versions_by_name(
        {MODEL: dr.ModelVersion.DeepseekV41Flash})
    req = dr.ChatCompletionRequest(json.loads(json.dumps(body))).convert(opts)
    msg = recipe_stream(req, [text])["message"]
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls") or []]


def _check_args(args: str) -> dict:
    a = json.loads(args)
    jsonschema.validate(a, WEATHER["function"]["parameters"])
    return a


TOOL_BODY = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 300,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
             "parallel_tool_calls": False, "thinking": {"type": "disabled"}, "seed": 5}
USER_JSON = [{"role": "user", "content": "Give me a user as JSON."}]


def _openai_kw(body: dict) -> dict:
    return {**{k: v for k, v in body.items() if k != "thinking"},
            "extra_body": {"thinking": body["thinking"]}}


def _stream_calls(stream):
    names, args, finish = {}, {}, None
    for ch in stream:
        d = ch.choices[0].delta if ch.choices else None
        for t in (d.tool_calls or []) if d else []:
            if t.id:
                names[t.index] = t.function.name
            args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
        finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
    return [(names[i], args[i]) for i in sorted(names)], finish


@pytest.fixture(scope="module")
def outputs(server):
    """Every generation of this module, run concurrently (one batch: the tiny model spells DSML
    tags in many small tokens, ~120 tokens a call)."""
    client = server.client()
    end = str(server.service.tokenizer.special.think_end)
    jobs = {
        "tool": lambda: client.chat.completions.create(**_openai_kw(TOOL_BODY), logprobs=True),
        "tool_stream": lambda: _stream_calls(client.chat.completions.create(
            **_openai_kw(TOOL_BODY), stream=True)),
        # random weights rarely end the reasoning: nudge </think>; then the grammar forces a call
        "tool_thinking": lambda: client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=300,
            seed=3, logit_bias={end: 9}, parallel_tool_calls=False,
            extra_body={"thinking": True}),
        "regex": lambda: client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=30, seed=1,
            extra_body={"thinking": False, "regex": r"(yes|no), [0-9]{1,3} days"}),
        "ebnf": lambda: "".join(ch.choices[0].delta.content or "" for ch in
                                client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=30, seed=2, stream=True,
            extra_body={"thinking": False,
                        "ebnf": 'root ::= ("red" | "green" | "blue") " " ("cat" | "dog")'})
            if ch.choices),
    }
    # 240 tokens: with random weights the reasoning runs long (seed 0 with thinking: ~110 tokens of
    # reasoning, then the 12-token object, and the end-of-sentence the grammar then forces)
    for thinking in (False, True):
        for seed in (0, 1, 2):
            bias = {end: 8} if thinking else {}
            jobs[f"json-{thinking}-{seed}"] = lambda t=thinking, s=seed, b=bias: \
                client.chat.completions.create(
                    model=MODEL, messages=USER_JSON, max_tokens=240, seed=s, logit_bias=b,
                    extra_body={"thinking": {"type": "enabled" if t else "disabled"}},
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "user", "schema": SCHEMA}})
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futs = {k: ex.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futs.items()}


def test_tool_call_matches_deepseek_recipe_streaming_and_not(outputs, client):
    out = outputs["tool"]
    c = out.choices[0]
    assert c.finish_reason == "tool_calls"
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert [n for n, _ in calls] == ["get_weather"]
    _check_args(calls[0][1])
    # the same text parsed by deepseek-recipe: the same calls (it keeps a JSON value's
    # surrounding whitespace, which the grammar allows and our parser strips)
    theirs = _recipe_calls(TOOL_BODY, _raw_text(c))
    assert [(n, json.loads(a)) for n, a in calls] == [(n, json.loads(a)) for n, a in theirs]
    assert outputs["tool_stream"] == (calls, "tool_calls")  # same seed, deltas add up

    # the tool's result goes back in a follow-up turn
    call = c.message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                        "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    again = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER],
                                           max_tokens=3, extra_body={"thinking": False})
    assert again.usage.prompt_tokens > out.usage.prompt_tokens
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_forced_tool_call_while_thinking(outputs):
    c = outputs["tool_thinking"].choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert c.message.reasoning_content is not None
    _check_args(c.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(outputs, thinking, seed):
    c = outputs[f"json-{thinking}-{seed}"].choices[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    if thinking:
        # the constrained JSON is the answer, not part of the (random-weight) reasoning
        assert c.message.reasoning_content is not None
        assert c.message.content not in c.message.reasoning_content
    else:
        assert getattr(c.message, "reasoning_content", None) is None


def test_regex_and_ebnf(outputs):
    assert re.fullmatch(r"(yes|no), [0-9]{1,3} days", outputs["regex"].choices[0].message.content)
    assert re.fullmatch(r"(red|green|blue) (cat|dog)", outputs["ebnf"])


def test_structured_output_without_xgrammar_is_a_clear_400(client, server):
    import openai

    svc = server.service
    factory, svc.grammar = svc.grammar, None
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=USER_JSON, max_tokens=4,
                                           response_format={"type": "json_object"},
                                           extra_body={"thinking": False})
        assert e.value.body["param"] == "response_format"
        assert "xgrammar" in e.value.body["message"]
    finally:
        svc.grammar = factory
    wait_idle(server)



# ---------------------------------------------------------------- output cut inside a call; budgets
def _answer(r):
    """(reasoning, content, [(name, arguments)], finish_reason) of a non-streaming answer or of
    a list of stream chunks."""
    if isinstance(r, list):
        reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                            for ch in r if ch.choices)
        content = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        calls, finish = _stream_calls(r)
        return reasoning, content, calls, finish
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    return (getattr(c.message, "reasoning_content", None) or "", c.message.content or "",
            calls, c.finish_reason)


def _no_markup(*texts: str) -> None:
    for t in texts:
        assert "｜" not in t and "DSML" not in t and "</think" not in t, t


def _cut_points(full) -> dict[str, int]:
    """Output lengths (tokens) at which the forced call's text ends at a telling place."""
    lps = full.choices[0].logprobs.content
    at = {}
    for k in range(1, len(lps) + 1):
        text = b"".join(bytes(t.bytes) for t in lps[:k]).decode("utf-8", "replace")
        tag = text[text.rfind("<"):]
        tag = "" if ">" in tag else tag  # the tag being written, if any
        if "inside_tag" not in at and tag.startswith("<｜DSML｜ inv"):
            at["inside_tag"] = k
        if "closer" not in at and tag.startswith("</｜DSML"):
            at["closer"] = k  # where the reported defect showed `content: "</｜DSML"`
        if "call_closed" not in at and text.endswith("</｜DSML｜ invoke>\n"):
            at["call_closed"] = k  # the call is complete, its block is not
    assert set(at) == {"inside_tag", "closer", "call_closed"}, text
    return at


def _thinking_tokens(r, end: str) -> int:
    """How many tokens came before `</think>` (from the logprobs)."""
    toks = [bytes(t.bytes).decode("utf-8", "replace") for t in r.choices[0].logprobs.content]
    return toks.index(end)


@pytest.fixture(scope="module")
def cut_outputs(server, outputs):
    """Requests that end inside a forced call (max_tokens at the points `_cut_points` finds in
    the full call of `outputs["tool"]`, or a stop string), streaming and not, and thinking
    requests with a bounded reasoning; one concurrent batch."""
    client = server.client()
    at = _cut_points(outputs["tool"])
    jobs = {}
    for name, k in at.items():
        jobs[name] = lambda k=k: client.chat.completions.create(
            **_openai_kw(dict(TOOL_BODY, max_tokens=k)), logprobs=True)
        jobs[name + "_stream"] = lambda k=k: list(client.chat.completions.create(
            **_openai_kw(dict(TOOL_BODY, max_tokens=k)), stream=True))
    jobs["stop_string"] = lambda: client.chat.completions.create(
        **_openai_kw(TOOL_BODY), stop=["days"])
    thinking = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False, seed=3)
    # without a bound, random weights reason until max_tokens (see "tool_thinking")
    jobs["required_budget"] = lambda: client.chat.completions.create(
        **thinking, max_tokens=200, logprobs=True,
        extra_body={"thinking": True, "thinking_budget": 8})
    # default bound: reasoning stops at 40 - 1 - 20 tokens; a call (~120 tokens) cannot fit
    jobs["required_no_room"] = lambda: client.chat.completions.create(
        **thinking, max_tokens=40, logprobs=True, extra_body={"thinking": True})
    jobs["required_no_room_stream"] = lambda: list(client.chat.completions.create(
        **thinking, max_tokens=40, stream=True, extra_body={"thinking": True}))
    jobs["plain_budget"] = lambda: client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, seed=4, logprobs=True,
        extra_body={"thinking": True, "thinking_token_budget": 3})
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futs = {k: ex.submit(f) for k, f in jobs.items()}
        return at, {k: f.result() for k, f in futs.items()}


@pytest.mark.parametrize("point", ["inside_tag", "closer", "call_closed"])
def test_output_cut_inside_a_call(outputs, cut_outputs, point):
    at, out = cut_outputs
    full = outputs["tool"]
    cut = out[point]
    assert cut.usage.completion_tokens == at[point]
    assert _raw_text(full.choices[0]).startswith(_raw_text(cut.choices[0]))  # the same tokens
    want_calls = [] if point != "call_closed" else [
        (t.function.name, t.function.arguments) for t in full.choices[0].message.tool_calls]
    for r in (cut, out[point + "_stream"]):
        reasoning, content, calls, finish = _answer(r)
        assert (content, calls, finish) == ("", want_calls, "length")
        _no_markup(reasoning, content)


def test_stop_string_inside_a_call(cut_outputs):
    _, out = cut_outputs
    reasoning, content, calls, finish = _answer(out["stop_string"])
    assert (content, calls, finish) == ("", [], "stop")  # uncut: a call and "tool_calls"
    _no_markup(reasoning, content)


def test_required_tool_call_with_bounded_thinking(cut_outputs):
    _, out = cut_outputs
    end = "</think>"
    r = out["required_budget"]
    reasoning, content, calls, finish = _answer(r)
    assert finish == "tool_calls" and [n for n, _ in calls] == ["get_weather"], r
    _check_args(calls[0][1])
    assert reasoning and _thinking_tokens(r, end) == 8  # random weights never end it earlier
    # the budget cannot fit a call: a clear `length`, no call, no markup
    r = out["required_no_room"]
    assert _thinking_tokens(r, end) == 40 - 1 - 20
    for a in (r, out["required_no_room_stream"]):
        reasoning, content, calls, finish = _answer(a)
        assert (content, calls, finish) == ("", [], "length") and reasoning
        _no_markup(reasoning, content)
    # a budget without tools or formats
    r = out["plain_budget"]
    assert _thinking_tokens(r, end) == 3 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


def test_bad_thinking_budget_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       extra_body={"thinking_budget": -1})
    assert e.value.body["param"] == "thinking_budget"
