"""Times the Gluon PREFILL L2 (kernels/moe/gluon_l2.py: 128 x 128 tiles, the MXFP4 W2
chunk upcast to exact fp16 under the chained async wgmma of the chunk before, the weighted
scatter to y) against the Triton L2 launch that routed_experts makes (moe.triton_l2: moe.gemm
role "l2" with pick_tile's tile), at V4.1-Flash dims: d = 5120 output columns, 384 experts x
F = 2304 (MXFP4 W2, E8M0 per 32), top-6, 8192 tokens, y [T, ks = 7, d] bf16 (mega_moe's: topk +
the shared expert's slot). H is random fp16 (the L1's output, expert-sorted rows), weights made
on the device. Each launch is timed as CUDA-graph replays (events, median of batches).

    python benchmarks/probes/moe_gluon_l2_probe.py --out /tmp/gl2                    # balanced, 8192
    python benchmarks/probes/moe_gluon_l2_probe.py --routing poisson --out /tmp/gl2  # realistic routing
    python benchmarks/probes/moe_gluon_l2_probe.py --y-dtype f32 --out /tmp/gl2
    python benchmarks/probes/moe_gluon_l2_probe.py --smoke                           # small dims
    python benchmarks/probes/moe_gluon_l2_probe.py --diag "w,mma,a,w+mma" --out /tmp/gl2  # by parts
    python benchmarks/probes/moe_gluon_l2_probe.py --ws 6:3,8:3,4:3:256 --out /tmp/gl2  # ws rings[:bn]
    python benchmarks/probes/moe_gluon_l2_probe.py --ws 4:3:256,4:3:256:2 --out /tmp/gl2  # [:upcasts]
    python benchmarks/probes/moe_gluon_l2_probe.py --ws none --out /tmp/gl2     # without the ws rows

--routing balanced: token t -> experts 6t .. 6t + 5 mod 384 (128 rows per expert at 8192 tokens:
one 128-row tile each); poisson: top-6 of random router logits (rows per expert ~89 .. 183: an
expert over 128 rows takes two tiles).

Order: the Triton L2 is timed first and the JSON / md written after every row; then the Gluon
L2 is checked in ONE child process (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims and
routing: NaN-poisoned y, every routed slot written and no other, 3 launches with the same bits,
rel. error vs the fp32 math of the first experts' rows < 2e-3 for f32 y, 1e-2 for bf16), so an
illegal memory access cannot lose the Triton row; the Gluon L2 is timed only if both checks
pass (else its row records the check results). Then its output is compared with the Triton
L2's (rel. Frobenius error: sum order only at these exponents). Then the warp-specialized twin
(moe_gluon_l2_ws.l2_gluon_ws, persistent CTAs; rows "gluon l2 ws NS:NU[:BN[:UPP]]" for each
--ws ring depth, tile width and number of upcast partitions): checked in its own child process
the same way (a deadlock ends there, at the child's timeout) plus bit for bit against the Gluon
L2 (same_bits_as_gluon_l2), timed only if that passes, its output compared bit for bit with the
Gluon L2's in this process too (the same numerics: the same bits expected).

L2 FLOPs = 2 * rows * F * d (rows = tokens * top-k); % of peak against 989 TFLOP/s (H200 dense
fp16). Needs CUDA sm_90 and Triton 3.6 (moe_gluon_l2.available()); elsewhere it says so and
exits 0 (with --out, a JSON that records the skip). About a minute on the H200.
"""
from __future__ import annotations

import functools
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
from gluon_probe_common import Y_DTYPES as YDT  # noqa: E402
from gluon_probe_common import build_l2, check_cases_in_child, check_lines, finish  # noqa: E402
from gluon_probe_common import flop_rates, l2_error_lines, not_checked, probe_parser  # noqa: E402
from gluon_probe_common import reference_l2_slots, rel, run_checks, skipped  # noqa: E402
from gluon_probe_common import probe_report, slot_errors, table, timed_row  # noqa: E402

PEAK_TFLOPS = 989.0
SMOKE = dict(d=1024, F=768, E=16, k=6)


def build(T: int, d: int, F: int, E: int, k: int, seed: int = 0, routing: str = "balanced"):
    """build_l2 with this probe's routing (balanced: token t -> experts kt .. kt + k - 1 mod E;
    poisson: top-k of random normal logits) and pair weights in [0.25, 1.25): (h, w2, counts,
    srt, wts [T, k]) on the GPU."""
    return build_l2(T, d, F, E, k, seed=seed, routing=routing, wts_lo=0.25)


def check(T: int, dims: dict, ks: int, ydt: str, routing: str, kernel: str = "gluon",
          rings: str | None = None) -> dict:
    """Gluon L2 calls (NaN-poisoned y, 3 launches compared bit for bit) against the fp32 math
    of the first experts' rows; kernel "ws": the warp-specialized twin at ring depths `rings`
    ("NS:NU[:BN[:UPP]]"), also compared bit for bit with one Gluon L2 launch
    (same_bits_as_gluon_l2, part of ok). Meant for the child process (--check-json)."""
    from megagraph.kernels.moe import gluon_l2 as mgl

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    h, w2, counts, srt, wts = build(T, d, F, E, k, seed=1, routing=routing)
    P = T * k
    launch = mgl.l2_gluon
    if kernel == "ws":
        from megagraph.kernels.moe import gluon_l2_ws as mlw

        ns, nu, bn, upp = _rings(rings)
        launch = functools.partial(mlw.l2_gluon_ws, stages=ns, bstages=nu, bn=bn, upp=upp)
    ys = []
    for _ in range(3):
        y = torch.full((T, ks, d), float("nan"), dtype=YDT[ydt], device="cuda")
        launch(h, w2, counts, srt, wts, y, topk=k, ks=ks, max_tiles=min(P, P // mgl.BM + E))
        ys.append(y)
    torch.cuda.synchronize()
    same = all(torch.equal(ys[0].float().nan_to_num(7.0), o.float().nan_to_num(7.0))
               for o in ys[1:])
    idx, ref = reference_l2_slots(h, w2, counts, srt, wts, ks, experts=4)
    res = dict(tokens=T, dims=dims, ks=ks, y_dtype=ydt, routing=routing, kernel=kernel,
               rings=rings, repeat_same_bits=same, **slot_errors(ys[0], idx, ref, k))
    tol = 2e-3 if ydt == "f32" else 1e-2
    res["ok"] = bool(res["all_written"] and res["others_untouched"] and same and
                     res["rel_err_vs_fp32"] < tol)
    if kernel == "ws":
        y = torch.full_like(ys[0], float("nan"))
        mgl.l2_gluon(h, w2, counts, srt, wts, y, topk=k, ks=ks, max_tiles=min(P, P // mgl.BM + E))
        torch.cuda.synchronize()
        res["same_bits_as_gluon_l2"] = bool(torch.equal(ys[0].float().nan_to_num(7.0),
                                                        y.float().nan_to_num(7.0)))
        res["rel_err_vs_gluon_l2"] = rel(ys[0][:, :k], y[:, :k])
        res["ok"] = res["ok"] and res["same_bits_as_gluon_l2"]
    return res


def _rings(spec: str | None) -> tuple[int | None, int | None, int | None, int | None]:
    """'NS:NU', 'NS:NU:BN' or 'NS:NU:BN:UPP' -> (stages, bstages, bn, upp) of l2_gluon_ws (upp:
    its upcast partitions, 1 or 2); None / '' / a missing field -> its default."""
    parts = [int(x) for x in spec.split(":")] if spec else []
    return tuple(parts[i] if len(parts) > i else None for i in range(4))


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
                                               "WRONG results by design, to see what bounds it")),
                          ("--ws", dict(default="6:3,8:3,4:3,4:3:256,5:3:256,4:3:256:2,"
                                                "6:3:128:2",
                                        help="ring depths NS:NU[:BN[:UPP]] of the "
                                             "warp-specialized L2 (moe_gluon_l2_ws; BN the "
                                             "tile's output columns, 128 or 256; UPP its "
                                             "upcast partitions, 1 or 2), comma-separated, "
                                             "each checked then timed as a row; 'none': no ws "
                                             "rows"))])
    args = ap.parse_args()

    def write():  # the JSON / md, after every row: a later crash loses nothing measured
        _write(args.out, res)

    if args.check_json:  # child process of check_cases_in_child: one JSON line per case
        run_checks(args.check_json,
                   lambda c: check(c["tokens"], c["dims"], c["ks"], c["ydt"], c["routing"],
                                   c.get("kernel", "gluon"), c.get("rings")))
        return

    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe import gluon_l2 as mgl

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
              moe.pick_tile("l2", rpg).__dict__, rates)
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
    mtg = min(P, P // mgl.BM + E)
    tiles = moe.tile_list(counts, mgl.BM, mtg)
    y_gl = torch.full_like(y_tr, float("nan"))
    inputs = (h, w2, counts, srt, wts)
    if not_checked(res, write, name, checks, len(cases)):
        y_gl = None
    else:
        y_gl = _gluon_rows(res, write, args, inputs, tiles, mtg, y_gl, idx, ref, y_tr, rates)
    specs = [x.strip() for x in args.ws.split(",") if x.strip() and x.strip() != "none"]
    if specs:
        _ws_rows(res, write, specs, cases, inputs, tiles, mtg, y_gl, idx, ref, rates)
    finish(res, t_start, write)


def _gluon_rows(res, write, args, inputs, tiles, mtg, y_gl, idx, ref, y_tr, rates):
    """The Gluon L2's rows (after its child check passed): timed, + tile_list, the arithmetic
    upcast, its errors, the --diag rows. Returns y_gl holding its output (None where its timed
    launch failed)."""
    from megagraph.kernels.moe import gluon_l2 as mgl

    h, w2, counts, srt, wts = inputs
    k, ks = wts.shape[1], res["ks"]
    name = "gluon l2"

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
        y_gl.fill_(float("nan"))  # the plain launch's output for the ws comparison
        gluon_l2()
        torch.cuda.synchronize()
        return y_gl
    return None


def _ws_rows(res, write, specs, cases, inputs, tiles, mtg, y_gl, idx, ref, rates) -> None:
    """The warp-specialized L2 (moe_gluon_l2_ws) at each ring depth NS:NU in specs: checked in a
    child process (the cases of the Gluon L2's check, + bit equality with it), timed if that
    passes, its output compared with the fp32 rows and bit for bit with the Gluon L2's (y_gl;
    None where that did not run)."""
    from megagraph.kernels.moe import gluon_l2_ws as mlw

    h, w2, counts, srt, wts = inputs
    k, ks = wts.shape[1], res["ks"]
    res.setdefault("ws", {})
    for spec in specs:
        name = f"gluon l2 ws {spec}"
        ns, nu, bn, upp = _rings(spec)
        wcases = [dict(c, kernel="ws", rings=spec) for c in cases]
        checks = check_cases_in_child(__file__, wcases, timeout=180.0)
        res["ws"][spec] = dict(checks=checks)
        print(json.dumps(checks), flush=True)
        write()
        if not_checked(res, write, name, checks, len(wcases)):
            continue
        y_ws = torch.full((wts.shape[0], ks, w2.n), float("nan"), dtype=YDT[res["y_dtype"]],
                          device="cuda")

        def ws_l2(prebuilt=True, ns=ns, nu=nu, bn=bn, upp=upp, y=y_ws):
            mlw.l2_gluon_ws(h, w2, counts, srt, wts, y, topk=k, ks=ks, max_tiles=mtg,
                            tiles=tiles if prebuilt else None, stages=ns, bstages=nu, bn=bn,
                            upp=upp)

        bn_ = bn or mlw.BN_TILE
        kc = mlw.kernel_consts(w2.k, bn=bn_, upp=upp)  # the launch's upcasts and registers
        tile = dict(bm=mlw.BM, bn=bn_, bk=mlw.BK,
                    ns=ns or (mlw.NS if bn_ == mlw.BN else mlw.NS_256),
                    nu=nu or (mlw.NU if bn_ == mlw.BN else mlw.NU_256), upp=kc["UPP"],
                    regs=(kc["R_MMA"], kc["R_UP"], kc["R_LD"]), maxnreg=mlw.launch_maxnreg(kc),
                    persistent=True)
        if timed_row(res, write, name, ws_l2, tile, rates):
            if spec == specs[0]:
                timed_row(res, write, f"{name} + tile_list", lambda: ws_l2(prebuilt=False),
                          None, rates)
            try:
                y_ws.fill_(float("nan"))
                ws_l2()
                torch.cuda.synchronize()
                out = dict(slot_errors(y_ws, idx, ref, k))
                if y_gl is not None:
                    out["same_bits_as_gluon_l2"] = bool(torch.equal(
                        y_ws.float().nan_to_num(7.0), y_gl.float().nan_to_num(7.0)))
                    out["rel_err_vs_gluon_l2"] = rel(y_ws[:, :k], y_gl[:, :k])
                res["ws"][spec].update(out)
                print({name: out}, flush=True)
            except Exception as exc:  # noqa: BLE001
                res["ws"][spec]["error"] = repr(exc)[:500]
            write()


def _body(res) -> list:
    """The report's body: the timing table, the error lines, the child checks and each
    warp-specialized item's comparison with the Gluon L2."""
    lines = table(res["rows"], "| launch | ms | TFLOP/s | % of 989 |",
                  lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{r['pct_peak']:.1f}"])
    lines += l2_error_lines(res, experts=4)
    lines += check_lines("gluon l2", res.get("gluon_checks", []))
    for spec, w in res.get("ws", {}).items():
        lines += check_lines(f"gluon l2 ws {spec}", w.get("checks", []))
        lines.append(f"gluon l2 ws {spec} at these dims: same bits as gluon l2 "
                     f"{w.get('same_bits_as_gluon_l2')}, rel vs gluon l2 "
                     f"{w.get('rel_err_vs_gluon_l2')}, rel vs fp32 "
                     f"{w.get('rel_err_vs_fp32')}, all written {w.get('all_written')}, "
                     f"others untouched {w.get('others_untouched')}"
                     + (f", error {w['error'][:200]}" if "error" in w else ""))
    return lines


def _write(out, res) -> None:
    head = [(f"# Gluon prefill L2 probe, {res['tokens']} tokens, dims {res['dims']}, routing "
             f"{res.get('routing')}, ks {res.get('ks')}, y {res.get('y_dtype')}")]
    if "rows_per_expert" in res:
        head += ["", f"rows per expert: {res['rows_per_expert']}"]
    probe_report(out, "moe_gluon_l2_probe", head, res, _body)


if __name__ == "__main__":
    main()
