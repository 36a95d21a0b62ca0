"""Peers' load generators against `megagraph runtime serve`, set beside serve_bench.py on the
same load: SGLang's `bench_serving` (`python -m sglang.benchmark.serving`) and guidellm, each
installed from PyPI and run unmodified (benchmarks/peer_client.sh runs them). This script only
reads their output files and writes the comparison, so that the numbers in the table are the
peers' own, not recomputed here.

What each client calls a metric, as read here:
  requests/s, output tok/s  completed requests / output tokens over the client's own duration;
  TTFT                      request sent -> first streamed token;
  ITL                       gaps between streamed tokens (SGLang and serve_bench: every gap;
                            guidellm: its `inter_token_latency_ms`, the per-request mean gap
                            weighted by the request's gaps);
  TPOT                      (E2E - TTFT) / (output tokens - 1), per request.
The machine's speed can change between two clients' runs (shared cores), so each row also
carries the server's own mean step time (forward + sample) over that client's run, from
/metrics scraped before and after it (`FILE.before.prom` / `FILE.after.prom` beside a peer's
output file; serve_bench.py records its own), and mean ITL over it (a mean over a mean: each
gap between two tokens of a request spans one step, whatever the step's length): the clients
agree when that ratio does, whatever the machine did meanwhile.

    python benchmarks/serve_peer.py --serve-bench SB/serve.json --sglang SG_C1.jsonl,SG_C4.jsonl \
        --guidellm G_C1.json,G_C4.json --out benchmarks/results/cpu/serving-peer-client.md \
        --header header.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from serve_stats import parse_metrics

COLS = ("client", "concurrency", "completed", "prompt tokens/request", "req/s", "output tok/s",
        "TTFT mean", "TTFT p50", "TTFT p99", "ITL mean", "ITL p50", "ITL p99", "TPOT p50",
        "server step", "ITL mean / server step")
KEYS = ("req_s", "out_tok_s", "ttft_mean", "ttft_p50", "ttft_p99", "itl_mean", "itl_p50",
        "itl_p99", "tpot_p50", "step_ms", "itl_over_step")


def prom(path: Path) -> dict[str, float]:
    return parse_metrics(path.read_text())


def server_step_ms(result: Path) -> float | None:
    """The server's mean step (forward + sample) over a peer's run, from the scrapes beside
    its output file."""
    b, a = Path(f"{result}.before.prom"), Path(f"{result}.after.prom")
    if not (b.exists() and a.exists()):
        return None
    b, a = prom(b), prom(a)
    n = a["megagraph_step_seconds_count"] - b["megagraph_step_seconds_count"]
    return 1e3 * (a["megagraph_step_seconds_sum"] - b["megagraph_step_seconds_sum"]) / n \
        if n else None


def with_step(row: dict, step_ms: float | None) -> dict:
    row["step_ms"] = step_ms
    row["itl_over_step"] = row["itl_mean"] / step_ms if step_ms and row["itl_mean"] else None
    return row


def from_serve_bench(path: Path) -> list[dict]:
    rows = []
    for run in json.loads(path.read_text())["runs"]:
        for p in run["points"]:
            if p["kind"] != "sweep":
                continue
            m = p["metrics"]
            rows.append({"client": "serve_bench.py", "concurrency": p["concurrency"],
                         "completed": m["completed"],
                         "prompt": m["total_input_tokens"] / max(m["completed"], 1),
                         "req_s": m["request_throughput"], "out_tok_s": m["output_tok_s"],
                         **{f"{k}_{q}": m[f"{k}_ms"][q] for k in ("ttft", "itl")
                            for q in ("mean", "p50", "p99")},
                         "tpot_p50": m["tpot_ms"]["p50"]})
            with_step(rows[-1], p["server"].get("step_ms_mean"))
    return rows


def from_sglang(path: Path) -> list[dict]:
    """The last line of each `--output-file` JSONL (one benchmark run per file)."""
    d = json.loads(path.read_text().strip().splitlines()[-1])
    rows = [{"client": "sglang bench_serving", "concurrency": d["max_concurrency"],
             "completed": d["completed"], "prompt": d["total_input_tokens"] / d["completed"],
             "req_s": d["request_throughput"], "out_tok_s": d["output_throughput"],
             "ttft_mean": d["mean_ttft_ms"], "ttft_p50": d["median_ttft_ms"],
             "ttft_p99": d["p99_ttft_ms"], "itl_mean": d["mean_itl_ms"],
             "itl_p50": d["median_itl_ms"], "itl_p99": d["p99_itl_ms"],
             "tpot_p50": d["median_tpot_ms"]}]
    with_step(rows[0], server_step_ms(path))
    return rows


def from_guidellm(path: Path) -> list[dict]:
    rows = []
    for b in json.loads(path.read_text())["benchmarks"]:
        m = b["metrics"]

        def ok(k):
            return m[k]["successful"]

        n = m["request_totals"]["successful"]
        dur = b["duration"]
        rows.append({"client": "guidellm", "concurrency": b["config"]["strategy"]["streams"],
                     "completed": n,
                     "prompt": ok("prompt_token_count")["mean"],
                     "req_s": n / dur, "out_tok_s": ok("output_token_count")["total_sum"] / dur,
                     **{f"{k}_{q}": (ok(name)["mean"] if q == "mean"
                                     else ok(name)["percentiles"][q])
                        for k, name in (("ttft", "time_to_first_token_ms"),
                                        ("itl", "inter_token_latency_ms"))
                        for q in ("mean", "p50", "p99")},
                     "tpot_p50": ok("time_per_output_token_ms")["percentiles"]["p50"]})
        with_step(rows[-1], server_step_ms(path))
    return rows


def _f(v, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def markdown(rows: list[dict], header: str = "") -> str:
    rows = sorted(rows, key=lambda r: (r["concurrency"], r["client"] != "serve_bench.py",
                                       r["client"]))
    out = [header.rstrip(), ""] if header else []
    out += ["Latencies in ms; every figure is the client's own but the server's step (its",
            "mean forward + sample time over that client's run, from /metrics).", "",
            "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    for r in rows:
        out.append("| " + " | ".join([r["client"], str(r["concurrency"]), str(r["completed"]),
                                      _f(r["prompt"])] + [_f(r[k], 2) for k in KEYS]) + " |")
    out += ["", "Each peer over serve_bench.py at the same concurrency (1.00: the same figure):",
            "", "| client | concurrency | " + " | ".join(COLS[4:]) + " |",
            "|" + "---|" * (len(COLS) - 2)]
    base = {r["concurrency"]: r for r in rows if r["client"] == "serve_bench.py"}
    for r in rows:
        b = base.get(r["concurrency"])
        if r["client"] == "serve_bench.py" or b is None:
            continue
        out.append("| " + " | ".join([r["client"], str(r["concurrency"])] + [
            _f(r[k] / b[k], 2) if r[k] is not None and b[k] else "-" for k in KEYS]) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve-bench", required=True,
                   help="comma-separated serve.json files of serve_bench.py")
    p.add_argument("--sglang", default="", help="comma-separated bench_serving JSONL files")
    p.add_argument("--guidellm", default="", help="comma-separated guidellm JSON files")
    p.add_argument("--header", default=None, help="markdown put above the tables")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = [r for f in filter(None, a.serve_bench.split(",")) for r in from_serve_bench(Path(f))]
    for f in filter(None, a.sglang.split(",")):
        rows += from_sglang(Path(f))
    for f in filter(None, a.guidellm.split(",")):
        rows += from_guidellm(Path(f))
    header = Path(a.header).read_text() if a.header else ""
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(markdown(rows, header))
    print(Path(a.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
