"""Decode step time per GPU at 8..256 requests with a long cached context, against the roofline.

Workload (the published SGLang vs DeepInfer decode comparison, on the hardware we have): B
requests per GPU (--batches 8..256), each decoding one token after --context cached tokens. The
context is not prefilled: every state pool gets random contents and each request's seq_cached says
it holds --context tokens (validity derives from seq_cached alone, docs/step-convention.md). Every
timed step decodes from the same context.

Rows, measured in one run (each fails soft; nothing starts once --time-budget is spent):
  megagraph   the plan's kernels (the Triton kernels where MEGAGRAPH_UNVALIDATED_KERNELS=1 picked
              them), one CUDA graph per batch size (bucket B);
  capturable  the same step graph with the capturable torch kernels, CUDA graphs;
  reference   the reference torch kernels, eager: what a plain PyTorch port does;
  compile     the capturable kernels under torch.compile (Inductor) + CUDA graphs, at the B of
              --compile-batches;
  DeepGEMM / FlashMLA: whether they are importable (they are not wired into the plan).
Roofline: the bytes a step must read at least (harness/costs.py, step_costs: every weight once,
routed experts only as far as B requests at top-6 of 384 touch them, window rings, the selected
compressed rows and every visible index key per request, the LM head) over the copy bandwidth
measured in the same run (or its FLOPs over the measured FP8 ceiling, whichever is longer).
Achieved bandwidth = those bytes / step time. Split and 40-layer extrapolation as in prefill.py.

    python benchmarks/decode.py --time-budget 150         # GPU: benchmarks/results/h200/decode.*
    python benchmarks/decode.py --smoke --out /tmp/d                                    # CPU
    python benchmarks/decode.py --replot benchmarks/results/h200/decode.json            # md+png
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: F401,E402  first: the time budget counts from its import
from harness import cli, report, sweep  # noqa: E402


def parse(argv):
    p = cli.parser(__doc__, "decode", context=32768, batches="8,16,32,64,128,256", warmup=2,
                  iters=5, graph_limit_help="B up to this run through CUDA graphs (default: the "
                                            "plan's largest decode bucket; every B on the CPU, "
                                            "padded, uncaptured)")
    return cli.parse_args(p, argv, dict(context=40, batches="2,4"))


def main(argv=None) -> int:
    args = parse(argv)
    return cli.run_benchmark(
        "decode", args, new_tokens=lambda B: [1] * B, scale_exp=0.5, write=write_outputs,
        graph_limit=lambda plan, dev: (max(plan.decode_buckets, default=0) if dev.type == "cuda"
                                       else max(args.batches)))


# ---------------------------------------------------------------------------------------------
# derived numbers, Markdown, plot (functions of the JSON alone, so --replot can redo them)
# ---------------------------------------------------------------------------------------------


def bandwidth(res: dict) -> tuple[float, str]:
    """(bytes/s, what) the roofline reads at: the measured copy bandwidth, else the profile's."""
    c = res.get("ceilings", {})
    if c.get("copy_tbps"):
        return c["copy_tbps"] * 1e12, f"copy {c['copy_tbps']} TB/s measured"
    hbm = res.get("hw", {}).get("hbm_tbps") or 0.0
    return hbm * 1e12, f"profile {hbm} TB/s"


def roofline_ms(res: dict, flops: float, nbytes: float) -> float:
    """max(bytes at the bandwidth, FLOPs at the measured FP8 ceiling or the profile's peak)."""
    bw = bandwidth(res)[0]
    flop_s = (res.get("ceilings", {}).get("fp8_tflops") or report.peak_name(res)[1]) * 1e12
    return 1e3 * max(nbytes / bw if bw else 0.0, flops / flop_s if flop_s else 0.0)


def derive(res: dict) -> dict:
    """Per B: every mode's tok/s and achieved GB/s; the roofline; the split; 40 layers."""
    bw = bandwidth(res)[0]
    out = {}
    for B in res["args"]["batches"]:
        cost = res.get("costs", {}).get(str(B), {})
        roof = roofline_ms(res, cost.get("flops", 0.0), cost.get("bytes", 0.0))
        d = {**sweep.derive_split(res, B), "roofline_ms": roof}
        for mode, r in sweep.mode_rates(res, B).items():
            gbs = cost.get("bytes", 0.0) / (r["ms"] / 1e3) / 1e9
            d[mode] = {**r, "gbps": gbs, "bw_frac": gbs * 1e9 / bw if bw else None,
                       "roof_frac": roof / r["ms"]}
        if "x40" in d:
            x = d["x40"]
            x["roofline_ms"] = roofline_ms(res, cost.get("flops40", 0.0), cost.get("bytes40", 0.0))
            x["roof_frac"] = x["roofline_ms"] / x["ms"] if x["ms"] else None
        out[B] = d
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    der = derive(res)
    bw_what = bandwidth(res)[1]
    workload = report.state_note(res, (
        f"B requests per GPU, each decoding one token after {a['context']:,} cached tokens; B up "
        f"to {res.get('graph_limit')} runs through one CUDA graph per B."))
    lines = report.header_lines(res, "Decode step time", workload)
    lines += ["## Step time of the layer slice (measured) and the roofline", "",
              "GB/step = the bytes a step must read at least (see Notes); achieved GB/s = GB/step "
              f"/ step time, % of the bandwidth it is compared with ({bw_what}); roofline = "
              "GB/step at that bandwidth (or FLOPs at the measured FP8 ceiling, if longer); % of "
              "roofline = roofline / step time.", ""]
    hdr = ["B (requests)", "path", "ms/step", "tok/s/GPU", "GB/step", "achieved GB/s (% of BW)",
           "roofline ms", "% of roofline", "capturable ms", "reference ms", "torch.compile ms",
           "DeepGEMM", "FlashMLA"]
    rows = []
    for B in a["batches"]:
        mg = next((r for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == B), None)
        st = report.cell_status(mg)
        d = der.get(B, {})
        gb = res.get("costs", {}).get(str(B), {}).get("bytes", 0.0) / 1e9
        base = report.baseline_cells(res, B, lambda r: f"{r['ms']:.2f}")
        m = d.get("megagraph")
        if st is not None or m is None:
            rows.append([B, (mg or {}).get("path", "-"), st or "-", "-", f"{gb:.2f}", "-",
                         f"{d['roofline_ms']:.3f}", "-", *base])
            continue
        gbps = f"{m['gbps']:,.{0 if m['gbps'] >= 10 else 3}f}"
        rows.append([B, mg["path"], f"{mg['ms']:.3f}", f"{m['tok_s']:,.0f}", f"{gb:.2f}",
                     f"{gbps} ({report.pct(m['bw_frac'])})", f"{d['roofline_ms']:.3f}",
                     report.pct(m["roof_frac"]), *base])
    lines += report.md_table(hdr, rows) + [""]
    if res.get("mapping"):
        lines += report.x40_intro(res, "GB/step and the roofline: the 40-layer bytes and FLOPs")
        xr = []
        for B in a["batches"]:
            x = der.get(B, {}).get("x40")
            gb40 = res.get("costs", {}).get(str(B), {}).get("bytes40", 0.0) / 1e9
            xr.append([B, f"{x['ms']:.2f}", f"{x['tok_s']:,.0f}", f"{gb40:.1f}",
                       f"{x['roofline_ms']:.2f}", report.pct(x["roof_frac"]),
                       f"B={der[B]['split']['from']}"] if x else
                      [B, "-", "-", f"{gb40:.1f}", "-", "-", "no split or no time"])
        lines += report.md_table(["B", "ms/step (40 layers)", "tok/s/GPU", "GB/step", "roofline ms",
                              "% of roofline", "split from"], xr) + [""]
    lines += report.split_sections(res, der, a["batches"])
    lines += ["## Notes", "",
              "- GB/step (the roofline's bytes): every device-resident weight once, routed experts "
              "only as far as the routing touches them (model routing: E (1 - (1 - k/E)^B) "
              "distinct experts expected, balanced: min(E, B k)), per request the window ring of "
              "every attention layer, its top-k compressed rows and every visible index key of "
              "every indexer, in the engine's storage dtypes (index keys are bf16 rows of "
              "fake-quantized MXFP4 values, exact in bf16), and the LM head; Engram tables are "
              "host-resident (not counted); activations are not counted.",
              "- Roofline FLOPs: as in prefill.py (GEMMs from the weight shapes, sparse attention "
              "over window + top-k keys, indexer over every visible index key)."]
    lines += report.common_notes(res)
    return "\n".join(lines) + "\n"


def plot(plt, res: dict, path: Path) -> None:
    der = derive(res)
    batches = res["args"]["batches"]
    x40 = [B for B in batches if der[B].get("x40")]
    roofs = [(f"roofline ({bandwidth(res)[1]})", [(B, der[B]["roofline_ms"]) for B in batches],
              {"color": "k", "linestyle": ":"}),
             ("roofline, 40 layers", [(B, der[B]["x40"]["roofline_ms"]) for B in x40],
              {"color": "grey", "linestyle": ":"})]
    report.two_panels(plt, res, path, der, y=lambda r: r["ms"], x40="ms", extra=roofs,
                  xlabel="B: requests per GPU", ylabel="ms per decode step", title="decode")


write_outputs = functools.partial(report.write_outputs, name="decode", markdown=markdown, plot=plot)


if __name__ == "__main__":
    sys.exit(main())
