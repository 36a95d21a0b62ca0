"""Compile time of the full-size models for every hardware profile (CPU only, no weights).

Baseline: the ARCHITECTURE.md promise, "compiling the full-size model for any hardware profile
runs on a laptop CPU in seconds". Measured per model x profile: building the step graph, running
the pipeline (with --bounded-replay, the most work), and rendering + writing the artifacts
(dumps after every pass, plan, manifest), as `megagraph compile` does. Median of `--repeat` runs
in one process (warm imports); the cold first run is reported separately.

    python benchmarks/compile_time.py [--repeat 3] [--out DIR]

Writes DIR/compile-time.md and DIR/compile-time.json (the rows), each atomically; DIR defaults to
benchmarks/results/cpu/ (the benchmark runs on the CPU whichever profile it compiles for).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
MODELS = ("v4.1-flash", "v4-flash")
HW = ("gb300", "b300", "b200", "h200", "cpu")


def one(model: str, hw: str, out: Path) -> dict:
    from megagraph.models.config import load_model_config
    from megagraph.passes import CompileOptions, compile_model, load_hw_profile
    from megagraph.passes.artifacts import write_artifacts

    t0 = time.perf_counter()
    cfg, prof = load_model_config(model), load_hw_profile(hw)
    c = compile_model(cfg, prof, CompileOptions(bounded_replay=True))
    t1 = time.perf_counter()
    write_artifacts(c, out, force=True, model_arg=model)
    t2 = time.perf_counter()
    return {"build": c.build_seconds, "passes": t1 - t0 - c.build_seconds, "write": t2 - t1,
            "total": t2 - t0, "nodes": (len(c.built.nodes), len(c.graph.nodes))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for compile-time.md / .json (default: benchmarks/results/cpu/)")
    args = ap.parse_args(argv)
    from harness.report import results_dir, write_atomic

    t_import = time.perf_counter()
    import megagraph.passes  # noqa: F401
    import megagraph.models.build  # noqa: F401
    import torch  # noqa: F401  (the Engram constants need it; counted once, as imports)

    t_import = time.perf_counter() - t_import
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cold = one(MODELS[0], HW[0], Path(tmp) / "cold")
        for model in MODELS:
            for hw in HW:
                runs = [one(model, hw, Path(tmp) / f"{model}-{hw}") for _ in range(args.repeat)]
                med = {k: statistics.median(r[k] for r in runs)
                       for k in ("build", "passes", "write", "total")}
                rows.append((model, hw, runs[0]["nodes"], med))
                print(f"{model:<11} {hw:<6} {med['total']:.2f}s", flush=True)
    lines = ["# Compile time, full-size models (CPU, no weights)", "",
             f"Produced by `benchmarks/compile_time.py --repeat {args.repeat}` on "
             f"{time.strftime('%Y-%m-%d')}: {platform.processor() or platform.machine()}, "
             f"Python {platform.python_version()}, CPU only. Median of {args.repeat} warm runs per "
             "row; each run builds the step graph, runs the whole pipeline with --bounded-replay, "
             "and writes every artifact (a dump after every pass, side graphs, plan, manifest).",
             "",
             f"Imports (torch, megagraph): {t_import:.2f} s, once per process. Cold first compile "
             f"({MODELS[0]} for {HW[0]}, after imports): {cold['total']:.2f} s.", "",
             "| model | hw | nodes built -> final | build (s) | passes (s) | write (s) | "
             "total (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model, hw, nodes, m in rows:
        lines.append(f"| {model} | {hw} | {nodes[0]} -> {nodes[1]} | {m['build']:.2f} | "
                     f"{m['passes']:.2f} | {m['write']:.2f} | {m['total']:.2f} |")
    lines += ["", "Target: a few seconds per model x profile on a laptop CPU (ARCHITECTURE.md). "
              "`megagraph compile` end to end adds the imports above."]
    out = args.out or results_dir("cpu")
    write_atomic(out / "compile-time.json", json.dumps(
        {"repeat": args.repeat, "import_s": t_import, "cold_s": cold["total"],
         "rows": [{"model": m, "hw": h, "nodes": list(n), **med} for m, h, n, med in rows]},
        indent=1) + "\n")
    write_atomic(out / "compile-time.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
