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
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "id", "m"),
                              req.parsing_options, None)
    out = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=1)))
    out += proc.push(dr.InferenceChunk.text(text, 1))
    out += proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    out += proc.finish()
    resp = dr.ChatCompletionResponse("id", "m", 0, 1, 0)
    for o in out:
        resp.accumulate(o)
    msg = json.loads(resp.to_json())["choices"][0]["message"]
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
        assert c.message.reasoning_content is not None and "{" not in c.message.reasoning_content
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
