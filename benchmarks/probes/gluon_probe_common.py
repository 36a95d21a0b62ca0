"""What the Gluon probes share (benchmarks/moe_gluon_probe.py / moe_gluon_decode_probe.py: the
prefill / decode L1, moe_gluon_l2_probe.py / moe_gluon_decode_l2_probe.py: the prefill / decode
L2): the inputs at V4.1-Flash dims, the fp32 math of the first experts' rows, the timing
(CUDA-graph replays), the child-process correctness check and the row-by-row JSON / markdown
report.

Why one module: the probes time the kernels of one op against the same Triton launch and
their numbers are read side by side (benchmarks/results/), so they must build the same inputs,
time the same way and guard against a crashing kernel the same way (its check runs in a child
process, so an illegal memory access cannot lose the rows already measured). The probes import
it as a sibling (run as scripts, benchmarks/ is on sys.path; each also puts it there, as
benchmarks/kernels.py does for kernel_rows).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

# V4.1-Flash's routed experts, the dims both probes time at: hidden d, expert width F, E experts,
# top-k
V41_FLASH = dict(d=5120, F=2304, E=384, k=6)
# the L2 probes' --y-dtype choices
Y_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def probe_parser(doc: str, tokens: int, tokens_help: str, smoke_help: str, stem: str,
                 extra=()) -> argparse.ArgumentParser:
    """The probes' command line: --tokens, --smoke, --limit, the probe's own options (extra:
    (flag, add_argument keywords) pairs), --out (for <stem>.json / .md) and the hidden
    --check-json of the child process (check_in_child's payload)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=tokens, help=tokens_help)
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--limit", type=float, default=10.0, help="SwiGLU clamp")
    for flag, kw in extra:
        ap.add_argument(flag, **kw)
    ap.add_argument("--out", default=None, help=f"directory for {stem}.json / .md")
    ap.add_argument("--check-json", default=None, help=argparse.SUPPRESS)  # the child: check()
    return ap


def parse_load(spec: str) -> tuple[str, int | None]:
    """A decode probe's --load item: "cp.async", "tma" or "tma:N" -> (load, stages) for the
    launcher (l1_gluon_decode / l2_gluon_decode)."""
    load, _, stages = spec.partition(":")
    return load, (int(stages) if stages else None)


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
    """x_q / x_scale (E4M3 per 128), W1 / W3 banks (MXFP4, exponents 119 .. 124), ids, counts,
    the sorted pair list. routing: "balanced" (token t -> experts kt .. kt + k - 1 mod E),
    "poisson" (top-k of random normal router logits), "random" (top-k of uniform random
    scores: distinct experts per token, as the decode probe draws them)."""
    from megagraph.kernels.moe import triton as moe

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
    counts, srt = route(T, E, k, routing, dev)
    return xq, xs, w1, w3, counts, srt


def route(T: int, E: int, k: int, routing: str, dev: str = "cuda"):
    """The probes' routing of T tokens to top-k of E experts, (counts [E] int32, the sorted pair
    list): "balanced" (token t -> experts kt .. kt + k - 1 mod E), "poisson" (top-k of random
    normal router logits), "random" (top-k of uniform random scores: distinct experts per
    token); the random ones draw from torch's global generator."""
    from megagraph.kernels.moe import triton as moe

    if routing == "poisson":
        ids = torch.randn(T, E, device=dev).topk(k, dim=1).indices
    elif routing == "random":
        ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices
    else:
        t = torch.arange(T, device=dev)[:, None]
        ids = (t * k + torch.arange(k, device=dev)[None, :]) % E
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    return counts, moe.permute(ids.flatten(), counts, E)


def reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts: int,
                   nonempty: bool = False):
    """fp32 H of the sorted rows of the first `experts` experts (`nonempty`: the first `experts`
    experts that have rows) on exactly dequantized operands, and the number of sorted rows
    before the last expert counted (the slice h[:n] the result covers)."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=xq.device)
    lut = torch.cat([lut, -lut])

    def deq(b, e):
        v = b.w[e].view(torch.uint8).long()
        v = torch.stack([lut[v & 0xF], lut[v >> 4]], -1).flatten(-2)
        return v * torch.exp2(b.s[e].float() - 127).repeat_interleave(32, -1)

    a = (xq.float().view(xq.shape[0], -1, 128) * xs[..., None]).view(xq.shape[0], -1)
    outs, r0, done = [], 0, 0
    for e, c in enumerate(counts.tolist()):
        if done == experts:
            break
        if c or not nonempty:
            rows = a[srt[r0:r0 + c].long() // k]
            gt = (rows @ deq(w1, e).T).clamp(max=limit)
            up = (rows @ deq(w3, e).T).clamp(-limit, limit)
            outs.append(gt * torch.sigmoid(gt) * up)
            done += 1
        r0 += c
    return torch.cat(outs), r0


def rel(x, y) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30))


def run_child(script: str, payload, timeout: float):
    """`python script --check-json <payload as JSON>` with CUDA_LAUNCH_BLOCKING=1 (the error
    names the launch; a crash kills only the child's CUDA context). Returns (the JSON objects
    the child printed, one a line; whether it timed out; the error to record where the results
    fall short: the timeout, else the exit code and the tail of the child's output)."""
    cmd = [sys.executable, os.path.abspath(script), "--check-json", json.dumps(payload)]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return ([json.loads(x) for x in out.splitlines() if x.startswith("{")], True,
                f"check timed out ({timeout} s)")
    got = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return got, False, f"rc {r.returncode}: {(r.stderr or r.stdout)[-800:]}"


def check_cases_in_child(script: str, cases: list, timeout: float) -> list:
    """The probe's check(**case) for each case, in order, in ONE child process (run_child of
    `script`: CUDA_LAUNCH_BLOCKING=1, the error names the launch; one process start), which
    stops at the first failure (run_checks). Returns the results, a failed or crashed case
    last (a crash or a timeout recorded as that case with ok False and the error)."""
    got, timed_out, error = run_child(script, cases, timeout)
    if timed_out:
        return got + [dict(cases[len(got)] if len(got) < len(cases) else {}, ok=False,
                           error=error)]
    if len(got) < len(cases) and not (got and not got[-1].get("ok")):
        got.append(dict(cases[len(got)], ok=False, error=error))
    return got


def run_checks(check_json: str, check) -> None:
    """The child process of check_cases_in_child (--check-json): check(case) for each case of
    the JSON list, one JSON line per result (an exception is a failed result with its error),
    stopping at the first failure."""
    for c in json.loads(check_json):
        try:
            res = check(c)
        except Exception as exc:  # noqa: BLE001  (reported to the parent)
            res = dict(c, ok=False, error=repr(exc)[:800])
        print(json.dumps(res), flush=True)
        if not res.get("ok"):
            return


def not_checked(res: dict, write, name: str, checks: list, n_cases: int) -> bool:
    """Where the child checks fell short (fewer than n_cases results or one not ok): the kernel's
    row `name` recorded as not timed, printed and written; True then (the probe finishes)."""
    if len(checks) >= n_cases and all(c.get("ok") for c in checks):
        return False
    res["rows"].append(dict(name=name, error="wrong or crashed in the child check: "
                            "not timed (gluon_checks)"))
    print(res["rows"][-1], flush=True)
    write()
    return True


def timed_row(res: dict, write, name: str, fn, tile, rates) -> bool:
    """Times fn (time_ms) into a row {name, ms, **rates(ms), tile} (or {name, error}) appended to
    res["rows"], printed, and written at once (write(): a later crash loses nothing measured).
    True when it ran."""
    try:
        ms = time_ms(fn)
        row = dict(name=name, ms=ms, **rates(ms), tile=tile)
    except Exception as exc:  # noqa: BLE001  (reported, the JSON keeps the other rows)
        row = dict(name=name, error=repr(exc)[:500])
    res["rows"].append(row)
    print(row, flush=True)
    write()
    return "error" not in row


def time_triton_l1(res: dict, write, rates, inputs, P: int, F: int, E: int, k: int,
                   limit: float, experts: int, nonempty: bool = False):
    """The baseline, timed first (its row survives whatever the Gluon kernel does): the Triton
    L1 as routed_experts launches it (moe.gemm role "l1", pick_tile's tile for these rows per
    expert) on inputs = build(...), into a NaN-poisoned fp16 H, a row in res (timed_row with
    rates), then its error against the fp32 math of the first experts' rows (reference_rows)
    as res["rel_err_triton_vs_fp32"], written. Returns (H, the reference, the rows it covers)."""
    from megagraph.kernels.moe import triton as moe

    xq, xs, w1, w3, counts, srt = inputs
    rpg = P / max(1, min(E, P))
    cfg = moe.pick_tile("l1", rpg)
    mt1 = min(P, P // cfg.bm + E)
    h_tr = torch.full((P, F), float("nan"), dtype=torch.float16, device="cuda")

    def triton_l1():
        moe.gemm(xq, xs, w1, h_tr, b2=w3, role="l1", rows_per_group=rpg, counts=counts,
                 a_idx=srt, topk=k, max_tiles=mt1, limit=limit)

    timed_row(res, write, "triton l1 (moe.gemm)", triton_l1, cfg.__dict__, rates)
    ref, n = reference_rows(xq, xs, w1, w3, counts, srt, k, limit, experts, nonempty)
    res["rel_err_triton_vs_fp32"] = rel(h_tr[:n], ref)
    write()
    return h_tr, ref, n


def flop_rates(flops: float, peak_tflops: float):
    """The prefill probes' rates(ms) for timed_row: TFLOP/s of `flops` per call and % of
    peak_tflops."""
    def rates(ms):
        tf = flops / ms / 1e9
        return dict(tflops=tf, pct_peak=100 * tf / peak_tflops)

    return rates


def skipped(res: dict, ok: bool, what: str, write) -> bool:
    """Where the kernel cannot run here (ok False: `what`, its availability check, said no):
    the skip recorded in res, printed and written (the probe then exits 0); True then."""
    if ok:
        return False
    res["skipped"] = f"needs CUDA sm_90 and Triton 3.6 Gluon ({what})"
    print(res["skipped"])
    write()
    return True


def finish(res: dict, t_start: float, write) -> None:
    """The probe's end: its wall time, the summary (everything but the rows) printed, the last
    write."""
    res["wall_s"] = time.perf_counter() - t_start
    print(json.dumps({x: res[x] for x in res if x != "rows"}, indent=1), flush=True)
    write()


def write_report(out, stem: str, res: dict, lines: list) -> None:
    """res as out/<stem>.json and the markdown `lines` as out/<stem>.md (nothing without out)."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def cuda_probe_args(ap: argparse.ArgumentParser, argv, name: str, smoke_help: str, stem: str):
    """A CUDA probe's command line (the attention and indexer probes): its own options in ap,
    then --smoke and --out (for <stem>.json / .md); argv parsed. None where there is no CUDA
    device (said on stdout: such a probe times nothing on the CPU)."""
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--out", default=None, help=f"directory for {stem}.json / .md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: needs CUDA; nothing timed")
        return None
    return args


def write_rows(out, stem: str, argv, rows: list, md: str) -> None:
    """A CUDA probe's rows as out/<stem>.json (with the command line: argv, or sys.argv's when
    None) and its markdown `md` as out/<stem>.md; nothing without out."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        f.write(json.dumps(dict(argv=argv, rows=rows), indent=1))
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(md)


def probe_report(out, stem: str, head: list, res: dict, body) -> None:
    """A probe's report (write_report; nothing without out): the `head` lines and a blank line,
    then `skipped: <why>` where the probe did not run, else body(res)'s lines."""
    if not out:
        return
    lines = [*head, ""]
    lines += [f"skipped: {res['skipped']}"] if "skipped" in res else body(res)
    write_report(out, stem, res, lines)


def decode_label(spec: str, bt: int) -> str:
    """A decode probe item's name in the report: its --load item and token tile."""
    return f"{spec}, bt {bt}"


def decode_body(res: dict, errors: list) -> list:
    """The decode probes' report body: the experts touched, the bandwidth table, the probe's
    own error lines (`errors`) and a line per child check, named by its load and token tile."""
    lines = [(f"experts touched: {res.get('experts_touched')}, max rows per expert "
              f"{res.get('max_rows_per_expert')}, weight bytes {res.get('weight_bytes')}"), ""]
    lines += table(res["rows"], "| launch | ms | GB/s | % of 4.24 TB/s | TFLOP/s |",
                   lambda r: [f"{r['ms']:.3f}", f"{r['gbs']:.0f}", f"{r['pct_bw']:.1f}",
                              f"{r['tflops']:.0f}"])
    lines += ["", *errors]
    for c in res.get("gluon_checks", []):
        lines += check_lines(f"gluon {decode_label(c.get('load', 'cp.async'), c.get('bt', 16))}",
                             [c])
    return lines


def table(rows: list, head: str, cells) -> list:
    """A markdown table of the probe's rows: header `head` ("| a | b |"), one line a row, an
    errored row as its error in the second column (cells(row): the other rows' cells)."""
    n = head.count("|") - 1
    lines = [head, "|" + " --- |" * n]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:120]} |" + " |" * (n - 2))
        else:
            lines.append("| " + " | ".join([r["name"], *cells(r)]) + " |")
    return lines


def check_lines(prefix: str, checks: list) -> list:
    """One markdown line per child check result."""
    return [f"{prefix} check {c.get('tokens')} tokens {c.get('dims')}: ok "
            f"{c.get('ok')}, rel {c.get('rel_err_vs_fp32')}, written "
            f"{c.get('all_written')}, error {str(c.get('error', ''))[:200]}" for c in checks]


def build_l2(T: int, d: int, F: int, E: int, k: int, seed: int = 0, routing: str = "random",
             wts_lo: float = 0.0):
    """The L2 probes' inputs (moe_gluon_decode_l2_probe.py: "random" routing, weights in [0, 1);
    moe_gluon_l2_probe.py: "balanced" / "poisson", weights in [0.25, 1.25)): fp16 H [T k, F]
    (the L1's output in expert-sorted rows; N(0, 1) values), a W2 bank [E, d, F / 2] (MXFP4,
    exponents 119 .. 124), top-k routing (route), the sorted pair list and the pair weights in
    [wts_lo, wts_lo + 1): (h, w2, counts, srt, wts [T, k]) on the GPU."""
    from megagraph.kernels.moe import triton as moe

    torch.manual_seed(seed)
    dev = "cuda"
    h = torch.randn(T * k, F, device=dev).to(torch.float16)
    w = torch.randint(-128, 128, (E, d, F // 2), dtype=torch.int8, device=dev)
    s = torch.randint(119, 125, (E, d, F // 32), dtype=torch.uint8, device=dev)
    w2 = moe.bank(w, s.view(torch.float8_e8m0fnu), "mxfp4")
    counts, srt = route(T, E, k, routing, dev)
    wts = torch.rand(T, k, device=dev) + wts_lo
    return h, w2, counts, srt, wts


def reference_l2_slots(h, w2, counts, srt, wts, ks: int, experts: int):
    """fp32 y rows of the first `experts` experts with rows: row_w[p] x (H[r] @ W2[g]^T) on the
    exactly dequantized W2, as (y row indices (p // k) ks + p % k, the rows [n, d])."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=h.device)
    lut = torch.cat([lut, -lut])
    k = wts.shape[1]
    idx, rows, r0, done = [], [], 0, 0
    for e, c in enumerate(counts.tolist()):
        if done == experts:
            break
        if c:
            v = w2.w[e].view(torch.uint8).long()
            W = torch.stack([lut[v & 0xF], lut[v >> 4]], -1).flatten(-2)
            W = W * torch.exp2(w2.s[e].float() - 127).repeat_interleave(32, -1)
            p = srt[r0:r0 + c].long()
            idx.append((p // k) * ks + p % k)
            rows.append(wts.reshape(-1)[p, None] * (h[r0:r0 + c].float() @ W.T))
            done += 1
        r0 += c
    return torch.cat(idx), torch.cat(rows)


def slot_errors(y, idx, ref, k: int) -> dict:
    """The L2 probes' check of y [T, ks, d]: every routed slot (the first k) written (finite),
    every other slot untouched (NaN), and the rel. error of the rows idx against ref
    (reference_l2_slots)."""
    flat = y.view(-1, y.shape[-1])
    return dict(all_written=bool(torch.isfinite(y[:, :k]).all()),
                others_untouched=bool(torch.isnan(y[:, k:].float()).all()),
                rel_err_vs_fp32=rel(flat[idx].nan_to_num(0.0, 0.0, 0.0), ref))


def l2_error_lines(res: dict, experts: int) -> list:
    """The L2 probes' report lines on the errors: Gluon vs Triton L2 (rel_err_gluon_vs_triton),
    both against the fp32 math of the first `experts` experts' rows (res["triton"] /
    res["gluon"]: slot_errors)."""
    v = res.get("rel_err_gluon_vs_triton")
    return ["", f"rel err gluon vs triton: {f'{v:.2e}' if isinstance(v, float) else 'n/a'}",
            f"triton vs fp32 math (first {experts} experts): {res.get('triton')}",
            f"gluon vs fp32 math (first {experts} experts): {res.get('gluon')}"]


def bandwidth_rates(res: dict, counts, bytes_per_expert: int, peak_gbs: float):
    """The decode probes' bandwidth accounting: records in res the experts a call touches, the
    largest expert's rows and the weight bytes it must read (touched experts x
    bytes_per_expert: packed FP4 + E8M0 of the matrices the kernel streams); returns
    rates(ms) -> GB/s and % of peak_gbs for timed_row."""
    touched = int((counts > 0).sum())
    wbytes = touched * bytes_per_expert
    res.update(experts_touched=touched, max_rows_per_expert=int(counts.max()),
               weight_bytes=wbytes)

    def rates(ms):
        gbs = wbytes / ms / 1e6
        return dict(gbs=gbs, pct_bw=100 * gbs / peak_gbs)

    return rates


def checks_passed(res: dict, write, name: str, checks: list) -> bool:
    """Records a launch's child checks (small dims, then the probe's); where either is missing,
    wrong or crashed, an error row for `name` instead (the launch is then not timed)."""
    res["gluon_checks"] += checks
    print(json.dumps(checks), flush=True)
    write()
    if len(checks) < 2 or not all(c.get("ok") for c in checks):
        msg = f"{name} is wrong or crashed (gluon_checks): not timed"
        res["rows"].append(dict(name=name, error=msg))
        print(msg, flush=True)
        return False
    return True


def time_decode_variants(timed, name: str, launch, tiles, mod, bt: int, load: str,
                         stages: int | None, out):
    """The rows of one decode launch (module `mod`'s tile constants): with the prebuilt tile
    list, with the list built in the call, with the integer-arithmetic upcast. Returns `out`
    refilled by one plain launch (NaN first, so a row it skips shows), None if not timed."""
    tile = dict(bw=mod.BW, bt=bt, bk=mod.BK, warps=mod.NUM_WARPS, load=load,
                ns=mod.NS if load == "cp.async" else (stages or mod.TMA_STAGES))
    if not timed(name, lambda: launch(tiles=tiles), tile):
        return None
    timed(f"{name} + tile_list", launch, None)
    timed(f"{name} (arith upcast)", lambda: launch(tiles=tiles, use_asm=False), None)
    out.fill_(float("nan"))
    launch(tiles=tiles)
    return out
