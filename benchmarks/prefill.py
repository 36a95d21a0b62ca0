"""Prefill throughput per GPU with a long cached context (DeepInfer's prefill workload, one GPU).

Workload (the published SGLang vs DeepInfer comparison, on the hardware we have): requests with a
long cached context (--context, 128K) and --new-tokens (4K) new tokens each, B new tokens per GPU
per step (--batches 4K..64K: B / 4K requests a step). The context is not prefilled: every state
pool (rings, compressed KV, index keys, pending compressor rows, Engram history) gets random
contents and each request's seq_cached says it holds --context tokens; validity derives from
seq_cached alone (docs/step-convention.md), so attention, the indexer and the compressor work over
a context of that length. Every timed step processes the same new tokens from the same context.

Rows, measured in one run (each fails soft; nothing starts once --time-budget is spent):
  megagraph   the plan's kernels (the Triton kernels where MEGAGRAPH_UNVALIDATED_KERNELS=1 picked
              them); B up to the plan's graph token limit (8192 on the H200) through a CUDA-graph
              bucket of size B, larger B eagerly, as the plan says;
  capturable  the same step graph with the capturable torch kernels (same graphs / eager split);
  reference   the reference torch kernels, eager: what a plain PyTorch port does;
  compile     the capturable kernels under torch.compile (Inductor) + CUDA graphs, at the B of
              --compile-batches;
  DeepGEMM / FlashMLA: whether they are importable (they are not wired into the plan).
Split: one eager step per B with every node timed (torch.profiler device time per node), grouped
into attention / MoE / mHC / other, applied to the megagraph row's step (harness/optime.py).
MFU: the step's model FLOPs (harness/costs.py, step_costs: GEMMs from the compiled graph's
weights, sparse attention over window + top-k keys, indexer over every visible index key) / time,
against the
profile's dense FP8 peak and against the FP8 GEMM ceiling measured in the same run. 40 layers:
extrapolated from the slice (harness/costs.py layer_mapping), clearly labelled, never measured.

    python benchmarks/prefill.py --time-budget 150       # GPU: benchmarks/results/h200/prefill.*
    python benchmarks/prefill.py --smoke --out /tmp/p                                   # CPU
    python benchmarks/prefill.py --replot benchmarks/results/h200/prefill.json          # md+png
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: F401,E402  first: the time budget counts from its import
from harness import cli, report, sweep  # noqa: E402


def parse(argv):
    p = cli.parser(__doc__, "prefill", context=131072, batches="4096,8192,16384,32768,65536",
                  warmup=1, iters=2,
                  graph_limit_help="B up to this run through CUDA-graph buckets (default: the "
                                   "plan's largest prefill bucket, 8192 on the H200)")
    p.add_argument("--new-tokens", type=int, default=4096, help="new tokens per request")
    return cli.parse_args(p, argv, dict(context=48, new_tokens=16, batches="16,32",
                                       graph_limit=16))


def requests_for(B: int, new: int) -> list[int]:
    """New tokens of each request of a step of B new tokens."""
    r = max(1, B // new)
    return [B // r] * r


def main(argv=None) -> int:
    args = parse(argv)
    return cli.run_benchmark(
        "prefill", args, new_tokens=lambda B: requests_for(B, args.new_tokens),
        graph_limit=lambda plan, dev: max(plan.prefill_buckets, default=0), scale_exp=1.0,
        write=write_outputs)


# ---------------------------------------------------------------------------------------------
# derived numbers, Markdown, plot (functions of the JSON alone, so --replot can redo them)
# ---------------------------------------------------------------------------------------------


def derive(res: dict) -> dict:
    """Per B: every mode's tok/s, TFLOP/s, MFU; the split; the 40-layer extrapolation."""
    _, peak = report.peak_name(res)
    meas = res.get("ceilings", {}).get("fp8_tflops") or 0.0
    out = {}
    for B in res["args"]["batches"]:
        cost = res.get("costs", {}).get(str(B), {})
        d = sweep.derive_split(res, B)
        for mode, r in sweep.mode_rates(res, B).items():
            tf = cost.get("flops", 0.0) / r["ms"] / 1e9
            d[mode] = {**r, "tflops": tf, "mfu_peak": tf / peak if peak else None,
                       "mfu_measured": tf / meas if meas else None}
        if "x40" in d:
            x = d["x40"]
            x["tflops"] = cost.get("flops40", 0.0) / x["ms"] / 1e9 if x["ms"] else 0.0
            x["mfu_peak"] = x["tflops"] / peak if peak else None
        out[B] = d
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    der = derive(res)
    pname, _ = report.peak_name(res)
    workload = report.state_note(res, (
        f"B new tokens per GPU per step in B / {a['new_tokens']} requests, each with "
        f"{a['context']:,} cached tokens and {a['new_tokens']} new ones; B up to "
        f"{res.get('graph_limit')} runs through a CUDA-graph bucket of size B, larger B eagerly "
        "(the plan's graph token limit)."))
    lines = report.header_lines(res, "Prefill throughput", workload)
    lines += ["## Throughput of the layer slice (measured)", "",
              "tok/s = new tokens per second on this GPU. MFU = model FLOPs of the step / time / "
              "peak (the profile's dense peak; and the FP8 GEMM ceiling measured above).", ""]
    hdr = ["B (new tok/step)", "requests", "path", "ms/step", "tok/s/GPU", "TFLOP/s",
           f"MFU vs {pname}", "MFU vs measured FP8", "capturable tok/s", "reference tok/s",
           "torch.compile tok/s", "DeepGEMM", "FlashMLA"]
    rows = []
    for B in a["batches"]:
        mg = next((r for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == B), None)
        st = report.cell_status(mg)
        d = der.get(B, {}).get("megagraph")
        req = (mg or {}).get("requests", len(requests_for(B, a["new_tokens"])))
        base = report.baseline_cells(res, B, lambda r: f"{r['tokens'] / (r['ms'] / 1e3):,.0f}")
        if st is not None or d is None:
            rows.append([B, req, (mg or {}).get("path", "-"), st or "-", "-", "-", "-", "-", *base])
            continue
        rows.append([B, req, mg["path"], f"{mg['ms']:.2f}", f"{d['tok_s']:,.0f}",
                     f"{d['tflops']:.1f}", report.pct(d["mfu_peak"]),
                     report.pct(d["mfu_measured"]), *base])
    lines += report.md_table(hdr, rows) + [""]
    if res.get("mapping"):
        lines += report.x40_intro(res, "MFU: the 40-layer FLOPs")
        xr = []
        for B in a["batches"]:
            x = der.get(B, {}).get("x40")
            xr.append([B, f"{x['ms']:.1f}", f"{x['tok_s']:,.0f}", f"{x['tflops']:.1f}",
                       report.pct(x["mfu_peak"]), f"B={der[B]['split']['from']}"] if x else
                      [B, "-", "-", "-", "-", "no split or no time"])
        lines += report.md_table(["B", "ms/step (40 layers)", "tok/s/GPU", "TFLOP/s",
                                  f"MFU vs {pname}", "split from"], xr) + [""]
    lines += report.split_sections(res, der, a["batches"])
    lines += ["## Notes", "",
              "- Graph path: a bucket b holds a step of up to b tokens in up to b requests "
              "(requests padded to b rows on a scratch slot), so a captured prefill step of B "
              "tokens also runs its LM head over B request rows (logits of each request's last "
              "token).",
              "- FLOPs: GEMMs from the compiled graph's weight shapes (routed experts x top-k, "
              "shared expert, gate, projections, compressor, indexer, mHC, Engram), sparse "
              "attention 2 x H x D per key for QK and PV over min(window, p+1) + min(top-k, "
              "(p+1)/ratio) keys, indexer Hi x Di per visible index key (p+1)/ratio of every index "
              "layer (the indexer scores every visible key, reindex layers too)."]
    lines += report.common_notes(res)
    return "\n".join(lines) + "\n"


def plot(plt, res: dict, path: Path) -> None:
    report.two_panels(plt, res, path, derive(res), y=lambda r: r["tokens"] / (r["ms"] / 1e3),
                  x40="tok_s", xlabel="B: new tokens per GPU per step",
                  ylabel="tokens / s / GPU", title="prefill")


write_outputs = functools.partial(report.write_outputs, name="prefill", markdown=markdown,
                                  plot=plot)


if __name__ == "__main__":
    sys.exit(main())
