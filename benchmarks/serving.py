"""Serving under load on loopback: N concurrent streaming requests of mixed lengths against
`megagraph runtime serve` (in this process, over the tiny V4.1 model with random weights, unless
`--url` points at a running server), through the real `openai` client.

Every request must finish or get a clean error; one that does not end within `--timeout` is a
hang and fails the run. Afterwards the server must hold no state (slots and token ledger back to
zero, read from /metrics). Reported: throughput, p50/p99 TTFT, inter-token latency and request
latency (client side), and the scheduling overhead the server measured (worker idle between
consecutive busy steps, with step N+1 assembled while step N runs vs. without: `--no-overlap`).

Baseline: none on CPU (the tiny model's forward dominates); the numbers show that the serving
path (HTTP, SSE, scheduler, detokenization, chat parsing) adds little to the forward passes.

    python benchmarks/serving.py                       # 200 requests -> results/serving-tiny-cpu.md
    python benchmarks/serving.py --smoke --out /tmp/s  # a few requests (the test suite runs this)
    python benchmarks/serving.py --repeat 10 --hostile 0.05 --max-running 8
        # robustness: 10 rounds of 200 streams + 5% hostile requests on one server
        # -> results/serving-robustness-tiny-cpu-r8-hostile.md (every well-formed one must complete,
        #    every hostile one get a 4xx, none hang, state back to zero after each round)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "v4.1-flash-tiny"
WORDS = ("graph state token prefill decode window expert router cache slot kernel stream batch "
         "latency schedule segment bucket").split()


@dataclass
class Outcome:
    kind: str  # chat | completion
    ok: bool = False
    error: str | None = None
    hang: bool = False
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    finish: str | None = None


def make_requests(n: int, seed: int, max_out: int) -> list[dict]:
    """Mixed lengths: prompts of 2..200 words, 4..max_out output tokens, half chat, half raw."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_words = int(rng.paretovariate(1.2) * 2) % 200 + 2
        words = " ".join(rng.choice(WORDS) for _ in range(n_words))
        req = {"max_tokens": rng.randint(4, max_out), "seed": i, "temperature": 1.0,
               "stream": True, "stream_options": {"include_usage": True}}
        if i % 2:
            req.update(kind="chat", messages=[{"role": "user", "content": words}],
                       extra_body={"thinking": bool(i % 4 == 1), "ignore_eos": True})
        else:
            req.update(kind="completion", prompt=words, extra_body={"ignore_eos": True})
        out.append(req)
    return out


async def one(client, req: dict, timeout: float) -> Outcome:
    req = dict(req)
    o = Outcome(req.pop("kind"))
    t0 = time.perf_counter()
    last = None

    async def consume():
        nonlocal last
        create = client.chat.completions.create if o.kind == "chat" else client.completions.create
        stream = await create(model=MODEL, **req)
        async for ch in stream:
            now = time.perf_counter()
            if ch.usage is not None:
                o.tokens, o.prompt_tokens = ch.usage.completion_tokens, ch.usage.prompt_tokens
            for c in ch.choices:
                if o.kind == "chat":
                    d = c.delta
                    has = bool(d.content or getattr(d, "reasoning_content", None))
                else:
                    has = bool(c.text)
                if has:
                    if last is None:
                        o.ttft = now - t0
                    else:
                        o.itls.append(now - last)
                    last = now
                o.finish = c.finish_reason or o.finish

    try:
        await asyncio.wait_for(consume(), timeout)
        o.ok = o.finish is not None
    except asyncio.TimeoutError:
        o.hang = True
    except Exception as e:  # noqa: BLE001 - a clean error is an allowed outcome
        o.error = f"{type(e).__name__}: {e}"
    o.latency = time.perf_counter() - t0
    return o


async def run_load(base_url: str, api_key: str | None, requests: list[dict],
                   timeout: float = 600.0) -> tuple[list[Outcome], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "none",
                                max_retries=0, timeout=timeout)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(client, r, timeout) for r in requests))
    wall = time.perf_counter() - t0
    await client.close()
    return list(outs), wall


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(outs: list[Outcome], wall: float) -> dict:
    ttft = [o.ttft for o in outs if o.ttft is not None]
    itl = [x for o in outs for x in o.itls]
    lat = [o.latency for o in outs if o.ok]
    toks = sum(o.tokens for o in outs)
    return {"requests": len(outs), "completed": sum(o.ok for o in outs),
            "errors": sum(o.error is not None for o in outs), "hangs": sum(o.hang for o in outs),
            "wall_s": wall, "output_tokens": toks,
            "prompt_tokens": sum(o.prompt_tokens for o in outs),
            "output_tok_s": toks / wall, "req_s": len(outs) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99),
            "error_samples": sorted({o.error for o in outs if o.error})[:5]}


def read_metrics(base_url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def wait_idle(base_url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url)
        if not (m["megagraph_cache_slots_used"] or m["megagraph_cache_tokens_used"]
                or m["megagraph_num_requests_running"] or m["megagraph_num_requests_waiting"]):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def overhead(before: dict, after: dict) -> dict:
    d = {k: after[k] - before.get(k, 0) for k in (
        "megagraph_scheduler_steps_total", "megagraph_scheduler_forward_seconds_total",
        "megagraph_scheduler_exposed_overhead_seconds_total",
        "megagraph_scheduler_cpu_seconds_total")}
    steps = max(d["megagraph_scheduler_steps_total"], 1)
    fwd = d["megagraph_scheduler_forward_seconds_total"]
    exp = d["megagraph_scheduler_exposed_overhead_seconds_total"]
    return {"steps": int(d["megagraph_scheduler_steps_total"]),
            "forward_ms_per_step": 1e3 * fwd / steps,
            "exposed_ms_per_step": 1e3 * exp / steps,
            "scheduler_cpu_ms_per_step": 1e3 * d["megagraph_scheduler_cpu_seconds_total"] / steps,
            "exposed_fraction": exp / max(exp + fwd, 1e-9)}


def start_local(artifacts: Path, *, max_running: int, overlap: bool, capacity: int):
    sys.path.insert(0, str(ROOT))
    from tests.runtime.server.conftest import free_port, start_server  # the suite's in-process server

    from megagraph.runtime.server import ServeConfig

    cfg = ServeConfig(artifacts=str(artifacts), port=free_port(), capacity=capacity,
                      max_running=max_running, overlap=overlap, max_prefill_tokens=256)
    return start_server(cfg)


def run_case(artifacts, args, reqs, overlap: bool) -> tuple[dict, dict, dict]:
    srv = start_local(artifacts, max_running=args.max_running, overlap=overlap,
                      capacity=args.capacity)
    try:
        before = read_metrics(srv.base_url)
        outs, wall = asyncio.run(run_load(srv.base_url, None, reqs, args.timeout))
        after = wait_idle(srv.base_url)
        return summarize(outs, wall), overhead(before, after), after
    finally:
        srv.stop()


async def _load_and_hostile(base_url: str, reqs: list[dict], hostile: list, timeout: float):
    from hostile import run_hostile

    (outs, wall), h = await asyncio.gather(run_load(base_url, None, reqs, timeout),
                                           run_hostile(base_url, hostile, timeout))
    return outs, wall, h


def run_robustness(artifacts: Path, args) -> int:
    """`--repeat` rounds of the load (+ `--hostile` share of hostile requests) on one server."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hostile import make_hostile, summarize_hostile

    srv = start_local(artifacts, max_running=args.max_running, overlap=True,
                      capacity=args.capacity)
    rounds = []
    try:
        for r in range(args.repeat):
            reqs = make_requests(args.requests, r, args.max_out)
            hostile = make_hostile(int(round(args.hostile * args.requests)), r, MODEL)
            outs, wall, h = asyncio.run(_load_and_hostile(srv.base_url, reqs, hostile,
                                                          args.timeout))
            after = wait_idle(srv.base_url)
            load, hs = summarize(outs, wall), summarize_hostile(h)
            state = {k: after[k] for k in ("megagraph_cache_slots_used",
                                           "megagraph_cache_tokens_used",
                                           "megagraph_num_requests_running",
                                           "megagraph_num_requests_waiting")}
            ok = (load["completed"] == load["requests"] and hs["ok"] == hs["sent"]
                  and not any(state.values()))
            rounds.append({"round": r, "ok": ok, "load": load, "hostile": hs, "state": state})
            print(f"round {r}: {load['completed']}/{load['requests']} completed, "
                  f"{load['errors']} errors, {load['hangs']} hangs; hostile {hs['ok']}/"
                  f"{hs['sent']} answered 4xx ({hs['5xx']} 5xx); state {state}", flush=True)
    finally:
        srv.stop()
    out = Path(args.out)
    name = f"serving-robustness-tiny-cpu-r{args.max_running}" + ("-hostile" if args.hostile else "")
    lines = [f"# Serving robustness: tiny V4.1 on CPU, {args.max_running} slots", "",
             f"`python benchmarks/serving.py --repeat {args.repeat} --hostile {args.hostile} "
             f"--requests {args.requests} --max-running {args.max_running}` on "
             f"{platform.machine()} ({platform.processor() or 'cpu'}), torch threads 1, "
             f"{time.strftime('%Y-%m-%d')}.", "",
             f"Each round: {args.requests} concurrent well-formed streaming requests (prompts "
             f"2..200 words, 4..{args.max_out} output tokens, half chat) and "
             f"{int(round(args.hostile * args.requests))} hostile requests "
             "(benchmarks/hostile.py: empty prompt, lone surrogate, out-of-range values, unknown "
             "field, deep nesting, prompt over the context, malformed JSON, disconnect after the "
             "first chunk), all sent at once to one server that serves every round. A round "
             "passes when every well-formed request completes, every hostile one gets a 4xx "
             "with an OpenAI-shaped error (a disconnect: its stream started), and /metrics "
             "shows no slot, token, running or waiting request afterwards.", "",
             "| round | completed | errors | hangs | hostile 4xx | 5xx | wall s | out tok/s | "
             "TTFT p50 ms | ITL p50 ms | state after | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rounds:
        ld, hs = x["load"], x["hostile"]
        lines.append(f"| {x['round']} | {ld['completed']}/{ld['requests']} | {ld['errors']} | "
                     f"{ld['hangs']} | {hs['ok']}/{hs['sent']} | {hs['5xx']} | "
                     f"{ld['wall_s']:.1f} | {ld['output_tok_s']:.1f} | "
                     f"{1e3 * ld['ttft_p50']:.0f} | {1e3 * ld['itl_p50']:.0f} | "
                     f"{'zero' if not any(x['state'].values()) else x['state']} | "
                     f"{'yes' if x['ok'] else 'NO'} |")
    fails = [f for x in rounds for f in x["hostile"]["failures"] + x["load"]["error_samples"]]
    if fails:
        lines += ["", "Failures: " + "; ".join(sorted(set(fails))[:10])]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(rounds, indent=1))
    ok = all(x["ok"] for x in rounds)
    print(f"wrote {out / name}.md; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def write_md(path: Path, args, main: dict, ov_on: dict, ov_off: dict | None, after: dict) -> None:
    lines = [
        "# Serving under load: tiny V4.1 on CPU (loopback)", "",
        f"`python benchmarks/serving.py{' --smoke' if args.smoke else ''} --requests "
        f"{args.requests} --max-running {args.max_running}` on {platform.processor() or 'cpu'} "
        f"({platform.machine()}), torch threads 1, {time.strftime('%Y-%m-%d')}.", "",
        f"{main['requests']} concurrent streaming requests (half chat, a quarter of those "
        f"thinking; half completions), prompts 2..200 words, 4..{args.max_out} output tokens, "
        f"all sent at once through `openai.AsyncOpenAI`; {args.max_running} state slots.", "",
        "| requests | completed | clean errors | hangs | wall s | output tok/s | req/s |",
        "|---|---|---|---|---|---|---|",
        f"| {main['requests']} | {main['completed']} | {main['errors']} | {main['hangs']} | "
        f"{main['wall_s']:.1f} | {main['output_tok_s']:.1f} | {main['req_s']:.2f} |", "",
        "| ms | p50 | p99 |", "|---|---|---|",
        f"| TTFT | {1e3 * main['ttft_p50']:.0f} | {1e3 * main['ttft_p99']:.0f} |",
        f"| inter-token latency | {1e3 * main['itl_p50']:.0f} | {1e3 * main['itl_p99']:.0f} |",
        f"| request latency | {1e3 * main['latency_p50']:.0f} | {1e3 * main['latency_p99']:.0f} |",
        "",
        f"State after the run (/metrics): slots used {after['megagraph_cache_slots_used']:.0f}, "
        f"tokens reserved {after['megagraph_cache_tokens_used']:.0f}, running "
        f"{after['megagraph_num_requests_running']:.0f}, waiting "
        f"{after['megagraph_num_requests_waiting']:.0f}, preemptions "
        f"{after['megagraph_cache_preemptions_total']:.0f}.", "",
        "## Scheduling overhead", "",
        "Exposed = the step worker idle between two consecutive steps of a busy period (waiting "
        "for the scheduler to hand it the next step, or for the grammar masks / sampler states "
        "before sampling). With overlap the scheduler builds step N+1 and post-processes step N-1 "
        "(detokenize, stop strings, SSE events) while step N runs.", "",
        f"Same workload both ways: the first {args.compare_requests} requests of the run above, "
        "each mode on a fresh server.", "",
        "| mode | wall s | output tok/s | steps | forward ms/step | exposed ms/step | "
        "scheduler thread ms/step | exposed share |",
        "|---|---|---|---|---|---|---|---|"]
    for name, ov in (("overlap (default)", ov_on), ("--no-overlap", ov_off)):
        if ov:
            lines.append(f"| {name} | {ov.get('wall_s', float('nan')):.1f} | "
                         f"{ov.get('output_tok_s', float('nan')):.1f} | {ov['steps']} | "
                         f"{ov['forward_ms_per_step']:.1f} | {ov['exposed_ms_per_step']:.3f} | "
                         f"{ov['scheduler_cpu_ms_per_step']:.3f} | "
                         f"{100 * ov['exposed_fraction']:.2f}% |")
    if main["error_samples"]:
        lines += ["", "Errors: " + "; ".join(main["error_samples"])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", help="compiled tiny artifacts (default: compile into a temp dir)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-out", type=int, default=64)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--timeout", type=float, default=900.0, help="per request: longer is a hang")
    p.add_argument("--no-compare", action="store_true", help="skip the --no-overlap run")
    p.add_argument("--smoke", action="store_true", help="8 short requests (seconds)")
    p.add_argument("--repeat", type=int, default=0,
                   help="robustness mode: this many rounds of the load on one server")
    p.add_argument("--hostile", type=float, default=0.0,
                   help="robustness mode: hostile requests per well-formed one (e.g. 0.05)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.smoke:
        args.requests, args.max_out, args.max_running = 8, 8, 4
    args.compare_requests = max(8, args.requests // 4)
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(args.artifacts) if args.artifacts else Path(tmp) / "tiny"
        if not args.artifacts:
            subprocess.run([sys.executable, "-m", "megagraph.main", "compile", "--model", MODEL,
                            "--hw", "cpu", "--out", str(art)], check=True, capture_output=True)
        if args.repeat or args.hostile:
            return run_robustness(art, argparse.Namespace(**{**vars(args),
                                                             "repeat": max(args.repeat, 1)}))
        reqs = make_requests(args.requests, 0, args.max_out)
        main_s, ov_on, after = run_case(art, args, reqs, overlap=True)
        print(json.dumps({"load": main_s, "overhead_overlap": ov_on}, indent=1))
        ov_off = None
        if not args.no_compare:
            sub = reqs[: args.compare_requests]  # the same workload both ways
            if not args.smoke:
                load_on, ov_on, _ = run_case(art, args, sub, overlap=True)
            else:
                load_on = main_s
            ov_on = {**ov_on, "wall_s": load_on["wall_s"], "output_tok_s": load_on["output_tok_s"]}
            load_off, ov_off, _ = run_case(art, args, sub, overlap=False)
            ov_off = {**ov_off, "wall_s": load_off["wall_s"],
                      "output_tok_s": load_off["output_tok_s"]}
            print(json.dumps({"overhead_no_overlap": ov_off}, indent=1))
    out = Path(args.out)
    name = "serving-tiny-cpu-smoke.md" if args.smoke else "serving-tiny-cpu.md"
    write_md(out / name, args, main_s, ov_on, ov_off, after)
    (out / name.replace(".md", ".json")).write_text(json.dumps(
        {"load": main_s, "overhead_overlap": ov_on, "overhead_no_overlap": ov_off,
         "state_after": {k: v for k, v in after.items() if k.startswith("megagraph_cache")}},
        indent=1))
    ok = main_s["hangs"] == 0 and main_s["completed"] + main_s["errors"] == main_s["requests"] \
        and after["megagraph_cache_slots_used"] == 0 and after["megagraph_cache_tokens_used"] == 0
    print(f"wrote {out / name}; {'OK' if ok else 'FAILED (hang or leaked state)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
