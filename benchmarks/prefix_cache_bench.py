"""Prefix-cache serving benchmark: a multi-turn chat workload through `megagraph runtime serve`,
the cache off, on, and on with a host tier, each on its own server.

Workload (what a chat front end sends): N conversations share one system prompt; each turn's
request carries the whole history, the model's earlier replies included (the real `openai`
client, chat completions, greedy, `ignore_eos`, a fixed `max_tokens`, streaming with the usage
block). Conversations run concurrently (`--concurrency` of them in flight), the turns of one
conversation in order, so a turn's prompt extends the previous turn's prompt and reply: the
shared system prompt is the hit of first turns, the history the hit of later ones. Messages are
random words (a fixed seed), so the three servers see the same prompts; replies of random
weights are random text, re-tokenized when sent back (the cache sees what a client sends).

Configurations, in this order: `off` (--no-prefix-cache), `on` (the default device budget),
`host` (the device budget a fraction of the bytes `on` held at its end, `--host-device-frac`,
and a host budget of `--host-budget-mult` times those bytes, so that the device tier overflows
into the host tier and the host tier holds the rest; the sizes are in the report). `--mode exact`
runs the cached servers with --prefix-cache-mode exact. A warm-up turn (its own system prompt)
runs first on each server and the cache is flushed after it, so every configuration starts cold.

Per configuration: hit rate from /metrics (hit tokens / lookup tokens) and from the responses
(cached_tokens / prompt_tokens), prompt tokens saved, exact and replay hits, evictions by tier,
host loads, TTFT p50/p90/p99 (send -> first chunk with content), turn latency (send -> last
chunk), output and prompt tokens per second served, wall time; then the state must be back to
zero (/metrics: nothing running or waiting, no slot or ledger token) and POST /flush_cache must
keep no node (a node kept is held by a request that has finished: a leak).

    python benchmarks/prefix_cache_bench.py --smoke --out /tmp/pc        # CPU: seconds
    python benchmarks/prefix_cache_bench.py --model v4.1-flash-tiny --hw cpu --out OUT \
        --conversations 16 --turns 4 --system-words 150 --max-tokens 8
Outputs: OUT/prefix-cache.md and prefix-cache.json; exit 1 when a request failed, a state was
not back to zero, a node was kept, or a cached run had no hit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_server as server  # noqa: E402
import serve_stats as stats  # noqa: E402
from serve_bench import CLEAN_EXIT, _cuda, environment  # noqa: E402

SMOKE = dict(device="cpu", model="v4.1-flash-tiny", hw="cpu", conversations=3, turns=2,
             system_words=40, user_words=6, max_tokens=4, concurrency=2, timeout=120.0,
             server_args="--capacity 256 --max-running 4 --max-prefill-tokens 64 "
                         "--log-level warning")
PREFIX = "megagraph_prefix_cache_"
COUNTERS = ("lookups", "lookup_tokens", "hit_tokens", "exact_hits", "replay_hits",
            "derived_hits", "replayed_tokens", "inserts", "host_loads", "flushes")
TIERS = {"hits": ("device", "host"), "evictions": ("device", "host", "window")}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu river stone cloud paper garden window silver number market engine signal").split()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for prefix-cache.md / .json")
    g = p.add_argument_group("server")
    g.add_argument("--artifacts", help="artifacts to serve (`megagraph compile` output)")
    g.add_argument("--model", help="compile this model into a temporary folder (--logits last)")
    g.add_argument("--hw", default=None, help="profile for --model (default: cpu / h200)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    g.add_argument("--server-args", default="", help="`runtime serve` flags of all three servers")
    g.add_argument("--mode", choices=("replay", "exact"), default="replay",
                   help="--prefix-cache-mode of the cached servers")
    g.add_argument("--host-device-frac", type=float, default=0.25,
                   help="host config: device budget = this x the bytes `on` held at its end")
    g.add_argument("--host-budget-mult", type=float, default=2.0,
                   help="host config: host budget = this x the bytes `on` held at its end")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    w = p.add_argument_group("workload")
    w.add_argument("--conversations", type=int, default=50)
    w.add_argument("--turns", type=int, default=5)
    w.add_argument("--system-words", type=int, default=700,
                   help="words of the shared system prompt (about 1.4 tokens each)")
    w.add_argument("--user-words", type=int, default=20, help="words of each user message")
    w.add_argument("--max-tokens", type=int, default=32, help="tokens of every reply")
    w.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="chat completions, or /v1/completions of a plain-text transcript (for "
                   "models served without a chat template)")
    w.add_argument("--timeout", type=float, default=600.0, help="per turn: longer is a failure")
    p.add_argument("--configs", default="off,on,host", help="which of off,on,host to run")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 x 2 turns")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    if a.device is None:
        a.device = "cuda" if _cuda() else "cpu"
    if a.hw is None:
        a.hw = "cpu" if a.device == "cpu" else "h200"
    if (a.artifacts is None) == (a.model is None):
        p.error("give one of --artifacts, --model (or --smoke)")
    a.config_list = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = sorted(set(a.config_list) - {"off", "on", "host"})
    if bad or not a.config_list:
        p.error(f"--configs: unknown {bad or 'empty'}; choose from off,on,host")
    if "host" in a.config_list and "on" not in a.config_list:
        p.error("--configs: host takes its sizes from the on run; include on before it")
    for k in ("conversations", "turns", "system_words", "user_words", "max_tokens",
              "concurrency"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if not 0 < a.host_device_frac < 1 or a.host_budget_mult <= 0:
        p.error("--host-device-frac must be in (0, 1) and --host-budget-mult > 0")
    return a


# ---------------------------------------------------------------------------------- workload
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class Workload:
    system: str
    users: list[list[str]]  # per conversation, per turn


def workload(a, seed: int) -> Workload:
    rng = random.Random(seed)
    system = "You are a careful assistant. " + words(rng, a.system_words)
    users = [[f"Question {t + 1} of chat {c}: " + words(rng, a.user_words)
              for t in range(a.turns)] for c in range(a.conversations)]
    return Workload(system, users)


@dataclass
class Turn:
    conversation: int
    turn: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # send -> first chunk with content
    latency: float = 0.0  # send -> last chunk
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reply: str = ""


def transcript(messages: list[dict]) -> str:
    """The conversation as plain text for /v1/completions (`--api completions`: a model served
    without a chat template, e.g. a random-weight layer slice at release widths)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


async def chat_turn(client, model: str, messages: list[dict], max_tokens: int, timeout: float,
                    turn: Turn, api: str = "chat") -> str:
    """One streaming chat completion (or completion of the transcript); fills `turn`, returns the
    reply text ('' on failure)."""
    t0 = time.perf_counter()
    parts: list[str] = []

    async def consume():
        common = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        if api == "chat":
            stream = await client.chat.completions.create(messages=messages, **common)
        else:
            stream = await client.completions.create(prompt=transcript(messages), **common)
        async for ch in stream:
            now = time.perf_counter()
            for c in ch.choices or ():
                text = (c.delta.content if c.delta else None) if api == "chat" else c.text
                if text:
                    parts.append(text)
                    if turn.ttft is None:
                        turn.ttft = now - t0
            if ch.usage:
                turn.prompt_tokens = ch.usage.prompt_tokens
                turn.output_tokens = ch.usage.completion_tokens
                det = ch.usage.prompt_tokens_details
                turn.cached_tokens = (det.cached_tokens or 0) if det else 0
            turn.latency = now - t0

    try:
        await asyncio.wait_for(consume(), timeout)
        turn.ok = turn.output_tokens == max_tokens
        if not turn.ok:
            turn.error = f"{turn.output_tokens} of {max_tokens} tokens (ignore_eos)"
    except asyncio.TimeoutError:
        turn.error = f"no end within {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001 - any failure is an outcome to count
        turn.error = f"{type(e).__name__}: {e}"[:300]
    if not turn.ok:
        turn.latency = time.perf_counter() - t0
    turn.reply = "".join(parts)
    return turn.reply


async def run_chats(base_url: str, wl: Workload, *, max_tokens: int, concurrency: int,
                    timeout: float, api: str = "chat") -> tuple[list[Turn], float]:
    """Every conversation, at most `concurrency` in flight, its turns in order; a failed turn
    ends its conversation (the next prompt would lack its reply). (turns, wall seconds)."""
    import httpx
    import openai

    http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                             limits=httpx.Limits(max_connections=concurrency + 4))
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", http_client=http,
                                max_retries=0)
    model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(concurrency)
    turns: list[Turn] = []

    async def conversation(c: int):
        async with sem:
            messages = [{"role": "system", "content": wl.system}]
            for t, user in enumerate(wl.users[c]):
                messages.append({"role": "user", "content": user})
                turn = Turn(c, t)
                turns.append(turn)
                reply = await chat_turn(client, model, messages, max_tokens, timeout, turn, api)
                if not turn.ok:
                    return
                messages.append({"role": "assistant", "content": reply})

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(conversation(c) for c in range(len(wl.users))))
    finally:
        await client.close()
    return turns, time.perf_counter() - t0


# ------------------------------------------------------------------------------------ numbers
def prefix_metrics(m: dict[str, float]) -> dict:
    """The prefix-cache samples of one /metrics scrape."""
    out: dict = {k: m.get(f"{PREFIX}{k}_total", 0.0) for k in COUNTERS}
    for name, tiers in TIERS.items():
        out[name] = {t: m.get(f'{PREFIX}{name}_total{{tier="{t}"}}', 0.0) for t in tiers}
    for name in ("bytes", "capacity_bytes", "nodes"):
        out[name] = {t: m.get(f'{PREFIX}{name}{{tier="{t}"}}', 0.0) for t in ("device", "host")}
    out["enabled"] = m.get(f"{PREFIX}enabled", 0.0)
    return out


def prefix_delta(before: dict, after: dict) -> dict:
    """Counters over the measured run; gauges (bytes, capacity, nodes) as they ended."""
    d = {k: int(after[k] - before[k]) for k in COUNTERS}
    for name, tiers in TIERS.items():
        d[name] = {t: int(after[name][t] - before[name][t]) for t in tiers}
    for name in ("bytes", "capacity_bytes", "nodes"):
        d[name] = {t: int(v) for t, v in after[name].items()}
    d["hit_rate"] = d["hit_tokens"] / d["lookup_tokens"] if d["lookup_tokens"] else None
    return d


def summarize(turns: list[Turn], wall: float, n_turns: int) -> dict:
    ok = [t for t in turns if t.ok]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    out = sum(t.output_tokens for t in ok)
    wall = max(wall, 1e-9)
    per_turn = []
    for i in range(n_turns):
        ts = [t for t in ok if t.turn == i]
        p = sum(t.prompt_tokens for t in ts)
        per_turn.append({"turn": i + 1, "n": len(ts), "prompt_tokens_mean": p / len(ts)
                         if ts else None, "cached_share": sum(t.cached_tokens for t in ts) / p
                         if p else None,
                         "ttft_ms": stats.dist([t.ttft for t in ts if t.ttft is not None])})
    return {"turns": len(turns), "completed": len(ok), "failed": len(turns) - len(ok),
            "error_samples": sorted({t.error for t in turns if t.error})[:5],
            "wall_s": wall, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": out, "cached_share": cached / prompt if prompt else None,
            "output_tok_s": out / wall, "prompt_tok_s": prompt / wall,
            "ttft_ms": stats.dist([t.ttft for t in ok if t.ttft is not None]),
            "turn_ms": stats.dist([t.latency for t in ok]), "per_turn": per_turn,
            "replies": {f"{t.conversation}.{t.turn}": t.reply for t in ok}}


def same_replies(c: dict, off: dict) -> dict:
    """Turns whose reply equals cache off's (greedy): exact mode resumes the same state, so a
    difference there is a numeric one (batch shapes) or a bug; replay rebuilds the windows
    approximately, and a changed reply changes every later prompt of its conversation."""
    a, b = c["replies"], off["replies"]
    keys = sorted(set(a) & set(b))
    turns = sorted({int(k.split(".")[1]) for k in keys})
    return {"same": sum(a[k] == b[k] for k in keys), "compared": len(keys),
            "same_by_turn": [sum(a[k] == b[k] for k in keys if k.endswith(f".{t}"))
                             for t in turns]}


# ---------------------------------------------------------------------------------------- run
@dataclass
class Config:
    name: str
    flags: str  # added to --server-args
    note: str = ""


@dataclass
class Outcome:
    config: Config
    client: dict = field(default_factory=dict)
    prefix: dict = field(default_factory=dict)
    state_after: dict = field(default_factory=dict)
    state_zero: bool = False
    flush: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # observations that do not fail the run


def flush(base_url: str) -> dict:
    import httpx

    r = httpx.post(base_url + "/flush_cache", timeout=60)
    r.raise_for_status()
    return r.json()


def measure(a, art: Path, cfg: Config, wl: Workload, warm: Workload, out: Path) -> Outcome:
    """One configuration on its own server: warm-up turn, flush, the workload, the checks."""
    res = Outcome(cfg)
    extra = f"{a.server_args} {cfg.flags}".strip()
    srv = server.start_server(art, device=a.device, extra=extra,
                              log_path=out / f"server-{cfg.name}.log",
                              timeout=a.startup_timeout)
    res.server = {"command": "megagraph runtime serve " + " ".join(
        shlex.quote(x) for x in srv.argv[5:]), "ready_s": srv.ready_s}
    try:
        wt, _ = asyncio.run(run_chats(srv.base_url, warm, max_tokens=a.max_tokens,
                                      concurrency=1, timeout=a.timeout, api=a.api))
        if not all(t.ok for t in wt):
            res.problems.append(f"{cfg.name}: warm-up failed ({wt[0].error})")
        stats.wait_zero(srv.base_url)
        flush(srv.base_url)
        before = prefix_metrics(stats.read_metrics(srv.base_url))
        turns, wall = asyncio.run(run_chats(srv.base_url, wl, max_tokens=a.max_tokens,
                                            concurrency=a.concurrency, timeout=a.timeout,
                                            api=a.api))
        res.client = summarize(turns, wall, a.turns)
        after_m, res.state_after = stats.wait_zero(srv.base_url)
        res.state_zero = stats.is_zero(res.state_after)
        res.prefix = prefix_delta(before, prefix_metrics(after_m))
        res.flush = flush(srv.base_url)
    finally:
        res.server["exit_code"] = srv.stop(timeout=60)
        res.server["log_tail"] = srv.log_tail(30)
    check(res, a)
    return res


def check(res: Outcome, a) -> None:
    c, px, name = res.client, res.prefix, res.config.name
    expected = a.conversations * a.turns
    if c["completed"] != expected:
        res.problems.append(f"{name}: {c['completed']} of {expected} turns completed "
                            f"({'; '.join(c['error_samples'][:2])})")
    if not res.state_zero:
        res.problems.append(f"{name}: state after the run {res.state_after}")
    if res.flush.get("kept_nodes"):
        res.problems.append(f"{name}: /flush_cache kept {res.flush['kept_nodes']} nodes with "
                            "no request running (a node still locked)")
    if res.server["exit_code"] not in CLEAN_EXIT:
        res.problems.append(f"{name}: server exit code {res.server['exit_code']} after SIGTERM")
    if name == "off":
        if c["cached_tokens"] or px.get("lookups"):
            res.problems.append(f"off: {c['cached_tokens']} cached tokens, "
                                f"{px.get('lookups')} lookups with the cache off")
    elif not px.get("hit_tokens") or not c["cached_tokens"]:
        res.problems.append(f"{name}: no hit ({px.get('hit_tokens')} hit tokens on /metrics, "
                            f"{c['cached_tokens']} cached tokens in the responses)")
    for tier in ("device", "host"):  # budgets hold once no request runs (nothing locked)
        if px.get("capacity_bytes", {}).get(tier) and px["bytes"][tier] > px["capacity_bytes"][
                tier]:
            res.notes.append(f"{name}: the {tier} tier ended over its budget "
                             f"({px['bytes'][tier]:,} of {px['capacity_bytes'][tier]:,} B) "
                             "with no request running")
    if name == "host" and not px["bytes"]["host"] and not px["host_loads"] \
            and not px["evictions"]["device"]:
        res.problems.append("host: the host tier was never used (no device eviction)")


def host_sizes(on: Outcome, a) -> tuple[int, int]:
    """(device, host) budgets of the host config from the bytes the `on` run held at its end:
    the device tier a fraction of them, the host tier a multiple (holds what leaves the device)."""
    held = on.prefix["bytes"]["device"]
    if held <= 0:
        raise RuntimeError("on: the cache held no bytes at its end; no host sizes to derive")
    return max(int(held * a.host_device_frac), 1), max(int(held * a.host_budget_mult), 1)


def main(argv=None) -> int:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.smoke:
        os.environ["OMP_NUM_THREADS"] = "1"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    wl, warm = workload(a, a.seed), workload(argparse.Namespace(**{**vars(a), "conversations": 1,
                                                                   "turns": 1}), a.seed + 999)
    mode = f" --prefix-cache-mode {a.mode}" if a.mode != "replay" else ""
    env = {**environment(a.device), "cpus": os.cpu_count()}
    res: dict = {"command": shlex.join(["python"] + sys.argv), "environment": env,
                 "args": {k: v for k, v in vars(a).items()},
                 "configs": [], "problems": []}
    with tempfile.TemporaryDirectory(prefix="megagraph-pc-bench-") as tmp:
        art = Path(a.artifacts) if a.artifacts else compile_model(a, Path(tmp))
        res["compile_s"] = round(time.perf_counter() - t0, 1)
        outcomes: dict[str, Outcome] = {}
        for name in a.config_list:
            if name == "off":
                cfg = Config("off", "--no-prefix-cache", "--no-prefix-cache")
            elif name == "on":
                cfg = Config("on", mode.strip(), "default device budget (the slot pools' bytes)")
            else:
                dev, host = host_sizes(outcomes["on"], a)
                held = outcomes["on"].prefix["bytes"]["device"]
                cfg = Config("host", f"{mode} --prefix-cache-bytes {dev} --host-cache-bytes "
                             f"{host}".strip(),
                             f"device {dev} B = {a.host_device_frac:g} x and host {host} B = "
                             f"{a.host_budget_mult:g} x the {held} B the on run held at its end")
            try:
                o = measure(a, art, cfg, wl, warm, out)
            except (server.ServerFailed, OSError, RuntimeError) as e:
                res["problems"].append(f"{name}: {type(e).__name__}: {str(e)[-1500:]}")
                break
            outcomes[name] = o
            if "off" in outcomes:
                o.client["same_as_off"] = same_replies(o.client, outcomes["off"].client)
            res["configs"].append(asdict(o))
            res["problems"] += o.problems
            print(line(o), flush=True)
            write(res, out)
    res["elapsed_s"] = round(time.perf_counter() - t0, 1)
    res["ok"] = not res["problems"]
    md = write(res, out)
    print(f"wrote {md}; " + ("OK" if res["ok"] else "PROBLEMS: " + "; ".join(res["problems"])))
    return 0 if res["ok"] else 1


def compile_model(a, tmp: Path) -> Path:
    from harness.models import compile_artifacts

    from megagraph.models.config import load_model_config

    return compile_artifacts(load_model_config(a.model), a.hw, tmp, logits="last")


def line(o: Outcome) -> str:
    c, px = o.client, o.prefix
    return (f"{o.config.name}: {c['completed']}/{c['turns']} turns, hit rate "
            f"{fmt_pct(px.get('hit_rate'))} (responses {fmt_pct(c['cached_share'])}), TTFT p50 "
            f"{c['ttft_ms']['p50'] or 0:.1f} ms, wall {c['wall_s']:.1f} s, state "
            f"{'zero' if o.state_zero else o.state_after}")


# ------------------------------------------------------------------------------------- report
def fmt_pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def fmt(v, d: int = 1) -> str:
    return "-" if v is None else f"{v:,.{d}f}"


def ratio(v, ref) -> str:
    return "-" if not v or not ref else f"{v / ref:.2f}x"


def markdown(res: dict) -> str:
    a, env = res["args"], res["environment"]
    cs = res["configs"]
    off = next((c for c in cs if c["config"]["name"] == "off"), None)
    ref = (lambda path: _get(off, path)) if off else (lambda path: None)
    lines = [f"# Prefix cache, multi-turn chat: {env.get('device')}, "
             f"{a.get('model') or a.get('artifacts')}", "",
             f"Command: `{res['command']}`", "",
             f"Environment: {env.get('date')}, python {env.get('python')}, torch "
             f"{env.get('torch')}, cuda {env.get('cuda')}, triton {env.get('triton')}, commit "
             f"{env.get('commit', '-')}; device {a['device']} (hw profile {a['hw']}), "
             f"{env.get('cpus', '?')} CPUs visible.", "",
             f"**Workload.** {a['conversations']} conversations x {a['turns']} turns, "
             f"{a['concurrency']} conversations in flight, one shared system prompt of "
             f"{a['system_words']} random words, user messages of {a['user_words']} words, "
             f"{a['max_tokens']} output tokens per turn (greedy, ignore_eos), each turn carrying "
             "the whole history with the replies (openai client, streaming "
             + ("chat completions). " if a.get("api", "chat") == "chat" else
                "completions of a plain-text transcript). ")
             + f"Cached servers in {a['mode']} mode. Server flags of all three: "
             f"`{a['server_args'] or '-'}`.", ""]
    lines += ["| config | flags | turns ok | hit rate (/metrics) | cached / prompt (responses) |"
              " prompt tokens saved | exact / replay / replay-derived hits |"
              " evictions device / host / window |"
              " host loads | replies = off | state zero, nodes kept |", "|" + "---|" * 11]
    for c in cs:
        px, cl, cfg = c["prefix"], c["client"], c["config"]
        hits = (f"{px.get('exact_hits', 0)} / {px.get('replay_hits', 0)} / "
                f"{px.get('derived_hits', 0)}") if px.get("enabled", 1) \
            and c["config"]["name"] != "off" else "-"
        ev = px.get("evictions") or {}
        lines.append(f"| {cfg['name']} | `{cfg['flags'] or '-'}` | {cl['completed']}/"
                     f"{cl['turns']} | {fmt_pct(px.get('hit_rate'))} | "
                     f"{fmt_pct(cl['cached_share'])} | {cl['cached_tokens']:,} of "
                     f"{cl['prompt_tokens']:,} | {hits} | {ev.get('device', 0)} / "
                     f"{ev.get('host', 0)} / {ev.get('window', 0)} | "
                     f"{px.get('host_loads', 0)} | {same(cl)} | "
                     f"{'yes' if c['state_zero'] else 'NO'}, "
                     f"{c['flush'].get('kept_nodes', '-')} |")
    lines += ["", "Latency and throughput (ratio: this / cache off):", "",
              "| config | TTFT p50 ms | p90 | p99 | TTFT p50 vs off | turn p50 ms | p90 |"
              " output tok/s | prompt tok/s | wall s | wall vs off |", "|" + "---|" * 11]
    for c in cs:
        cl = c["client"]
        t, tu = cl["ttft_ms"], cl["turn_ms"]
        lines.append(f"| {c['config']['name']} | {fmt(t['p50'])} | {fmt(t['p90'])} | "
                     f"{fmt(t['p99'])} | {ratio(t['p50'], ref(('client', 'ttft_ms', 'p50')))} | "
                     f"{fmt(tu['p50'])} | {fmt(tu['p90'])} | {fmt(cl['output_tok_s'])} | "
                     f"{fmt(cl['prompt_tok_s'])} | {fmt(cl['wall_s'])} | "
                     f"{ratio(cl['wall_s'], ref(('client', 'wall_s')))} |")
    lines += ["", "Per turn (cached share of the prompt; TTFT p50 ms):", "",
              "| config | " + " | ".join(f"turn {i + 1}" for i in range(a["turns"])) + " |",
              "|" + "---|" * (a["turns"] + 1)]
    for c in cs:
        cells = [f"{fmt_pct(p['cached_share'])}; {fmt(p['ttft_ms']['p50'])}"
                 for p in c["client"]["per_turn"]]
        lines.append(f"| {c['config']['name']} | " + " | ".join(cells) + " |")
    lines += ["", "Cache sizes at the end (device / host): "]
    for c in cs:
        px = c["prefix"]
        if c["config"]["name"] != "off":
            lines.append(f"- {c['config']['name']}: bytes {px['bytes']['device']:,} / "
                         f"{px['bytes']['host']:,}, capacity {px['capacity_bytes']['device']:,} /"
                         f" {px['capacity_bytes']['host']:,}, nodes {px['nodes']['device']} / "
                         f"{px['nodes']['host']}, inserts {px['inserts']}, replayed tokens "
                         f"{px['replayed_tokens']:,}" + (f"; {c['config']['note']}"
                                                         if c["config"]["name"] == "host"
                                                         else ""))
    lines += ["", "Definitions: hit rate (/metrics) = hit_tokens / lookup_tokens over the run; "
              "cached / prompt = the responses' usage.prompt_tokens_details.cached_tokens over "
              "prompt_tokens; TTFT = send to the first chunk with content; turn = send to the "
              "last chunk; tok/s over the configuration's wall time (prompt tok/s counts cached "
              "tokens as served). Hits: exact = the restored state is that of a cold prefill; "
              "replay = the windows rebuilt by encoder replay; replay-derived = kept windows of "
              "a node snapshotted from a request that had resumed by replay (approximate too). "
              "Replies = off: turns whose greedy reply text equals cache "
              "off's (replay mode rebuilds sliding windows approximately; one changed reply "
              "changes the later prompts of its conversation). State zero: /metrics shows no "
              "running or waiting request and "
              "no slot or ledger token after the run; nodes kept: what POST /flush_cache could "
              "not drop (held by a request) after it.", ""]
    notes = [n for c in cs for n in c.get("notes", [])]
    lines.append("**Observations:** " + ("; ".join(notes) if notes else "none"))
    lines.append("")
    lines.append("**Problems:** " + ("; ".join(res["problems"]) if res["problems"] else "none"))
    return "\n".join(lines) + "\n"


def same(cl: dict) -> str:
    s = cl.get("same_as_off")
    if not s:
        return "-"
    by = "/".join(map(str, s.get("same_by_turn", [])))
    return f"{s['same']} of {s['compared']}" + (f" ({by} by turn)" if by else "")


def _get(d, path):
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def write(res: dict, out: Path) -> Path:
    from harness.report import write_atomic

    write_atomic(out / "prefix-cache.json", json.dumps(res, indent=1, default=str) + "\n")
    md = out / "prefix-cache.md"
    write_atomic(md, markdown(res))
    return md


if __name__ == "__main__":
    sys.exit(main())
