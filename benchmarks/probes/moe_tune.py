"""Tile sweep of the routed-expert GEMMs (kernels/moe/triton.py: L1 = W1/W3 + SwiGLU, L2 = W2 +
routing weights) at V4.1-Flash dims on the GPU, one launch timed at a time (CUDA-graph replays),
each candidate checked against the reference `moe_experts_q` before it counts.

    python benchmarks/probes/moe_tune.py --out /tmp/tune --budget 200          # H200
    python benchmarks/probes/moe_tune.py --smoke --out /tmp/tune               # CPU: Triton interpreter
    python benchmarks/probes/moe_tune.py --fp8-h --tokens 8192 --out /tmp/tune8  # the FP8-H roles
    python benchmarks/probes/moe_tune.py --swap --tokens 64 --out /tmp/tunes     # decode, swapped MMA
    python benchmarks/probes/moe_tune.py --swap --fp8-h --tokens 64 --out /tmp/tunesq  # same, FP8-H

--fp8-h tunes the FP8-H path's roles (l1_fp8h: L1 with H quantized to E4M3 per 128 in the
epilogue, bn a multiple of 128; l2_fp8h: L2 on E4M3 H) with MoeConfig.fp8_h on;
each candidate is checked against the reference that quantizes H the same way
(reference moe_experts_q(h_fmt="fp8_1x128"), rel err < 1.5e-2 at bf16 output) and its error vs
the fp32-H reference is recorded too (rel_err_fp32h, ~2-3%).

--swap times L1 and L2 at decode sizes with the Tile.swap tiles first (moe_jit.moe_acc_swap:
C^T = W A^T per K chunk, so the 16-row tile runs on wgmma m64n16 with the E4M3 weight tile instead
of mma.sync on an fp16 copy staged through shared memory; 16 x 128 x 4 warps with / without the
parity split, 16 x 64 x 4 warps (128 registers: 4 programs per SM), 16 x 128 / 16 x 256 x 8
warps), then the heuristic's neighbours (8 warps included). With --fp8-h: the same swap tiles for
l2_fp8h (L2 on E4M3 H: QGMMA m64n16 on the E4M3 W2 tile, no fp16 copy) and, bn 128 only (whole
scale blocks), for l1_fp8h (the swapped L1 with the quantizing epilogue).

Tiles are Tile fields in order (bm, bn, bk, warps, stages, par[, qsplit[, swap]]), each timed as
the role's pinned tile (MoeConfig.tiles) next to the other role's default.
Writes OUT/moe_tune.json (every candidate: tile, ms, TB/s or TFLOP/s, error) and OUT/moe_tune.md
(the best tile per (role, tokens) next to the heuristic's). `kernels/moe/triton.py:pick_tile`
takes its tiles from this table (the committed result is benchmarks/results/moe-tune-h200.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # probes/ and benchmarks/
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from kernel_rows import rel_err, time_ms  # noqa: E402
from kernel_rows import moe as mr  # noqa: E402


def candidates(role: str, decode: bool, swap: bool = False):
    """(bm, bn, bk, warps, stages, par[, qsplit[, swap]]) to try: small-row tiles for decode,
    large for prefill. l1_fp8h: bn multiple of 128 (its epilogue owns whole 128-column scale
    blocks)."""
    if decode:
        bms, bns, warps, stages = (16, 64), (64, 128), (4,), (3, 4)
    else:
        bms, bns, warps, stages = (64, 128), (64, 128), (4, 8), (3, 4)
    if swap and decode:  # swapped MMA operands (Tile.swap) first
        for bn, w, st, par in ((128, 4, 3, True), (128, 4, 4, True), (128, 4, 3, False),
                               (64, 4, 3, True), (128, 8, 3, True), (256, 8, 3, True)):
            if role != "l1_fp8h" or bn == 128:  # the FP8-H L1 owns whole 128-column blocks
                yield (16, bn, 128, w, st, par, 1, True)
        warps = (4, 8)
    if role == "l1_fp8h":
        bns = (128, 256) if not decode else (128,)
        if not decode:  # 128 columns as two 64-column K loops (qsplit 2), then the one-loop tiles
            for bm, s, par in itertools.product((64, 128), stages, (True, False)):
                yield (bm, 128, 128, 4 if bm == 64 else 8, s, par, 2)
    for bm, bn, w, s, par in itertools.product(bms, bns, warps, stages, (True, False)):
        if bm == 128 and w == 4:
            continue
        yield (bm, bn, 128, w, s, par)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole sweep")
    ap.add_argument("--tokens", default="64,8192")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--fp8-h", action="store_true",
                    help="tune the FP8-H roles (l1_fp8h / l2_fp8h, MoeConfig.fp8_h numerics)")
    ap.add_argument("--swap", action="store_true",
                    help="decode: the Tile.swap tiles first for L1 and L2 (swapped MMA); "
                         "with --fp8-h for l1_fp8h / l2_fp8h")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    from megagraph.kernels.fused import reference as rf
    from megagraph.kernels.gemm.config import Tile
    from megagraph.kernels.moe import triton as tm
    from megagraph.kernels.moe.config import MoeConfig

    dims = mr.TINY if a.smoke else mr.V41
    t_end = time.perf_counter() + a.budget
    w = mr.make_weights(dims, dev)
    auto = tm.asm_ok(dev) if dev.type == "cuda" else False
    results = []
    Ts = [int(x) for x in a.tokens.split(",")] if not a.smoke else [8]
    for T in Ts:
        streams, (x, xq, xs, pre, post, comb) = mr.layer_inputs(dims, w, T, dev, seed=T + 1)
        E, k = dims["E"], dims["k"]
        ids, wts = tm.route(x, w["gate"], w["bias"], topk=k, route_scale=1.5)
        a2 = (xq, xs, ids, wts, *w["routed"])
        kw2 = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt="fp8_1x128", out_dtype="bf16")
        ref = rf.moe_experts_q(*a2, **kw2)
        ref_f = ref
        if a.fp8_h:  # candidates must match the quantized-H numerics; fp32-H error recorded
            ref = rf.moe_experts_q(*a2, **kw2, h_fmt="fp8_1x128")
        tol = 1.5e-2 if a.fp8_h else 1e-2
        r1, r2 = ("l1_fp8h", "l2_fp8h") if a.fp8_h else ("l1", "l2")
        base = MoeConfig(fp8_h=a.fp8_h, fp8_h_prefill=False, fp4_asm="on" if auto else "off")
        P = T * k
        rpg = P / min(E, P)
        touched = int((torch.bincount(ids.flatten(), minlength=E) > 0).sum())
        fl, by = mr.routed_counts(dims, T, touched)
        d1, d2 = tm.pick_tile(r1, rpg), tm.pick_tile(r2, rpg)
        for role, other in ((r1, r2), (r2, r1)):
            fixed = d2 if role == r1 else d1
            cands = [tuple(vars(d1 if role == r1 else d2).values())]
            cands += [c for c in candidates(role, T <= 256, a.swap)
                      if tuple(vars(Tile(*c)).values()) != cands[0]]
            per_t = 2
            n_groups_left = (per_t if role == r1 else 1) + per_t * (len(Ts) - 1 - Ts.index(T))
            g_end = time.perf_counter() + (t_end - time.perf_counter()) / n_groups_left
            for c in cands:
                if time.perf_counter() > g_end:
                    results.append(dict(T=T, role=role, tile=list(c), error="skipped: budget"))
                    continue
                cfg = replace(base, tiles=(Tile(*c).spec(role), fixed.spec(other)))
                r = dict(T=T, role=role, tile=list(c), default=c == cands[0])
                try:
                    y = tm.moe_experts_q(*a2, **kw2, kernel_config=cfg)
                    e = rel_err(y, ref)
                    r["rel_err"] = e
                    if a.fp8_h:
                        r["rel_err_fp32h"] = rel_err(y, ref_f)
                    if not e < tol:
                        r["error"] = f"wrong: rel err {e:.2e}"
                    else:
                        r["ms"] = round(time_ms(lambda: tm.moe_experts_q(*a2, **kw2,
                                                                         kernel_config=cfg),
                                                device=dev), 4)
                        r["tflops"] = round(fl / r["ms"] / 1e9, 1)
                        r["tbps"] = round(by / r["ms"] / 1e9, 3)
                except Exception as ex:  # noqa: BLE001
                    r["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                    print(traceback.format_exc(limit=2), file=sys.stderr)
                results.append(r)
                print(json.dumps(r), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "moe_tune.json").write_text(json.dumps(results, indent=1))
    lines = ["| tokens | role | heuristic tile (ms) | best tile (ms) | speed-up |", "|---|---|---|---|---:|"]
    for T in sorted({r["T"] for r in results}):
        for role in (("l1_fp8h", "l2_fp8h") if a.fp8_h else ("l1", "l2")):
            rs = [r for r in results if r["T"] == T and r["role"] == role and "ms" in r]
            if not rs:
                continue
            d = next((r for r in rs if r["default"]), None)
            b = min(rs, key=lambda r: r["ms"])
            lines.append(f"| {T} | {role} | {d['tile'] if d else '-'} ({d['ms'] if d else '-'}) | "
                         f"{b['tile']} ({b['ms']}) | {d['ms'] / b['ms']:.2f}x |" if d else "")
    (a.out / "moe_tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
