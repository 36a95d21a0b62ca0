"""Serving benchmark in the anchors' terms: `megagraph runtime serve` under a load generator that
measures what SGLang's `bench_serving` and `vllm bench serve` measure, plus what they cannot see.

Points, each on one server, in this order (each optional):
  sweep    fixed or random input/output lengths as token ids, at each `--concurrency` (all issued
           at once, or Poisson arrivals with `--request-rate`); requests per point
           clamp(--point-mult x concurrency, --point-min, --point-max), none issued after
           --point-time seconds;
  prefill  `--prefill-heavy LEN:CONC,...`: LEN-token prompts, --prefill-output-len tokens out, at
           CONC in flight: prompt chunks of the server's prefill budget, each after the first over
           the cached context of the chunks before it (no prefix cache yet: the whole prompt is
           prefilled, so this is long-prompt prefill, not cache reuse);
  soak     `--soak N` requests of mixed lengths at --soak-concurrency: every request completes
           with all its tokens, none hangs, memory stays flat, the state ends at zero.
After every point /metrics must show the state back to zero (no slot, ledger token, running or
waiting sequence). Per sweep point the serving overhead: served ITL p50 / the engine's own step
time at the same batch (engine_step.py on the same artifacts, in its own process before the
server starts; `--engine-step PATH` reads an earlier run of it). That baseline is decode-only,
while served steps also carry the prompt chunks of arriving requests; so after the server has
stopped (`--engine-mix auto`), engine_step.py measures each point's own mix, read from the
server's step counters: a step of the mean rows of its decode-only steps, and one of the mean
rows and prompt tokens of its mixed steps. The same-mix step time is their mean weighted by the
two kinds' step counts, and the report sets served ITL against both baselines. The server's
start-up time (weights, capture) and memory come from its start-up report, /proc and
nvidia-smi.

The server: `--url` (already running; nothing about its process is read), or one this script
starts from `--artifacts DIR` / `--model NAME --hw HW` with `--server-args` (the CLI, in its own
process, as a user starts it), stopped with SIGTERM at the end.

    python benchmarks/serve_bench.py --smoke --out /tmp/sb       # CPU, tiny model: seconds
    python benchmarks/serve_bench.py --artifacts A --device cuda --out OUT \
        --server-args "--capacity 16640 --max-running 256 --max-prefill-tokens 4096" \
        --concurrency 1,8,32,64,128,256 --prefill-heavy 16384:2 --soak 2000
    python benchmarks/serve_bench.py --merge OUT/a/serve.json OUT/b/serve.json --out OUT
Outputs: OUT/serve.md, serve.json, serve.png (benchmarks/serve_report.py); exit 1 when a request
failed, hung or lost tokens, or the state was not back to zero.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_load as load  # noqa: E402
import serve_report as report  # noqa: E402
import serve_server as server  # noqa: E402
import serve_stats as stats  # noqa: E402

# uvicorn re-raises the signal it caught once it has drained, so a clean stop by SIGTERM exits
# with -SIGTERM; SIGKILL (-9: no exit within the drain time) or an error code is not clean
CLEAN_EXIT = (0, -signal.SIGTERM, None)
SMOKE = dict(device="cpu", model="v4.1-flash-tiny", hw="cpu", input_len=16, output_len=6,
             concurrency="1,2", point_mult=2.0, point_min=2, point_max=4, point_time=60.0,
             prefill_heavy="96:2", prefill_output_len=2, prefill_requests=2, soak=8,
             soak_concurrency=4, soak_input="4:48", soak_output="2:8", soak_time=60.0,
             engine_warmup=0, engine_iters=2, engine_mix_time=60.0, timeout=120.0,
             time_budget=240.0,
             server_args="--capacity 256 --max-running 4 --max-prefill-tokens 32 "
                         "--log-level warning")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for serve.md / serve.json / serve.png")
    p.add_argument("--label", default=None, help="this run's title in a merged report")
    g = p.add_argument_group("server")
    g.add_argument("--url", help="an already running server (http://127.0.0.1:PORT)")
    g.add_argument("--artifacts", help="artifacts to serve (`megagraph compile` output)")
    g.add_argument("--model", help="compile this model into OUT/artifacts instead (--logits last)")
    g.add_argument("--hw", default=None, help="profile for --model (default: cpu / h200)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    g.add_argument("--server-args", default="", help="more `megagraph runtime serve` flags")
    g.add_argument("--served-model", default=None, help="`model` sent in requests (default none)")
    g.add_argument("--vocab", type=int, default=129280,
                   help="with --url: prompt ids below this (default: the V4 tokenizer's size)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=1024)
    w.add_argument("--output-len", type=int, default=256)
    w.add_argument("--range-ratio", type=float, default=1.0,
                   help="lengths uniform in [len x ratio, len] (SGLang's --random-range-ratio)")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    w.add_argument("--concurrency", default="1,8,32,64,128,256",
                   help="sweep points, requests in flight ('' for none)")
    w.add_argument("--point-mult", type=float, default=2.0)
    w.add_argument("--point-min", type=int, default=8)
    w.add_argument("--point-max", type=int, default=512)
    w.add_argument("--point-time", type=float, default=60.0,
                   help="seconds a point issues requests for (those issued all finish)")
    w.add_argument("--prefill-heavy", default="", help="LEN:CONC,... prefill-heavy points")
    w.add_argument("--prefill-output-len", type=int, default=4)
    w.add_argument("--prefill-requests", type=int, default=8)
    w.add_argument("--soak", type=int, default=0, help="requests of the soak (0: none)")
    w.add_argument("--soak-concurrency", type=int, default=128)
    w.add_argument("--soak-input", default="64:1024", help="LO:HI prompt tokens")
    w.add_argument("--soak-output", default="16:256", help="LO:HI output tokens")
    w.add_argument("--soak-time", type=float, default=300.0, help="seconds the soak issues for")
    w.add_argument("--warmup-requests", type=int, default=1,
                   help="sent before the first point, not counted")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0, help="per request: longer is a hang")
    e = p.add_argument_group("engine step (serving overhead)")
    e.add_argument("--engine-step", default=None,
                   help="'auto' (default when this script starts the server: engine_step.py on "
                        "the same artifacts first), a JSON of an earlier run, or 'none'")
    e.add_argument("--engine-context", type=int, default=None,
                   help="cached tokens per request (default input + output / 2)")
    e.add_argument("--engine-warmup", type=int, default=3)
    e.add_argument("--engine-iters", type=int, default=10)
    e.add_argument("--engine-timeout", type=float, default=300.0)
    e.add_argument("--engine-mix", choices=("auto", "none"), default=None,
                   help="after the server stops, the engine alone at each point's step mix "
                        "(default: auto when this script starts the server)")
    e.add_argument("--engine-mix-time", type=float, default=150.0,
                   help="seconds of --time-budget kept for the same-mix baseline")
    p.add_argument("--time-budget", type=float, default=float("inf"),
                   help="seconds for the whole run: no point starts once spent, results written")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few requests")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join serve.json files into --out")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    if a.device is None:
        a.device = "cuda" if _cuda() else "cpu"
    if a.hw is None:
        a.hw = "cpu" if a.device == "cpu" else "h200"
    if not a.merge and sum(x is not None for x in (a.url, a.artifacts, a.model)) != 1:
        p.error("give one of --url, --artifacts, --model (or --smoke, or --merge)")
    if a.engine_step is None:
        a.engine_step = "none" if a.url else "auto"
    if a.engine_mix is None:
        a.engine_mix = "none" if a.url else "auto"
    a.concurrency_list = [int(c) for c in str(a.concurrency).split(",") if c.strip()]
    a.prefill_points = [tuple(int(x) for x in s.split(":")) for s in a.prefill_heavy.split(",")
                        if s.strip()]
    a.soak_in = tuple(int(x) for x in a.soak_input.split(":"))
    a.soak_out = tuple(int(x) for x in a.soak_output.split(":"))
    return a


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def serve_flags(extra: str) -> dict:
    """The engine-relevant `runtime serve` flags in `extra`, with the CLI's defaults."""
    from megagraph.runtime.server.config import ServeConfig

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--capacity", type=int, default=ServeConfig.capacity)
    p.add_argument("--max-running", type=int, default=ServeConfig.max_running)
    p.add_argument("--seed", type=int, default=ServeConfig.seed)
    p.add_argument("--no-cuda-graphs", action="store_true")
    known, _ = p.parse_known_args(shlex.split(extra))
    return vars(known)


class Bench:
    """One run: a server, its points, the report rewritten after each point."""

    def __init__(self, a):
        self.a = a
        self.t0 = time.perf_counter()
        self.out = Path(a.out)
        self.srv: server.ServerProcess | None = None
        self.run: dict = {"label": a.label, "command": " ".join(["python"] + sys.argv),
                          "args": {k: (v if not isinstance(v, float) or math.isfinite(v)
                                       else str(v)) for k, v in vars(a).items()},
                          "points": [], "skipped": [], "problems": []}
        self.engine: dict | None = None
        # kept from the points for the same-mix baseline, which runs once the server is gone
        self.reserve = a.engine_mix_time if (a.engine_mix == "auto" and not a.url and (
            a.concurrency_list or a.soak)) else 0.0

    # -- budget ----------------------------------------------------------------------------------
    def left(self) -> float:
        return self.a.time_budget - (time.perf_counter() - self.t0) - self.reserve

    def fits(self, what: str, need: float) -> bool:
        if self.left() >= need:
            return True
        self.run["skipped"].append(f"{what} ({self.left():.0f} s of the budget left, "
                                   f"{need:.0f} s needed)")
        return False

    def ready(self, what: str, need: float) -> bool:
        """Time for `what` is left and the server still answers /health with 200."""
        if not self.fits(what, need):
            return False
        if self.srv.alive() and server.health(self.srv.base_url) == 200:
            return True
        self.run["skipped"].append(f"{what} (the server is not healthy)")
        if "the server stopped answering /health with 200" not in self.run["problems"]:
            self.run["problems"].append("the server stopped answering /health with 200")
        return False

    def save(self) -> None:
        report.write({"runs": [self.run]}, self.out, with_plot=False)

    # -- set-up ----------------------------------------------------------------------------------
    def artifacts(self, tmp: Path) -> Path | None:
        a = self.a
        if a.artifacts:
            return Path(a.artifacts)
        if a.model:
            from harness.models import compile_artifacts

            from megagraph.models.config import load_model_config

            return compile_artifacts(load_model_config(a.model), a.hw, tmp, logits="last")
        return None

    def engine_step(self, art: Path) -> None:
        a = self.a
        if a.engine_step == "none" or not self.a.concurrency_list:
            return
        if a.engine_step != "auto":
            self.engine = json.loads(Path(a.engine_step).read_text())
            return
        slots = serve_flags(a.server_args)["max_running"]
        self.engine = self.measure_engine(
            art, "engine_step", batches=[c for c in a.concurrency_list if c <= slots], mixes=[],
            timeout=a.engine_timeout)

    def measure_engine(self, art: Path, name: str, *, batches: list[int],
                       mixes: list[tuple[int, int, int]], timeout: float) -> dict | None:
        """engine_step.py on the served artifacts with the server's engine flags: in this
        process on the CPU (no device memory to share), else in its own process (a CUDA context
        here would hold memory beside the server's); None with a problem noted on failure."""
        a = self.a
        f = serve_flags(a.server_args)
        context = a.engine_context or a.input_len + a.output_len // 2
        kw = dict(device=a.device, capacity=f["capacity"], slots=f["max_running"],
                  batches=batches, context=context, warmup=a.engine_warmup,
                  iters=a.engine_iters, seed=f["seed"], cuda_graphs=not f["no_cuda_graphs"],
                  mixes=mixes)
        if a.device == "cpu":
            import engine_step

            return engine_step.measure(str(art), **kw)
        path = self.out / f"{name}.json"
        cmd = [sys.executable, str(HERE / "engine_step.py"), "--artifacts", str(art),
               "--device", a.device, "--capacity", str(kw["capacity"]), "--slots",
               str(kw["slots"]), "--batches", ",".join(map(str, batches)), "--context",
               str(context), "--warmup", str(a.engine_warmup), "--iters", str(a.engine_iters),
               "--seed", str(kw["seed"]), "--mixes", ",".join(":".join(map(str, m))
                                                            for m in mixes),
               "--out", str(path)] + (["--no-cuda-graphs"] if f["no_cuda_graphs"] else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent,
                               timeout=max(min(timeout, self.left()), 1))
        except subprocess.TimeoutExpired:
            self.run["problems"].append(f"{name} (engine_step.py) ran past its time limit")
            return None
        if p.returncode != 0:
            self.run["problems"].append(f"{name} (engine_step.py) failed: "
                                        + (p.stderr or p.stdout)[-800:])
            return None
        return json.loads(path.read_text())

    def same_mix(self, art: Path | None) -> None:
        """The engine alone at each point's step mix, after the server has stopped; then each
        sweep and soak point's same-mix step time and served ITL over it."""
        if art is None or self.a.engine_mix != "auto":
            return
        self.reserve = 0.0
        pts = [p for p in self.run["points"] if p["kind"] in ("sweep", "soak")]
        slots = serve_flags(self.a.server_args)["max_running"]
        specs = {id(p): mix_specs(p, self.prefill_cap(), slots) for p in pts}
        mixes = sorted({m for ms in specs.values() for m in ms if m[0] >= 1})
        if not mixes or not self.fits("same-mix engine baseline", 20.0):
            return
        self.run["engine_mix"] = res = self.measure_engine(
            art, "engine_mix", batches=[], mixes=mixes, timeout=self.left())
        if res is None:
            return
        from engine_step import mix_ms

        for p in pts:
            mx = p["server"].get("mix") or {}
            parts = [(n, mix_ms(res, *m)) for n, m in zip(
                (mx.get("decode_only_steps"), mx.get("mixed_steps")), specs[id(p)])]
            ov = p.setdefault("overhead", {})
            ov["mixes"] = [list(m) for m in specs[id(p)]]
            steps = sum(n for n, _ in parts if n)
            if steps and all(ms is not None for n, ms in parts if n):
                ms = sum(n * ms for n, ms in parts if n) / steps
                itl = p["metrics"]["itl_ms"]
                ov["same_mix_step_ms"] = ms
                ov["same_mix_ratio"] = itl["p50"] / ms if itl["p50"] else None
                ov["same_mix_mean_ratio"] = itl["mean"] / ms if itl["mean"] else None
        self.save()

    def prefill_cap(self) -> int | None:
        return self.run.get("server", {}).get("startup", {}).get("prefill_cap")

    def start(self, art: Path | None) -> None:
        a = self.a
        if a.url:
            self.srv = server.attach(a.url)
            self.run["server"] = {"url": a.url, "started_by_bench": False}
        else:
            log = self.out / "server.log"
            self.srv = server.start_server(art, device=a.device, extra=a.server_args,
                                           log_path=log,
                                           timeout=min(a.startup_timeout, max(self.left(), 30)))
            self.run["server"] = {
                "started_by_bench": True, "argv": self.srv.argv,
                "command": "megagraph runtime serve " + " ".join(
                    shlex.quote(x) for x in self.srv.argv[5:]),
                "startup": self.srv.startup(), "memory_start": self.srv.memory()}
        m = stats.read_metrics(self.srv.base_url)
        self.run["model"] = next((k.split('model="')[1].split('"')[0] for k in m
                                  if k.startswith("megagraph_model_info")), None)
        self.vocab = self._vocab(art)

    def _vocab(self, art: Path | None) -> int:
        """Prompt ids stay below this: the artifacts' vocabulary, else --vocab."""
        if art is not None:
            import yaml

            return int(yaml.safe_load((art / "model.yaml").read_text())["vocab_size"])
        return self.a.vocab

    # -- points ----------------------------------------------------------------------------------
    def point(self, kind: str, reqs: list, *, concurrency: int, issue_for: float,
              extra: dict, on_tick=None) -> dict:
        import httpx

        a, url = self.a, self.srv.base_url
        try:
            before = stats.read_metrics(url)
        except httpx.HTTPError:
            before = {}
        lr = load.run(load.run_load(url, a.served_model, reqs, concurrency=concurrency,
                                    request_rate=a.request_rate if kind == "sweep" else math.inf,
                                    seed=a.seed, timeout=a.timeout,
                                    issue_for=max(issue_for, 0.0), on_tick=on_tick))
        try:
            after, state = stats.wait_zero(url)
        except httpx.HTTPError as e:  # the server died or hangs: the next points are skipped
            after, state = {}, {"/metrics": f"unreachable ({type(e).__name__})"}
        p = {"kind": kind, "concurrency": concurrency, **extra, "metrics": stats.summarize(lr),
             "server": stats.server_delta(before, after), "state_after": state,
             "state_zero": bool(after) and stats.is_zero(state)}
        self.check(p)
        self.run["points"].append(p)
        self.save()
        m = p["metrics"]
        print(f"{kind} c={concurrency}: {m['completed']}/{m['issued']} done, {m['failed']} failed, "
              f"{m['hung']} hung; {m['output_tok_s']:.0f} out tok/s, TTFT p50 "
              f"{m['ttft_ms']['p50'] or 0:.1f} ms, ITL p50 {m['itl_ms']['p50'] or 0:.2f} ms; "
              f"state {'zero' if p['state_zero'] else state}", flush=True)
        return p

    def check(self, p: dict) -> None:
        m, where = p["metrics"], f"{p['kind']} c={p['concurrency']}"
        for k in ("failed", "hung", "lost_tokens", "prompt_tokens_mismatch"):
            if m[k]:
                self.run["problems"].append(f"{where}: {m[k]} {k.replace('_', ' ')} "
                                            f"({'; '.join(m['error_samples'][:2])})")
        if m["completed"] != m["issued"]:
            self.run["problems"].append(f"{where}: {m['issued'] - m['completed']} of "
                                        f"{m['issued']} requests did not complete")
        if not p["state_zero"]:
            self.run["problems"].append(f"{where}: state after the point {p['state_after']}")

    def warmup(self) -> None:
        """--warmup-requests requests before the first point, not counted (SGLang's
        --warmup-requests): a first request can meet one-off costs, e.g. kernels of the eager
        segments compiled on first use."""
        a = self.a
        if not a.warmup_requests:
            return
        out_len = min(a.output_len, 32)
        in_len = min(a.input_len, 1024)
        if self.srv.proc is not None:  # within the context this script gave the server
            in_len = max(1, min(in_len, serve_flags(a.server_args)["capacity"] - out_len))
        reqs = load.fixed_requests(a.warmup_requests, in_len, out_len, self.vocab,
                                   seed=a.seed + 999)
        lr = load.run(load.run_load(self.srv.base_url, a.served_model, reqs,
                                    concurrency=a.warmup_requests, timeout=a.timeout))
        s = stats.summarize(lr)
        self.run["warmup"] = {k: s[k] for k in ("issued", "completed", "failed", "hung",
                                                "duration_s", "error_samples")}
        if s["completed"] != s["issued"]:
            self.run["problems"].append(f"warm-up: {s['completed']} of {s['issued']} completed "
                                        f"({'; '.join(s['error_samples'][:2])})")
        stats.wait_zero(self.srv.base_url)

    def sweep(self) -> None:
        a = self.a
        cap = serve_flags(a.server_args)["capacity"] if self.srv.proc else None
        for i, c in enumerate(a.concurrency_list):
            n = int(min(max(math.ceil(a.point_mult * c), a.point_min), a.point_max))
            if cap is not None and a.input_len + a.output_len > cap:
                self.run["skipped"].append(f"sweep: input + output over --capacity {cap}")
                return
            if not self.ready(f"sweep c={c}", 15.0):
                continue
            reqs = load.fixed_requests(n, a.input_len, a.output_len, self.vocab,
                                       range_ratio=a.range_ratio, seed=a.seed + i)
            p = self.point("sweep", reqs, concurrency=c,
                           issue_for=min(a.point_time, self.left() - 10.0),
                           extra={"input_len": a.input_len, "output_len": a.output_len})
            self.overhead(p)
        self.save()

    def overhead(self, p: dict) -> None:
        from engine_step import step_ms

        ms = step_ms(self.engine, p["concurrency"])
        itl = p["metrics"]["itl_ms"]["p50"]
        p["overhead"] = {"engine_step_ms": ms, "itl_p50_ms": itl,
                         "ratio": itl / ms if ms and itl else None,
                         "server_forward_ratio": (p["server"]["forward_ms_per_step"] / ms
                                                  if ms and p["server"]["forward_ms_per_step"]
                                                  else None)}

    def prefill(self) -> None:
        a = self.a
        budget = self.prefill_cap()
        for j, (L, c) in enumerate(a.prefill_points):
            if not self.ready(f"prefill-heavy {L}:{c}", 20.0):
                continue
            reqs = load.fixed_requests(a.prefill_requests, L, a.prefill_output_len, self.vocab,
                                       seed=a.seed + 100 + j)
            ctx = (f"0, {budget}, ... {budget * ((L - 1) // budget)}" if budget else "-")
            self.point("prefill", reqs, concurrency=c, issue_for=self.left() - 10.0,
                       extra={"input_len": L, "output_len": a.prefill_output_len,
                              "prefill_cap": budget, "cached_context": ctx})

    def soak(self) -> None:
        a = self.a
        if not a.soak or not self.ready("soak", 30.0):
            return
        samples: list[dict] = []

        def tick():
            samples.append({"t": time.perf_counter() - self.t0, **self.srv.memory(),
                            **allocator_memory(self.srv.base_url)})

        tick()
        reqs = load.mixed_requests(a.soak, a.soak_in, a.soak_out, self.vocab, seed=a.seed + 7)
        p = self.point("soak", reqs, concurrency=a.soak_concurrency,
                       issue_for=min(a.soak_time, self.left() - 20.0),
                       extra={"input_range": list(a.soak_in), "output_range": list(a.soak_out)},
                       on_tick=tick)
        tick()
        p["memory"] = flatness(samples)
        if p["memory"].get("flat") == "no":
            self.run["problems"].append(f"soak: memory grew ({p['memory']})")
        self.save()

    # -- the run ---------------------------------------------------------------------------------
    def main(self) -> int:
        a = self.a
        self.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="megagraph-serve-bench-") as tmp:
            art = self.artifacts(Path(tmp))
            self.run["environment"] = environment(a.device)
            if art is not None:
                self.engine_step(art)
                self.run["engine_step"] = self.engine
            try:
                self.start(art)
            except Terminated:
                self.run["problems"].append("stopped by SIGTERM during the server's start-up")
                self.save()
                return 1
            except server.ServerFailed as e:
                self.run["problems"].append(f"server: {e}")
                self.run["ok"] = False
                self.save()
                print(f"server failed: {e}", file=sys.stderr)
                return 1
            stop_s = 60.0
            try:
                self.warmup()
                self.sweep()
                self.prefill()
                self.soak()
            except Terminated:  # the caller's time limit: keep what was measured
                self.run["problems"].append("stopped by SIGTERM before the last point")
                stop_s = 8.0
            finally:
                srv = self.run["server"]
                if self.srv.proc is not None:
                    srv["memory_end"] = self.srv.memory()
                    srv["alive_at_end"] = self.srv.alive()
                    srv["exit_code"] = self.srv.stop(timeout=stop_s)
                    srv["log_tail"] = self.srv.log_tail(60)
                    if srv["exit_code"] not in CLEAN_EXIT:
                        self.run["problems"].append(
                            f"server exit code {srv['exit_code']} after SIGTERM")
                    if not srv["alive_at_end"]:
                        self.run["problems"].append("the server died during the run")
            if stop_s > 8.0:  # not stopped by the caller's SIGTERM
                try:
                    self.same_mix(art)
                except Terminated:
                    self.run["problems"].append("stopped by SIGTERM in the same-mix baseline")
        self.run["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.run["ok"] = not self.run["problems"]
        md = report.write({"runs": [self.run]}, self.out)
        verdict = "OK" if self.run["ok"] else "PROBLEMS: " + "; ".join(self.run["problems"])
        print(f"wrote {md}; {verdict}", flush=True)
        return 0 if self.run["ok"] else 1


class Terminated(Exception):
    """SIGTERM, e.g. from `timeout` around this script: the server is stopped and what was
    measured is written before the caller's SIGKILL."""


def _terminate(signum, frame):
    raise Terminated()


def mix_specs(p: dict, prefill_cap: int | None, slots: int) -> list[tuple[int, int, int]]:
    """The two step shapes of a point for engine_step.py, (decode rows, prompt tokens, largest
    chunk): its decode-only steps' mean rows, and its mixed steps' mean rows and prompt tokens;
    a prompt chunk is at most the mean prompt of the point (arrivals are one chunk each when
    they fit the prefill cap) and the cap; decode rows and chunks together fit the `slots`, as
    they did in the server. A kind of step the point did not run is (0, 0, C)."""
    mx = p.get("server", {}).get("mix") or {}
    if p["kind"] == "soak":
        mean_in = sum(p["input_range"]) / 2
    else:
        mean_in = p["input_len"]
    chunk = max(1, int(min(mean_in, prefill_cap or mean_in)))
    d0 = round(mx["decode_only_rows"]) if mx.get("decode_only_rows") else 0
    d1 = round(mx["mixed_rows"]) if mx.get("mixed_rows") else 0
    p1 = round(mx["mixed_prompt_tokens"]) if d1 and mx.get("mixed_prompt_tokens") else 0
    d1 = max(1, min(d1, slots - math.ceil(p1 / chunk))) if d1 else 0
    return [(d0, 0, chunk), (d1, p1, chunk)]


def allocator_memory(base_url: str) -> dict:
    """The server's CUDA allocator gauges from /metrics in MiB (none on the CPU, or when the
    scrape fails): allocated tells growth of live tensors apart from the allocator's cache."""
    import httpx

    try:
        m = stats.read_metrics(base_url)
    except httpx.HTTPError:
        return {}
    return {f"{k}_mib": round(m[f"megagraph_device_memory_{k}_bytes"] / 2**20, 1)
            for k in ("allocated", "reserved") if f"megagraph_device_memory_{k}_bytes" in m}


def flatness(samples: list[dict]) -> dict:
    """first / last / max of RSS, GPU memory (nvidia-smi) and the allocator's allocated and
    reserved bytes; flat when from the sample a quarter into the run (the first under load at
    the earliest: the one before the load holds no working set) to the last none grew by more
    than max(2%, 64 MiB)."""
    out: dict = {"samples": samples}
    verdicts = []
    for k in ("rss_mib", "gpu_mib", "allocated_mib", "reserved_mib"):
        xs = [s[k] for s in samples if k in s]
        if len(xs) < 2:
            continue
        ref = xs[max(len(xs) // 4, 1)]
        out[k] = {"first": xs[0], "last": xs[-1], "max": max(xs), "ref": ref}
        verdicts.append(xs[-1] - ref <= max(0.02 * ref, 64.0))
    out["flat"] = "-" if not verdicts else ("yes" if all(verdicts) else "no")
    return out


def environment(device: str) -> dict:
    """Versions and the device, read without touching CUDA in this process (a CUDA context here
    would take GPU memory beside the server's, and nvidia-smi's device total would count it)."""
    import platform

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
           "device": platform.processor() or "cpu", "driver": "-"}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
    except ImportError:
        env["torch"] = "not installed"
    if device != "cpu":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            name, driver = smi.stdout.strip().splitlines()[0].split(", ")
            env["device"], env["driver"] = name, driver
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            env["driver"] = "?"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    if commit:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=HERE).stdout.strip()
        env["commit"] = commit + ("+dirty" if dirty else "")
    return env


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        res = report.merge([Path(p) for p in a.merge])
        print(report.write(res, Path(a.out)))
        return 0 if all(r.get("ok") for r in res["runs"]) else 1
    signal.signal(signal.SIGTERM, _terminate)
    if a.smoke:  # one thread for the server and the engine step, as the CPU tests run
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    return Bench(a).main()


if __name__ == "__main__":
    sys.exit(main())
