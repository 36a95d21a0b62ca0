"""Times the experimental Gluon L1 (kernels/triton/moe_gluon.py: hand-pipelined async wgmma, the
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
routing), where 128-row tiles pad (an expert with 129 rows takes 2 tiles). Every Gluon variant
- row tile bm = 128 / 64 x PTX upcast "lane" (moe_jit.FP4_E4M3_ASM, per-byte-lane offsets) /
"pack" (moe_gluon.FP4_PACK_ASM_TEXT, one offset per int32 word) - is checked in its own child
process (small dims, then these dims and routing) and timed only if correct.

Order: the Triton L1 is timed first and the JSON written after every row; then the Gluon L1 is
checked in child processes (CUDA_LAUNCH_BLOCKING=1; small dims, then these dims), so an illegal
memory access cannot lose the Triton row; the Gluon L1 is timed only if both checks pass
(else its row records the check results).

L1 FLOPs = 2 * rows * 2F * d (rows = tokens * top-k); % of peak against 1430 TFLOP/s (H200
dense FP8). Needs CUDA sm_90 and Triton 3.6 (moe_gluon.available()); elsewhere it says so and
exits 0 (with --out, a JSON that records the skip). Meant to finish in < 150 s on the H200
(one child process per Gluon variant; not yet timed there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

PEAK_TFLOPS = 1430.0
REAL = dict(d=5120, F=2304, E=384, k=6)
SMOKE = dict(d=1024, F=256, E=16, k=6)


def time_ms(fn, reps: int = 5, min_ms: float = 20.0) -> float:
    """Median ms per call: warm-up, one CUDA graph of n calls (n sized to >= min_ms per replay),
    replays timed with events; eager batches if the capture fails."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(1, min(200, int(min_ms / max(1e-3, 1e3 * (time.perf_counter() - t0)))))
    run = None
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        run = g.replay
    except Exception as exc:  # noqa: BLE001  (eager fallback, reported)
        print(f"[probe] graph capture failed ({exc!r}): eager timing", file=sys.stderr)

        def run():
            for _ in range(n):
                fn()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


def build(T: int, d: int, F: int, E: int, k: int, seed: int = 0, routing: str = "balanced"):
    """x_q / x_scale (E4M3 per 128), W1 / W3 banks, ids (balanced: token t -> experts 6t ..
    6t + 5 mod E; poisson: top-k of random router logits), counts, sorted pair list."""
    from megagraph.kernels.triton import moe

    torch.manual_seed(seed)
    dev = "cuda"
    x = torch.randn(T, d, device=dev)
    xb = x.view(T, d // 128, 128)
    sc = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1).clamp_min(1e-4) / 448)))
    xq = (xb / sc[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, d)
    xs = sc.float().contiguous()

    def bank():
        w = torch.randint(-128, 128, (E, F, d // 2), dtype=torch.int8, device=dev)
        s = torch.randint(119, 125, (E, F, d // 32), dtype=torch.uint8, device=dev)
        return moe.bank(w, s.view(torch.float8_e8m0fnu), "mxfp4")

    w1, w3 = bank(), bank()
    if routing == "poisson":
        ids = torch.randn(T, E, device=dev).topk(k, dim=1).indices
    else:
        t = torch.arange(T, device=dev)[:, None]
        ids = (t * k + torch.arange(k, device=dev)[None, :]) % E
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    srt = moe.permute(ids.flatten(), counts, E)
    return xq, xs, w1, w3, counts, srt


def reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts: int):
    """fp32 H of the first `experts` experts' sorted rows (exactly dequantized operands)."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=xq.device)
    lut = torch.cat([lut, -lut])

    def deq(b, e):
        v = b.w[e].view(torch.uint8).long()
        v = torch.stack([lut[v & 0xF], lut[v >> 4]], -1).flatten(-2)
        return v * torch.exp2(b.s[e].float() - 127).repeat_interleave(32, -1)

    a = (xq.float().view(xq.shape[0], -1, 128) * xs[..., None]).view(xq.shape[0], -1)
    outs, r0 = [], 0
    for e, c in enumerate(counts.tolist()[:experts]):
        rows = a[srt[r0:r0 + c].long() // k]
        gt = (rows @ deq(w1, e).T).clamp(max=limit)
        up = (rows @ deq(w3, e).T).clamp(-limit, limit)
        outs.append(gt * torch.sigmoid(gt) * up)
        r0 += c
    return torch.cat(outs), r0


def rel(x, y) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30))


def check(T: int, dims: dict, limit: float, bm: int = 128, asm: str = "lane",
          routing: str = "balanced", maxnreg: int | None = None) -> dict:
    """One Gluon L1 call (into a NaN-poisoned output) against the fp32 math of the first experts'
    rows: every row written, relative error. Meant for a child process (--check): an illegal
    memory access there kills only that process's CUDA context."""
    from megagraph.kernels.triton import moe_gluon as mg

    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, seed=1, routing=routing)
    P = T * k
    mtg = min(P, P // bm + E)
    h = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    mg.l1_gluon(xq, xs, srt, w1, w3, counts, h, topk=k, max_tiles=mtg, limit=limit, bm=bm,
                asm=asm, use_asm=True, maxnreg=maxnreg)
    torch.cuda.synchronize()
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts=min(E, 4))
    err = rel(h[:n].nan_to_num(0.0, 0.0, 0.0), ref)
    written = bool(torch.isfinite(h).all())
    return dict(tokens=T, dims=dims, bm=bm, asm=asm, routing=routing, all_written=written,
                rel_err_vs_fp32=err, ok=written and err < 2e-3)


def check_in_child(cases: list, timeout: float = 120.0) -> list:
    """check(**case) for each case, in order, in ONE child process with CUDA_LAUNCH_BLOCKING=1
    (the error names the launch; one process start per variant); stops at the first failure.
    Returns the results (a failed or crashed case last)."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--check-json", json.dumps(cases)]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        return got + [dict(cases[len(got)] if len(got) < len(cases) else {}, ok=False,
                           error=f"check timed out ({timeout} s)")]
    got = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if len(got) < len(cases) and not (got and not got[-1].get("ok")):
        got.append(dict(cases[len(got)], ok=False,
                        error=f"rc {r.returncode}: {(r.stderr or r.stdout)[-800:]}"))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens (rows = tokens * 6)")
    ap.add_argument("--smoke", action="store_true", help="small dims (d 1024, F 256, 16 experts)")
    ap.add_argument("--limit", type=float, default=10.0, help="SwiGLU clamp")
    ap.add_argument("--routing", choices=("balanced", "poisson"), default="balanced",
                    help="balanced: 128 rows per expert at 8192 tokens; poisson: top-6 of "
                         "random logits (89 .. 183 rows per expert)")
    ap.add_argument("--variants", default="128:lane,128:pack,64:lane,64:pack",
                    help="gluon variants bm:asm[:maxnreg], comma-separated (e.g. 64:lane:128: "
                         "2 programs of 8 warps per SM)")
    ap.add_argument("--out", default=None, help="directory for moe_gluon_probe.json / .md")
    ap.add_argument("--check-json", default=None, help=argparse.SUPPRESS)  # child: check()
    args = ap.parse_args()

    if args.check_json:  # child process of check_in_child: one JSON line per case
        for c in json.loads(args.check_json):
            try:
                res = check(c["tokens"], c["dims"], c["limit"], c["bm"], c["asm"], c["routing"],
                            c.get("maxnreg"))
            except Exception as exc:  # noqa: BLE001  (reported to the parent)
                res = dict(c, ok=False, error=repr(exc)[:800])
            print(json.dumps(res), flush=True)
            if not res.get("ok"):
                return
        return

    from megagraph.kernels.triton import moe
    from megagraph.kernels.triton import moe_gluon as mg

    dims = SMOKE if args.smoke else REAL
    T = min(args.tokens, 512) if args.smoke else args.tokens
    res = dict(tokens=T, dims=dims, routing=args.routing, peak_tflops=PEAK_TFLOPS, rows=[])
    if not mg.available():
        res["skipped"] = "needs CUDA sm_90 and Triton 3.6 Gluon (moe_gluon.available())"
        print(res["skipped"])
        return _write(args.out, res)
    t_start = time.perf_counter()
    d, F, E, k = dims["d"], dims["F"], dims["E"], dims["k"]
    xq, xs, w1, w3, counts, srt = build(T, d, F, E, k, routing=args.routing)
    P = T * k
    cl = counts.tolist()
    res["rows_per_expert"] = dict(min=min(cl), max=max(cl), mean=P / E,
                                  tiles_bm128=sum(-(-c // 128) for c in cl),
                                  tiles_bm64=sum(-(-c // 64) for c in cl))
    rpg = P / max(1, min(E, P))
    cfg = moe.pick_config("l1", rpg)
    mt1 = min(P, P // cfg.bm + E)
    h_tr = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    flops = 2.0 * P * 2 * F * d

    def triton_l1():
        moe.gemm(xq, xs, w1, h_tr, b2=w3, role="l1", rows_per_group=rpg, counts=counts,
                 a_idx=srt, topk=k, max_tiles=mt1, limit=args.limit)

    def timed(name, fn, tile):
        try:
            ms = time_ms(fn)
            tf = flops / ms / 1e9
            row = dict(name=name, ms=ms, tflops=tf, pct_peak=100 * tf / PEAK_TFLOPS, tile=tile)
        except Exception as exc:  # noqa: BLE001  (reported, the JSON keeps the other rows)
            row = dict(name=name, error=repr(exc)[:500])
        res["rows"].append(row)
        print(row, flush=True)
        _write(args.out, res)  # after every row: a later crash loses nothing measured
        return "error" not in row

    # 1) the Triton L1 first (the baseline survives whatever the Gluon kernel does)
    timed("triton l1 (moe.gemm)", triton_l1, cfg.__dict__)
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, args.limit, experts=4)
    res["rel_err_triton_vs_fp32"] = rel(h_tr[:n], ref)
    _write(args.out, res)
    # 2) each Gluon variant: checked in a child process (an illegal access there cannot poison
    # this process's context; small dims, then these dims and routing), then timed
    res["gluon_checks"] = {}
    h_gl = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")
    for var in args.variants.split(","):
        bm_s, asm, *mr = var.split(":")
        bm, maxnreg = int(bm_s), (int(mr[0]) if mr else None)
        name = f"gluon l1 bm{bm} {asm}" + (f" maxnreg {maxnreg}" if maxnreg else "")
        cases = [dict(tokens=min(T, 256), dims=SMOKE, limit=args.limit, bm=bm, asm=asm,
                      routing=args.routing, maxnreg=maxnreg)]
        if dims != SMOKE:
            cases.append(dict(cases[0], tokens=T, dims=dims))
        checks = check_in_child(cases)
        res["gluon_checks"][name] = checks
        print(json.dumps(checks), flush=True)
        _write(args.out, res)
        if len(checks) < len(cases) or not all(c.get("ok") for c in checks):
            res["rows"].append(dict(name=name, error="wrong or crashed in the child check: "
                                    "not timed (gluon_checks)"))
            print(res["rows"][-1], flush=True)
            _write(args.out, res)
            continue
        mtg = min(P, P // bm + E)
        tiles = moe.tile_list(counts, bm, mtg)
        h_gl.fill_(float("nan"))

        def gluon_l1(bm=bm, asm=asm, mtg=mtg, tiles=tiles, maxnreg=maxnreg):
            mg.l1_gluon(xq, xs, srt, w1, w3, counts, h_gl, topk=k, max_tiles=mtg,
                        limit=args.limit, tiles=tiles, bm=bm, asm=asm, use_asm=True,
                        maxnreg=maxnreg)

        ok = timed(name, gluon_l1, dict(bm=bm, bn=mg.BN, bk=mg.BK, nsa=mg.NSA, asm=asm,
                                        maxnreg=maxnreg, **mg.TILES[bm]))
        if ok:
            try:
                torch.cuda.synchronize()
                row = res["rows"][-1]
                row["all_written"] = bool(torch.isfinite(h_gl).all())
                row["rel_err_vs_triton"] = rel(h_gl, h_tr)
                row["rel_err_vs_fp32"] = rel(h_gl[:n], ref)
                print({x: row[x] for x in ("all_written", "rel_err_vs_triton",
                                           "rel_err_vs_fp32")}, flush=True)
            except Exception as exc:  # noqa: BLE001
                res["rows"][-1]["check_error"] = repr(exc)[:500]
            _write(args.out, res)
    res["wall_s"] = time.perf_counter() - t_start
    print(json.dumps({x: res[x] for x in res if x != "rows"}, indent=1), flush=True)
    _write(args.out, res)


def _write(out, res) -> None:
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "moe_gluon_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [(f"# Gluon L1 probe, {res['tokens']} tokens, dims {res['dims']}, routing "
              f"{res.get('routing', 'balanced')}"), ""]
    if "rows_per_expert" in res:
        lines += [f"rows per expert: {res['rows_per_expert']}", ""]
    if "skipped" in res:
        lines.append(f"skipped: {res['skipped']}")
    else:
        lines += ["| launch | ms | TFLOP/s | % of 1430 | rel vs triton | rel vs fp32 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"| {r['name']} | error: {r['error'][:120]} | | | | |")
            else:
                lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                             f"{r['pct_peak']:.1f} | {r.get('rel_err_vs_triton', 'n/a')} | "
                             f"{r.get('rel_err_vs_fp32', 'n/a')} |")
        lines += ["", f"triton vs fp32 math (first 4 experts): {res.get('rel_err_triton_vs_fp32')}"]
        for name, checks in res.get("gluon_checks", {}).items():
            for c in checks:
                lines.append(f"{name} check {c.get('tokens')} tokens {c.get('dims')}: ok "
                             f"{c.get('ok')}, rel {c.get('rel_err_vs_fp32')}, written "
                             f"{c.get('all_written')}, error {str(c.get('error', ''))[:200]}")
    with open(os.path.join(out, "moe_gluon_probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
