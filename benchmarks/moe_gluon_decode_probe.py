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
    python benchmarks/moe_gluon_decode_probe.py --load cp.async,tma,tma:6 --out /tmp/gd

Order: the Triton L1 is timed first and the JSON / md written after every row; then the Gluon
kernel is checked in child processes (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims:
NaN-poisoned output, every row written, rel. error vs the fp32 math of the same quantized
operands < 2e-3), so an illegal memory access cannot lose the Triton row; the Gluon kernel is
timed only if both checks pass. --load (default cp.async) names the loads of the packed weights
to check and time in one run: "cp.async", "tma" (TMA_STAGES stages) or "tma:N" (N stages); each
is checked in the child as above and, other than cp.async, for the cp.async kernel's bits on
the same call; timed only if its checks pass, then compared bit for bit with the first load's
output here too. Bandwidth: bytes of the touched experts' W1 + W3 (packed FP4
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
from gluon_probe_common import parse_load, probe_parser, skipped  # noqa: E402
from gluon_probe_common import bandwidth_rates, write_report  # noqa: E402

PEAK_GBS = 4240.0
SMOKE = dict(d=1024, F=256, E=64, k=6)


def check(T: int, dims: dict, limit: float, load: str = "cp.async") -> dict:
    """One Gluon decode L1 call with the --load item `load` (NaN-poisoned output) against the
    fp32 math of the first experts' rows, and - other than cp.async - against the cp.async
    kernel's bits on the same inputs. Meant for a child process (--check-json)."""
    from megagraph.kernels.triton import moe_gluon_decode as md

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, seed=1, routing="random")
    P = T * k

    def run(spec):
        name, stages = parse_load(spec)
        h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
        md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h, topk=k,
                           max_tiles=min(P, P // md.BT + E), limit=limit, load=name,
                           stages=stages)
        torch.cuda.synchronize()
        return h

    h = run(load)
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts=8, nonempty=True)
    err = rel(h[:n].nan_to_num(0.0, 0.0, 0.0), ref)
    written = bool(torch.isfinite(h).all())
    same = True if load == "cp.async" else bool(torch.equal(h, run("cp.async")))
    return dict(tokens=T, dims=dims, load=load, all_written=written, rel_err_vs_fp32=err,
                same_bits_as_cp_async=same, ok=written and err < 2e-3 and same)


def check_in_child(T: int, dims: dict, limit: float, load: str, timeout: float = 120.0) -> dict:
    """check(...) in a child process (gluon_probe_common.check_cases_in_child:
    CUDA_LAUNCH_BLOCKING=1, a crash cannot poison this process's context): its result, or the
    failure as a result."""
    return check_cases_in_child(__file__, [dict(tokens=T, dims=dims, limit=limit, load=load)],
                                timeout)[-1]


def main() -> None:
    ap = probe_parser(__doc__, 64, "decode tokens (rows = tokens * 6)",
                      "small dims (d 1024, F 256, 64 experts)", "moe_gluon_decode_probe",
                      extra=[("--load", dict(default="cp.async",
                                             help="comma-separated loads of the packed weights: "
                                                  "cp.async, tma, tma:N (N stages)"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json,
                   lambda c: check(c["tokens"], c["dims"], c["limit"], c["load"]))
        return

    from megagraph.kernels.triton import moe
    from megagraph.kernels.triton import moe_gluon_decode as md

    loads = [x.strip() for x in args.load.split(",") if x.strip()]
    for spec in loads:  # a typo fails here, before any child or timing
        md._load_and_stages(*parse_load(spec))
    dims = SMOKE if args.smoke else REAL
    T = args.tokens
    res = dict(tokens=T, dims=dims, peak_gbs=PEAK_GBS, loads=loads, rows=[])
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
    res["gluon_checks"], outs = [], {}
    tiles = moe.tile_list(counts, md.BT, mtg)
    for spec in loads:
        h_gl = time_load(res, write, timed, spec, args.limit, (xq, xs, w1, w3, counts, srt), P,
                         F, E, k, mtg, tiles, T, dims)
        if h_gl is not None:
            outs[spec] = h_gl
    try:
        torch.cuda.synchronize()
        for spec, h_gl in outs.items():
            res.setdefault("all_written", {})[spec] = bool(torch.isfinite(h_gl).all())
            res.setdefault("rel_err_gluon_vs_triton", {})[spec] = rel(h_gl, h_tr)
            res.setdefault("rel_err_gluon_vs_fp32", {})[spec] = rel(h_gl[:n], ref)
        first = next(iter(outs.values()), None)
        res["same_bits_as_first_load"] = {spec: bool(torch.equal(h_gl, first))
                                          for spec, h_gl in outs.items()}
    except Exception as exc:  # noqa: BLE001
        res["gluon_error"] = repr(exc)[:500]
    finish(res, t_start, write)


def time_load(res, write, timed, spec, limit, inputs, P, F, E, k, mtg, tiles, T, dims):
    """One --load item: its child checks (small dims, then these dims), then - only if both
    pass - its rows: the launch with a prebuilt tile list, with the list built in the call,
    with the integer-arithmetic upcast. Returns its output of the plain launch (None if not
    timed)."""
    from megagraph.kernels.triton import moe_gluon_decode as md

    xq, xs, w1, w3, counts, srt = inputs
    load, stages = parse_load(spec)
    checks = [check_in_child(min(T, 64), SMOKE, limit, spec)]
    if checks[0].get("ok"):
        checks.append(check_in_child(T, dims, limit, spec))
    res["gluon_checks"] += checks
    print(json.dumps(checks), flush=True)
    write()
    tag = "" if spec == "cp.async" else f" [{spec}]"
    if not all(c.get("ok") for c in checks):
        msg = f"the Gluon decode L1 ({spec}) is wrong or crashed (gluon_checks): not timed"
        res["rows"].append(dict(name=f"gluon decode l1{tag}", error=msg))
        print(msg, flush=True)
        return None
    h_gl = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")

    def launch(**kw):
        md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg,
                           limit=limit, load=load, stages=stages, **kw)

    tile = dict(bw=md.BW, bt=md.BT, bk=md.BK, warps=md.NUM_WARPS, load=load,
                ns=md.NS if load == "cp.async" else (stages or md.TMA_STAGES))
    if timed(f"gluon decode l1{tag}", lambda: launch(tiles=tiles), tile):
        timed(f"gluon decode l1{tag} + tile_list", launch, None)
        timed(f"gluon decode l1{tag} (arith upcast)",
              lambda: launch(tiles=tiles, use_asm=False), None)
        h_gl.fill_(float("nan"))
        launch(tiles=tiles)
        return h_gl
    return None


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

        def f(key, spec=None):
            v = res.get(key)
            v = v.get(spec) if isinstance(v, dict) else v
            return f"{v:.2e}" if isinstance(v, float) else "n/a"

        lines += ["", f"triton vs fp32 math (first 8 experts): {f('rel_err_triton_vs_fp32')}"]
        for spec in res.get("same_bits_as_first_load", {}):
            lines.append(f"gluon {spec}: rel err vs triton {f('rel_err_gluon_vs_triton', spec)}, "
                         f"vs fp32 math {f('rel_err_gluon_vs_fp32', spec)}, every row written "
                         f"{res['all_written'].get(spec)}, same bits as the first load "
                         f"{res['same_bits_as_first_load'][spec]}")
        for c in res.get("gluon_checks", []):
            lines += check_lines(f"gluon {c.get('load', 'cp.async')}", [c])
    write_report(out, "moe_gluon_decode_probe", res, lines)


if __name__ == "__main__":
    main()
