"""The prefix cache through the real server and the real `openai` client: a multi-turn chat
reports `usage.prompt_tokens_details.cached_tokens` and moves the cache counters of /metrics,
POST /flush_cache empties it, `--no-prefix-cache` turns it off, a small device budget spills to
the host tier and hits come back from it, and replay mode (the product default) serves."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL, fresh_config, start_server

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short line, "
          "no preamble, no lists, no markdown."}


def chat_turns(client, user_texts, max_tokens=4):
    """One conversation: each turn's request carries the history (with the replies)."""
    msgs, usages = [SYSTEM], []
    for text in user_texts:
        msgs.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens,
                                           temperature=0, extra_body={"ignore_eos": True})
        msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        usages.append(r.usage)
    return usages


@pytest.fixture(scope="module")
def replay_server(server_config):
    """The product defaults: replay mode, the device budget of the pools; a host tier."""
    srv = start_server(fresh_config(server_config, prefix_cache_mode="replay",
                                    host_cache_bytes=1 << 28))
    yield srv
    srv.stop()


def test_multi_turn_reports_cached_tokens_and_metrics(server):
    client = server.client()
    before = server.metrics()
    usages = chat_turns(client, ["What is a radix tree?", "And a trie?", "Which is smaller?"])
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] < cached[1]
    for prev, u in zip(usages, usages[1:]):
        # the next turn resumes at least where the previous prompt ended
        assert u.prompt_tokens_details.cached_tokens >= prev.prompt_tokens - 1
        assert u.prompt_tokens_details.cached_tokens < u.prompt_tokens
    after = server.metrics()
    assert after["megagraph_prefix_cache_enabled"] == 1
    assert after['megagraph_prefix_cache_hits_total{tier="device"}'] >= \
        before['megagraph_prefix_cache_hits_total{tier="device"}'] + 2
    assert after["megagraph_prefix_cache_hit_tokens_total"] > \
        before["megagraph_prefix_cache_hit_tokens_total"]


def test_flush_cache_empties_what_no_request_holds(server):
    chat_turns(server.client(), ["Name a prime number."])
    assert server.metrics()['megagraph_prefix_cache_nodes{tier="device"}'] > 0
    r = httpx.post(server.base_url + "/flush_cache", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["flushed_nodes"] > 0 and body["kept_nodes"] == 0 and body["enabled"]
    m = server.metrics()
    assert m['megagraph_prefix_cache_nodes{tier="device"}'] == 0
    assert m['megagraph_prefix_cache_bytes{tier="device"}'] == 0
    # a flushed cache serves the same answers, cold
    u = chat_turns(server.client(), ["Name a prime number."])[0]
    assert u.prompt_tokens_details.cached_tokens == 0


def test_no_prefix_cache(server_config):
    srv = start_server(fresh_config(server_config, prefix_cache=False))
    try:
        usages = chat_turns(srv.client(), ["Hello.", "Again."])
        assert all(u.prompt_tokens_details.cached_tokens == 0 for u in usages)
        assert srv.metrics()["megagraph_prefix_cache_enabled"] == 0
        r = httpx.post(srv.base_url + "/flush_cache", timeout=30).json()
        assert r == {"flushed_nodes": 0, "flushed_bytes": 0, "kept_nodes": 0, "enabled": False}
    finally:
        srv.stop()


def test_host_tier_spills_and_comes_back(server_config):
    """A device budget of about one conversation: the others move to the host tier, and their
    next turns come back from it."""
    srv = start_server(fresh_config(server_config, prefix_cache_bytes=1 << 15,
                                    host_cache_bytes=1 << 26))
    try:
        client = srv.client()
        msgs = [SYSTEM, {"role": "user", "content": "Topic 0: tell me about number 0."}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
        for i in range(1, 6):
            chat_turns(client, [f"Topic {i}: tell me about number {i}."])
        m = srv.metrics()
        assert m['megagraph_prefix_cache_bytes{tier="device"}'] <= 1 << 15
        assert m['megagraph_prefix_cache_bytes{tier="host"}'] > 0
        assert m['megagraph_prefix_cache_evictions_total{tier="device"}'] > 0
        # the first conversation's next turn resumes from its end, now in host memory
        msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                 {"role": "user", "content": "More."}]
        r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
        m2 = srv.metrics()
        assert m2['megagraph_prefix_cache_hits_total{tier="host"}'] >= 1
        assert m2["megagraph_prefix_cache_host_loads_total"] >= 1
    finally:
        srv.stop()


def test_replay_mode_serves_and_counts(replay_server):
    client = replay_server.client()
    usages = chat_turns(client, ["Count to three.", "Now backwards.", "Once more."])
    assert usages[-1].prompt_tokens_details.cached_tokens > 0
    m = replay_server.metrics()
    hits = sum(m[f"megagraph_prefix_cache_{k}_hits_total"] for k in ("exact", "replay",
                                                                      "derived"))
    assert hits >= 2
    # n > 1: the other choices resume from the first one's prompt
    r = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user",
                                       "content": "Pick a colour."}], max_tokens=3, n=3,
                                       temperature=0.8, seed=1)
    assert len(r.choices) == 3
    m2 = replay_server.metrics()
    assert m2["megagraph_prefix_cache_hit_tokens_total"] >= \
        m["megagraph_prefix_cache_hit_tokens_total"] + 2 * (r.usage.prompt_tokens - 1)
