"""Times the Gluon DECODE L1 (kernels/triton/moe_gluon_decode.py: swapped wgmma
with the MXFP4 weights upcast in registers as the A operand, a 4-stage cp.async ring) against
the Triton L1 launch that routed_experts makes at decode (moe.gemm role "l1" with
pick_config("l1", rows): the swapped 16 x 64 tile), at V4.1-Flash dims: hidden d = 5120,
384 experts x F = 2304 (MXFP4, E8M0 per 32), top-6, 64 tokens with random routing (~240
experts touched, 1..5 rows each). Random weights made on the device. Each launch is timed as
CUDA-graph replays (events, median of batches).

    python benchmarks/moe_gluon_decode_probe.py --out /tmp/gd            # H200, 64 tokens
    python benchmarks/moe_gluon_decode_probe.py --tokens 16 --out /tmp/gd
    python benchmarks/moe_gluon_decode_probe.py --smoke                  # small dims

Order: the Triton L1 is timed first and the JSON / md written after every row; then the Gluon
kernel is checked in child processes (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims:
NaN-poisoned output, every row written, rel. error vs the fp32 math of the same quantized
operands < 2e-3), so an illegal memory access cannot lose the Triton row; the Gluon kernel is
timed only if both checks pass. Bandwidth: bytes of the touched experts' W1 + W3 (packed FP4
+ E8M0) per call, GB/s and % of 4.24 TB/s (H200 HBM3e). Needs CUDA sm_90 and Triton 3.6
(moe_gluon_decode.available()); elsewhere it says so and exits 0. Well under 120 s.
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
from gluon_probe_common import build, check_lines, finish, reference_rows, rel  # noqa: E402
from gluon_probe_common import check_cases_in_child, run_checks, table  # noqa: E402
from gluon_probe_common import time_triton_l1, timed_row  # noqa: E402
from gluon_probe_common import V41_FLASH as REAL  # noqa: E402
from gluon_probe_common import probe_parser, skipped  # noqa: E402
from gluon_probe_common import bandwidth_rates, write_report  # noqa: E402

PEAK_GBS = 4240.0
SMOKE = dict(d=1024, F=256, E=64, k=6)


def check(T: int, dims: dict, limit: float) -> dict:
    """One Gluon decode L1 call (NaN-poisoned output) against the fp32 math of the first experts'
    rows. Meant for a child process (--check-json)."""
    from megagraph.kernels.triton import moe_gluon_decode as md

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, seed=1, routing="random")
    P = T * k
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h, topk=k, max_tiles=min(P, P // md.BT + E),
                       limit=limit)
    torch.cuda.synchronize()
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts=8, nonempty=True)
    err = rel(h[:n].nan_to_num(0.0, 0.0, 0.0), ref)
    written = bool(torch.isfinite(h).all())
    return dict(tokens=T, dims=dims, all_written=written, rel_err_vs_fp32=err,
                ok=written and err < 2e-3)


def check_in_child(T: int, dims: dict, limit: float, timeout: float = 120.0) -> dict:
    """check(...) in a child process (gluon_probe_common.check_cases_in_child:
    CUDA_LAUNCH_BLOCKING=1, a crash cannot poison this process's context): its result, or the
    failure as a result."""
    return check_cases_in_child(__file__, [dict(tokens=T, dims=dims, limit=limit)], timeout)[-1]


def main() -> None:
    ap = probe_parser(__doc__, 64, "decode tokens (rows = tokens * 6)",
                      "small dims (d 1024, F 256, 64 experts)", "moe_gluon_decode_probe")
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json, lambda c: check(c["tokens"], c["dims"], c["limit"]))
        return

    from megagraph.kernels.triton import moe
    from megagraph.kernels.triton import moe_gluon_decode as md

    dims = SMOKE if args.smoke else REAL
    T = args.tokens
    res = dict(tokens=T, dims=dims, peak_gbs=PEAK_GBS, rows=[])
    if skipped(res, md.available(), "moe_gluon_decode.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, routing="random")
    P = T * k
    rates = bandwidth_rates(res, counts, 2 * F * (d // 2 + d // 32), PEAK_GBS)  # W1 + W3
    mtg = min(P, P // md.BT + E)

    def timed(name, fn, tile):
        return timed_row(res, write, name, fn, tile, rates)

    h_tr, ref, n = time_triton_l1(res, write, rates, (xq, xs, w1, w3, counts, srt), P, F, E, k,
                                  args.limit, experts=8, nonempty=True)
    checks = [check_in_child(min(T, 64), SMOKE, args.limit)]
    if checks[0].get("ok"):
        checks.append(check_in_child(T, dims, args.limit))
    res["gluon_checks"] = checks
    print(json.dumps(checks), flush=True)
    _write(args.out, res)
    if not all(c.get("ok") for c in checks):
        res["gluon_skipped"] = "the Gluon decode L1 is wrong or crashed (gluon_checks): not timed"
        res["rows"].append(dict(name="gluon decode l1", error=res["gluon_skipped"]))
        print(res["gluon_skipped"], flush=True)
    else:
        h_gl = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
        tiles = moe.tile_list(counts, md.BT, mtg)

        def gluon_l1():
            md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg,
                               limit=args.limit, tiles=tiles)

        def gluon_l1_list():  # the same, with the device tile list built in the call
            md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg,
                               limit=args.limit)

        def gluon_l1_arith():  # the integer-arithmetic upcast (for comparison)
            md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg,
                               limit=args.limit, tiles=tiles, use_asm=False)

        tile = dict(bw=md.BW, bt=md.BT, bk=md.BK, ns=md.NS, warps=md.NUM_WARPS)
        if timed("gluon decode l1", gluon_l1, tile):
            timed("gluon decode l1 + tile_list", gluon_l1_list, None)
            timed("gluon decode l1 (arith upcast)", gluon_l1_arith, None)
            gluon_l1()
        try:
            torch.cuda.synchronize()
            res["all_written"] = bool(torch.isfinite(h_gl).all())
            res["rel_err_gluon_vs_triton"] = rel(h_gl, h_tr)
            res["rel_err_gluon_vs_fp32"] = rel(h_gl[:n], ref)
        except Exception as exc:  # noqa: BLE001
            res["gluon_error"] = repr(exc)[:500]
    finish(res, t_start, write)


def _write(out, res) -> None:
    if not out:
        return
    lines = [f"# Gluon decode L1 probe, {res['tokens']} tokens, dims {res['dims']}", ""]
    if "skipped" in res:
        lines.append(f"skipped: {res['skipped']}")
    else:
        lines += [(f"experts touched: {res.get('experts_touched')}, max rows per expert "
                   f"{res.get('max_rows_per_expert')}, weight bytes {res.get('weight_bytes')}"), ""]
        lines += table(res["rows"], "| launch | ms | GB/s | % of 4.24 TB/s |",
                       lambda r: [f"{r['ms']:.3f}", f"{r['gbs']:.0f}", f"{r['pct_bw']:.1f}"])

        def f(key):
            v = res.get(key)
            return f"{v:.2e}" if isinstance(v, float) else "n/a"

        lines += ["", (f"rel err gluon vs triton: {f('rel_err_gluon_vs_triton')}; vs fp32 math "
                       f"(first 8 experts): gluon {f('rel_err_gluon_vs_fp32')}, triton "
                       f"{f('rel_err_triton_vs_fp32')}; every gluon row written: "
                       f"{res.get('all_written', 'n/a')}")]
        lines += check_lines("gluon", res.get("gluon_checks", []))
    write_report(out, "moe_gluon_decode_probe", res, lines)


if __name__ == "__main__":
    main()
