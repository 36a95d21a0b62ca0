"""Times the Gluon DECODE L2 (kernels/moe/gluon_decode_l2.py: swapped wgmma
with the MXFP4 W2 upcast to fp16 in registers as the A operand, a 4-stage cp.async ring or a
TMA ring of the packed W2 rows, a token tile of 16 / 32 / 64 / 128 rows, the weighted scatter
to y) against the Triton L2 launch that routed_experts makes for the same rows per expert
(moe.gemm role "l2" with pick_tile("l2", rows)) and, where its shapes allow (d % 128,
F % 192), the Gluon prefill L2 (moe_gluon_l2.l2_gluon: 128 x 128 tiles), at V4.1-Flash dims:
d = 5120 output columns, 384 experts x F = 2304 (MXFP4 W2, E8M0 per 32), top-6, 64 tokens
with random routing (~240 experts touched, 1..5 rows each) or a prefill size (--tokens 8192:
~128 rows per expert), y [T, ks = 7, d] bf16 (mega_moe's: topk + the shared expert's slot,
bf16 for a bf16 model). Random weights made on the device. Each launch is timed as CUDA-graph
replays (events, median of batches).

    python benchmarks/probes/moe_gluon_decode_l2_probe.py --out /tmp/gd2            # H200, 64 tokens
    python benchmarks/probes/moe_gluon_decode_l2_probe.py --tokens 16 --out /tmp/gd2
    python benchmarks/probes/moe_gluon_decode_l2_probe.py --y-dtype f32 --out /tmp/gd2
    python benchmarks/probes/moe_gluon_decode_l2_probe.py --smoke                  # small dims
    python benchmarks/probes/moe_gluon_decode_l2_probe.py --load cp.async,tma,tma:4 --out /tmp/gd2
    python benchmarks/probes/moe_gluon_decode_l2_probe.py --tokens 8192 --load cp.async,tma \\
        --bt 64,128 --out /tmp/gp2                                        # prefill size

Order: the Triton L2 is timed first, then the Gluon prefill L2 (the run on the H200 checked
it: 4.01 ms at 8192 tokens), the JSON / md written after every row; then the decode kernel is
checked in a child process per (load, bt) item (CUDA_LAUNCH_BLOCKING=1; small dims at up to
1024 tokens, then these dims: NaN-poisoned y, every routed slot written and no other, rel.
error vs the fp32 math of the same operands < 2e-3 for f32 y, 1e-2 for bf16), so an illegal
memory access cannot lose the baselines' rows; an item is timed only if both checks pass.
--load (default cp.async) names the loads of the packed W2 rows: "cp.async", "tma"
(TMA_STAGES stages) or "tma:N" (N stages); --bt (default 16) the token tiles
(moe_gluon_decode_l2.BTS; the tile list and max_tiles = min(P, P // bt + E) at that tile);
every pair is checked in the child as above and, other than cp.async, for the cp.async
kernel's bits at the same bt on the same call; timed only if its checks pass, then compared
bit for bit with the first load's output at the same bt here too (other bt: other bits
allowed, the wgmma's n sets the tensor core's sum order - compared through the error vs the
fp32 math). Rates: bytes of the touched experts' W2 (packed FP4 + E8M0) per call, GB/s and %
of 4.24 TB/s (H200 HBM3e; at prefill sizes W2 is read more than once, so this is its size over
the time), and TFLOP/s of 2 P F d per call (% of 989, the H200's dense fp16 peak: the MMA is
fp16). Needs CUDA sm_90 and Triton 3.6 (moe_gluon_decode_l2.available()); elsewhere it says
so and exits 0. Well under 2 minutes at 64 tokens; a few minutes at 8192 with 2 loads x 2 tiles.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # probes/ and benchmarks/
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# the shared inputs, timing, child checks and report (after the sys.path entry: E402)
from gluon_probe_common import V41_FLASH as REAL  # noqa: E402
from gluon_probe_common import Y_DTYPES as YDT  # noqa: E402
from gluon_probe_common import build_l2, finish, probe_parser  # noqa: E402
from gluon_probe_common import decode_body, decode_label  # noqa: E402
from gluon_probe_common import check_cases_in_child, reference_l2_slots, rel  # noqa: E402
from gluon_probe_common import parse_load, run_checks, skipped, slot_errors  # noqa: E402
from gluon_probe_common import bandwidth_rates, probe_report, timed_row  # noqa: E402
from gluon_probe_common import flop_rates  # noqa: E402
from gluon_probe_common import checks_passed, time_decode_variants  # noqa: E402

PEAK_GBS = 4240.0
PEAK_TFLOPS = 989.0  # the H200's dense fp16 tensor-core peak (the L2s' MMA is fp16 x fp16)
SMOKE = dict(d=1024, F=256, E=64, k=6)
SMOKE_TOKENS = 1024  # the small-dims check at up to this many tokens (96 rows per expert)


def bits(y):
    """y's bits as integers (torch.equal on floats says NaN != NaN: the unrouted slots)."""
    return y.view({4: torch.int32, 2: torch.int16}[y.element_size()])


def check(T: int, dims: dict, ks: int, ydt: str, load: str = "cp.async", bt: int = 16) -> dict:
    """One Gluon decode L2 call with the --load item `load` at token tile bt (NaN-poisoned y)
    against the fp32 math of the first experts' rows, and - other than cp.async - against the
    cp.async kernel's bits at the same bt on the same inputs. Meant for a child process
    (--check-json)."""
    from megagraph.kernels.moe import gluon_decode_l2 as ml2

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build_l2(T, d, F, E, k, seed=1)
    P = T * k

    def run(spec):
        name, stages = parse_load(spec)
        y = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
        ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y.view(T * ks, d), topk=k,
                            ks=ks, max_tiles=min(P, P // bt + E), load=name, stages=stages,
                            bt=bt)
        torch.cuda.synchronize()
        return y

    y = run(load)
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=8)
    res = dict(tokens=T, dims=dims, ks=ks, y_dtype=ydt, load=load, bt=bt,
               **slot_errors(y, idx, ref, k))
    res["same_bits_as_cp_async"] = True if load == "cp.async" else \
        bool(torch.equal(bits(y), bits(run("cp.async"))))
    tol = 2e-3 if ydt == "f32" else 1e-2
    res["ok"] = res["all_written"] and res["others_untouched"] and \
        res["rel_err_vs_fp32"] < tol and res["same_bits_as_cp_async"]
    return res


def check_in_child(T: int, dims: dict, ks: int, ydt: str, load: str, bt: int,
                   timeout: float = 300.0) -> list:
    """check(...) at the small dims (up to SMOKE_TOKENS tokens), then at these dims, in ONE
    child process (gluon_probe_common.check_cases_in_child: CUDA_LAUNCH_BLOCKING=1, a crash
    cannot poison this process's context; it stops at the first failure): the results, a
    failure or crash last."""
    case = dict(ks=ks, ydt=ydt, load=load, bt=bt)
    return check_cases_in_child(__file__, [dict(case, tokens=min(T, SMOKE_TOKENS), dims=SMOKE),
                                           dict(case, tokens=T, dims=dims)], timeout)


def main() -> None:
    ap = probe_parser(__doc__, 64, "tokens (rows = tokens * 6; 8192: a prefill size)",
                      "small dims (d 1024, F 256, 64 experts)", "moe_gluon_decode_l2_probe",
                      extra=[("--ks", dict(type=int, default=7, help="slots per token in y")),
                             ("--y-dtype", dict(choices=sorted(YDT), default="bf16",
                                                help="y dtype")),
                             ("--load", dict(default="cp.async",
                                             help="comma-separated loads of the packed W2 rows: "
                                                  "cp.async, tma, tma:N (N stages)")),
                             ("--bt", dict(default="16",
                                           help="comma-separated token tiles (16, 32, 64, "
                                                "128)"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json, lambda c: check(c["tokens"], c["dims"], c["ks"], c["ydt"],
                                                    c["load"], c["bt"]))
        return

    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe import gluon_decode_l2 as ml2
    from megagraph.kernels.moe.gluon_common import token_tile

    loads = [x.strip() for x in args.load.split(",") if x.strip()]
    bts = [token_tile(int(x), ml2.BT, ml2.BTS) for x in args.bt.split(",") if x.strip()]
    for spec in loads:  # a typo fails here, before any child or timing
        ml2._load_and_stages(*parse_load(spec))
    dims = SMOKE if args.smoke else REAL
    T, ks, ydt = args.tokens, args.ks, args.y_dtype
    res = dict(tokens=T, dims=dims, ks=ks, y_dtype=ydt, peak_gbs=PEAK_GBS,
               peak_tflops=PEAK_TFLOPS, loads=loads, bts=bts, rows=[])
    if skipped(res, ml2.available(), "moe_gluon_decode_l2.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build_l2(T, d, F, E, k)
    P = T * k
    bw = bandwidth_rates(res, counts, d * (F // 2 + F // 32), PEAK_GBS)  # W2
    fl = flop_rates(2.0 * P * F * d, PEAK_TFLOPS)

    def rates(ms):
        return dict(bw(ms), **fl(ms))

    def timed(name, fn, tile):
        return timed_row(res, write, name, fn, tile, rates)

    y_tr = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
    rpg = P / max(1, min(E, P))
    timed("triton l2 (moe.gemm)", lambda: moe.triton_l2(h, w2, counts, srt, wts, y_tr),
          moe.pick_tile("l2", rpg).__dict__)
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=8)
    res["triton"] = slot_errors(y_tr, idx, ref, k)
    write()
    time_prefill_l2(res, write, timed, (h, w2, counts, srt, wts), T, dims, ks, ydt, idx, ref)
    res["gluon_checks"], outs = [], {}
    for bt in bts:
        mtg = min(P, P // bt + E)
        tiles = moe.tile_list(counts, bt, mtg)
        for spec in loads:
            y_gl = time_load(res, write, timed, spec, bt, (h, w2, counts, srt, wts), mtg,
                             tiles, T, dims, ks, ydt)
            if y_gl is not None:
                outs[(spec, bt)] = y_gl
    try:
        torch.cuda.synchronize()
        _compare(res, outs, y_tr, idx, ref, k)
    except Exception as exc:  # noqa: BLE001
        res["gluon_error"] = repr(exc)[:500]
    finish(res, t_start, write)


def _compare(res, outs: dict, y_tr, idx, ref, k: int) -> None:
    """The timed items' outputs: slot_errors vs the fp32 math of the first experts' rows, the
    error vs the Triton L2, and the same bits as the first load at the same bt."""
    first = {}
    for (spec, bt), y_gl in outs.items():
        label = decode_label(spec, bt)
        first.setdefault(bt, y_gl)
        res.setdefault("gluon", {})[label] = slot_errors(y_gl, idx, ref, k)
        res.setdefault("rel_err_gluon_vs_triton", {})[label] = rel(y_gl[:, :k], y_tr[:, :k])
        res.setdefault("same_bits_as_first_load", {})[label] = \
            bool(torch.equal(bits(y_gl), bits(first[bt])))


def time_prefill_l2(res, write, timed, inputs, T: int, dims: dict, ks: int, ydt: str, idx,
                    ref) -> None:
    """The Gluon prefill L2 baseline (moe_gluon_l2.l2_gluon: 128-row tiles, as routed_experts
    runs it past 48 rows per expert) into a NaN-poisoned y: a row where its shapes allow (d a
    multiple of its 128-column tile, F of its 3 x 64-column ring; the small dims' F = 256 is
    not), then its slot_errors vs the fp32 math as res["prefill_gluon"]."""
    from megagraph.kernels.moe import gluon_l2 as mgl

    h, w2, counts, srt, wts = inputs
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    if d % mgl.BN or F % (mgl.NS * mgl.BK):
        res["rows"].append(dict(name="gluon prefill l2 (moe_gluon_l2)",
                                error=f"d {d} / F {F}: not its tile shapes"))
        write()
        return
    P = T * k
    y = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
    tile = dict(bm=mgl.BM, bn=mgl.BN, bk=mgl.BK, warps=mgl.NUM_WARPS, ns=mgl.NS)
    if timed("gluon prefill l2 (moe_gluon_l2)",
             lambda: mgl.l2_gluon(h, w2, counts, srt, wts, y, topk=k, ks=ks,
                                  max_tiles=min(P, P // mgl.BM + E)), tile):
        torch.cuda.synchronize()
        res["prefill_gluon"] = slot_errors(y, idx, ref, k)
        write()


def time_load(res, write, timed, spec, bt, inputs, mtg, tiles, T, dims, ks, ydt):
    """One (--load item, token tile) pair: its child checks (small dims, then these dims), then
    - only if both pass - its rows: the launch with a prebuilt tile list, with the list built
    in the call, with the integer-arithmetic upcast. Returns its y of the plain launch (None
    if not timed)."""
    from megagraph.kernels.moe import gluon_decode_l2 as ml2

    h, w2, counts, srt, wts = inputs
    d, k = dims["d"], dims["k"]
    load, stages = parse_load(spec)
    checks = check_in_child(T, dims, ks, ydt, spec, bt)
    name = f"gluon decode l2 [{decode_label(spec, bt)}]"
    if not checks_passed(res, write, name, checks):
        return None
    y_gl = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")

    def launch(**kw):
        ml2.l2_gluon_decode(h, w2, counts, srt, wts.reshape(-1), y_gl.view(T * ks, d), topk=k,
                            ks=ks, max_tiles=mtg, load=load, stages=stages, bt=bt, **kw)

    return time_decode_variants(timed, name, launch, tiles, ml2, bt, load, stages, y_gl)


def _errors(res) -> list:
    """The report's error lines: Triton's and the prefill Gluon L2's vs the fp32 math, each
    Gluon decode item's."""
    lines = [f"triton vs fp32 math (first 8 experts): {res.get('triton')}",
             f"gluon prefill l2 vs fp32 math (first 8 experts): "
             f"{res.get('prefill_gluon', 'n/a')}"]
    for label in res.get("same_bits_as_first_load", {}):
        v = res["rel_err_gluon_vs_triton"][label]
        lines.append(f"gluon {label}: rel err vs triton {v:.2e}, vs fp32 math (first 8 "
                     f"experts) {res['gluon'][label]}, same bits as the first load at this "
                     f"bt {res['same_bits_as_first_load'][label]}")
    return lines


def _write(out, res) -> None:
    probe_report(out, "moe_gluon_decode_l2_probe",
                 [(f"# Gluon decode L2 probe, {res['tokens']} tokens, dims {res['dims']}, ks "
                   f"{res['ks']}, y {res['y_dtype']}")], res, lambda r: decode_body(r, _errors(r)))


if __name__ == "__main__":
    main()
