"""Kernel table: every row provider in benchmarks/kernel_rows/ (a module with
`rows(device, smoke) -> list[dict]`; the row format is in kernel_rows/__init__.py), next to the
ceilings measured in the same run: bf16 matmul TFLOP/s, FP8 `torch._scaled_mm` TFLOP/s and
device-to-device copy bandwidth (bytes read + written).

    python benchmarks/kernels.py                    # GPU, every provider: results/h200/kernels.*
    python benchmarks/kernels.py --only moe --out /tmp/k                        # one provider
    python benchmarks/kernels.py --device cpu --smoke --out /tmp/k              # CPU, seconds

Writes OUT/kernels.md (the Markdown table, also printed) and OUT/kernels.json (ceilings,
environment, every row with all its fields), each atomically; OUT defaults to
benchmarks/results/<hw>/ (hw: this device's profile, e.g. h200, or cpu). Percentages: a row's
TFLOP/s against the ceiling its `peak` names (fp8 or bf16), its GB/s against the copy bandwidth.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness.env import ceilings  # noqa: E402 (after the sys.path entry)
from harness.models import hw_for  # noqa: E402
from harness.report import results_dir, write_atomic  # noqa: E402


def providers() -> list[str]:
    """Names of the modules in benchmarks/kernel_rows/ (each imported on its own)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE / "kernel_rows")])
                  if not m.name.startswith("_"))


def collect(device: torch.device, smoke: bool, only: list[str] | None) -> list[dict]:
    rows: list[dict] = []
    for name in providers():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"kernel_rows.{name}")
            got = mod.rows(device, smoke)
            for r in got:
                r.setdefault("group", name)
            rows += got
        except Exception as e:  # noqa: BLE001
            rows.append({"group": name, "kernel": name, "case": "FAILED",
                         "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc(limit=6)})
        print(f"[kernels] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _us(ms) -> str:
    return "-" if ms is None else (f"{1e3 * ms:.1f}" if ms < 10 else f"{ms:.2f} ms")


def markdown(rows: list[dict], ceil: dict, env: dict) -> str:
    bf, f8, bw = ceil.get("bf16_tflops"), ceil.get("fp8_tflops"), ceil.get("copy_tbps")
    lines = [f"Kernels on {env.get('device', '?')} ({env.get('date', '')}; torch "
             f"{env.get('torch')}, triton {env.get('triton', '-')}).", "",
             f"Ceilings measured in this run: bf16 matmul {bf} TFLOP/s, FP8 `_scaled_mm` {f8} "
             f"TFLOP/s, copy {bw} TB/s (read + write).", "",
             "Times in us unless marked ms. % = of the ceiling named in the column (TFLOP/s: the "
             "row's FP8 or bf16 peak; GB/s: copy bandwidth). baseline = the torch path of the same "
             "op (capturable unless noted), compile = torch.compile of it, rel. err = vs the "
             "reference op on the row's inputs.", "",
             "| group | kernel | case | time | TFLOP/s (%) | GB/s (%) | baseline | compile | "
             "speed-up | rel. err | notes |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g = r.get("group", "")
        if "error" in r:
            lines.append(f"| {g} | {r.get('kernel')} | {r.get('case', 'FAILED')} | | | | | | | | "
                         f"FAILED: {str(r['error'])[:160]} |")
            continue
        ms = r.get("ms")
        tf = r.get("tflops")
        peak = {"fp8": f8, "bf16": bf}.get(r.get("peak", ""), None)
        ptf = "-" if not r.get("flops") else (
            f"{tf:.1f} ({100 * tf / peak:.0f}% {r['peak']})" if peak else f"{tf:.1f}")
        gb = r.get("gbps")
        pgb = "-" if not r.get("bytes") else (
            f"{gb:.0f} ({100 * gb / 1e3 / bw:.0f}%)" if bw else f"{gb:.0f}")
        base = r.get("baseline_ms")
        bname = r.get("baseline", "")
        btxt = "-" if base is None else (_us(base) + ("" if bname in ("", "capturable")
                                                      else f" ({bname})"))
        sp = f"{base / ms:.1f}x" if (base and ms) else "-"
        err = r.get("rel_err", r.get("rel_err_vs_baseline"))
        etxt = "-" if err is None else f"{err:.1e}"
        notes = [str(r["notes"])] if r.get("notes") else []
        if r.get("ref_ms") is not None:
            notes.append(f"reference {_us(r['ref_ms'])}")
        cells = [g, r.get("kernel"), r.get("case"), _us(ms), ptf, pgb, btxt,
                 _us(r.get("compile_ms")), sp, etxt, "; ".join(notes)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: seconds)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for kernels.md / kernels.json (default: benchmarks/results/<hw>/)")
    ap.add_argument("--only", default="", help="comma-separated provider names (default: all)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)
    dev = torch.device(args.device)
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "python": platform.python_version(), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "smoke": args.smoke}
    if dev.type == "cuda":
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    ceil = ceilings(dev, args.smoke)
    only = [s for s in args.only.split(",") if s] or None
    rows = collect(dev, args.smoke, only)
    md = markdown(rows, ceil, env)
    print(md)
    out = args.out or results_dir(hw_for(dev))
    write_atomic(out / "kernels.json", json.dumps({"env": env, "ceilings": ceil, "rows": rows},
                                                  indent=1, default=str) + "\n")
    write_atomic(out / "kernels.md", md)
    return 1 if any("error" in r for r in rows) and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
