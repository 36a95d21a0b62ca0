"""Numbers of a serving run: the client's metrics in SGLang `bench_serving` / `vllm bench serve`
terms, and the server's own counters from /metrics.

Client side (serve_load.Result): completed / failed / hung requests, duration, request
throughput, input / output / total token throughput, concurrency achieved (sum of E2E / duration,
as SGLang reports it), and mean / p50 / p90 / p99 / max of TTFT, TPOT, ITL and E2E latency
(numpy's linear-interpolation percentiles, as both anchors compute them). Output tokens come from
each request's usage block.

Server side: deltas of the scheduler counters over a point (steps, forward seconds, the overhead
the overlap left exposed, prompt and decode tokens per step, and the mix of the steps that
decoded: decode-only ones and mixed ones with their mean rows and prompt tokens, the batch
compositions of the same-mix engine baseline), and the state after the point, which
must be back to zero: no slot or ledger token held, nothing running or waiting, no HTTP request
in flight but the scrape itself.
"""
from __future__ import annotations

import time

import numpy as np

from serve_load import LoadRun

QUANTILES = (50, 90, 99)
STATE_KEYS = ("megagraph_cache_slots_used", "megagraph_cache_tokens_used",
              "megagraph_num_requests_running", "megagraph_num_requests_waiting")


def dist(xs: list[float]) -> dict:
    """mean, p50, p90, p99, max of `xs` (seconds) in ms; empty -> None values."""
    if not xs:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}, "max": None, "n": 0}
    a = np.asarray(xs, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in QUANTILES},
            "max": float(a.max()), "n": int(a.size)}


def summarize(run: LoadRun) -> dict:
    rs = run.results
    ok = [r for r in rs if r.ok]
    dur = max(run.wall_s, 1e-9)
    inp = sum(r.input_len for r in ok)
    out = sum(r.output_tokens for r in ok)
    return {
        "issued": run.issued, "not_issued": run.not_issued, "completed": len(ok),
        "failed": sum(r.error is not None for r in rs), "hung": sum(r.hang for r in rs),
        "lost_tokens": sum(r.lost_tokens for r in rs),
        "prompt_tokens_mismatch": sum(1 for r in ok if r.prompt_tokens not in (0, r.input_len)),
        "duration_s": run.wall_s, "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(ok) / dur, "input_tok_s": inp / dur, "output_tok_s": out / dur,
        "total_tok_s": (inp + out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur, "peak_in_flight": run.peak_in_flight,
        "ttft_ms": dist([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": dist([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": dist([x for r in ok for x in r.itls]),
        "e2e_ms": dist([r.latency for r in ok]),
        "client_cpu_share": run.client_cpu_s / dur,
        "error_samples": sorted({r.error for r in rs if r.error})[:5],
    }


# ------------------------------------------------------------------------------------ /metrics
def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition (comments and non-numeric values skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                continue
    return out


def read_metrics(base_url: str) -> dict[str, float]:
    """Samples of /metrics: unlabelled ones by name, labelled ones by their full name."""
    import httpx

    return parse_metrics(httpx.get(base_url + "/metrics", timeout=30).text)


def requests_by_status(m: dict[str, float]) -> dict[str, float]:
    """'completions 200' -> count, from megagraph_requests_total{endpoint=..,status=..}."""
    out = {}
    for k, v in m.items():
        if k.startswith("megagraph_requests_total{"):
            labels = dict(p.split("=", 1) for p in k[k.index("{") + 1:-1].split(","))
            out[f"{labels['endpoint'].strip(chr(34))} {labels['status'].strip(chr(34))}"] = v
    return out


def server_delta(before: dict, after: dict) -> dict:
    """The scheduler's work over a point, per step."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (
        "megagraph_scheduler_steps_total", "megagraph_scheduler_forward_seconds_total",
        "megagraph_scheduler_exposed_overhead_seconds_total",
        "megagraph_scheduler_cpu_seconds_total", "megagraph_scheduler_prefill_tokens_total",
        "megagraph_scheduler_decode_tokens_total", "megagraph_step_seconds_sum",
        "megagraph_step_seconds_count", "megagraph_cache_preemptions_total",
        "megagraph_engine_errors_total", "megagraph_scheduler_decode_only_steps_total",
        "megagraph_scheduler_mixed_steps_total", "megagraph_scheduler_mixed_decode_tokens_total",
        "megagraph_scheduler_mixed_prefill_tokens_total")}
    steps = d["megagraph_scheduler_steps_total"]
    per = (lambda v: v / steps) if steps else (lambda v: None)
    ms = (lambda v: 1e3 * v / steps) if steps else (lambda v: None)
    fwd, exp = d["megagraph_scheduler_forward_seconds_total"], \
        d["megagraph_scheduler_exposed_overhead_seconds_total"]
    n_step = d["megagraph_step_seconds_count"]
    codes = requests_by_status(after)
    codes0 = requests_by_status(before)
    return {"steps": int(steps), "forward_ms_per_step": ms(fwd),
            "step_ms_mean": 1e3 * d["megagraph_step_seconds_sum"] / n_step if n_step else None,
            "exposed_ms_per_step": ms(exp),
            "scheduler_cpu_ms_per_step": ms(d["megagraph_scheduler_cpu_seconds_total"]),
            "exposed_fraction": exp / (exp + fwd) if exp + fwd > 0 else None,
            "prefill_tokens_per_step": per(d["megagraph_scheduler_prefill_tokens_total"]),
            "decode_tokens_per_step": per(d["megagraph_scheduler_decode_tokens_total"]),
            "mix": step_mix(d),
            "preemptions": int(d["megagraph_cache_preemptions_total"]),
            "engine_errors": int(d["megagraph_engine_errors_total"]),
            "responses": {k: int(v - codes0.get(k, 0)) for k, v in codes.items()
                          if v - codes0.get(k, 0) and not k.startswith(("metrics", "health"))}}


def step_mix(d: dict[str, float]) -> dict:
    """The batch composition of the point's steps that decoded: decode-only steps and their mean
    rows, mixed steps (decode rows + prompt chunks) and their mean rows and prompt tokens."""
    n0 = d["megagraph_scheduler_decode_only_steps_total"]
    n1 = d["megagraph_scheduler_mixed_steps_total"]
    dec1 = d["megagraph_scheduler_mixed_decode_tokens_total"]
    dec0 = d["megagraph_scheduler_decode_tokens_total"] - dec1
    return {"decode_only_steps": int(n0), "decode_only_rows": dec0 / n0 if n0 else None,
            "mixed_steps": int(n1), "mixed_rows": dec1 / n1 if n1 else None,
            "mixed_prompt_tokens": (d["megagraph_scheduler_mixed_prefill_tokens_total"] / n1
                                    if n1 else None)}


def state_of(m: dict[str, float]) -> dict[str, float]:
    s = {k.removeprefix("megagraph_"): m.get(k, float("nan")) for k in STATE_KEYS}
    s["http_requests_active"] = m.get("megagraph_http_requests_active", float("nan"))
    return s


def is_zero(state: dict[str, float]) -> bool:
    """Nothing held; one active HTTP request is the /metrics scrape that read this."""
    return all(state[k.removeprefix("megagraph_")] == 0 for k in STATE_KEYS) and \
        state["http_requests_active"] <= 1


def wait_zero(base_url: str, timeout: float = 30.0) -> tuple[dict, dict]:
    """(/metrics, state) once the state is back to zero, or when `timeout` passes (a request
    that finished on the client may still be leaving the scheduler for a step or two)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url)
        st = state_of(m)
        if is_zero(st) or time.monotonic() > deadline:
            return m, st
        time.sleep(0.2)
