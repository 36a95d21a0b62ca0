"""Times the Gluon DECODE L1 (kernels/moe/gluon_decode.py: swapped wgmma
with the MXFP4 weights upcast in registers as the A operand, a cp.async or TMA weight ring, a
token tile of 16 / 32 / 64 rows) against the Triton L1 launch that routed_experts makes for the
same rows per expert (moe.gemm role "l1" with pick_tile("l1", rows): the swapped 16 x 64 tile
at decode) and - past decode sizes - the cuBLAS grouped L1, at V4.1-Flash dims: hidden
d = 5120, 384 experts x F = 2304 (MXFP4, E8M0 per 32), top-6, 64 tokens with random routing
(~240 experts touched, 1..5 rows each) or a prefill size (--tokens 8192: ~128 rows per expert).
Random weights made on the device. Each launch is timed as CUDA-graph replays (events, median
of batches).

    python benchmarks/probes/moe_gluon_decode_probe.py --out /tmp/gd            # H200, 64 tokens
    python benchmarks/probes/moe_gluon_decode_probe.py --tokens 16 --out /tmp/gd
    python benchmarks/probes/moe_gluon_decode_probe.py --smoke                  # small dims
    python benchmarks/probes/moe_gluon_decode_probe.py --load cp.async,tma,tma:6 --out /tmp/gd
    python benchmarks/probes/moe_gluon_decode_probe.py --tokens 8192 --load tma,tma:4 --bt 16,32,64 \\
        --out /tmp/gp                                                    # prefill size

Order: the Triton L1 is timed first, then (more than 12 rows per expert, where
moe_grouped_cublas.supported()) the cuBLAS grouped L1 (moe_grouped_cublas.l1_swiglu: per-call
upcast of the touched experts, routed_experts' L1 from 100 rows per expert), the JSON / md
written after every row; then the Gluon kernel is checked in a child process per (load, bt)
item (CUDA_LAUNCH_BLOCKING=1; small dims at up to 1024 tokens, then these dims: NaN-poisoned
output, every row written, rel. error vs the fp32 math of the same quantized operands < 2e-3),
so an illegal memory access cannot lose the baselines' rows; an item is timed only if both
checks pass. --load (default cp.async) names the loads of the packed weights: "cp.async", "tma"
(TMA_STAGES stages) or "tma:N" (N stages); --bt (default 16) the token tiles (moe_gluon_decode.
BTS; the tile list and max_tiles = min(P, P // bt + E) at that tile); every pair is checked in
the child as above and, other than cp.async, for the cp.async kernel's bits at the same bt on
the same call; timed only if its checks pass, then compared bit for bit with the first load's
output at the same bt here too (other bt: other bits allowed, the wgmma's n sets the tensor
core's sum order - compared through the error vs the fp32 math). Rates: bytes of the touched
experts' W1 + W3 (packed FP4 + E8M0) per call, GB/s and % of 4.24 TB/s (H200 HBM3e; at
prefill sizes the weights are read more than once, so this is their size over the time), and
TFLOP/s of 2 P 2F d per call (% of 1430, moe_gluon_probe's peak). Needs CUDA sm_90 and Triton
3.6 (moe_gluon_decode.available()); elsewhere it says so and exits 0. Well under 120 s at 64
tokens; a few minutes at 8192 with 3 loads x 3 tiles.
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
from gluon_probe_common import build, finish, reference_rows, rel  # noqa: E402
from gluon_probe_common import decode_body, decode_label  # noqa: E402
from gluon_probe_common import check_cases_in_child, probe_report, run_checks  # noqa: E402
from gluon_probe_common import time_triton_l1, timed_row  # noqa: E402
from gluon_probe_common import checks_passed, time_decode_variants  # noqa: E402
from gluon_probe_common import V41_FLASH as REAL  # noqa: E402
from gluon_probe_common import parse_load, probe_parser, skipped  # noqa: E402
from gluon_probe_common import bandwidth_rates, flop_rates  # noqa: E402

PEAK_GBS = 4240.0
PEAK_TFLOPS = 1430.0  # moe_gluon_probe's (the prefill L1 probe's) FP8 peak, for one scale
SMOKE = dict(d=1024, F=256, E=64, k=6)
SMOKE_TOKENS = 1024  # the small-dims check at up to this many tokens (96 rows per expert)
CUBLAS_FROM = 12  # rows per expert above which the cuBLAS grouped L1 is timed (past decode)


def check(T: int, dims: dict, limit: float, load: str = "cp.async", bt: int = 16) -> dict:
    """One Gluon decode L1 call with the --load item `load` at token tile bt (NaN-poisoned
    output) against the fp32 math of the first experts' rows, and - other than cp.async -
    against the cp.async kernel's bits at the same bt on the same inputs. Meant for a child
    process (--check-json)."""
    from megagraph.kernels.moe import gluon_decode as md

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, seed=1, routing="random")
    P = T * k

    def run(spec):
        name, stages = parse_load(spec)
        h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
        md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h, topk=k,
                           max_tiles=min(P, P // bt + E), limit=limit, load=name,
                           stages=stages, bt=bt)
        torch.cuda.synchronize()
        return h

    h = run(load)
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts=8, nonempty=True)
    err = rel(h[:n].nan_to_num(0.0, 0.0, 0.0), ref)
    written = bool(torch.isfinite(h).all())
    same = True if load == "cp.async" else bool(torch.equal(h, run("cp.async")))
    return dict(tokens=T, dims=dims, load=load, bt=bt, all_written=written,
                rel_err_vs_fp32=err, same_bits_as_cp_async=same,
                ok=written and err < 2e-3 and same)


def check_in_child(T: int, dims: dict, limit: float, load: str, bt: int,
                   timeout: float = 300.0) -> list:
    """check(...) at the small dims (up to SMOKE_TOKENS tokens), then at these dims, in ONE
    child process (gluon_probe_common.check_cases_in_child: CUDA_LAUNCH_BLOCKING=1, a crash
    cannot poison this process's context; it stops at the first failure): the results, a
    failure or crash last."""
    cases = [dict(tokens=min(T, SMOKE_TOKENS), dims=SMOKE, limit=limit, load=load, bt=bt),
             dict(tokens=T, dims=dims, limit=limit, load=load, bt=bt)]
    return check_cases_in_child(__file__, cases, timeout)


def main() -> None:
    ap = probe_parser(__doc__, 64, "tokens (rows = tokens * 6; 8192: a prefill size)",
                      "small dims (d 1024, F 256, 64 experts)", "moe_gluon_decode_probe",
                      extra=[("--load", dict(default="cp.async",
                                             help="comma-separated loads of the packed weights: "
                                                  "cp.async, tma, tma:N (N stages)")),
                             ("--bt", dict(default="16",
                                           help="comma-separated token tiles (16, 32, 64)"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json,
                   lambda c: check(c["tokens"], c["dims"], c["limit"], c["load"], c["bt"]))
        return

    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe import gluon_decode as md

    loads = [x.strip() for x in args.load.split(",") if x.strip()]
    bts = [md._token_tile(int(x)) for x in args.bt.split(",") if x.strip()]
    for spec in loads:  # a typo fails here, before any child or timing
        md._load_and_stages(*parse_load(spec))
    dims = SMOKE if args.smoke else REAL
    T = args.tokens
    res = dict(tokens=T, dims=dims, peak_gbs=PEAK_GBS, peak_tflops=PEAK_TFLOPS, loads=loads,
               bts=bts, rows=[])
    if skipped(res, md.available(), "moe_gluon_decode.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    inputs = build(T, d, F, E, k, routing="random")  # (xq, xs, w1, w3, counts, srt)
    counts, P = inputs[4], T * k
    rates = _rates(res, counts, P, d, F)

    def timed(name, fn, tile):
        return timed_row(res, write, name, fn, tile, rates)

    h_tr, ref, n = time_triton_l1(res, write, rates, inputs, P, F, E, k, args.limit, experts=8,
                                  nonempty=True)
    if P / E > CUBLAS_FROM:
        time_cublas_l1(res, write, timed, inputs, P, F, k, args.limit, ref, n)
    res["gluon_checks"], outs = [], {}
    for bt in bts:
        mtg = min(P, P // bt + E)
        tiles = moe.tile_list(counts, bt, mtg)
        for spec in loads:
            h_gl = time_load(res, write, timed, spec, bt, args.limit, inputs, P, F, k, mtg,
                             tiles, T, dims)
            if h_gl is not None:
                outs[(spec, bt)] = h_gl
    try:
        torch.cuda.synchronize()
        _compare(res, outs, h_tr, ref, n)
    except Exception as exc:  # noqa: BLE001
        res["gluon_error"] = repr(exc)[:500]
    finish(res, t_start, write)


def _rates(res, counts, P: int, d: int, F: int):
    """rates(ms) for timed_row: the touched experts' W1 + W3 bytes per call as GB/s and % of
    PEAK_GBS (bandwidth_rates, which records the bytes in res) and the call's 2 P 2F d FLOP as
    TFLOP/s and % of PEAK_TFLOPS (the number that matters at prefill sizes)."""
    bw = bandwidth_rates(res, counts, 2 * F * (d // 2 + d // 32), PEAK_GBS)
    fl = flop_rates(2.0 * P * 2 * F * d, PEAK_TFLOPS)
    return lambda ms: dict(bw(ms), **fl(ms))


def _compare(res, outs: dict, h_tr, ref, n: int) -> None:
    """The timed items' outputs: every row written, the error vs the Triton L1 and vs the fp32
    math of the first experts' rows, and the same bits as the first load at the same bt."""
    first = {}
    for (spec, bt), h_gl in outs.items():
        label = decode_label(spec, bt)
        first.setdefault(bt, h_gl)
        res.setdefault("all_written", {})[label] = bool(torch.isfinite(h_gl).all())
        res.setdefault("rel_err_gluon_vs_triton", {})[label] = rel(h_gl, h_tr)
        res.setdefault("rel_err_gluon_vs_fp32", {})[label] = rel(h_gl[:n], ref)
        res.setdefault("same_bits_as_first_load", {})[label] = bool(torch.equal(h_gl,
                                                                                first[bt]))


def time_cublas_l1(res, write, timed, inputs, P: int, F: int, k: int, limit: float, ref,
                   n: int) -> None:
    """The cuBLAS grouped L1 baseline (moe_grouped_cublas.l1_swiglu, as routed_experts runs it
    from 100 rows per expert: the touched experts' W1 / W3 upcast to E4M3 per call, torch's
    grouped FP8 GEMM, the SwiGLU) into a NaN-poisoned fp16 H: a row where supported() says yes,
    and its error vs the fp32 math (it rounds to bf16 before the SwiGLU) as
    res["rel_err_cublas_vs_fp32"]."""
    from megagraph.kernels.moe import grouped_cublas as mc

    xq, xs, w1, w3, counts, srt = inputs
    if not mc.supported(torch.cuda.current_device()):
        res["rows"].append(dict(name="cublas grouped l1", error="moe_grouped_cublas.supported() "
                                "says no on this device / torch"))
        write()
        return
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    if timed("cublas grouped l1 (upcast + grouped mm)",
             lambda: mc.l1_swiglu(xq, xs, srt, w1, w3, counts, h, topk=k, limit=limit), None):
        torch.cuda.synchronize()
        res["rel_err_cublas_vs_fp32"] = rel(h[:n], ref)
        write()


def time_load(res, write, timed, spec, bt, limit, inputs, P, F, k, mtg, tiles, T, dims):
    """One (--load item, token tile) pair: its child checks (small dims, then these dims), then
    - only if both pass - its rows: the launch with a prebuilt tile list, with the list built
    in the call, with the integer-arithmetic upcast. Returns its output of the plain launch
    (None if not timed)."""
    from megagraph.kernels.moe import gluon_decode as md

    xq, xs, w1, w3, counts, srt = inputs
    load, stages = parse_load(spec)
    checks = check_in_child(T, dims, limit, spec, bt)
    name = f"gluon decode l1 [{decode_label(spec, bt)}]"
    if not checks_passed(res, write, name, checks):
        return None
    h_gl = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")

    def launch(**kw):
        md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg,
                           limit=limit, load=load, stages=stages, bt=bt, **kw)

    return time_decode_variants(timed, name, launch, tiles, md, bt, load, stages, h_gl)


def _errors(res) -> list:
    """The report's error lines: Triton's and cuBLAS's vs the fp32 math, each Gluon item's."""
    def f(key, label=None):
        v = res.get(key)
        v = v.get(label) if isinstance(v, dict) else v
        return f"{v:.2e}" if isinstance(v, float) else "n/a"

    lines = [f"triton vs fp32 math (first 8 experts): {f('rel_err_triton_vs_fp32')}",
             f"cublas vs fp32 math (first 8 experts): {f('rel_err_cublas_vs_fp32')}"]
    for label in res.get("same_bits_as_first_load", {}):
        lines.append(f"gluon {label}: rel err vs triton "
                     f"{f('rel_err_gluon_vs_triton', label)}, vs fp32 math "
                     f"{f('rel_err_gluon_vs_fp32', label)}, every row written "
                     f"{res['all_written'].get(label)}, same bits as the first load at "
                     f"this bt {res['same_bits_as_first_load'][label]}")
    return lines


def _write(out, res) -> None:
    probe_report(out, "moe_gluon_decode_probe",
                 [f"# Gluon decode L1 probe, {res['tokens']} tokens, dims {res['dims']}"], res,
                 lambda r: decode_body(r, _errors(r)))


if __name__ == "__main__":
    main()
