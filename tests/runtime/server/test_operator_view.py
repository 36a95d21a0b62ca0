"""What an operator sees of failures: requests counted by how they ended (a stream that fails
after its 200 status line counts as an error, a client that leaves as aborted), and every
failure in the log with the request id the client got, while the client gets that id and no
exception text (it can hold paths and internals)."""

from __future__ import annotations

import json
import logging
import threading

import httpx

from .conftest import API_KEY, MODEL, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STREAM = {"model": MODEL, "prompt": "A long story:", "max_tokens": 60, "stream": True,
          "ignore_eos": True}


def count(server, status: int, outcome: str, endpoint: str = "completions") -> float:
    key = f'megagraph_requests_total{{endpoint="{endpoint}",status="{status}",' \
          f'outcome="{outcome}"}}'
    return server.metrics().get(key, 0.0)


def events(lines) -> list[str]:
    return [ln[6:] for ln in lines if ln.startswith("data: ")]


def test_a_stream_the_engine_fails_after_its_200_counts_as_an_error(server, caplog):
    eng, boom = server.service.engine, threading.Event()
    real = eng.step

    def step(chunks, *, exact=False):  # from `boom` on, every step fails: the retry too
        if boom.is_set():
            raise RuntimeError("injected failure in /opt/kernels/secret.py")
        return real(chunks, exact=exact)

    before = count(server, 200, "error")
    eng.step = step
    try:
        with caplog.at_level(logging.ERROR, logger="megagraph"):
            with httpx.stream("POST", server.base_url + "/v1/completions", json=STREAM,
                              headers=AUTH, timeout=60) as r:
                assert r.status_code == 200
                rid = r.headers["x-request-id"]
                lines = r.iter_lines()
                next(ln for ln in lines if ln.startswith("data: {"))
                boom.set()  # the next step fails, mid-stream
                rest = events(lines)
    finally:
        eng.step = real
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["code"] == "engine_error" and rid in err["message"]
    assert "secret" not in err["message"] and "injected" not in err["message"]
    assert any(rid in rec.getMessage() and rec.exc_info and "secret.py" in str(rec.exc_info[1])
               for rec in caplog.records)  # the log has the failure, with its traceback
    wait_idle(server)
    assert count(server, 200, "error") == before + 1  # not counted as a success


def test_a_client_that_leaves_mid_stream_counts_as_aborted(server):
    before = count(server, 200, "aborted")
    with httpx.stream("POST", server.base_url + "/v1/completions", json=STREAM, headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: {"))
    wait_idle(server)  # the route has seen the disconnect and freed the request
    assert count(server, 200, "aborted") == before + 1, server.metrics()


def test_an_unhandled_exception_is_a_500_with_the_request_id_and_no_internals(server, caplog,
                                                                              monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("bug in /srv/megagraph/secret.py: key=abc")

    before = count(server, 500, "error")
    monkeypatch.setattr(server.service, "submit", broken)
    with caplog.at_level(logging.ERROR, logger="megagraph.server"):
        r = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500
    err, rid = r.json()["error"], r.headers["x-request-id"]
    assert err["code"] == "internal_error" and rid in err["message"]
    assert "secret" not in r.text and "RuntimeError" not in r.text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback, by request id
    assert count(server, 500, "error") == before + 1


def test_an_exception_mid_stream_ends_the_stream_with_an_error_event(server, monkeypatch):
    def broken(token_id):
        raise RuntimeError("bug in /srv/megagraph/secret.py")

    monkeypatch.setattr(server.service, "token_text", broken)  # logprobs need it, mid-stream
    with httpx.stream("POST", server.base_url + "/v1/completions", headers=AUTH, timeout=60,
                      json={**STREAM, "max_tokens": 3, "logprobs": 1}) as r:
        assert r.status_code == 200
        data = events(r.iter_lines())
    assert data[-1] == "[DONE]" and "secret" not in "".join(data)
    assert r.headers["x-request-id"] in json.loads(data[-2])["error"]["message"]
    monkeypatch.undo()
    wait_idle(server)
