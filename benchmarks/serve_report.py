"""The serving benchmark's outputs: serve.md (tables in the anchors' terms), serve.json (every
number, `{"runs": [...]}`: one run per server configuration) and serve.png (output throughput
against TTFT and ITL across concurrency). Functions of the JSON alone, so that `serve_bench.py
--merge` can join runs of several server configurations into one report.
"""
from __future__ import annotations

import json
from pathlib import Path


def _f(v, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def _ms(d: dict, k: str, nd: int = 1) -> str:
    return _f((d or {}).get(k), nd)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(str(c) for c in r) + " |" for r in rows]]


def _state(p: dict) -> str:
    return "zero" if p.get("state_zero") else f"NOT zero: {p.get('state_after')}"


def server_section(run: dict) -> list[str]:
    s = run.get("server", {})
    st = s.get("startup", {})
    lines = [f"Server: `{s.get('command', s.get('url', '?'))}`", ""]
    if s.get("started_by_bench"):
        ph = ", ".join(f"{k} {v:.1f} s" for k, v in (st.get("phases_s") or {}).items())
        lines += [f"- Start-up: ready (spawn to the first /health 200) in {_f(st.get('ready_s'))} "
                  f"s; the engine's own start-up {_f(st.get('engine_s'))} s "
                  f"({ph or 'no phases read'}); graph memory "
                  f"{_f(st.get('graph_memory_mib'), 0)} MiB.",
                  f"- State cache: {st.get('state_cache', '-')}.",
                  f"- Memory after start: {mem_line(s.get('memory_start'))}; at the end: "
                  f"{mem_line(s.get('memory_end'))}.",
                  f"- Stopped with SIGTERM after the run: exit code {s.get('exit_code')} "
                  "(-15: uvicorn drained, then re-raised the signal)."]
    else:
        lines.append("- Already running (`--url`): start-up and process memory not read.")
    if st.get("lines"):
        lines += ["", "Start-up report:", "", "```", *st["lines"], "```"]
    return lines + [""]


def mem_line(m: dict | None) -> str:
    if not m:
        return "not read"
    parts = []
    if "rss_mib" in m:
        parts.append(f"RSS {m['rss_mib'] / 1024:.2f} GiB")
    if "gpu_mib" in m:
        parts.append(f"GPU {m['gpu_mib'] / 1024:.2f} of {m.get('gpu_total_mib', 0) / 1024:.2f} "
                     f"GiB ({m.get('gpu_scope')})")
    return ", ".join(parts) or "not read"


def sweep_section(run: dict) -> list[str]:
    pts = [p for p in run["points"] if p["kind"] == "sweep"]
    if not pts:
        return []
    a = run["args"]
    lines = [f"### Concurrency sweep: input {a['input_len']} / output {a['output_len']} tokens "
             f"(range ratio {a['range_ratio']}), request rate {a['request_rate']}", "",
             "Latencies in ms. Serving overhead = served ITL p50 / the engine's step time at the "
             "same batch (engine_step.py on the same artifacts; goal <= 1.05): the decode-only "
             "step at `concurrency` rows, and the same-mix step, the engine alone at the "
             "point's own step composition (its decode-only steps' mean rows, its mixed steps' "
             "mean rows + prompt tokens, weighted by their step counts; table below).", ""]
    rows = []
    for p in pts:
        m, sv, ov = p["metrics"], p.get("server", {}), p.get("overhead", {})
        rows.append([p["concurrency"], f"{m['completed']}/{m['issued']}", m["failed"], m["hung"],
                     _f(m["duration_s"]), _f(m["request_throughput"], 2), _f(m["input_tok_s"], 0),
                     _f(m["output_tok_s"], 0), _ms(m["ttft_ms"], "p50"), _ms(m["ttft_ms"], "p99"),
                     _ms(m["tpot_ms"], "p50", 2), _ms(m["itl_ms"], "p50", 2),
                     _ms(m["itl_ms"], "p99", 2), _ms(m["e2e_ms"], "p50", 0),
                     _f(ov.get("engine_step_ms"), 2), _f(ov.get("ratio"), 3),
                     _f(ov.get("same_mix_step_ms"), 2), _f(ov.get("same_mix_ratio"), 3),
                     _f(sv.get("forward_ms_per_step"), 2), _f(sv.get("exposed_ms_per_step"), 3),
                     _state(p)])
    lines += table(["concurrency", "done/issued", "failed", "hung", "duration s", "req/s",
                    "input tok/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
                    "ITL p99", "E2E p50", "engine step", "ITL p50 / step", "same-mix step",
                    "ITL p50 / same-mix", "server fwd/step",
                    "exposed/step", "state after"], rows)
    lines += ["", "Means and the rest of the percentiles (mean / p90 / max):", ""]
    def three(d: dict) -> str:
        return f"{_ms(d, 'mean', 2)} / {_ms(d, 'p90', 2)} / {_ms(d, 'max', 1)}"

    rows = [[p["concurrency"]] + [three(p["metrics"][k])
                                  for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
            + [_f(p["metrics"]["concurrency"], 1), p["metrics"]["peak_in_flight"],
               _f(p.get("server", {}).get("decode_tokens_per_step"), 1),
               _f(p.get("server", {}).get("prefill_tokens_per_step"), 1),
               _f(100 * p["metrics"]["client_cpu_share"], 0) + "%"] for p in pts]
    lines += table(["concurrency", "TTFT", "TPOT", "ITL", "E2E", "achieved concurrency",
                    "peak in flight", "decode rows/step", "prompt tokens/step",
                    "client CPU"], rows)
    return lines + [""] + mix_table(pts)


def mix_table(pts: list[dict]) -> list[str]:
    """The steps that decoded, by composition, and the engine alone at each (same-mix)."""
    rows = []
    for p in pts:
        mx, ov = p.get("server", {}).get("mix") or {}, p.get("overhead", {})
        if not mx:
            continue
        rows.append([p["kind"], p["concurrency"], mx["decode_only_steps"],
                     _f(mx["decode_only_rows"], 1), mx["mixed_steps"], _f(mx["mixed_rows"], 1),
                     _f(mx["mixed_prompt_tokens"], 0), _f(ov.get("same_mix_step_ms"), 2),
                     _ms(p["metrics"]["itl_ms"], "p50", 2), _f(ov.get("same_mix_ratio"), 3),
                     _ms(p["metrics"]["itl_ms"], "mean", 2),
                     _f(ov.get("same_mix_mean_ratio"), 3)])
    if not rows:
        return []
    return ["Step composition (the server's counters over the point) and the same-mix engine "
            "step (ms):", ""] + table(
        ["point", "concurrency", "decode-only steps", "rows", "mixed steps", "rows",
         "prompt tokens", "same-mix step", "ITL p50", "p50 / same-mix", "ITL mean",
         "mean / same-mix"], rows) + [""]


def prefill_section(run: dict) -> list[str]:
    pts = [p for p in run["points"] if p["kind"] == "prefill"]
    if not pts:
        return []
    lines = ["### Prefill-heavy", "",
             "Long prompts, a few output tokens. There is no prefix cache: each prompt is "
             "prefilled in chunks of the server's prefill budget, and every chunk after the first "
             "attends over the chunks before it, the cached context of a DeepInfer-style "
             "prefill step. The budget is the server's prefill cap; prompt tokens and forward "
             "time per step are the server's counters over the point, every step counted (the "
             "steps that decode a request's few output tokens too).", ""]
    rows = []
    for p in pts:
        m, sv = p["metrics"], p.get("server", {})
        rows.append([p["input_len"], p["output_len"], p["concurrency"],
                     f"{m['completed']}/{m['issued']}", m["failed"], m["hung"],
                     _f(m["input_tok_s"], 0), _ms(m["ttft_ms"], "p50", 0),
                     _ms(m["ttft_ms"], "p99", 0), p.get("prefill_cap") or "-",
                     _f(sv.get("prefill_tokens_per_step"), 0), sv.get("steps", "-"),
                     _f(sv.get("forward_ms_per_step"), 1), p.get("cached_context", "-"),
                     _state(p)])
    return lines + table(["prompt tokens", "output tokens", "concurrency", "done/issued",
                          "failed", "hung", "input tok/s", "TTFT p50", "TTFT p99",
                          "prefill budget (tokens/step)", "prompt tokens/step (mean of all "
                          "steps)", "steps", "forward ms/step", "cached context per chunk",
                          "state after"], rows) + [""]


def soak_section(run: dict) -> list[str]:
    pts = [p for p in run["points"] if p["kind"] == "soak"]
    if not pts:
        return []
    lines = ["### Soak", ""]
    for p in pts:
        m, mem = p["metrics"], p.get("memory", {})
        lines += [f"{m['issued']} requests issued ({m['not_issued']} not issued when the time "
                  f"cap passed) at concurrency {p['concurrency']}, inputs "
                  f"{p['input_range'][0]}..{p['input_range'][1]} and outputs "
                  f"{p['output_range'][0]}..{p['output_range'][1]} tokens (uniform):", ""]
        lines += table(["completed", "failed", "hung", "lost tokens", "duration s",
                        "output tok/s", "TTFT p99 ms", "ITL p99 ms", "RSS GiB first / last / max",
                        "GPU GiB first / last / max", "allocated GiB first / last / max",
                        "memory flat", "state after"],
                       [[m["completed"], m["failed"], m["hung"], m["lost_tokens"],
                         _f(m["duration_s"]), _f(m["output_tok_s"], 0), _ms(m["ttft_ms"], "p99", 0),
                         _ms(m["itl_ms"], "p99", 1), _mem3(mem.get("rss_mib")),
                         _mem3(mem.get("gpu_mib")), _mem3(mem.get("allocated_mib")),
                         mem.get("flat", "-"), _state(p)]])
        lines += ["", f"Memory flat: from the sample a quarter into the soak (the first under "
                  f"load at the earliest) to the last, growth at most max(2%, 64 MiB) in RSS, "
                  f"GPU memory and the allocator's allocated and reserved bytes; "
                  f"{len(mem.get('samples', []))} samples, one every 5 s.", ""]
    return lines + mix_table(pts)


def _mem3(x: dict | None) -> str:
    if not x:
        return "-"
    return " / ".join(f"{x[k] / 1024:.2f}" for k in ("first", "last", "max"))


def run_section(run: dict, i: int, n: int) -> list[str]:
    title = run.get("label") or f"run {i + 1}"
    lines = [f"## {title}" if n > 1 else "## Run", ""]
    lines += server_section(run)
    w = run.get("warmup")
    if w:
        lines += [f"Warm-up before the first point (not counted): {w['completed']}/{w['issued']} "
                  f"requests completed in {w['duration_s']:.1f} s.", ""]
    lines += sweep_section(run) + prefill_section(run) + soak_section(run)
    if run.get("skipped"):
        lines += ["Not run: " + "; ".join(run["skipped"]) + ".", ""]
    if run.get("problems"):
        lines += ["**Problems:** " + "; ".join(run["problems"]), ""]
    return lines


def markdown(res: dict) -> str:
    runs = res["runs"]
    first = runs[0]
    env = first.get("environment", {})
    model = first.get("model") or "?"
    lines = [f"# Serving benchmark: {model} on {env.get('device', '?')}", "",
             f"{env.get('device')} (driver {env.get('driver', '-')}), torch {env.get('torch')}, "
             f"triton {env.get('triton')}, Python {env.get('python')}; {env.get('date')}; commit "
             f"{env.get('commit', '?')}.", "", "Commands:", ""]
    lines += [f"    {r.get('command')}" for r in runs] + [""]
    lines += ["Load generator: benchmarks/serve_bench.py (streaming /v1/completions with token-id "
              "prompts, `ignore_eos`, `max_tokens` fixed, temperature 0; at most `concurrency` in "
              "flight). Metrics as SGLang's `bench_serving` and `vllm bench serve` define them: "
              "TTFT = first token chunk - send, ITL = gaps between token chunks, TPOT = (E2E - "
              "TTFT) / (output tokens - 1), E2E = last chunk - send; percentiles are numpy's.", ""]
    ok = all(r.get("ok") for r in runs)
    unfinished = [r.get("label") or "the run" for r in runs if "ok" not in r]
    verdict = ("every request completed with all its tokens, none hung, the state back to zero "
               "after every point" if ok else "PROBLEMS (see below)")
    lines += [f"Result: {verdict}.", ""]
    if unfinished:
        lines += [f"Not finished: {', '.join(unfinished)} (its process was stopped before its "
                  "final report; the points it finished are below).", ""]
    for i, r in enumerate(runs):
        lines += run_section(r, i, len(runs))
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> str | None:
    """serve.png; returns why not, where matplotlib is missing or nothing was swept."""
    pts = [(r, p) for r in res["runs"] for p in r["points"] if p["kind"] == "sweep"
           and p["metrics"]["completed"]]
    if not pts:
        return "no sweep point completed"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (the `plot` extra)"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            xs = [p["metrics"]["output_tok_s"] for _, p in pts]
            ys = [p["metrics"][key][q] for _, p in pts]
            ax.plot(xs, ys, style, label=f"{title} {q}")
        if key == "itl_ms":
            eng = [(p["metrics"]["output_tok_s"], p["overhead"]["engine_step_ms"]) for _, p in pts
                   if p.get("overhead", {}).get("engine_step_ms")]
            if eng:
                ax.plot(*zip(*eng), "k:", marker="x", label="engine step alone (same batch)")
        for _, p in pts:
            ax.annotate(f"c={p['concurrency']}", (p["metrics"]["output_tok_s"],
                                                  p["metrics"][key]["p50"] or 0),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("output tokens/s (whole server)")
        ax.set_ylabel(f"{title} ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    r0 = pts[0][0]
    a = r0["args"]
    fig.suptitle(f"{r0.get('model')}: input {a['input_len']} / output {a['output_len']} tokens, "
                 f"concurrency {', '.join(str(p['concurrency']) for _, p in pts)} "
                 f"({r0.get('environment', {}).get('device')}, "
                 f"{r0.get('environment', {}).get('date')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(res: dict, out: Path, with_plot: bool = True) -> Path:
    """serve.json, serve.md and (with_plot) serve.png under `out`; returns the md's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    if with_plot:
        why = plot(res, out / "serve.png")
        if why:
            md += f"\nPlot not written: {why}.\n"
    (out / "serve.md").write_text(md)
    return out / "serve.md"


def merge(paths: list[Path]) -> dict:
    """One report of the runs in several serve.json files, in the order given."""
    runs = []
    for p in paths:
        runs += json.loads(Path(p).read_text())["runs"]
    return {"runs": runs}
