"""`runtime serve --nproc 2` over artifacts compiled with --dp 2 --ep 2: the command re-runs
itself under torchrun (gloo on CPU), rank 0 spreads requests over both ranks, greedy text equals
one process with the same seeded weights, a disconnect through the proxy frees the other rank's
state, and SIGTERM stops every rank."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import MODEL, free_port, openai

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [5, 6, 7, 8, 9, 10, 11]]


def _slots_used(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("megagraph_cache_slots_used "):
            return float(line.split()[1])
    raise AssertionError("no megagraph_cache_slots_used")


def _tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("megagraph_generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no megagraph_generation_tokens_total")


@pytest.fixture(scope="module")
def dep(artifacts, tmp_path_factory):
    out = tmp_path_factory.mktemp("dep") / "dp2"
    subprocess.run([sys.executable, "-m", "megagraph.main", "compile", "--model",
                    str(artifacts.parent / f"{MODEL}.yaml"), "--hw", "cpu", "--dp", "2",
                    "--ep", "2", "--out", str(out)], check=True, capture_output=True)
    port = free_port()
    while True:  # rank 1 takes port + 1
        try:
            with __import__("socket").create_server(("127.0.0.1", port + 1)):
                break
        except OSError:
            port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    log = open(out.parent / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "megagraph.main", "runtime", "serve", str(out),
                             "--nproc", "2", "--port", str(port), "--no-grammar", "--max-running",
                             "4", "--capacity", "256", "--seed", "0", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("DEP server did not start:\n" +
                                     (out.parent / "serve.log").read_text()[-4000:])
            time.sleep(0.5)
        yield proc, url, f"http://127.0.0.1:{port + 1}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_dep_serving_spreads_requests_and_matches_one_process(dep, artifacts):
    from megagraph.runtime.engine import Engine
    from megagraph.runtime.sampling import SamplingParams

    proc, url, url1 = dep
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    with cf.ThreadPoolExecutor(4) as ex:
        texts = list(ex.map(lambda p: client.completions.create(
            model=MODEL, prompt=p, max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text, PROMPTS))
    assert _tokens(url1) > 0  # rank 1 served some of them
    eng = Engine.from_artifacts(artifacts, seed=0, progress=False, random_weights="seeded")
    want = eng.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert texts == [o.text for o in want]


def test_dep_disconnect_through_the_proxy_frees_state_and_sigterm_stops(dep):
    proc, url, url1 = dep
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as a, \
                c.stream("POST", url + "/v1/completions", json=body) as b:
            lines = [r.iter_lines() for r in (a, b)]  # one on each rank (least loaded); keep the
            for it in lines:                          # iterators: dropping one closes its stream
                while not next(it).startswith("data: {"):
                    pass
            assert _slots_used(url) == 1 and _slots_used(url1) == 1
    deadline = time.monotonic() + 30
    while _slots_used(url) or _slots_used(url1):
        assert time.monotonic() < deadline, "a disconnect did not free its rank's state"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # what a service manager sends
    proc.wait(timeout=90)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url1 + "/health", timeout=2)
