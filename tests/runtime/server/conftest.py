"""A real server on 127.0.0.1 over tiny V4.1 artifacts (compiled once with `megagraph compile`),
random weights, talked to with the real `openai` client.

The server runs in this process (uvicorn in a thread, packages.md §9), so tests can read its
service (metrics, scheduler) and inject faults.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("deepseek_recipe")

from megagraph.runtime.server import ServeConfig, ServingEngine, create_app  # noqa: E402

API_KEY = "sk-megagraph-test"
MODEL = "v4.1-flash-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    service: ServingEngine
    server: object  # uvicorn.Server
    thread: threading.Thread
    base_url: str  # http://127.0.0.1:PORT

    def client(self, **kw):
        kw.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=self.base_url + "/v1", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (plus labelled ones under their full name)."""
        import httpx

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_server(config: ServeConfig) -> RunningServer:
    import uvicorn

    service = ServingEngine.start(config)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1",
                                           port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=int(config.drain_timeout)))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return RunningServer(service, server, t, f"http://127.0.0.1:{config.port}")


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """`megagraph compile` of the tiny V4.1 model with f32 activations: its steps are then
    batch-invariant to ~5e-6 (bf16 prefill logits move by up to ~5% with the batch's other rows,
    as in other engines without a batch-invariant mode), so greedy batched == alone is exact."""
    import yaml

    from megagraph.models.config import CONFIG_DIR

    d = tmp_path_factory.mktemp("serve")
    cfg = yaml.safe_load((CONFIG_DIR / "models" / f"{MODEL}.yaml").read_text())
    cfg["act_dtype"] = "f32"
    (d / f"{MODEL}.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "megagraph.main", "compile", "--model",
                    str(d / f"{MODEL}.yaml"), "--hw", "cpu", "--out", str(d / "tiny")],
                   check=True, capture_output=True)
    return d / "tiny"


@pytest.fixture(scope="session")
def server_config(artifacts) -> ServeConfig:
    # exact prefix-cache resumes: the tests compare repeated requests token for token, and
    # encoder replay (the default mode) is approximate; tests/runtime/server/test_prefix_cache.py
    # serves it in replay mode too
    return ServeConfig(artifacts=str(artifacts), port=free_port(), api_key=API_KEY,
                       capacity=1024, max_running=8, max_prefill_tokens=128, seed=0,
                       drain_timeout=20, prefix_cache_mode="exact")


@pytest.fixture(scope="session")
def server(server_config):
    srv = start_server(server_config)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return server.client()


def fresh_config(config: ServeConfig, **kw) -> ServeConfig:
    return replace(config, port=free_port(), **kw)


def wait_idle(server: RunningServer, timeout: float = 30) -> dict[str, float]:
    """Poll /metrics until no sequence holds state; returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["megagraph_cache_slots_used"] == 0 and m["megagraph_cache_tokens_used"] == 0
                and m["megagraph_num_requests_running"] == 0
                and m["megagraph_num_requests_waiting"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"state not freed: {m}")
        time.sleep(0.1)
