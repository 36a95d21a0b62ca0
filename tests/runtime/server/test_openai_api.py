"""The server through the real `openai` client: chat + completions, streaming and not, n > 1,
stop strings, logprobs, seeds, API key, 4xx naming the field, batching == alone (greedy)."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from .conftest import API_KEY, MODEL, openai, wait_idle

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
USER = [{"role": "user", "content": "Write a haiku about graphs."}]


def test_health_models_and_metrics_are_served(server, client):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = server.metrics()
    assert m["megagraph_cache_slots_total"] == 8 and m["megagraph_engine_healthy"] == 1


def test_chat_thinking_splits_reasoning_and_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=8, seed=7,
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    full = client.chat.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason == "length" and full.usage.completion_tokens == 8
    assert full.usage.prompt_tokens > 0
    assert c.message.reasoning_content  # thinking asked for: the output is reasoning
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                        for ch in chunks if ch.choices)
    assert reasoning == c.message.reasoning_content  # same seed, same tokens
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_thinking_is_off_unless_the_request_asks(client):
    """As SGLang serves V4.1: a client that knows nothing of thinking gets content."""
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert plain.choices[0].message.content
    assert not getattr(plain.choices[0].message, "reasoning_content", None)
    for extra in ({"thinking": True}, {"thinking": {"type": "enabled"}},
                  {"chat_template_kwargs": {"thinking": True}}, {"reasoning_effort": "high"}):
        out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                             extra_body=extra)
        assert out.choices[0].message.reasoning_content and not out.choices[0].message.content, \
            extra


def test_chat_without_thinking_gives_content_and_usage_in_last_chunk(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=6, extra_body={"thinking": False},
              temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.content and not getattr(
        full.choices[0].message, "reasoning_content", None)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
        full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6  # usage rides on the final chunk


def test_completions_n_seeds_and_streaming(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, n=3, seed=123,
              temperature=1.0)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeds reproduce
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    assert a.usage.completion_tokens == 18
    texts = ["", "", ""]
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]
    other = client.completions.create(**{**kw, "seed": 124})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_completions_prompt_lists_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], "Hi"], max_tokens=3,
                                    n=2, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: same text per prompt


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                     **GREEDY).choices[0].text
    assert len(base) > 6
    stop = base[len(base) // 2:len(base) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                    stop=[stop], **GREEDY).choices[0]
    assert cut.text == base[:base.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, stop=[stop], stream=True,
        **GREEDY))
    assert streamed == cut.text


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"thinking": False})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_api_key_is_enforced(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes stay open


@pytest.mark.parametrize("kw, param", [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"top_k": "x"}}, "top_k"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"frequency_penalty": 9}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids[0]"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tokens": 1100}, "messages"),  # over the 1024-token context
])
def test_invalid_chat_requests_name_the_field(client, kw, param):
    args = {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body


def test_invalid_completion_requests_name_the_field(client, server):
    for kw, param in [({"prompt": [[]]}, "prompt[0]"), ({"logprobs": 50}, "logprobs"),
                      ({"prompt": "x " * 1100, "max_tokens": 4}, "prompt"),
                      ({"echo": "yes"}, "echo"), ({"max_tokens": 0}, "max_tokens"), ({"seed": "s"}, "seed")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw})
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    r = httpx.post(server.base_url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_greedy_output_under_batching_equals_output_alone(client, server):
    prompts = ["Tell me about the sea.", "Count: one two three", "x" * 40, "Why is the sky"]
    kw = dict(model=MODEL, max_tokens=10, **GREEDY)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:  # the same requests, concurrently, twice each
        futs = [ex.submit(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, p)
                for p in prompts * 2]
        together = [f.result() for f in futs]
    assert together == alone * 2
    wait_idle(server)
