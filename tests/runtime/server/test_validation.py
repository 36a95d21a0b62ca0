"""Bodies that used to reach code not ready for them get an OpenAI-shaped 400 (or 413) naming the
field: lone surrogates (were a 500 from the tokenizer), deep nesting (a RecursionError in the
ASGI stack), bytes that are not UTF-8, NaN, unknown fields, wrong types and ranges; and an
oversize prompt is refused from its length, without tokenizing it, while /health keeps
answering."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from .conftest import API_KEY, MODEL, openai, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": MODEL, "max_tokens": 2, "prompt": "hi"}


def post(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.base_url + path, content=raw, headers=AUTH, timeout=120)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", b'{"max_tokens": 2, "messages": [{"role": "user", "content": '
     b'"\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"max_tokens": 2, "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\udbff"}]}]}', "messages[0].content[0].text"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, raw, param):
    e = error_of(post(server, path, raw))
    assert e["param"] == param and e["code"] == "invalid_encoding", e
    ok = post(server, path, raw.replace(b"\\ud800", b"\\ud83d\\ude00").replace(b"\\udfff", b"x")
              .replace(b"\\udbff", b"y"))  # a surrogate *pair* is an emoji: fine
    assert ok.status_code == 200, ok.text


def test_deep_nesting_is_a_400_without_a_traceback(server, caplog):
    deep = b"[" * 100_000 + b"]" * 100_000
    with caplog.at_level(logging.ERROR):
        for path, raw in [("/v1/completions", b'{"prompt": ' + deep + b"}"),
                          ("/v1/chat/completions", json.dumps(CHAT).encode()[:-1] + b', "x": '
                           + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}")]:
            e = error_of(post(server, path, raw))
            assert e["code"] == "invalid_json" and "64 deep" in e["message"], e
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    ok = b'{"prompt": "hi", "max_tokens": 2, "x": ' + b"[" * 63 + b"]" * 63 + b"}"
    assert error_of(post(server, "/v1/completions", ok))["param"] == "x"  # parsed; x is unknown
    text = json.dumps({**COMP, "prompt": "[{\\\"" * 300}).encode()  # brackets inside a string
    assert post(server, "/v1/completions", text).status_code == 200


@pytest.mark.parametrize("raw, code", [
    (b'{"prompt": "caf\xe9", "max_tokens": 2}', "invalid_encoding"),  # Latin-1, not UTF-8
    (b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', "invalid_encoding"),  # encoded surrogate
    ('{"prompt": "hi"}'.encode("utf-16"), "invalid_encoding"),
    (b'{"prompt": "hi", "temperature": NaN}', "invalid_json"),
    (b'{"prompt": "hi", "temperature": 1e999}', "invalid_json"),
    (b'{"prompt": "hi", "n": ' + b"9" * 5000 + b"}", "invalid_json"),
    (b'{"prompt": "hi",', "invalid_json"),
    (b'["prompt"]', "invalid_json"),
])
def test_bodies_that_are_not_json_text(server, raw, code):
    assert error_of(post(server, "/v1/completions", raw))["code"] == code


def test_unknown_fields_are_refused_naming_them_and_bookkeeping_fields_accepted(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**CHAT, extra_body={"temprature": 0.5})
    assert e.value.body["param"] == "temprature" and e.value.body["code"] == "unknown_field"
    assert "temperature" in e.value.body["message"]  # the message lists what the route takes
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**COMP, extra_body={"stream_options": {"include_usage": True,
                                                                          "bogus": 1}})
    assert e.value.body["param"] == "stream_options.bogus"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**CHAT, extra_body={"audio": {"voice": "alloy"}})
    assert e.value.body["param"] == "audio" and e.value.body["code"] == "unsupported"
    out = client.chat.completions.create(**CHAT, user="u1", metadata={"k": "v"}, store=False,
                                         extra_body={"audio": None, "tool_choice": None,
                                                     "parallel_tool_calls": None, "n": None})
    assert out.choices[0].finish_reason == "length"  # null = absent; bookkeeping ignored


@pytest.mark.parametrize("path, field, value, param", [
    ("/v1/completions", "temperature", -0.1, "temperature"),
    ("/v1/completions", "top_p", 1.5, "top_p"),
    ("/v1/completions", "n", 17, "n"),
    ("/v1/completions", "logprobs", 21, "logprobs"),
    ("/v1/completions", "seed", 2**64, "seed"),
    ("/v1/completions", "max_tokens", 2**40, "max_tokens"),
    ("/v1/completions", "stop", ["a"] * 17, "stop"),
    ("/v1/completions", "stream", "yes", "stream"),
    ("/v1/completions", "prompt", [1, 2.5], "prompt[1]"),
    ("/v1/chat/completions", "max_tokens", 10**30, "max_tokens"),
    ("/v1/chat/completions", "top_logprobs", 21, "top_logprobs"),
    ("/v1/chat/completions", "seed", -1, "seed"),
    ("/v1/chat/completions", "temperature", "hot", "temperature"),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": 5}],
     "messages[0].content"),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": "x"}] * 20_000,
     "messages"),
    ("/v1/chat/completions", "tools", [{"type": "function"}] * 129, "tools"),
    ("/v1/chat/completions", "reasoning_effort", "extreme", "reasoning_effort"),
    ("/v1/chat/completions", "stream_options", 5, "stream_options"),
])
def test_types_and_ranges_name_the_field(server, path, field, value, param):
    body = {**(COMP if path == "/v1/completions" else CHAT), field: value}
    e = error_of(post(server, path, json.dumps(body).encode()))
    assert e["param"] == param, e


def test_a_body_over_the_cap_is_a_413_before_it_is_read(server):
    r = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=60,
                   content=b'{"prompt": "' + b"x" * (32 * 2**20) + b'"}')
    assert error_of(r, 413)["code"] == "too_large"


def test_an_oversize_prompt_is_refused_untokenized_while_health_answers(server, client):
    """31 MiB of text (the 32 MiB cap allows it) is refused without being tokenized: its length
    alone proves it cannot fit 1024 tokens, and tokenizing it in full takes 35-40 s with /health
    stalled meanwhile."""
    tok = server.service.tokenizer
    real, lengths = tok.encode, []

    def encode(text):  # the real tokenizer, recording what it is asked to encode
        lengths.append(len(text))
        return real(text)

    tok.encode = encode
    try:
        big = json.dumps({"model": MODEL, "prompt": "word " * (31 * 2**20 // 5),
                          "max_tokens": 4}).encode()
        order, result, waits = [], {}, []

        def send():
            result["r"] = post(server, "/v1/completions", big)
            order.append("big")

        t = threading.Thread(target=send)
        t.start()
        while t.is_alive():
            t0 = time.monotonic()
            assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - t0)
            order.append("health")
            time.sleep(0.01)
        t.join()
        e = error_of(result["r"])
        assert e["code"] == "context_length_exceeded" and e["param"] == "prompt", e
        assert "at least" in e["message"]
        assert "health" in order[:order.index("big")], order  # answered while it was in flight
        assert max(waits) < 5, waits  # generous: it stalled past 5 s while tokenizing
        assert all(n < 200_000 for n in lengths), lengths  # never handed to the tokenizer
        chat = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 2**22}]})
        e = error_of(post(server, "/v1/chat/completions", chat.encode()))
        assert e["code"] == "context_length_exceeded" and e["param"] == "messages", e
        ids = json.dumps({**COMP, "prompt": [5] * 2_000_000}).encode()  # ids: no need to look
        assert error_of(post(server, "/v1/completions", ids))["code"] == \
            "context_length_exceeded"
    finally:
        tok.encode = real
    near = client.completions.create(model=MODEL, prompt="word " * 150, max_tokens=2)
    assert near.usage.prompt_tokens > 150  # under the bound: tokenized and served as before
    wait_idle(server)


def test_grammar_errors_name_the_field_without_the_libraries_source_paths(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**CHAT, extra_body={"regex": "(unclosed"})
    assert e.value.body["param"] == "regex"
    assert ".cc:" not in e.value.body["message"] and "/project/" not in e.value.body["message"]
