"""What a client or a schema-driven tool finds: `models.retrieve`, OpenAI-shaped 404/405 (with
`Allow`), request ids, and an /openapi.json that declares every status code and content type the
routes return (checked against what they did return), with the request bodies of fields.py."""

from __future__ import annotations

import httpx
import pytest

from megagraph.runtime.server.fields import chat_endpoint, completions_endpoint

from .conftest import API_KEY, MODEL, openai

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_models_retrieve(server, client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    assert client.models.retrieve("DeepSeek-V4.1-Flash").id == "DeepSeek-V4.1-Flash"  # alias
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-5")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(server.base_url + "/v1/models/org/name", headers=AUTH)  # ids may hold a '/'
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_wrong_methods_and_routes_are_openai_shaped(server):
    for method, path, allow in [("GET", "/v1/completions", "POST"),
                                ("DELETE", "/v1/chat/completions", "POST"),
                                ("POST", "/v1/models", "GET"), ("PUT", "/health", "GET")]:
        r = httpx.request(method, server.base_url + path, headers=AUTH)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.base_url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_request_ids(server):
    r = httpx.get(server.base_url + "/health", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"  # a client's id is kept
    r = httpx.get(server.base_url + "/health", headers={"X-Request-Id": "bad id\x7f"})
    assert r.headers["x-request-id"].startswith("req-")  # not a token: replaced


def test_openapi_declares_what_the_routes_return(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()
    paths = spec["paths"]
    for ops in paths.values():
        for op in ops.values():
            assert "422" not in op["responses"]  # validation errors are 400
    u = server.base_url
    seen = {  # (path, method) -> statuses and content types these requests got
        ("/v1/completions", "post"): [
            httpx.post(u + "/v1/completions", headers=AUTH, json=b) for b in (
                {"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2,
                                                    "stream": True},
                {"prompt": "hi", "temperature": 9}, {"prompt": "hi", "model": "nope"})]
        + [httpx.post(u + "/v1/completions", json={"prompt": "hi"}),
           httpx.post(u + "/v1/completions", headers=AUTH, content=b"x" * (33 * 2**20))],
        ("/v1/chat/completions", "post"): [
            httpx.post(u + "/v1/chat/completions", headers=AUTH, json=b) for b in (
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                 "stream": True}, {"messages": []})],
        ("/v1/models", "get"): [httpx.get(u + "/v1/models", headers=AUTH)],
        ("/v1/models/{model}", "get"): [httpx.get(u + f"/v1/models/{m}", headers=AUTH)
                                        for m in (MODEL, "nope")],
        ("/health", "get"): [httpx.get(u + "/health")],
        ("/metrics", "get"): [httpx.get(u + "/metrics")],
    }
    for (path, method), responses in seen.items():
        declared = paths[path][method]["responses"]
        for r in responses:
            status = str(r.status_code)
            assert status in declared, (path, method, status, sorted(declared))
            kind = r.headers["content-type"].split(";")[0]
            assert kind in declared[status]["content"], (path, status, kind)
    assert {"200", "400", "401", "404", "413", "500", "503"} <= set(
        paths["/v1/completions"]["post"]["responses"])
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, table in (("/v1/completions", completions_endpoint(server.service)),
                        ("/v1/chat/completions", chat_endpoint(server.service))):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["properties"]) == set(table.fields) and not body["additionalProperties"]
        assert body["required"] == list(table.required)
    temp = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]["temperature"]
    assert (temp["minimum"], temp["maximum"]) == (0, 2)
