"""Times the warp-specialized Gluon prefill L1 (kernels/moe/gluon_ws.py: loader / upcast /
two MMA warpgroups on mbarrier rings, 128 rows x 64 columns of W1 and W3 per CTA) against the
Triton L1 launch that routed_experts makes for the same rows per expert (moe.gemm role "l1") and
the Gluon decode L1 at 64-token tiles with the TMA weight ring (moe_gluon_decode.l1_gluon_decode
bt=64, load="tma": the best L1 before it, 8.30 ms at 8192 tokens), at V4.1-Flash dims (d = 5120,
384 experts x F = 2304, MXFP4 + E8M0 per 32, top-6), 8192 tokens by default (~128 rows per
expert). Random weights made on the device; each launch timed as CUDA-graph replays (events,
median of batches); TFLOP/s of 2 P 2F d per call and % of the H200's 1979 dense FP8 peak.

    python benchmarks/probes/moe_gluon_ws_probe.py --tokens 8192 --out /tmp/ws          # H200
    python benchmarks/probes/moe_gluon_ws_probe.py --rings 4:2,6:3,3:2 --out /tmp/ws
    python benchmarks/probes/moe_gluon_ws_probe.py --smoke                              # small dims

Order: the Triton L1 is timed first (its row survives whatever a Gluon kernel does), the JSON /
md written after every row; then each Gluon item - "decode64" and one "ws NS:NU" per --rings
item (raw ring NS stages, B ring NU) - is checked in a child process (gluon_probe_common.
check_cases_in_child: CUDA_LAUNCH_BLOCKING=1; small dims at up to 1024 tokens, then these
dims: poisoned output, every row written, rel. error vs the fp32 math of the first 8 non-empty
experts' rows < 2e-3, and for ws 3 launches giving the same bits), and timed only if both
checks pass; a faulting kernel kills only its child. Needs CUDA sm_90 and Triton 3.6
(moe_gluon_ws.available()); elsewhere it says so and exits 0. A few minutes at 8192 tokens.
"""
from __future__ import annotations

import json
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
from gluon_probe_common import (  # noqa: E402
    build,
    check_cases_in_child,
    check_lines,
    finish,
    flop_rates,
    probe_parser,
    probe_report,
    reference_rows,
    rel,
    run_checks,
    skipped,
    table,
    time_triton_l1,
    timed_row,
)

PEAK_TFLOPS = 1979.0  # H200 dense FP8
SMOKE = dict(d=1024, F=256, E=64, k=6)
SMOKE_TOKENS = 1024


def _parse_item(item: str) -> dict:
    """A Gluon item -> its launch arguments:
      "decode64" / "decode64:S"   the decode L1 at 64-token tiles, TMA ring of S stages (default);
      "ws NS:NU" / "ws NS:NU:LAG" the ws kernel, raw ring NS, B ring NU, loader lag LAG;
      "diag NS:NU:LAG:WHAT"       the ws kernel with parts skipped (WHAT: "+"-joined names of
                                  moe_gluon_ws.DIAG_BITS - upcast, mma, a): WRONG results by
                                  design, timed without checks, to see which part bounds it;
      "pws ..." / "pdiag ..."     the same with persistent CTAs (one per SM);
      "tws ..." / "ptws ..."      ... with A by TMA from an expert-sorted copy (made per call,
                                  inside the timed launch);
      "pwws ..." (w with p / t)    ... with the 128-column tile (moe_gluon_ws.BN_WIDE);
      "ptwsws ..." (s with w)      ... its quarters one at a time (qlag 0; else the kernel's
                                  default, WIDE_QLAG);
      "ptowws ..." (o with w, t)   ... one upcast partition (upp 1; else the kernel's default:
                                  two with A by TMA, WIDE_UPP);
      "pkws ..." (k with any)      ... the rows 64.. warpgroup idle on tiles of <= 64 rows
                                  (skip; else the kernel's default, SKIP_IDLE);
      "ptwfws ..." (f with w)      ... each weight row's frame over all of K (row_frames,
                                  built outside the timed launch);
      "ptwfrws ..." (r with f)     ... the A rows in registers once per chunk (areg; else the
                                  kernel's default, AREG)."""
    from megagraph.kernels.moe import gluon_ws as mw

    if item.startswith("decode64"):
        _, _, st = item.partition(":")
        return dict(kind="decode64", stages=int(st) if st else None)
    kind, _, spec = item.partition(" ")
    flags, kind = (kind[:-2], "ws") if kind.endswith("ws") else (kind[:-4], kind[-4:])
    persist, a_tma, wide = "p" in flags, "t" in flags, "w" in flags
    if set(flags) - {"p", "t", "w", "s", "o", "k", "f", "r"}:
        raise ValueError(f"item {item!r}: prefixes p (persistent), t (A by TMA), w (the "
                         "128-column tile), s (its quarters one at a time), o (one upcast "
                         "partition), k (skip idle rows), f (row frames) and r (A in "
                         "registers) only")
    parts = spec.split(":")
    if kind not in ("ws", "diag") or not 2 <= len(parts) <= 4 or (kind == "diag") != (
            len(parts) == 4):
        raise ValueError(f"item {item!r}: decode64[:S], [p]ws NS:NU[:LAG] or [p]diag "
                         "NS:NU:LAG:WHAT")
    diag = 0
    if kind == "diag":
        diag = sum(mw.DIAG_BITS[w] for w in parts[3].split("+"))  # KeyError: a typo
    return dict(kind=kind, stages=int(parts[0]), bstages=int(parts[1]),
                lag=int(parts[2]) if len(parts) > 2 else None, diag=diag, persist=persist,
                a_tma=a_tma, bn=mw.BN_WIDE if wide else mw.BN,
                qlag=0 if "s" in flags else None, upp=1 if "o" in flags else None,
                skip=True if "k" in flags else None, frames="f" in flags,
                areg=True if "r" in flags else None)


def _launcher(item: str, inputs, out, k: int, limit: float, tiles=None):
    """A no-argument launch of item on inputs = build(...) into out (its own tile list unless
    `tiles` is given: the list at its row tile)."""
    from megagraph.kernels.moe import gluon_decode as md
    from megagraph.kernels.moe import gluon_ws as mw

    xq, xs, w1, w3, counts, srt = inputs
    P, E = srt.numel(), counts.numel()
    it = _parse_item(item)
    frames = mw.row_frames(w1, w3) if it.get("frames") else None
    if it.get("frames") and frames is None:
        raise ValueError(f"item {item!r}: the banks' exponents span more than "
                         f"{mw.FRAME_SPAN} binades (row_frames refused them)")
    if it["kind"] == "decode64":
        return lambda: md.l1_gluon_decode(xq, xs, srt, w1, w3, counts, out, topk=k,
                                          max_tiles=min(P, P // 64 + E), limit=limit,
                                          load="tma", bt=64, tiles=tiles, stages=it["stages"])
    return lambda: mw.l1_gluon_ws(xq, xs, srt, w1, w3, counts, out, topk=k,
                                  max_tiles=min(P, P // mw.BM + E), limit=limit, tiles=tiles,
                                  stages=it["stages"], bstages=it["bstages"], lag=it["lag"],
                                  diag=it["diag"], persist=it["persist"], a_tma=it["a_tma"],
                                  bn=it["bn"], qlag=it["qlag"], upp=it["upp"],
                                  skip=it["skip"], frames=frames, areg=it["areg"])


def check(T: int, dims: dict, limit: float, item: str, routing: str) -> dict:
    """One call of item into a poisoned fp16 H against the fp32 math of the first 8 non-empty
    experts' rows; ws also relaunched twice for the same bits. For a child process."""
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    inputs = build(T, d, F, E, k, seed=1, routing=routing)
    P = T * k
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    launch = _launcher(item, inputs, h, k, limit)
    launch()
    torch.cuda.synchronize()
    first = h.clone()
    same = True
    if not item.startswith("decode64"):
        for _ in range(2):
            h.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
            same = same and bool(torch.equal(h, first))
    ref, n = reference_rows(*inputs, k, limit, experts=8, nonempty=True)
    err = rel(first[:n].nan_to_num(0.0, 0.0, 0.0), ref)
    written = bool(torch.isfinite(first).all())
    return dict(tokens=T, dims=dims, item=item, all_written=written, rel_err_vs_fp32=err,
                same_bits_repeated=same, ok=written and err < 2e-3 and same)


def time_item(res, write, rates, item, inputs, T, dims, k, limit, routing, h_tr, ref, n):
    """item's child checks (small dims, then these dims), then - only if both pass - its row
    (CUDA graph of the launch with a prebuilt tile list) and its errors vs the Triton L1 and the
    fp32 math."""
    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe import gluon_ws as mw

    name = f"gluon {item}"
    diag = _parse_item(item)["kind"] == "diag"
    if diag:  # wrong by design: no checks (the ws items' checks cover the same kernel)
        checks = []
    else:
        cases = [dict(tokens=min(T, SMOKE_TOKENS), dims=SMOKE, limit=limit, item=item,
                      routing=routing), dict(tokens=T, dims=dims, limit=limit, item=item,
                                             routing=routing)]
        checks = check_cases_in_child(__file__, cases, 600.0)
        res["gluon_checks"] += checks
        print(json.dumps(checks), flush=True)
        write()
    if not diag and (len(checks) < 2 or not all(c.get("ok") for c in checks)):
        res["rows"].append(dict(name=name, error="wrong or crashed in the child check: not "
                                "timed (gluon_checks)"))
        print(res["rows"][-1], flush=True)
        write()
        return
    counts, srt = inputs[4], inputs[5]
    P, E, F = srt.numel(), counts.numel(), h_tr.shape[1]
    bm = 64 if item.startswith("decode64") else mw.BM
    tiles = moe.tile_list(counts, bm, min(P, P // bm + E))
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    launch = _launcher(item, inputs, h, k, limit, tiles)
    if timed_row(res, write, name, launch, dict(item=item, bm=bm), rates) and not diag:
        h.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        res.setdefault("rel_err_vs_triton", {})[item] = rel(h, h_tr)
        res.setdefault("rel_err_vs_fp32", {})[item] = rel(h[:n], ref)
        write()


def main() -> None:
    ap = probe_parser(__doc__, 8192, "tokens (rows = tokens * 6)",
                      "small dims (d 1024, F 256, 64 experts)", "moe_gluon_ws_probe",
                      extra=[("--rings", dict(default="4:2,6:3",
                                              help="comma-separated ws items: NS:NU[:LAG] "
                                                   "(ring depths, loader lag) or diag "
                                                   "NS:NU:LAG:WHAT (_parse_item)")),
                             ("--decode", dict(default="",
                                               help="comma-separated extra decode64 TMA ring "
                                                    "depths (decode64:S items)")),
                             ("--routing", dict(default="random",
                                                help="balanced, poisson or random")),
                             ("--no-decode", dict(action="store_true",
                                                  help="skip the decode64 baseline"))])
    args = ap.parse_args()

    def write():
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child
        run_checks(args.check_json, lambda c: check(c["tokens"], c["dims"], c["limit"],
                                                    c["item"], c["routing"]))
        return

    from megagraph.kernels.moe import gluon_ws as mw

    rings = [x.strip() if x.strip()[:1].isalpha() else f"ws {x.strip()}"
             for x in args.rings.split(",") if x.strip()]
    extra = [f"decode64:{x.strip()}" for x in args.decode.split(",") if x.strip()]
    items = ([] if args.no_decode else ["decode64"]) + extra + rings
    for item in items:  # a typo fails here, before any child or timing
        _parse_item(item)
    dims = SMOKE if args.smoke else REAL
    T = args.tokens
    res = dict(tokens=T, dims=dims, routing=args.routing, peak_tflops=PEAK_TFLOPS, items=items,
               rows=[], gluon_checks=[])
    if skipped(res, mw.available(), "moe_gluon_ws.available()", write):
        return
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    inputs = build(T, d, F, E, k, routing=args.routing)
    P = T * k
    res["max_rows_per_expert"] = int(inputs[4].max())
    rates = flop_rates(2.0 * P * 2 * F * d, PEAK_TFLOPS)
    h_tr, ref, n = time_triton_l1(res, write, rates, inputs, P, F, E, k, args.limit, experts=8,
                                  nonempty=True)
    for item in items:
        time_item(res, write, rates, item, inputs, T, dims, k, args.limit, args.routing, h_tr,
                  ref, n)
    finish(res, t_start, write)


def _body(res) -> list:
    """The report's body: the timing table, Triton's error vs the fp32 math, each Gluon item's
    and the child checks."""
    lines = [f"max rows per expert {res.get('max_rows_per_expert')}", ""]
    lines += table(res["rows"], "| launch | ms | TFLOP/s | % of 1979 |",
                   lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{r['pct_peak']:.1f}"])
    lines += ["", f"triton vs fp32 math (first 8 experts): {res.get('rel_err_triton_vs_fp32')}"]
    for item, err in res.get("rel_err_vs_triton", {}).items():
        lines.append(f"gluon {item}: rel err vs triton {err:.2e}, vs fp32 math "
                     f"{res['rel_err_vs_fp32'][item]:.2e}")
    for c in res.get("gluon_checks", []):
        lines += check_lines(f"gluon {c.get('item')}", [c])
    return lines


def _write(out, res) -> None:
    probe_report(out, "moe_gluon_ws_probe",
                 [f"# Gluon warp-specialized L1 probe, {res['tokens']} tokens ({res['routing']}), "
                  f"dims {res['dims']}"], res, _body)


if __name__ == "__main__":
    main()
