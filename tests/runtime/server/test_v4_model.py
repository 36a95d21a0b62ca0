"""The tiny V4-Flash model serves with DeepSeek-V4's encoding and the bundled V4 tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ServeConfig, free_port, start_server


@pytest.fixture(scope="module")
def v4_server(tmp_path_factory):
    out = tmp_path_factory.mktemp("v4") / "tiny"
    subprocess.run([sys.executable, "-m", "megagraph.main", "compile", "--model",
                    "v4-flash-tiny", "--hw", "cpu", "--out", str(out)], check=True,
                   capture_output=True)
    srv = start_server(ServeConfig(artifacts=str(out), port=free_port(), capacity=512,
                                   max_running=4, served_model_name="tiny-v4"))
    yield srv
    srv.stop()


def test_v4_chat_thinking_and_json(v4_server):
    c = v4_server.client(api_key="unused")
    r = c.chat.completions.create(model="tiny-v4", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=4, extra_body={"thinking": True})
    assert r.choices[0].message.reasoning_content and r.usage.completion_tokens == 4
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = c.chat.completions.create(
        model="DeepSeek-V4-Flash", max_tokens=40, extra_body={"thinking": False},
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    with pytest.raises(Exception) as e:  # a V4 server does not take the V4.1 name
        c.chat.completions.create(model="DeepSeek-V4.1-Flash", max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}])
    assert getattr(e.value, "status_code", None) == 404
