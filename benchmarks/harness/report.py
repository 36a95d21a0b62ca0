"""Markdown tables, plots and the result files of the benchmarks.

Results go to benchmarks/results/<hw>/<benchmark>.{md,json,png} (`results_dir`), each file
written to a temporary name in the same folder and renamed over the old one, so that a run cut
short (a device lease ending, the time budget) never leaves a half-written result behind.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .engines import is_oom
from .env import env_lines
from .optime import CLASS_TITLES, CLASSES, node_layer

RESULTS = Path(__file__).resolve().parents[1] / "results"


def results_dir(hw: str) -> Path:
    """benchmarks/results/<hw>/: where the product benchmarks keep their latest result."""
    return RESULTS / hw


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return out


def cell_status(row: dict | None) -> str | None:
    """'failed: ...' / 'skipped: ...' for a row that has no time, else None."""
    if row is None:
        return "-"
    if row.get("error"):
        msg = row["error"].splitlines()[0]
        if is_oom(msg):
            return "failed: out of memory"
        return "failed: " + msg[:90].replace("|", "/")
    if row.get("skipped"):
        return "skipped: " + row["skipped"][:90]
    return None if row.get("ms") else "-"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_outputs(res: dict, out: Path, png: bool = True, *, name: str, markdown, plot) -> str:
    """NAME.json, NAME.md and (png) NAME.png in `out` from `res` alone, each written atomically;
    returns the Markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{name}.json", json.dumps(res, indent=1, default=str) + "\n")
    md = markdown(res)
    if png:
        plt = pyplot()
        err = "matplotlib is not installed (pip install 'megagraph[plot]', then --replot)"
        if plt is not None:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".png", dir=out)
            os.close(fd)
            try:
                err = plot(plt, res, Path(tmp))  # None when written
                if not err:
                    os.replace(tmp, out / f"{name}.png")
            except Exception as e:  # noqa: BLE001  (the tables matter more than the picture)
                err = f"{type(e).__name__}: {e}"
            finally:
                Path(tmp).unlink(missing_ok=True)
        md += f"\nPlot not written: {err}\n" if err else f"\n![{name}]({name}.png)\n"
    write_atomic(out / f"{name}.md", md)
    return md


def peak_name(res: dict) -> tuple[str, float]:
    """(label, TFLOP/s) of the profile's dense FP8 peak (bf16 where it has no FP8)."""
    hw = res.get("hw", {})
    if hw.get("fp8_tflops"):
        return f"FP8 peak {hw['fp8_tflops']:.0f}", hw["fp8_tflops"]
    return f"bf16 peak {hw.get('bf16_tflops', 0):.0f}", hw.get("bf16_tflops") or 0.0


def state_note(res: dict, work: str) -> str:
    """The workload paragraph: `work`, how the context is set, routing, how a row is timed."""
    a = res["args"]
    return (f"**Workload.** {work} The cached context is **set as state, not prefilled**: every "
            "state pool holds random contents and seq_cached says each request holds the context "
            "(validity derives from seq_cached alone, docs/step-convention.md), so attention, "
            "indexer and compressor work over that context; every timed step starts from the same "
            f"context. Routing: {a['routing']}. {a['warmup']} warm-up + up to {a['iters']} timed "
            "steps per row (median; slow rows stop after 3 s); a step = host metadata + copies + "
            "graph replay (or eager kernels) + logits, with a device synchronize around it.")


def header_lines(res: dict, title: str, workload: str) -> list[str]:
    """Title, environment, workload, model, kernels and ceilings paragraphs of a report."""
    m, env = res.get("model", {}), res["environment"]
    ceil, hw = res.get("ceilings", {}), res.get("hw", {})
    lines = [f"# {title}: {env.get('device')}, {m.get('model', res['args'].get('model'))}", ""]
    lines += env_lines(env) + ["", workload, ""]
    if m:
        roles = ", ".join(f"L{i} {k}" for i, k in enumerate(m["roles"]))
        lines += [f"**Model.** {m['model']}: {m['layers']} layers ({roles}), hidden {m['hidden']}, "
                  f"{m['experts']} experts, weights {m['weight_bytes'] / 2**30:.2f} GiB (release "
                  f"formats, random, made on the device), profile {m['hw_profile']}.", ""]
    if res.get("kernels"):
        lines += ["**Kernels of the megagraph row** (graph nodes per implementation): " +
                  ", ".join(f"{k} x {v}" for k, v in res["kernels"].items()) + ".", ""]
    for mode, info in res.get("engines", {}).items():
        if info.get("fallbacks"):
            lines.append(f"- {mode}: kernel fallbacks {info['fallbacks']}")
    lines += [f"**Ceilings** measured in this run: bf16 GEMM {ceil.get('bf16_tflops', '-')} "
              f"TFLOP/s, FP8 `_scaled_mm` {ceil.get('fp8_tflops', '-')} TFLOP/s, copy "
              f"{ceil.get('copy_tbps', '-')} TB/s (read + write); profile "
              f"{hw.get('profile', '-')}: FP8 {hw.get('fp8_tflops', '-')} / bf16 "
              f"{hw.get('bf16_tflops', '-')} TFLOP/s dense, {hw.get('hbm_tbps', '-')} TB/s.", ""]
    return lines


def x40_intro(res: dict, what: str) -> list[str]:
    mp = res["mapping"]
    return [f"## Extrapolated to {mp['layers'][0]} layers (not measured)", "",
            f"Each of the {mp['layers'][0]} layers of V4.1-Flash takes the time of the slice layer "
            "with its role (" + ", ".join(f"{k}: {v}" for k, v in mp["how"].items()) +
            f"); Engram ({mp['engram'][0]} layers) the slice's Engram time per layer; the batched "
            "ring copies scale with the layer count; embedding, LM head, host work and launch gaps "
            "stay. Layer times come from the split below (the nearest B that has one). "
            f"{what} counted the same way.", ""]


def split_sections(res: dict, der: dict, batches: list[int]) -> list[str]:
    """Per-B class split, the per-layer split and the top ops at the largest B with a split of
    its own (`der[B]["split"]` = applied_split)."""
    have = [s for s in res.get("split", {}).values() if s.get("ops")]
    methods = sorted({s.get("method", "?") for s in have})
    cov = [s["coverage"] for s in have if s.get("coverage") is not None]
    if cov:
        methods.append(f"{100 * min(cov):.0f}-{100 * max(cov):.0f}% of the profiled kernel time "
                       "attributed to nodes")
    for s in have:
        if s.get("why_not_profiler"):
            methods.append(f"profiler not used: {s['why_not_profiler']}")
            break
    lines = ["## Where the time goes (megagraph row)", "",
             f"Node times of one eager step with every node timed ({', '.join(methods) or '-'}), "
             "applied to the timed step: kept where they sum to less (the rest is host work and "
             "launch gaps: metadata, copies, host-side Engram gathers, idle GPU), scaled down "
             "where they sum to more. Classes: attention = the whole attention sub-layer "
             "(projections, compressor, indexer, top-k, sparse attention, ring copies); MoE = "
             "router, routed + shared experts, combine; mHC = hyper-connection mixers, "
             "collapse, expand; other = embedding, Engram, LM head.", ""]
    hdr = ["B", "step ms"] + [CLASS_TITLES[c] + " ms (%)" for c in CLASSES] + \
        ["host + gaps ms (%)", "split from"]
    rows = []
    for B in batches:
        ap = der.get(B, {}).get("split")
        if not ap:
            err = res.get("split", {}).get(str(B), {}).get("error")
            rows.append([B, "-"] + ["-"] * len(CLASSES) + ["-", f"none ({err})" if err else "none"])
            continue
        sp = ap["split"]
        t = sp["step_ms"] or 1.0
        cells = [(sp["classes_ms"][c]) for c in CLASSES] + [sp["host_gap_ms"]]
        rows.append([B, f"{sp['step_ms']:.2f}"] + [f"{v:.2f} ({100 * v / t:.0f}%)" for v in cells]
                    + [f"B={ap['from']}"])
    lines += md_table(hdr, rows) + [""]
    own = [B for B in batches if der.get(B, {}).get("split") and der[B]["split"]["from"] == B]
    if not own:
        return lines
    B = max(own)
    sp = der[B]["split"]["split"]
    roles = res.get("model", {}).get("roles", [])
    lines += [f"### Per layer, B = {B} (ms)", ""]
    lr = []
    for scope, cls in sp["scopes_ms"].items():
        layer = node_layer(scope + ".")
        role = roles[layer] if layer is not None and layer < len(roles) else \
            ("ring copies of every layer" if scope == "all layers" else "embedding, LM head, ...")
        lr.append([scope, role] + [f"{cls[c]:.3f}" for c in CLASSES] + [f"{sum(cls.values()):.3f}"])
    lines += md_table(["layer", "role"] + [CLASS_TITLES[c] for c in CLASSES] + ["total"], lr)
    lines += ["", f"### Top ops, B = {B}", ""]
    tot = sp["step_ms"] or 1.0
    lines += md_table(["op", "ms", "% of step"], [[o, f"{v:.3f}", f"{100 * v / tot:.1f}%"]
                                                   for o, v in list(sp["by_op_ms"].items())[:10]])
    return lines + [""]


def stack_split(ax, der: dict, batches: list[int]) -> None:
    """Stacked bars: attention / MoE / mHC / other / host + gaps, ms per step, per B."""
    xs = [B for B in batches if der.get(B, {}).get("split")]
    bottom = [0.0] * len(xs)
    for c in list(CLASSES) + ["host"]:
        vals = [(der[B]["split"]["split"]["host_gap_ms"] if c == "host"
                 else der[B]["split"]["split"]["classes_ms"][c]) for B in xs]
        ax.bar([str(B) for B in xs], vals, bottom=bottom, label=CLASS_TITLES.get(c, "host + gaps"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("B")
    ax.set_ylabel("ms per step (layer slice)")
    ax.set_title("time split (megagraph row)")
    ax.legend(fontsize=8)


def common_notes(res: dict) -> list[str]:
    a = res["args"]
    out = [f"- Rows that did not run say why; `--time-budget {a['time_budget']:.0f}` s for the "
           f"whole run ({res.get('elapsed_s', '?')} s used)."]
    out += [f"- {r['mode']} B={r['B']}: {r['note']}." for r in res["rows"] if r.get("note")]
    for k, v in res.get("libraries", {}).items():
        out.append(f"- {k}: {v} (a kernel column only where importable; not wired into the plan).")
    return out + [""]


def two_panels(plt, res: dict, path: Path, der: dict, *, y, x40: str, extra: tuple = (),
               xlabel: str, ylabel: str, title: str) -> None:
    """Left, on log axes over the batch sizes: every mode's y(row), the megagraph row's 40-layer
    extrapolation der[B]["x40"][x40], and `extra` lines [(label, [(x, y)], style)]; right: the
    time split per B. Saved to `path`."""
    batches = res["args"]["batches"]
    lines = [(m, [(B, y(r)) for B, r in pts], {"marker": "o"}) for m, pts in mode_lines(res)]
    lines.append(("megagraph, 40 layers (extrapolated)",
                  [(B, d["x40"][x40]) for B, d in der.items() if d.get("x40")],
                  {"marker": "x", "linestyle": "--"}))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, pts, style in [*lines, *extra]:
        if pts:
            ax.plot(*zip(*pts), label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}, {res.get('model', {}).get('model', '')}, "
                 f"{res['args']['context']:,}-token context", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    stack_split(bx, der, batches)
    env = res["environment"]
    fig.suptitle(f"{env.get('device')} ({env.get('date')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mode_lines(res: dict) -> list:
    """Plot lines of every mode's rows: (mode, [(B, row)])."""
    return [(m, [(r["B"], r) for r in res["rows"] if r["mode"] == m and r.get("ms")])
            for m in res["args"]["modes"]]


def mode_table_cell(res: dict, mode: str, B: int, value) -> str:
    """A mode's cell at B: value(row) where it ran, else why not."""
    row = next((r for r in res["rows"] if r["mode"] == mode and r["B"] == B), None)
    st = cell_status(row)
    return st if st is not None else value(row)


def baseline_cells(res: dict, B: int, value) -> list[str]:
    """The capturable / reference / torch.compile / DeepGEMM / FlashMLA cells of a table row."""
    libs = res.get("libraries", {})
    return [mode_table_cell(res, x, B, value) if x in res["args"]["modes"] else "not run"
            for x in ("capturable", "reference", "compile")] + \
        [libs.get("DeepGEMM", "-"), libs.get("FlashMLA", "-")]
