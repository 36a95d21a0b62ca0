"""The load of the serving benchmark: token-id prompts, arrivals, streaming clients.

Requests are what SGLang's `bench_serving --dataset-name random` and `vllm bench serve
--dataset-name random` send to an OpenAI-compatible server: POST /v1/completions with a prompt of
random token ids (no tokenizer round trip, so the input length is exact), `max_tokens` fixed per
request, `ignore_eos: true` (every request generates exactly that many tokens), `temperature: 0`,
`stream: true` with the usage block. Lengths are fixed, or uniform in [len x range_ratio, len]
(SGLang's `--random-range-ratio`), or uniform over a range (the soak's mixed lengths).

Arrivals as in both anchors: at most `concurrency` requests in flight (`--max-concurrency`), and
either all issued at once (`request_rate` inf) or as a Poisson process of that rate. A point can
stop issuing after a deadline; requests not issued are counted as such, never as lost.

Timing per request (the anchors' definitions): TTFT = first token chunk - send; ITL = the gaps
between consecutive token chunks; E2E = last byte - send; TPOT = (E2E - TTFT) / (tokens - 1).
This server sends one SSE chunk per generated token (runtime/server/completions.py), so every chunk
with a choice is a token, including tokens whose text is still an incomplete UTF-8 character
(empty text; the anchors skip those chunks, which merges their gaps).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    output_len: int


@dataclass
class Result:
    input_len: int
    output_len: int  # asked for
    ok: bool = False
    error: str | None = None
    hang: bool = False  # did not end within the per-request timeout
    sent: float = 0.0  # perf_counter at send
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    chunks: int = 0  # token chunks received
    output_tokens: int = 0  # usage.completion_tokens (chunks where the server sent no usage)
    prompt_tokens: int = 0
    finish: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def lost_tokens(self) -> int:
        """Tokens asked for (ignore_eos) that did not come back on a completed request."""
        return max(self.output_len - self.output_tokens, 0) if self.ok else 0


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n ids from [100, vocab - 300): clear of the low control ids and the specials at the top."""
    hi = max(vocab - 300, 101)
    return [rng.randrange(100, hi) for _ in range(n)]


def fixed_requests(n: int, input_len: int, output_len: int, vocab: int, *, range_ratio: float = 1.0,
                   seed: int = 0) -> list[Request]:
    """n requests of input_len / output_len tokens, or uniform in [len x range_ratio, len]."""
    rng = random.Random(seed)

    def length(full: int) -> int:
        lo = max(1, int(full * range_ratio))
        return full if lo >= full else rng.randint(lo, full)

    return [Request(random_ids(rng, length(input_len), vocab), length(output_len))
            for _ in range(n)]


def mixed_requests(n: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int, *,
                   seed: int = 0) -> list[Request]:
    """n requests, input and output lengths each uniform over its [lo, hi]."""
    rng = random.Random(seed)
    return [Request(random_ids(rng, rng.randint(*inputs), vocab), rng.randint(*outputs))
            for _ in range(n)]


def body(model: str | None, req: Request) -> dict:
    b = {"prompt": req.prompt_ids, "max_tokens": req.output_len, "ignore_eos": True,
         "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        b["model"] = model
    return b


TOKEN_ONLY = b'"finish_reason": null'  # this server's plain token chunk (json.dumps spacing)


async def send(client, url: str, model: str | None, req: Request, timeout: float) -> Result:
    """One streaming completion; never raises (errors and hangs are in the Result).

    SSE events are split from the raw bytes; a plain token chunk of this server (no finish
    reason, usage or error) is counted without parsing its JSON: at 256 streams and ~30 ms steps
    the client sees ~8,000 chunks a second, and a full parse of each would make the client, not
    the server, the thing measured. Any other event, and every event of a server that spaces its
    JSON differently, is parsed."""
    r = Result(len(req.prompt_ids), req.output_len)
    r.sent = t0 = time.perf_counter()
    last = None

    def token(now: float) -> None:
        nonlocal last
        r.chunks += 1
        if last is None:
            r.ttft = now - t0
        else:
            r.itls.append(now - last)
        last = now

    def event(data: bytes, now: float) -> bool:
        """Handle one `data:` payload; True at [DONE]."""
        if data == b"[DONE]":
            return True
        if TOKEN_ONLY in data and b'"usage"' not in data and b'"error"' not in data:
            token(now)
            return False
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error'].get('message', obj)}")
        if obj.get("usage"):
            r.output_tokens = obj["usage"]["completion_tokens"]
            r.prompt_tokens = obj["usage"]["prompt_tokens"]
        for c in obj.get("choices") or ():
            token(now)
            r.finish = c.get("finish_reason") or r.finish
        return False

    async def consume():
        async with client.stream("POST", url, json=body(model, req)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            buf = b""
            async for part in resp.aiter_bytes():
                now = time.perf_counter()
                buf += part
                *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                for ev in events:
                    for line in ev.split(b"\n"):
                        if line.startswith(b"data:") and event(line[5:].strip(), now):
                            return

    try:
        await asyncio.wait_for(consume(), timeout)
        r.ok = r.finish is not None
        if not r.ok:
            r.error = "the stream ended without a finish_reason"
    except asyncio.TimeoutError:
        r.hang = True
    except Exception as e:  # noqa: BLE001 - any failure is an outcome to count
        r.error = f"{type(e).__name__}: {e}"
    r.latency = (last if last is not None and r.ok else time.perf_counter()) - t0
    if r.ok and not r.output_tokens:
        r.output_tokens = r.chunks
    return r


@dataclass
class LoadRun:
    results: list[Result]  # the requests issued, in order
    wall_s: float  # start -> last request done
    not_issued: int  # left when the point's deadline passed
    peak_in_flight: int
    client_cpu_s: float  # this process's CPU time over the run (a saturated client shows here)

    @property
    def issued(self) -> int:
        return len(self.results)


async def run_load(base_url: str, model: str | None, requests: list[Request], *,
                   concurrency: int, request_rate: float = math.inf, seed: int = 0,
                   timeout: float = 600.0, issue_for: float | None = None,
                   on_tick=None, tick_s: float = 5.0) -> LoadRun:
    """Issue `requests` in order: each arrives (at once, or after an exponential gap of mean
    1 / request_rate), waits for one of `concurrency` places, and is sent unless `issue_for`
    seconds have passed since the start by then (those sent all run to the end). `on_tick()`
    runs in a thread every `tick_s` while the load runs (the soak samples memory with it)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency + 8)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits)
    url = base_url + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    in_flight = peak = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    late = (lambda: False) if issue_for is None else (lambda: time.perf_counter() - t0 > issue_for)
    stop_ticks = asyncio.Event()

    async def ticker():
        while not stop_ticks.is_set():
            try:
                await asyncio.wait_for(stop_ticks.wait(), tick_s)
            except asyncio.TimeoutError:
                await asyncio.to_thread(on_tick)

    async def one(req: Request) -> Result | None:
        nonlocal in_flight, peak
        async with sem:
            if late():
                return None
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send(client, url, model, req, timeout)
            finally:
                in_flight -= 1

    tick = asyncio.create_task(ticker()) if on_tick else None
    tasks: list[asyncio.Task] = []
    try:
        for req in requests:
            if math.isfinite(request_rate) and tasks:
                await asyncio.sleep(rng.expovariate(request_rate))
            if late():
                break
            tasks.append(asyncio.create_task(one(req)))
        done = await asyncio.gather(*tasks)
    finally:
        stop_ticks.set()
        if tick is not None:
            await tick
        await client.aclose()
    results = [r for r in done if r is not None]
    return LoadRun(results, time.perf_counter() - t0, len(requests) - len(results), peak,
                   time.process_time() - cpu0)


def run(coro):
    """asyncio.run, on uvloop where it is installed (less client time per SSE chunk)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    return uvloop.run(coro) if hasattr(uvloop, "run") else asyncio.run(coro)
