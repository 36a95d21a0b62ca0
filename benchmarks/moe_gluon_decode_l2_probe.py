"""Times the Gluon DECODE L2 (kernels/triton/moe_gluon_decode_l2.py: swapped wgmma
with the MXFP4 W2 upcast to fp16 in registers as the A operand, a 4-stage cp.async ring or a
TMA ring of the packed W2 rows, the weighted scatter to y) against the Triton L2 launch that
routed_experts makes at decode (moe.gemm role "l2" with pick_config("l2", rows)), at V4.1-Flash
dims: d = 5120 output columns, 384 experts x F = 2304 (MXFP4 W2, E8M0 per 32), top-6, 64 tokens
with random routing (~240 experts touched, 1..5 rows each), y [T, ks = 7, d] bf16 (mega_moe's:
topk + the shared expert's slot, bf16 for a bf16 model). Random weights made on the device.
Each launch is timed as CUDA-graph replays (events, median of batches).

    python benchmarks/moe_gluon_decode_l2_probe.py --out /tmp/gd2            # H200, 64 tokens
    python benchmarks/moe_gluon_decode_l2_probe.py --tokens 16 --out /tmp/gd2
    python benchmarks/moe_gluon_decode_l2_probe.py --y-dtype f32 --out /tmp/gd2
    python benchmarks/moe_gluon_decode_l2_probe.py --smoke                  # small dims
    python benchmarks/moe_gluon_decode_l2_probe.py --load cp.async,tma,tma:4 --out /tmp/gd2

Order: the Triton L2 is timed first and the JSON / md written after every row; then the Gluon
kernel is checked in child processes (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims:
NaN-poisoned y, every routed slot written and no other, rel. error vs the fp32 math of the
same operands < 2e-3 for f32 y, 1e-2 for bf16), so an illegal memory access cannot lose the
Triton row; the Gluon kernel is timed only if both checks pass. --load (default cp.async)
names the loads of the packed W2 rows to check and time in one run: "cp.async", "tma"
(TMA_STAGES stages) or "tma:N" (N stages); each is checked in the child as above and, other
than cp.async, for the cp.async kernel's bits on the same call; timed only if its checks pass,
then compared bit for bit with the first load's output here too. Bandwidth: bytes of the touched
experts' W2 (packed FP4 + E8M0) per call, GB/s and % of 4.24 TB/s (H200 HBM3e). Needs CUDA
sm_90 and Triton 3.6 (moe_gluon_decode_l2.available()); elsewhere it says so and exits 0.
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
from gluon_probe_common import build_l2, check_lines, finish, probe_parser  # noqa: E402
from gluon_probe_common import check_cases_in_child, reference_l2_slots, rel  # noqa: E402
from gluon_probe_common import parse_load, run_checks, skipped, slot_errors  # noqa: E402
from gluon_probe_common import bandwidth_rates, table, timed_row, write_report  # noqa: E402

PEAK_GBS = 4240.0
SMOKE = dict(d=1024, F=256, E=64, k=6)


def bits(y):
    """y's bits as integers (torch.equal on floats says NaN != NaN: the unrouted slots)."""
    return y.view({4: torch.int32, 2: torch.int16}[y.element_size()])


def check(T: int, dims: dict, ks: int, ydt: str, load: str = "cp.async") -> dict:
    """One Gluon decode L2 call with the --load item `load` (NaN-poisoned y) against the fp32
    math of the first experts' rows, and - other than cp.async - against the cp.async kernel's
    bits on the same inputs. Meant for a child process (--check-json)."""
    from megagraph.kernels.triton import moe_gluon_decode_l2 as ml2

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build_l2(T, d, F, E, k, seed=1)
    P = T * k

    def run(spec):
        name, stages = parse_load(spec)
        y = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
        ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y.view(T * ks, d), topk=k,
                            ks=ks, max_tiles=min(P, P // ml2.BT + E), load=name, stages=stages)
        torch.cuda.synchronize()
        return y

    y = run(load)
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=8)
    res = dict(tokens=T, dims=dims, ks=ks, y_dtype=ydt, load=load,
               **slot_errors(y, idx, ref, k))
    res["same_bits_as_cp_async"] = True if load == "cp.async" else \
        bool(torch.equal(bits(y), bits(run("cp.async"))))
    tol = 2e-3 if ydt == "f32" else 1e-2
    res["ok"] = res["all_written"] and res["others_untouched"] and \
        res["rel_err_vs_fp32"] < tol and res["same_bits_as_cp_async"]
    return res


def check_in_child(T: int, dims: dict, ks: int, ydt: str, load: str,
                   timeout: float = 120.0) -> dict:
    """check(...) in a child process (gluon_probe_common.check_cases_in_child:
    CUDA_LAUNCH_BLOCKING=1, a crash cannot poison this process's context): its result, or the
    failure as a result."""
    return check_cases_in_child(__file__, [dict(tokens=T, dims=dims, ks=ks, ydt=ydt, load=load)],
                                timeout)[-1]


def main() -> None:
    ap = probe_parser(__doc__, 64, "decode tokens (rows = tokens * 6)",
                      "small dims (d 1024, F 256, 64 experts)", "moe_gluon_decode_l2_probe",
                      extra=[("--ks", dict(type=int, default=7, help="slots per token in y")),
                             ("--y-dtype", dict(choices=sorted(YDT), default="bf16",
                                                help="y dtype")),
                             ("--load", dict(default="cp.async",
                                             help="comma-separated loads of the packed W2 rows: "
                                                  "cp.async, tma, tma:N (N stages)"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json,
                   lambda c: check(c["tokens"], c["dims"], c["ks"], c["ydt"], c["load"]))
        return

    from megagraph.kernels.triton import moe
    from megagraph.kernels.triton import moe_gluon_decode_l2 as ml2

    loads = [x.strip() for x in args.load.split(",") if x.strip()]
    for spec in loads:  # a typo fails here, before any child or timing
        ml2._load_and_stages(*parse_load(spec))
    dims = SMOKE if args.smoke else REAL
    T, ks, ydt = args.tokens, args.ks, args.y_dtype
    res = dict(tokens=T, dims=dims, ks=ks, y_dtype=ydt, peak_gbs=PEAK_GBS, loads=loads, rows=[])
    if skipped(res, ml2.available(), "moe_gluon_decode_l2.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build_l2(T, d, F, E, k)
    P = T * k
    rates = bandwidth_rates(res, counts, d * (F // 2 + F // 32), PEAK_GBS)  # W2
    mtg = min(P, P // ml2.BT + E)

    def timed(name, fn, tile):
        return timed_row(res, write, name, fn, tile, rates)

    y_tr = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
    rpg = P / max(1, min(E, P))
    timed("triton l2 (moe.gemm)", lambda: moe.triton_l2(h, w2, counts, srt, wts, y_tr),
          moe.pick_config("l2", rpg).__dict__)
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=8)
    res["triton"] = slot_errors(y_tr, idx, ref, k)
    write()
    res["gluon_checks"], outs = [], {}
    tiles = moe.tile_list(counts, ml2.BT, mtg)
    for spec in loads:
        y_gl = time_load(res, write, timed, spec, (h, w2, counts, srt, wts), mtg, tiles, T,
                         dims, ks, ydt)
        if y_gl is not None:
            outs[spec] = y_gl
    try:
        torch.cuda.synchronize()
        for spec, y_gl in outs.items():
            res.setdefault("gluon", {})[spec] = slot_errors(y_gl, idx, ref, k)
            res.setdefault("rel_err_gluon_vs_triton", {})[spec] = rel(y_gl[:, :k], y_tr[:, :k])
        first = next(iter(outs.values()), None)
        res["same_bits_as_first_load"] = {spec: bool(torch.equal(bits(y_gl), bits(first)))
                                          for spec, y_gl in outs.items()}
    except Exception as exc:  # noqa: BLE001
        res["gluon_error"] = repr(exc)[:500]
    finish(res, t_start, write)


def time_load(res, write, timed, spec, inputs, mtg, tiles, T, dims, ks, ydt):
    """One --load item: its child checks (small dims, then these dims), then - only if both
    pass - its rows: the launch with a prebuilt tile list, with the list built in the call,
    with the integer-arithmetic upcast. Returns its y of the plain launch (None if not
    timed)."""
    from megagraph.kernels.triton import moe_gluon_decode_l2 as ml2

    h, w2, counts, srt, wts = inputs
    d, k = dims["d"], dims["k"]
    load, stages = parse_load(spec)
    checks = [check_in_child(min(T, 64), SMOKE, ks, ydt, spec)]
    if checks[0].get("ok"):
        checks.append(check_in_child(T, dims, ks, ydt, spec))
    res["gluon_checks"] += checks
    print(json.dumps(checks), flush=True)
    write()
    tag = "" if spec == "cp.async" else f" [{spec}]"
    if not all(c.get("ok") for c in checks):
        msg = f"the Gluon decode L2 ({spec}) is wrong or crashed (gluon_checks): not timed"
        res["rows"].append(dict(name=f"gluon decode l2{tag}", error=msg))
        print(msg, flush=True)
        return None
    y_gl = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")

    def launch(**kw):
        ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y_gl.view(T * ks, d), topk=k,
                            ks=ks, max_tiles=mtg, load=load, stages=stages, **kw)

    tile = dict(bw=ml2.BW, bt=ml2.BT, bk=ml2.BK, warps=ml2.NUM_WARPS, load=load,
                ns=ml2.NS if load == "cp.async" else (stages or ml2.TMA_STAGES))
    if timed(f"gluon decode l2{tag}", lambda: launch(tiles=tiles), tile):
        timed(f"gluon decode l2{tag} + tile_list", launch, None)
        timed(f"gluon decode l2{tag} (arith upcast)",
              lambda: launch(tiles=tiles, use_asm=False), None)
        y_gl.fill_(float("nan"))
        launch(tiles=tiles)
        return y_gl
    return None


def _write(out, res) -> None:
    if not out:
        return
    lines = [(f"# Gluon decode L2 probe, {res['tokens']} tokens, dims {res['dims']}, ks "
              f"{res['ks']}, y {res['y_dtype']}"), ""]
    if "skipped" in res:
        lines.append(f"skipped: {res['skipped']}")
    else:
        lines += [(f"experts touched: {res.get('experts_touched')}, max rows per expert "
                   f"{res.get('max_rows_per_expert')}, weight bytes {res.get('weight_bytes')}"), ""]
        lines += table(res["rows"], "| launch | ms | GB/s | % of 4.24 TB/s |",
                       lambda r: [f"{r['ms']:.3f}", f"{r['gbs']:.0f}", f"{r['pct_bw']:.1f}"])
        lines += ["", f"triton vs fp32 math (first 8 experts): {res.get('triton')}"]
        for spec in res.get("same_bits_as_first_load", {}):
            v = res["rel_err_gluon_vs_triton"][spec]
            lines.append(f"gluon {spec}: rel err vs triton {v:.2e}, vs fp32 math (first 8 "
                         f"experts) {res['gluon'][spec]}, same bits as the first load "
                         f"{res['same_bits_as_first_load'][spec]}")
        for c in res.get("gluon_checks", []):
            lines += check_lines(f"gluon {c.get('load', 'cp.async')}", [c])
    write_report(out, "moe_gluon_decode_l2_probe", res, lines)


if __name__ == "__main__":
    main()
