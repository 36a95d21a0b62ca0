"""Hostile and random bodies against the live test server (hypothesis, bounded in count and time):
valid requests with fields set to random JSON, wrong types, out-of-range numbers, lone
surrogates, special-token spellings, strings of up to 3 MB, unknown fields; random top-level
JSON; raw bytes that are not UTF-8, not JSON, NaN, or nested thousands deep.

Every answer must be below 500 and every error OpenAI-shaped; streams must end in `[DONE]`
with no error event; afterwards the server is healthy and holds no request state. Generations
are kept short (at most 4 tokens, 3 choices) so the whole run stays within about a minute.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest

from .conftest import API_KEY, MODEL, wait_idle

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
EXAMPLES = 150
WALL_S = 150.0  # examples after this are skipped (the run stays bounded on a slow machine)

COMMON = ["model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p",
          "stop", "frequency_penalty", "presence_penalty", "logit_bias", "user", "top_k",
          "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "seed", "logprobs"]
FIELDS = {
    "/v1/completions": COMMON + ["prompt", "echo", "best_of", "suffix"],
    "/v1/chat/completions": COMMON + [
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "response_format", "thinking", "chat_template_kwargs",
        "reasoning_effort", "metadata", "store", "modalities", "audio", "functions"],
}
UNKNOWN = ["max_token", "temprature", "foo", "", "\ud800", "prompt ", "messages\x00"]
BASE = {"/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]}}

surrogate = st.characters(categories=["Cs"])
text = st.one_of(
    st.text(max_size=30),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), surrogate, st.text(max_size=4)),
    st.sampled_from(["", "\x00", "<｜end▁of▁sentence｜>", "</think>", "<｜DSML｜invoke", "\ufeff",
                     "\U0001F600" * 3, "model"]),
    st.integers(50_000, 3_000_000).map(lambda n: "x" * n))
number = st.one_of(st.integers(-2**70, 2**70), st.integers(-3, 40),
                   st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(
                       [0, 1, -1, 0.0, 1e-300, 2.0000001, 2**31, 2**63, -2**63 - 1]))
scalar = st.one_of(st.none(), st.booleans(), number, text)
value = st.recursive(scalar, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(
        ["role", "content", "type", "function", "name", "include_usage", "json_schema"])),
        c, max_size=4)), max_leaves=10)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
    ["user", "system", "assistant", "tool", "developer", "robot"]), value), "content": value})
valid = {  # values a well-formed request may hold: odd combinations of them must still work
    "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
    "n": st.integers(1, 3), "best_of": st.integers(1, 3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2),
    "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**63 - 1), "stop": st.one_of(st.text(min_size=1, max_size=3),
                                                         st.lists(st.text(min_size=1),
                                                                  max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 129_000), max_size=3),
    "ignore_eos": st.booleans(), "logit_bias": st.dictionaries(
        st.integers(0, 129_000).map(str), st.floats(-100, 100), max_size=3),
    "thinking": st.one_of(st.booleans(), st.sampled_from([{"type": "enabled"},
                                                          {"type": "disabled"}])),
    "reasoning_effort": st.sampled_from(["none", "low", "high", "max"]),
    "chat_template_kwargs": st.sampled_from([{"thinking": True}, {"enable_thinking": False}]),
    "user": st.text(max_size=8), "metadata": st.dictionaries(st.text(max_size=4),
                                                             st.text(max_size=4), max_size=2),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)), "top_logprobs": st.integers(0, 5),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "echo": st.booleans(), "suffix": st.just(""), "modalities": st.just(["text"]),
}
field_value = {
    "messages": st.one_of(st.lists(message, max_size=3), value),
    "prompt": st.one_of(text, st.lists(st.one_of(st.integers(-5, 200_000), text,
                                                 st.lists(st.integers(-5, 130_000),
                                                          max_size=5)), max_size=4), value),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "json_object", "json_schema", "regex", "bogus"])}), value),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]), value),
}


@st.composite
def json_case(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = dict(BASE[path])
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.one_of(st.sampled_from(FIELDS[path]), st.sampled_from(UNKNOWN)))
        if draw(st.integers(0, 9)) == 0:
            body.pop(name, None)
        else:
            choices = [field_value.get(name, value)]
            if name in valid:
                choices.append(valid[name])
            body[name] = draw(st.one_of(*choices))
    return path, body


@st.composite
def raw_case(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    depth = draw(st.integers(60, 20_000))
    kind = draw(st.sampled_from(["binary", "truncated", "deep", "deep_objects", "nan", "top"]))
    ok = json.dumps(BASE[path]).encode()
    if kind == "binary":
        return path, draw(st.binary(max_size=64))
    if kind == "truncated":
        return path, ok[:draw(st.integers(0, len(ok) - 1))]
    if kind == "deep":
        return path, ok[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "deep_objects":
        return path, ok[:-1] + b', "x": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    if kind == "nan":
        return path, ok[:-1] + b', "temperature": ' + draw(st.sampled_from(
            [b"NaN", b"Infinity", b"-Infinity", b"1e999"])) + b"}"
    return path, json.dumps(draw(value)).encode()  # any JSON at the top level


def bounded(path: str, body: dict) -> dict:
    """Keep a request that would run cheap: valid lengths and choice counts are cut to 4
    tokens and 3 choices (invalid ones stay as drawn, to be refused)."""
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if type(v) is int and 4 < v <= 2048:
            body[k] = 4
    for k in ("n", "best_of"):
        v = body.get(k)
        if type(v) is int and 3 < v <= 16:
            body[k] = 3
    if path == "/v1/chat/completions" and "max_tokens" not in body \
            and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    return body


def check_error(r: httpx.Response, what) -> None:
    err = r.json()
    assert set(err) == {"error"}, what
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"}, what
    assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str), what
    assert e["param"] is None or isinstance(e["param"], str), what


def check_stream(lines: list[str], what) -> None:
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", what
    for d in data[:-1]:
        chunk = json.loads(d)
        assert "error" not in chunk, (what, chunk)
        assert "choices" in chunk, (what, chunk)


def test_fuzzed_bodies_get_no_5xx_and_leave_no_state(server):
    deadline = time.monotonic() + WALL_S
    seen: Counter = Counter()
    http = httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(json_case(), json_case(), raw_case()))
    def run(case):
        if time.monotonic() > deadline:
            seen["skipped (time)"] += 1
            return
        path, body = case
        if isinstance(body, dict):
            body = bounded(path, body)
            raw = json.dumps(body).encode()  # ensure_ascii: surrogates go as \ud800 escapes
        else:
            raw = body
        what = (path, raw[:300])
        stream = isinstance(body, dict) and body.get("stream") is True
        with http.stream("POST", path, content=raw) as r:
            lines = list(r.iter_lines()) if r.status_code == 200 and stream else None
            if lines is None:
                r.read()
        seen[r.status_code] += 1
        assert r.status_code < 500, (what, r.status_code, r.text[:500])
        assert r.headers.get("x-request-id"), what
        if r.status_code >= 400:
            check_error(r, what)
        elif lines is not None:
            check_stream(lines, what)
        else:
            assert "choices" in r.json(), what

    try:
        run()
    finally:
        http.close()
    assert seen[200] >= 5 and sum(n for s, n in seen.items() if s in (400, 404)) >= 30, seen
    m = wait_idle(server, timeout=60)
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert m["megagraph_num_requests_running"] == 0 and m["megagraph_cache_slots_used"] == 0
    assert m["megagraph_http_requests_active"] <= 1  # the /metrics request itself
