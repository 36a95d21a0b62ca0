"""Times the experimental Gluon L1 (kernels/moe/gluon_l1.py: hand-pipelined async wgmma, the
MXFP4 upcast of chunk i + 1 under the MMA of chunk i) against the Triton L1 launch that
routed_experts makes (moe.gemm role "l1"), at V4.1-Flash dims: hidden d = 5120, 384 experts
x F = 2304 (MXFP4, E8M0 per 32), top-6, balanced routing (token t -> experts 6t .. 6t + 5 mod
384: every expert gets 8192 * 6 / 384 = 128 rows at 8192 tokens). Random weights made on the
device. Each launch is timed as CUDA-graph replays (events, median of batches); the outputs of
the two are compared (relative Frobenius error, and both against the fp32 math of the same
quantized operands on the first experts' rows).

    python benchmarks/moe_gluon_probe.py --out /tmp/gl               # H200, 8192 tokens
    python benchmarks/moe_gluon_probe.py --tokens 4096 --out /tmp/gl
    python benchmarks/moe_gluon_probe.py --smoke                     # small dims, seconds
    python benchmarks/moe_gluon_probe.py --routing poisson --out /tmp/gl   # realistic routing

--routing poisson: top-6 of random router logits over the 384 experts (rows per expert
~Binomial(T * 6, 1 / 64): 89 .. 183 at 8192 tokens, as benchmarks/kernel_rows/moe.py's real
routing), where 128-row tiles pad (an expert with 129 rows takes 2 tiles). (The bm = 64 and
"pack" variants this probe also timed in the seventh and eighth sessions (--variants) were
removed: moe_gluon.py; the probe with them is in commit f12126b.)

Order: the Triton L1 is timed first and the JSON written after every row; then the Gluon L1 is
checked in child processes (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims), so an illegal
memory access cannot lose the Triton row; the Gluon L1 is timed only if both checks pass
(else its row records the check results).

L1 FLOPs = 2 * rows * 2F * d (rows = tokens * top-k); % of peak against 1430 TFLOP/s (H200
dense FP8). Needs CUDA sm_90 and Triton 3.6 (moe_gluon.available()); elsewhere it says so and
exits 0 (with --out, a JSON that records the skip). About 60 s on the H200.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# the shared inputs, timing, child checks and report (after the sys.path entry: E402)
from gluon_probe_common import build, check_cases_in_child, check_lines, finish  # noqa: E402
from gluon_probe_common import flop_rates, not_checked, reference_rows, rel  # noqa: E402
from gluon_probe_common import run_checks, table, time_triton_l1, timed_row  # noqa: E402
from gluon_probe_common import V41_FLASH as REAL  # noqa: E402
from gluon_probe_common import probe_parser, skipped  # noqa: E402
from gluon_probe_common import write_report  # noqa: E402

PEAK_TFLOPS = 1430.0
SMOKE = dict(d=1024, F=256, E=16, k=6)


def check(T: int, dims: dict, limit: float, routing: str = "balanced") -> dict:
    """One Gluon L1 call (into a NaN-poisoned output) against the fp32 math of the first experts'
    rows: every row written, relative error. Meant for a child process (--check): an illegal
    memory access there kills only that process's CUDA context."""
    from megagraph.kernels.moe import gluon_l1 as mg

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, seed=1, routing=routing)
    P = T * k
    mtg = min(P, P // mg.BM + E)
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, h, topk=k, max_tiles=mtg, limit=limit,
                use_asm=True)
    torch.cuda.synchronize()
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts=min(E, 4))
    err = rel(h[:n].nan_to_num(0.0, 0.0, 0.0), ref)
    written = bool(torch.isfinite(h).all())
    return dict(tokens=T, dims=dims, routing=routing, all_written=written,
                rel_err_vs_fp32=err, ok=written and err < 2e-3)


def main() -> None:
    ap = probe_parser(__doc__, 8192, "tokens (rows = tokens * 6)",
                      "small dims (d 1024, F 256, 16 experts)", "moe_gluon_probe", extra=[
                          ("--routing", dict(choices=("balanced", "poisson"), default="balanced",
                                             help="balanced: 128 rows per expert at 8192 tokens; "
                                                  "poisson: top-6 of random logits (89 .. 183 "
                                                  "rows per expert)"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json,
                   lambda c: check(c["tokens"], c["dims"], c["limit"], c["routing"]))
        return

    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe import gluon_l1 as mg

    dims = SMOKE if args.smoke else REAL
    T = min(args.tokens, 512) if args.smoke else args.tokens
    res = dict(tokens=T, dims=dims, routing=args.routing, peak_tflops=PEAK_TFLOPS, rows=[])
    if skipped(res, mg.available(), "moe_gluon.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, routing=args.routing)
    P = T * k
    cl = counts.tolist()
    res["rows_per_expert"] = dict(min=min(cl), max=max(cl), mean=P / E,
                                  tiles=sum(-(-c // mg.BM) for c in cl))
    rates = flop_rates(2.0 * P * 2 * F * d, PEAK_TFLOPS)

    # 1) the Triton L1 first (the baseline survives whatever the Gluon kernel does)
    h_tr, ref, n = time_triton_l1(res, write, rates, (xq, xs, w1, w3, counts, srt), P, F, E, k,
                                  args.limit, experts=4)
    # 2) the Gluon L1: checked in a child process (an illegal access there cannot poison this
    # process's context; small dims, then these dims and routing), then timed
    name = "gluon l1"
    cases = [dict(tokens=min(T, 256), dims=SMOKE, limit=args.limit, routing=args.routing)]
    if dims != SMOKE:
        cases.append(dict(cases[0], tokens=T, dims=dims))
    checks = check_cases_in_child(__file__, cases, timeout=120.0)
    res["gluon_checks"] = {name: checks}
    print(json.dumps(checks), flush=True)
    _write(args.out, res)
    if not_checked(res, write, name, checks, len(cases)):
        finish(res, t_start, write)
        return
    mtg = min(P, P // mg.BM + E)
    tiles = moe.tile_list(counts, mg.BM, mtg)
    h_gl = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")

    def gluon_l1():
        mg.l1_gluon(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg, limit=args.limit,
                    tiles=tiles, use_asm=True)

    if timed_row(res, write, name, gluon_l1, dict(bm=mg.BM, bn=mg.BN, bk=mg.BK, nsa=mg.NSA,
                                                  nw=mg.NUM_WARPS), rates):
        try:
            torch.cuda.synchronize()
            row = res["rows"][-1]
            row["all_written"] = bool(torch.isfinite(h_gl).all())
            row["rel_err_vs_triton"] = rel(h_gl, h_tr)
            row["rel_err_vs_fp32"] = rel(h_gl[:n], ref)
            print({x: row[x] for x in ("all_written", "rel_err_vs_triton", "rel_err_vs_fp32")},
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            res["rows"][-1]["check_error"] = repr(exc)[:500]
        _write(args.out, res)
    finish(res, t_start, write)


def _write(out, res) -> None:
    if not out:
        return
    lines = [(f"# Gluon L1 probe, {res['tokens']} tokens, dims {res['dims']}, routing "
              f"{res.get('routing', 'balanced')}"), ""]
    if "rows_per_expert" in res:
        lines += [f"rows per expert: {res['rows_per_expert']}", ""]
    if "skipped" in res:
        lines.append(f"skipped: {res['skipped']}")
    else:
        lines += table(res["rows"], "| launch | ms | TFLOP/s | % of 1430 | rel vs triton | rel vs "
                       "fp32 |", lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
                                             f"{r['pct_peak']:.1f}",
                                             f"{r.get('rel_err_vs_triton', 'n/a')}",
                                             f"{r.get('rel_err_vs_fp32', 'n/a')}"])
        lines += ["", f"triton vs fp32 math (first 4 experts): {res.get('rel_err_triton_vs_fp32')}"]
        for name, checks in res.get("gluon_checks", {}).items():
            lines += check_lines(name, checks)
    write_report(out, "moe_gluon_probe", res, lines)


if __name__ == "__main__":
    main()
