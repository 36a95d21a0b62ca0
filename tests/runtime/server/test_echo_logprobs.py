"""`echo` and prompt logprobs on /v1/completions, as evaluation harnesses send them (a
loglikelihood request: `echo: true, logprobs: k, max_tokens: 0 or 1`): each prompt token's
log-probability under the model equals log_softmax of one prefill of the prompt, computed here
by a second engine with the server's weights (seeded random weights, f32 plan: the server's
chunked prefill agrees with a one-shot prefill to ~5e-6 in the logits; 1e-4 is the bound)."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from megagraph.runtime.batch import SeqChunk
from megagraph.runtime.engine import Engine

from .conftest import API_KEY, MODEL

PROMPT = [0, 1023, 2047, 3001, 17, 99, 512, 4000, 123, 77, 8, 250, 3999, 64]


@pytest.fixture(scope="module")
def ref(artifacts, server_config):
    eng = Engine.from_artifacts(artifacts, max_slots=1, capacity=server_config.capacity,
                                seed=server_config.seed, progress=False,
                                random_weights=server_config.random_weights)
    slot = eng.slots.allocate()
    logp = torch.log_softmax(eng.step([SeqChunk(slot, tuple(PROMPT))]).float(), -1)
    eng.release(slot)
    return logp


def post(server, body):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    return r.status_code, r.json()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs(server, ref, max_tokens):
    status, r = post(server, {"prompt": PROMPT, "echo": True, "logprobs": 2, "temperature": 0,
                              "max_tokens": max_tokens})
    assert status == 200, r
    ch = r["choices"][0]
    lp = ch["logprobs"]
    n_out = max_tokens
    assert len(lp["token_logprobs"]) == len(PROMPT) + n_out
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    svc = server.service
    for pos in range(1, len(PROMPT)):
        want = ref[pos - 1, PROMPT[pos]].item()
        assert math.isclose(lp["token_logprobs"][pos], want, abs_tol=1e-4), pos
        assert lp["tokens"][pos] == svc.token_text(PROMPT[pos])[0]
        top = ref[pos - 1].topk(2)
        assert math.isclose(max(lp["top_logprobs"][pos].values()), top.values[0].item(),
                            abs_tol=1e-4)
    shown = [t for t, i in zip(lp["tokens"], PROMPT) if i not in svc._skip]  # BOS adds no text
    prompt_text = "".join(shown)
    assert ch["text"].startswith(prompt_text)
    assert lp["text_offset"][len(PROMPT) - 1] == len(prompt_text) - len(lp["tokens"][-1 - n_out])
    if max_tokens == 0:
        assert ch["text"] == prompt_text and r["usage"]["completion_tokens"] == 0
    else:
        assert r["usage"]["completion_tokens"] == 1
        # the generated token is the greedy one: its logprob is the row's maximum
        assert math.isclose(lp["token_logprobs"][-1], ref[-1].max().item(), abs_tol=1e-4)


def test_echo_text_prompts_stream_the_same_as_they_collect(server):
    body = {"prompt": ["The sea is", "One two"], "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0, "n": 2}
    status, whole = post(server, body)
    assert status == 200
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    assert texts[0].startswith("The sea is") and texts[2].startswith("One two")
    streamed: dict[int, str] = {}
    tokens: dict[int, list] = {}
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={"model": MODEL, **body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
        import json

        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
                    tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
    assert streamed == texts
    for c in whole["choices"]:
        assert tokens[c["index"]] == c["logprobs"]["tokens"]


def test_max_tokens_0_needs_echo(server):
    status, r = post(server, {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and r["error"]["param"] == "max_tokens"
