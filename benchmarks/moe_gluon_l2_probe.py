"""Times the Gluon PREFILL L2 (kernels/triton/moe_gluon_l2.py: 128 x 128 tiles, the MXFP4 W2
chunk upcast to exact fp16 under the chained async wgmma of the chunk before, the weighted
scatter to y) against the Triton L2 launch that routed_experts makes (moe.triton_l2: moe.gemm
role "l2" with pick_config's tile), at V4.1-Flash dims: d = 5120 output columns, 384 experts x
F = 2304 (MXFP4 W2, E8M0 per 32), top-6, 8192 tokens, y [T, ks = 7, d] bf16 (mega_moe's: topk +
the shared expert's slot). H is random fp16 (the L1's output, expert-sorted rows), weights made
on the device. Each launch is timed as CUDA-graph replays (events, median of batches).

    python benchmarks/moe_gluon_l2_probe.py --out /tmp/gl2                    # balanced, 8192
    python benchmarks/moe_gluon_l2_probe.py --routing poisson --out /tmp/gl2  # realistic routing
    python benchmarks/moe_gluon_l2_probe.py --y-dtype f32 --out /tmp/gl2
    python benchmarks/moe_gluon_l2_probe.py --smoke                           # small dims
    python benchmarks/moe_gluon_l2_probe.py --diag "w,mma,a,w+mma" --out /tmp/gl2  # by parts

--routing balanced: token t -> experts 6t .. 6t + 5 mod 384 (128 rows per expert at 8192 tokens:
one 128-row tile each); poisson: top-6 of random router logits (rows per expert ~89 .. 183: an
expert over 128 rows takes two tiles).

Order: the Triton L2 is timed first and the JSON / md written after every row; then the Gluon
L2 is checked in ONE child process (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims and
routing: NaN-poisoned y, every routed slot written and no other, 3 launches with the same bits,
rel. error vs the fp32 math of the first experts' rows < 2e-3 for f32 y, 1e-2 for bf16), so an
illegal memory access cannot lose the Triton row; the Gluon L2 is timed only if both checks
pass (else its row records the check results). Then its output is compared with the Triton
L2's (rel. Frobenius error: sum order only at these exponents).

L2 FLOPs = 2 * rows * F * d (rows = tokens * top-k); % of peak against 989 TFLOP/s (H200 dense
fp16). Needs CUDA sm_90 and Triton 3.6 (moe_gluon_l2.available()); elsewhere it says so and
exits 0 (with --out, a JSON that records the skip). About a minute on the H200.
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
from gluon_probe_common import V41_FLASH as REAL  # noqa: E402
from gluon_probe_common import Y_DTYPES as YDT  # noqa: E402
from gluon_probe_common import build_l2, check_cases_in_child, check_lines, finish  # noqa: E402
from gluon_probe_common import flop_rates, l2_error_lines, not_checked, probe_parser  # noqa: E402
from gluon_probe_common import reference_l2_slots, rel, run_checks, skipped  # noqa: E402
from gluon_probe_common import slot_errors, table, timed_row, write_report  # noqa: E402

PEAK_TFLOPS = 989.0
SMOKE = dict(d=1024, F=768, E=16, k=6)


def build(T: int, d: int, F: int, E: int, k: int, seed: int = 0, routing: str = "balanced"):
    """build_l2 with this probe's routing (balanced: token t -> experts kt .. kt + k - 1 mod E;
    poisson: top-k of random normal logits) and pair weights in [0.25, 1.25): (h, w2, counts,
    srt, wts [T, k]) on the GPU."""
    return build_l2(T, d, F, E, k, seed=seed, routing=routing, wts_lo=0.25)


def check(T: int, dims: dict, ks: int, ydt: str, routing: str) -> dict:
    """Gluon L2 calls (NaN-poisoned y, 3 launches compared bit for bit) against the fp32 math
    of the first experts' rows. Meant for the child process (--check-json)."""
    from megagraph.kernels.triton import moe_gluon_l2 as mgl

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build(T, d, F, E, k, seed=1, routing=routing)
    P = T * k
    ys = []
    for _ in range(3):
        y = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
        mgl.l2_gluon(h, w2, counts, srt, wts, y, topk=k, ks=ks, max_tiles=min(P, P // mgl.BM + E))
        ys.append(y)
    torch.cuda.synchronize()
    same = all(torch.equal(ys[0].float().nan_to_num(7.0), o.float().nan_to_num(7.0))
               for o in ys[1:])
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=4)
    res = dict(tokens=T, dims=dims, ks=ks, y_dtype=ydt, routing=routing, repeat_same_bits=same,
               **slot_errors(ys[0], idx, ref, k))
    tol = 2e-3 if ydt == "f32" else 1e-2
    res["ok"] = bool(res["all_written"] and res["others_untouched"] and same and
                     res["rel_err_vs_fp32"] < tol)
    return res


def main() -> None:
    ap = probe_parser(__doc__, 8192, "tokens (rows = tokens * 6)",
                      "small dims (d 1024, F 768, 16 experts)", "moe_gluon_l2_probe", extra=[
                          ("--routing", dict(choices=("balanced", "poisson"), default="balanced",
                                             help="balanced: 128 rows per expert at 8192 tokens; "
                                                  "poisson: top-6 of random logits")),
                          ("--ks", dict(type=int, default=7, help="slots per token in y")),
                          ("--y-dtype", dict(choices=sorted(YDT), default="bf16",
                                             help="y dtype")),
                          ("--diag", dict(default="",
                                          help="comma-separated '+'-joined DIAG_BITS names "
                                               "(w, mma, a): the kernel with those parts of its "
                                               "K loop skipped, timed after the checked rows - "
                                               "WRONG results by design, to see what bounds it"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json,
                   lambda c: check(c["tokens"], c["dims"], c["ks"], c["ydt"], c["routing"]))
        return

    from megagraph.kernels.triton import moe
    from megagraph.kernels.triton import moe_gluon_l2 as mgl

    dims = SMOKE if args.smoke else REAL
    T = min(args.tokens, 1024) if args.smoke else args.tokens
    ks, ydt = args.ks, args.y_dtype
    res = dict(tokens=T, dims=dims, routing=args.routing, ks=ks, y_dtype=ydt,
               peak_tflops=PEAK_TFLOPS, rows=[])
    if skipped(res, mgl.available(), "moe_gluon_l2.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build(T, d, F, E, k, routing=args.routing)
    P = T * k
    cl = counts.tolist()
    res["rows_per_expert"] = dict(min=min(cl), max=max(cl), mean=P / E,
                                  tiles_128=sum(-(-c // mgl.BM) for c in cl))
    rates = flop_rates(2.0 * P * F * d, PEAK_TFLOPS)

    # 1) the Triton L2 first (the baseline survives whatever the Gluon kernel does)
    y_tr = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
    rpg = P / max(1, min(E, P))
    timed_row(res, write, "triton l2 (moe.gemm)",
              lambda: moe.triton_l2(h, w2, counts, srt, wts, y_tr),
              moe.pick_config("l2", rpg).__dict__, rates)
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=4)
    res["triton"] = slot_errors(y_tr, idx, ref, k)
    write()
    # 2) the Gluon L2: checked in a child process (small dims, then these dims and routing),
    # then timed
    name = "gluon l2"
    cases = [dict(tokens=min(T, 1024), dims=SMOKE, ks=ks, ydt=ydt, routing=args.routing)]
    if dims != SMOKE:
        cases.append(dict(cases[0], tokens=T, dims=dims))
    checks = check_cases_in_child(__file__, cases, timeout=180.0)
    res["gluon_checks"] = checks
    print(json.dumps(checks), flush=True)
    write()
    if not_checked(res, write, name, checks, len(cases)):
        finish(res, t_start, write)
        return
    mtg = min(P, P // mgl.BM + E)
    tiles = moe.tile_list(counts, mgl.BM, mtg)
    y_gl = torch.full_like(y_tr, float("nan"))

    def gluon_l2(use_asm=True, prebuilt=True, diag=0):
        mgl.l2_gluon(h, w2, counts, srt, wts, y_gl, topk=k, ks=ks, max_tiles=mtg,
                     tiles=tiles if prebuilt else None, use_asm=use_asm, diag=diag)

    tile = dict(bm=mgl.BM, bn=mgl.BN, bk=mgl.BK, ns=mgl.NS, warps=mgl.NUM_WARPS)
    if timed_row(res, write, name, gluon_l2, tile, rates):
        timed_row(res, write, "gluon l2 + tile_list", lambda: gluon_l2(prebuilt=False), None,
                  rates)
        timed_row(res, write, "gluon l2 (arith upcast)", lambda: gluon_l2(use_asm=False), None,
                  rates)
        try:
            y_gl.fill_(float("nan"))
            gluon_l2()
            torch.cuda.synchronize()
            res["gluon"] = slot_errors(y_gl, idx, ref, k)
            res["rel_err_gluon_vs_triton"] = rel(y_gl[:, :k], y_tr[:, :k])
            print({"gluon": res["gluon"], "vs_triton": res["rel_err_gluon_vs_triton"]},
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            res["gluon_error"] = repr(exc)[:500]
        write()
        for what in [x.strip() for x in args.diag.split(",") if x.strip()]:
            bits = sum(mgl.DIAG_BITS[w] for w in what.split("+"))  # KeyError: a typo
            timed_row(res, write, f"gluon l2 diag {what} (wrong by design)",
                      lambda b=bits: gluon_l2(diag=b), dict(diag=bits), rates)
    finish(res, t_start, write)


def _write(out, res) -> None:
    if not out:
        return
    lines = [(f"# Gluon prefill L2 probe, {res['tokens']} tokens, dims {res['dims']}, routing "
              f"{res.get('routing')}, ks {res.get('ks')}, y {res.get('y_dtype')}"), ""]
    if "rows_per_expert" in res:
        lines += [f"rows per expert: {res['rows_per_expert']}", ""]
    if "skipped" in res:
        lines.append(f"skipped: {res['skipped']}")
    else:
        lines += table(res["rows"], "| launch | ms | TFLOP/s | % of 989 |",
                       lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
                                  f"{r['pct_peak']:.1f}"])
        lines += l2_error_lines(res, experts=4)
        lines += check_lines("gluon l2", res.get("gluon_checks", []))
    write_report(out, "moe_gluon_l2_probe", res, lines)


if __name__ == "__main__":
    main()
