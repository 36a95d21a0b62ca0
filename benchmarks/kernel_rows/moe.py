"""Benchmark rows of the MegaMoE path in Triton (kernels/moe/triton.py, mhc.py) at real
V4.1-Flash dims: hidden 5120, 384 routed experts x 2304 (MXFP4, E8M0 per 32), top-6 + 1 shared
expert (FP8, 32x32 E8M0 blocks), 4 mHC streams; random weights made on the device.

Rows per token count (64 = decode, 8192 = prefill; --smoke / CPU: tiny dims, torch paths only):
  mega_mhc          Triton vs the capturable torch path (what the plan ran before), its
                    torch.compile, and the reference;
  mega_moe          the whole MoE layer (router, routed + shared experts, combine, residual
                    expand) vs capturable and reference;
  routed experts    moe_experts_q alone (the routed-expert GEMMs + permutation + combine): the row
                    to read next to DeepGEMM's grouped FP8 GEMMs on this H200 (4.23 ms at 8192
                    tokens, 2.23 ms at 64 decode tokens; experts upcast to FP8), with a sweep of
                    tiles and of the PTX upcast (MoeConfig.fp4_asm) in its notes;
  routed FP8-H      the same op with H quantized to E4M3 per 128 in L1's epilogue and the FP8
                    L2 (MoeConfig.fp8_h; roles l1_fp8h / l2_fp8h, a few tiles in its notes), baseline = the best default (fp16-H) variant above; rel_err
                    vs the fp32-H reference (expected ~2-3%: H's E4M3 rounding) and
                    rel_err_q vs the reference that quantizes H the same way (the kernel's
                    own numerics: ~1e-2 at most, bf16 output);
  pieces            router (gate GEMM + top-k + counts), permutation, L1, L2, shared expert,
                    combine + expand, timed alone;
  FP8-block GEMMs   attention projections (linear_q, grouped wo_a) vs capturable, torch.compile
                    and torch._scaled_mm (per-tensor FP8 cuBLAS at the same shape: a speed
                    reference, not the same numerics).
Bytes are the floor: weights of the experts the routing touched (FP4 + scales) + every
activation read once and written once; FLOPs count the multiply-adds the op must do (x2).
Each Triton row carries its relative error vs the reference op on the same inputs. Every
variant is a MoeConfig / GemmConfig passed as the ops' kernel_config, as the plan binds it.
Time: CUDA-graph replays (kernel_rows.time_ms); slow torch baselines: one timed call after a
warm-up call. Rows stop being added after BUDGET_S seconds.
"""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import replace

import torch

from megagraph.kernels.gemm.config import GemmConfig, Tile
from megagraph.kernels.moe.config import MoeConfig

from . import rel_err, row, time_ms, time_once_ms

V41 = dict(d=5120, F=2304, E=384, k=6, n=4, fs=2304, block=32)
TINY = dict(d=256, F=128, E=8, k=2, n=4, fs=128, block=32)
MHC_KW = dict(eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20, act_fmt="fp8_1x128")
MOE_KW = dict(route_scale=1.5, norm_topk=True, score_func="sqrtsoftplus", fmt="mxfp4",
              shared_fmt="fp8_block", swiglu_limit=10.0, act_fmt="fp8_1x128")
DEEPGEMM_MS = {8192: 4.23, 64: 2.23}  # grouped FP8 GEMMs, routed experts, this H200 (brief)
BUDGET_S = 250.0
COMPILE = True  # torch.compile baselines (decode sizes only: each compile costs tens of seconds)


def log(msg: str) -> None:
    print(f"[moe rows] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def make_weights(dims: dict, dev, seed: int = 0) -> dict:
    from megagraph.kernels import formats

    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    d, F, E, n, fs, blk = dims["d"], dims["F"], dims["E"], dims["n"], dims["fs"], dims["block"]

    def fp4(*shape):
        w = torch.randint(-128, 128, shape, dtype=torch.int8, device=dev, generator=g)
        s = torch.randint(119, 125, (*shape[:-1], shape[-1] * 2 // 32), dtype=torch.uint8,
                          device=dev, generator=g)
        return w, s.view(torch.float8_e8m0fnu)

    def fp8(N, K):
        return formats.quantize_fp8_block(
            torch.randn(N, K, device=dev, generator=g) * 0.02, blk)

    w = {"gate": (torch.randn(E, d, device=dev, generator=g) * 0.02).to(torch.bfloat16),
         "bias": torch.randn(E, device=dev, generator=g) * 0.01,
         "fn": torch.randn((2 + n) * n, n * d, device=dev, generator=g) * 0.01,
         "base": torch.randn((2 + n) * n, device=dev, generator=g) * 0.1,
         "scale": torch.rand(3, device=dev, generator=g) + 0.5,
         "nw": (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16)}
    w1, s1 = fp4(E, F, d // 2)
    w3, s3 = fp4(E, F, d // 2)
    w2, s2 = fp4(E, d, F // 2)
    w["routed"] = (w1, s1, w3, s3, w2, s2)
    w["shared"] = (*fp8(fs, d), *fp8(fs, d), *fp8(d, fs))
    return w


def layer_inputs(dims: dict, w: dict, T: int, dev, seed: int):
    """streams, and the Mega-mHC outputs the MoE reads (through the reference on CPU / the
    Triton kernel on the GPU)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    streams = torch.randn(T, dims["n"], dims["d"], device=dev, generator=g).to(torch.bfloat16)
    from megagraph.kernels.moe import triton as tm

    if tm.available() and tm.on_device(streams):
        from megagraph.kernels.mhc.triton import mega_mhc
    else:
        from megagraph.kernels.fused.reference import mega_mhc
    mhc = mega_mhc(streams, w["fn"], w["base"], w["scale"], None, w["nw"], **MHC_KW)
    return streams, mhc


def moe_counts(dims: dict, T: int, routed_experts_touched: int) -> tuple[int, int]:
    """(flops, bytes) of the whole MoE layer (router + routed + shared + expand)."""
    d, F, E, k, n, fs = (dims[x] for x in ("d", "F", "E", "k", "n", "fs"))
    flops = 2 * T * E * d + 2 * T * k * 3 * F * d + 2 * T * 3 * fs * d
    expert = 3 * F * d // 2 + 3 * F * d // 32
    byt = (routed_experts_touched * expert + 3 * fs * d + 3 * fs * d // 1024 + E * d * 2
           + T * d * (2 + 1) + T * d // 128 * 4 + 2 * T * n * d * 2 + T * (n + n * n) * 4)
    return flops, byt


def routed_counts(dims: dict, T: int, touched: int) -> tuple[int, int]:
    d, F, k = dims["d"], dims["F"], dims["k"]
    flops = 2 * T * k * 3 * F * d
    byt = touched * (3 * F * d // 2 + 3 * F * d // 32) + T * d + T * d // 128 * 4 + T * d * 2
    return flops, byt


def mhc_counts(dims: dict, T: int) -> tuple[int, int]:
    d, n = dims["d"], dims["n"]
    nm = (2 + n) * n
    flops = 2 * T * nm * n * d
    byt = T * n * d * 2 + nm * n * d * 4 + T * d * (2 + 1) + T * d // 128 * 4 + T * 6 * n * 4
    return flops, byt


# ---------------------------------------------------------------------------------------------
# CPU smoke: the torch paths only
# ---------------------------------------------------------------------------------------------


def cpu_rows(smoke: bool) -> list[dict]:
    from megagraph.kernels.fused import capturable as cf
    from megagraph.kernels.fused import reference as rf

    dev = torch.device("cpu")
    dims = TINY
    w = make_weights(dims, dev)
    out = []
    for T in (4,):
        streams, mhc = layer_inputs(dims, w, T, dev, seed=T)
        args_mhc = (streams, w["fn"], w["base"], w["scale"], None, w["nw"])
        cap = cf.mega_mhc(*args_mhc, **MHC_KW)
        ref = rf.mega_mhc(*args_mhc, **MHC_KW)
        fl, by = mhc_counts(dims, T)
        out.append(row("capturable.mega_mhc", f"T={T} tiny", time_ms(
            lambda: cf.mega_mhc(*args_mhc, **MHC_KW), device=dev), flops=fl, bytes=by,
            ref_ms=time_once_ms(lambda: rf.mega_mhc(*args_mhc, **MHC_KW), device=dev),
            rel_err=rel_err(cap[3:], ref[3:])))
        x, xq, xs, pre, post, comb = ref
        args = (x, xq, xs, streams, post, comb, w["gate"], w["bias"], *w["routed"], *w["shared"])
        kw = dict(topk=dims["k"], **MOE_KW)
        cap = cf.mega_moe(*args, **kw)
        ref = rf.mega_moe(*args, **kw)
        fl, by = moe_counts(dims, T, dims["E"])
        out.append(row("capturable.mega_moe", f"T={T} tiny", time_ms(
            lambda: cf.mega_moe(*args, **kw), device=dev), flops=fl, bytes=by,
            ref_ms=time_once_ms(lambda: rf.mega_moe(*args, **kw), device=dev),
            rel_err=rel_err(cap, ref)))
    return out


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _compiled(fn):
    return torch.compile(fn, dynamic=False, fullgraph=False)


def mhc_rows(dims, w, T, dev, t_end) -> list[dict]:
    from megagraph.kernels.fused import capturable as cf
    from megagraph.kernels.fused import reference as rf
    from megagraph.kernels.mhc import triton as th

    g = torch.Generator(device=dev)
    g.manual_seed(T)
    streams = torch.randn(T, dims["n"], dims["d"], device=dev, generator=g).to(torch.bfloat16)
    a = (streams, w["fn"], w["base"], w["scale"], None, w["nw"])
    tri = th.mega_mhc(*a, **MHC_KW)
    ref = rf.mega_mhc(*a, **MHC_KW)
    err = max(rel_err(tri[0], ref[0]), rel_err(tri[3:], ref[3:]))
    ms = time_ms(lambda: th.mega_mhc(*a, **MHC_KW), device=dev)
    base = time_ms(lambda: cf.mega_mhc(*a, **MHC_KW), device=dev)
    comp = None
    if COMPILE and T <= 256 and time.perf_counter() < t_end - 60:
        try:
            fc = _compiled(lambda s: cf.mega_mhc(s, *a[1:], **MHC_KW))
            fc(streams)
            comp = time_ms(lambda: fc(streams), device=dev, graph=False)
        except Exception as e:  # noqa: BLE001
            log(f"compile mega_mhc failed: {e}")
    fl, by = mhc_counts(dims, T)
    return [row("triton.mega_mhc", f"T={T}", ms, flops=fl, bytes=by, peak="bf16",
                baseline="capturable", baseline_ms=base, compile_ms=comp,
                ref_ms=time_once_ms(lambda: rf.mega_mhc(*a, **MHC_KW), device=dev),
                rel_err=err, notes="x / pre / post / comb vs reference (max)")]


def moe_rows(dims, w, T, dev, t_end, sweep: bool = True) -> list[dict]:
    from megagraph.kernels.fused import capturable as cf
    from megagraph.kernels.fused import reference as rf
    from megagraph.kernels.moe import triton as tm

    streams, (x, xq, xs, pre, post, comb) = layer_inputs(dims, w, T, dev, seed=T + 1)
    args = (x, xq, xs, streams, post, comb, w["gate"], w["bias"], *w["routed"], *w["shared"])
    kw = dict(topk=dims["k"], **MOE_KW)
    E, k = dims["E"], dims["k"]
    ids, wts = tm.route(x, w["gate"], w["bias"], topk=k, route_scale=1.5)
    cnt = torch.bincount(ids.flatten(), minlength=E)
    touched = int((cnt > 0).sum())
    spread = f"{touched} experts touched, rows/expert {int(cnt[cnt > 0].min())}..{int(cnt.max())}"
    out = []
    # whole layer
    tri = tm.mega_moe(*args, **kw)
    ref = rf.mega_moe(*args, **kw)
    err = rel_err(tri, ref)
    ms = time_ms(lambda: tm.mega_moe(*args, **kw), device=dev)
    cf.mega_moe(*args, **kw)
    base = time_once_ms(lambda: cf.mega_moe(*args, **kw), device=dev)
    ref_ms = time_once_ms(lambda: rf.mega_moe(*args, **kw), device=dev)
    fl, by = moe_counts(dims, T, touched)
    out.append(row("triton.mega_moe", f"T={T} {'decode' if T <= 256 else 'prefill'}", ms,
                   flops=fl, bytes=by, peak="fp8", baseline="capturable", baseline_ms=base,
                   ref_ms=ref_ms, rel_err=err,
                   notes=f"{spread}; torch.compile n/a (the capturable MoE is a Python loop "
                         "over weight-tile chunks: minutes to compile)"))
    log(f"T={T} mega_moe {ms:.3f} ms (capturable {base:.1f} ms), err {err:.2e}")
    if T > 256 and (T * k) % E == 0:
        out += balanced_row(dims, w, T, dev, tm, rf, args, kw, ms)
    # routed experts alone, tile / upcast sweep
    a2 = (xq, xs, ids, wts, *w["routed"])
    kw2 = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt="fp8_1x128", out_dtype="bf16")
    ref2 = rf.moe_experts_q(*a2, **kw2)
    rpg = T * k / min(E, T * k)
    variants = {}
    best = None
    auto = tm.asm_ok(dev)
    for name, asm, cfg in _variants(rpg, tm, auto)[:None if sweep else 1]:
        if time.perf_counter() > t_end - 40:
            break
        tag = f"{name}{'+ptx' if asm else ''}"
        r = timed_variant(cfg, lambda c: tm.moe_experts_q(*a2, **kw2, kernel_config=c),
                          lambda y: within(rel_err(y, ref2), 1e-2), dev, variants, tag,
                          lambda: log(f"variant {tag}: {traceback.format_exc(limit=3)}"))
        if r and (best is None or r[0] < best[1]):
            best = (tag, r[0], r[1][0], cfg)
    if best is not None:
        fl, by = routed_counts(dims, T, touched)
        dg = DEEPGEMM_MS.get(T)
        out.append(row("triton.moe_experts_q", f"T={T} routed experts", best[1], flops=fl,
                       bytes=by, peak="fp8", rel_err=best[2], best=best[0], variants=variants,
                       deepgemm_fp8_ms=dg,
                       asm_auto=auto,
                       notes=(f"best {best[0]}; DeepGEMM grouped FP8 (experts upcast) {dg} ms"
                              if dg else f"best {best[0]}") + f"; PTX upcast check: {auto}"
                       + "; variants (ms): "
                       + ", ".join(f"{kk} {vv}" for kk, vv in variants.items())))
    else:
        out.append({"kernel": "triton.moe_experts_q", "case": f"T={T}", "error":
                    f"no variant ran: {variants}"})
    # the rows below time Triton kernels at the best variant's tiles with the PTX upcast
    # wherever its check passed (the best variant's upcast setting may be the other one by
    # noise where the Gluon kernels, which ignore it, won)
    cur = replace(best[3] if best else _fp16_h(auto), fp4_asm="on" if auto else "off")
    out += fp8h_rows(dims, T, dev, tm, a2, kw2, ref2, touched, cur,
                     best[1] if best else None, t_end, sweep)
    out += piece_rows(dims, w, T, dev, tm, x, xq, xs, streams, post, comb, touched, cur)
    return out


def _fp16_h(asm: bool) -> MoeConfig:
    """The defaults with fp16 H at every size and the given upcast: the routed-expert sweep and
    its DeepGEMM comparison stay the fp16-H kernels' (the FP8-H default at prefill sizes has
    its own row, fp8h_rows)."""
    return MoeConfig(fp8_h_prefill=False, fp4_asm="on" if asm else "off")


def balanced_routing(T: int, E: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(tid2eid [T, k] i32, token_ids [T] i32) of the "balanced routing" #7's prefill target
    names: token t -> experts k t .. k t + k - 1 (mod E), through the hash-routed layers' own
    path (tid2eid[token_ids]), so every expert gets exactly T k / E rows where E divides T k
    (128 at 8192 tokens). The routing weights still come from the gate's scores of those
    experts, so the layer does the same work as a gate-routed one but the top-k selection."""
    t = torch.arange(T, device=dev, dtype=torch.int32)
    tid2eid = (t[:, None] * k + torch.arange(k, device=dev, dtype=torch.int32)[None, :]) % E
    return tid2eid.contiguous(), t


def layer_call(dims: dict, w: dict, T: int, dev, routing: str = "gate", configs=None):
    """A no-argument call of the whole Triton MegaMoE layer on layer_inputs at T tokens (seed
    T + 1, the kernel table's inputs), routed by the gate ("gate") or balanced_routing
    ("balanced"): what benchmarks/probes/moe_ab.py times and benchmarks/probes/ncu_moe.py profiles, with
    `configs` (family -> KernelConfig, kernel_config.resolve's answer; None: the defaults) bound
    as the plan binds them: MoeConfig as kernel_config, GemmConfig as gemm_config."""
    from megagraph.kernels.moe import triton as tm

    streams, (x, xq, xs, _pre, post, comb) = layer_inputs(dims, w, T, dev, seed=T + 1)
    args = (x, xq, xs, streams, post, comb, w["gate"], w["bias"], *w["routed"], *w["shared"])
    if routing == "balanced":
        args += balanced_routing(T, dims["E"], dims["k"], dev)
    kw = dict(topk=dims["k"], **MOE_KW)
    if configs:
        kw.update(kernel_config=configs["moe"], gemm_config=configs["gemm"])
    return lambda: tm.mega_moe(*args, **kw)


def balanced_row(dims, w, T, dev, tm, rf, args, kw, random_ms: float) -> list[dict]:
    """The whole layer at balanced routing (balanced_routing): every tile of the grouped GEMMs
    full, the case #7's "MoE layer at 8192 tokens with balanced routing" target is stated for;
    baseline = the same layer at the gate's (random-weight) routing above. Then the same with
    fp16 H (fp8_h_prefill off), its baseline the default row."""
    E, k = dims["E"], dims["k"]
    hashed = (*args, *balanced_routing(T, E, k, dev))
    tri = tm.mega_moe(*hashed, **kw)
    ref = rf.mega_moe(*hashed, **kw)
    err = rel_err(tri, ref)
    ms = time_ms(lambda: tm.mega_moe(*hashed, **kw), device=dev)
    fl, by = moe_counts(dims, T, E)
    log(f"T={T} mega_moe balanced {ms:.3f} ms, err {err:.2e}")
    fp16 = MoeConfig(fp8_h_prefill=False)  # the same layer with fp16 H
    tri16 = tm.mega_moe(*hashed, **kw, kernel_config=fp16)
    ms16 = time_ms(lambda: tm.mega_moe(*hashed, **kw, kernel_config=fp16), device=dev)
    err16 = rel_err(tri16, ref)
    log(f"T={T} mega_moe balanced, fp16 H {ms16:.3f} ms, err {err16:.2e}")
    rows = "rows (token t -> experts {k}t..{k}t+{k - 1} mod E, through tid2eid)"
    return [row("triton.mega_moe", f"T={T} prefill, balanced routing", ms, flops=fl, bytes=by,
                peak="fp8", baseline="gate-routed", baseline_ms=random_ms, rel_err=err,
                notes=f"{E} experts x {T * k // E} {rows}; H in FP8 where "
                      "MoeConfig.fp8_h_prefill picks it (the default); baseline = the "
                      "gate-routed row above"),
            row("triton.mega_moe", f"T={T} prefill, balanced routing, fp16 H", ms16, flops=fl,
                bytes=by, peak="fp8", baseline="FP8 H (default)", baseline_ms=ms,
                rel_err=err16, notes=f"the row above with moe.fp8_h_prefill=false; "
                                     f"rel diff to it {rel_err(tri, tri16):.2e}")]


def within(err: float, bound: float):
    """(errors, why wrong or None) for timed_variant: one relative error under `bound`."""
    return (err,), (None if err < bound else f"rel err {err:.2e}")


def timed_variant(cfg, run, check, dev, times: dict, key, on_fail):
    """One candidate of a sweep: `run(cfg)` (cfg the kernel_config of the variant). check(y) ->
    (errors, why wrong or None). Records times[key] = ms, or why there is none ("wrong: ...",
    "failed: ..."; on_fail() logs the traceback); returns (ms, errors), or None."""
    try:
        errors, wrong = check(run(cfg))
        if wrong:
            times[key] = f"wrong: {wrong}"
            return None
        ms = time_ms(lambda: run(cfg), device=dev)
        times[key] = round(ms, 4)
        return ms, errors
    except Exception as ex:  # noqa: BLE001
        times[key] = f"failed: {type(ex).__name__}: {str(ex)[:200]}"
        on_fail()
        return None


def _variants(rpg: float, tm, auto: bool) -> list[tuple[str, bool, MoeConfig]]:
    """(name, PTX upcast, config) to time: the defaults (fp16 H, _fp16_h: routed_experts picks as
    in serving, the Gluon decode L1 / L2 where available) with the default upcast, the same with
    the other upcast, at decode the Triton kernels instead of the Gluon ones (both: "triton",
    one at a time: "triton-l1" / "triton-l2"), at prefill the Triton L1 ("triton-l1") and the
    cuBLAS one ("cublas-l1", from 100 rows per expert) instead of the default Gluon L1s, and the
    Triton L2 ("triton-l2") instead of the Gluon one, one alternative tile each for L1 and
    L2."""
    base = _fp16_h(auto)
    out = [("default", auto, base)]
    if not tm.INTERPRET:
        out.append(("default", not auto, _fp16_h(not auto)))
    if rpg <= 12:  # the Gluon decode L1 / L2 (default) against the Triton kernels
        out[1:1] = [("triton", auto, replace(base, gluon=False)),
                    ("triton-l1", auto, replace(base, gluon_decode=False)),
                    ("triton-l2", auto, replace(base, gluon_decode_l2=False))]
    elif rpg > 48:  # the L1 on the Triton kernel, on cuBLAS; the L2 on Triton
        out[1:1] = [("triton-l1", auto, replace(base, cublas_prefill=False, gluon_ws_l1=False,
                                                gluon_wide_l1=False)),
                    ("cublas-l1", auto, replace(base, gluon_ws_l1=False, gluon_wide_l1=False)),
                    ("triton-l2", auto, replace(base, gluon_prefill_l2=False))]
    if rpg <= 12:
        alt = (Tile(16, 64, 128, 4, 4, par=True), Tile(64, 64, 128, 4, 4, par=True))
    else:
        alt = (Tile(128, 64, 128, 8, 4, par=True), Tile(128, 128, 64, 8, 4, par=True))
    out.append(("alt", auto, replace(base, tiles=(alt[0].spec("l1"), alt[1].spec("l2")))))
    return out


def fp8h_rows(dims, T, dev, tm, a2, kw2, ref2, touched, cur: MoeConfig, base_ms, t_end,
              sweep: bool) -> list[dict]:
    """moe_experts_q with the FP8-H path (MoeConfig.fp8_h: E4M3 H + per-128 scales from L1's
    epilogue, FP8 L2) at the pick_tile l1_fp8h / l2_fp8h tiles, then (sweeping) a few other
    tiles; the row carries the fastest, the default (fp16-H) best as baseline, and both errors.
    cur: the config the other settings come from (the upcast)."""
    from megagraph.kernels.fused import reference as rf

    rpg = T * dims["k"] / min(dims["E"], T * dims["k"])
    G = Tile
    d1, d2 = tm.pick_tile("l1_fp8h", rpg), tm.pick_tile("l2_fp8h", rpg)
    tiles = [("default", d1, d2)]
    if rpg > cur.wide_l1_min_rows:  # the warp-specialized FP8-H kernels: no tile overrides
        tiles.insert(0, ("gluon-ws", None, None))
    if sweep and rpg > 12:
        tiles += [("l1 128x128", G(128, 128, 128, 8, 3, par=True), d2),
                  ("l1 64x128 4w", G(64, 128, 128, 4, 3, par=True), d2),
                  ("l1 64x256", G(64, 256, 128, 8, 3, par=True), d2),
                  ("l2 128x128", d1, G(128, 128, 128, 8, 3, par=True)),
                  ("l2 64x128 4w", d1, G(64, 128, 128, 4, 3, par=True)),
                  ("l2 64x256", d1, G(64, 256, 128, 8, 3, par=True))]
    ref_q = rf.moe_experts_q(*a2, **kw2, h_fmt="fp8_1x128")

    def fp8h_errors(y):
        e, eq = rel_err(y, ref2), rel_err(y, ref_q)
        return (e, eq), (None if e < 2.0 ** -4 and eq < 1.5e-2
                         else f"rel err {e:.2e} (quantized-H ref {eq:.2e})")
    times, best = {}, None
    for name, c1, c2 in tiles:
        if time.perf_counter() > t_end - 20:
            times[name] = "skipped: budget"
            continue
        pins = () if c1 is None else (c1.spec("l1_fp8h"), c2.spec("l2_fp8h"))
        cfg = replace(cur, fp8_h=True, tiles=pins)
        r = timed_variant(cfg, lambda c: tm.moe_experts_q(*a2, **kw2, kernel_config=c),
                          fp8h_errors, dev, times, name,
                          lambda: log(f"fp8-H {name}: {traceback.format_exc(limit=3)}"))
        if r and (best is None or r[0] < best[1]):
            best = (name, r[0], *r[1], c1, c2)
    notes = "tiles (ms): " + ", ".join(f"{k} {v}" for k, v in times.items())
    if best is None:
        return [{"kernel": "triton.moe_experts_q fp8-H", "case": f"T={T}",
                 "error": f"no tile ran: {notes}"}]
    fl, by = routed_counts(dims, T, touched)
    log(f"T={T} routed FP8-H {best[0]} {best[1]:.3f} ms (fp16-H {base_ms}), err {best[2]:.2e} "
        f"(quantized-H ref {best[3]:.2e})")
    return [row("triton.moe_experts_q fp8-H", f"T={T} routed experts", best[1], flops=fl,
                bytes=by, peak="fp8", rel_err=best[2], rel_err_q=best[3],
                baseline="fp16 H (default)", baseline_ms=base_ms, fp8h_ms=times,
                deepgemm_fp8_ms=DEEPGEMM_MS.get(T),
                notes=f"FP8 H (the default at prefill sizes on sm_90: moe.fp8_h_prefill; "
                      f"moe.fp8_h=true everywhere); best {best[0]}"
                      + ("" if best[4] is None else
                         f": l1 {tuple(vars(best[4]).values())[:6]}, "
                         f"l2 {tuple(vars(best[5]).values())[:6]}") + "; "
                      f"rel_err vs fp32-H reference {best[2]:.2e}, vs quantized-H reference "
                      f"{best[3]:.2e}; {notes}")]


def piece_rows(dims, w, T, dev, tm, x, xq, xs, streams, post, comb, touched,
               cur: MoeConfig) -> list[dict]:
    """The launches of mega_moe timed one by one (same inputs, cur's tiles and upcast)."""
    E, k, d, F, fs = dims["E"], dims["k"], dims["d"], dims["F"], dims["fs"]
    P = T * k
    b = [tm.bank(wt, s, "mxfp4") for wt, s in zip(w["routed"][0::2], w["routed"][1::2],
                                                   strict=True)]
    sb = [tm.bank(wt, s, "fp8_block") for wt, s in zip(w["shared"][0::2], w["shared"][1::2],
                                                        strict=True)]
    counts = torch.zeros(E, dtype=torch.int32, device=dev)

    def route():
        counts.zero_()
        return tm.route_ids(x, w["gate"], w["bias"], topk=k, route_scale=1.5, norm_topk=True,
                            score_func="sqrtsoftplus", counts=counts)

    ids, wts = route()
    srt = tm.permute(ids.reshape(-1), counts, E)
    rpg = P / min(E, P)
    h = torch.empty(P, F, dtype=torch.float16, device=dev)
    y = torch.empty(T, k + 1, d, dtype=torch.bfloat16, device=dev)
    c1, c2 = tm.pick_tile("l1", rpg, cur), tm.pick_tile("l2", rpg, cur)

    def l1():
        tm.gemm(xq, xs, b[0], h, b2=b[1], role="l1", rows_per_group=rpg, counts=counts, a_idx=srt,
                topk=k, max_tiles=min(P, P // c1.bm + E), limit=10.0, kc=cur)

    def l1c():  # the prefill default: cuBLAS grouped FP8 on the per-call E4M3 upcast
        from megagraph.kernels.moe import grouped_cublas as mgc

        mgc.l1_swiglu(xq, xs, srt, b[0], b[1], counts, h, topk=k, limit=10.0)

    def l2():
        tm.gemm(h, None, b[2], y.view(T * (k + 1), d), role="l2", rows_per_group=rpg,
                counts=counts, c_idx=srt, row_w=wts.reshape(-1), topk=k, ks=k + 1,
                max_tiles=min(P, P // c2.bm + E), kc=cur)

    hq = torch.empty(P, F, dtype=torch.float8_e4m3fn, device=dev)
    hs = torch.empty(P, F // 128, dtype=torch.float32, device=dev)
    q1, q2 = tm.pick_tile("l1_fp8h", rpg, cur), tm.pick_tile("l2_fp8h", rpg, cur)

    def l1q():
        tm.gemm(xq, xs, b[0], hq, b2=b[1], role="l1_fp8h", rows_per_group=rpg, counts=counts,
                a_idx=srt, topk=k, max_tiles=min(P, P // q1.bm + E), limit=10.0, out_scale=hs,
                kc=cur)

    def l2q():
        tm.gemm(hq, hs, b[2], y.view(T * (k + 1), d), role="l2_fp8h", rows_per_group=rpg,
                counts=counts, c_idx=srt, row_w=wts.reshape(-1), topk=k, ks=k + 1,
                max_tiles=min(P, P // q2.bm + E), kc=cur)

    def shared(gemm_cfg=None):
        tm.shared_expert(xq, xs, *sb, y[:, k], swiglu_limit=10.0, cfg=cur, gemm_cfg=gemm_cfg)

    def shared_q():  # FP8 H, both GEMMs on cuBLAS's FP8 GEMM (the prefill default)
        return tm.shared_expert_fp8h(xq, xs, *sb, swiglu_limit=10.0, out_dtype=torch.bfloat16)

    out_s = torch.empty_like(streams)

    def comb_():
        tm.combine(y, out_s, topk=k, shared=True, rdt=torch.bfloat16, streams=streams, post=post,
                   comb=comb)

    l1()
    l2()
    l1q()
    l2q()
    shared()
    expert = 3 * F * d // 2 + 3 * F * d // 32
    pieces = [
        ("router (gate GEMM + top-k + counts)", route, 2 * T * E * d, E * d * 2 + T * d * 2, "bf16"),
        ("permutation (plan + scatter)", lambda: tm.permute(ids.reshape(-1), counts, E), 0,
         P * 8, ""),
        ("L1: W1/W3 + SwiGLU", l1, 2 * P * 2 * F * d, touched * expert * 2 // 3 + T * d + P * F * 2,
         "fp8"),
        ("L1 on cuBLAS: E4M3 upcast of W1/W3 + row gather + grouped FP8 GEMM + SwiGLU "
         "(moe_grouped_cublas)", l1c, 2 * P * 2 * F * d,
         touched * expert * 2 // 3 * 3 + T * d + P * 2 * F * 2 * 2 + P * F * 2, "fp8"),
        ("L2: W2 + weights -> (token, slot)", l2, 2 * P * F * d,
         touched * expert // 3 + P * F * 2 + P * d * 2, "fp8"),
        ("L1 FP8-H: W1/W3 + SwiGLU + H to E4M3 (moe.fp8_h)", l1q, 2 * P * 2 * F * d,
         touched * expert * 2 // 3 + T * d + P * F + P * F // 32, "fp8"),
        ("L2 FP8-H: W2 on E4M3 H + weights (moe.fp8_h)", l2q, 2 * P * F * d,
         touched * expert // 3 + P * F + P * F // 32 + P * d * 2, "fp8"),
        ("shared expert (FP8 blocks, L1 + L2)", shared, 2 * T * 3 * fs * d,
         3 * fs * d + T * d + T * d * 2, "bf16"),
        ("shared expert FP8 H: both GEMMs on cuBLAS FP8 (moe.shared_fp8_h)",
         shared_q, 2 * T * 3 * fs * d, 3 * fs * d + T * d + T * d * 2, "fp8"),
        ("shared expert, Triton L1 (gemm.cublas_fp8=false)", lambda: shared(NO_CUBLAS),
         2 * T * 3 * fs * d, 3 * fs * d + T * d + T * d * 2, "bf16"),
        ("combine + shared + mHC expand", comb_, 0, T * (k + 1) * d * 2 + 2 * T * 4 * d * 2, ""),
    ]
    from megagraph.kernels.moe import grouped_cublas as mgc

    if not mgc.applies(xq, b[0], b[1], h, rpg):  # decode sizes / no device support
        pieces = [p for p in pieces if p[1] is not l1c]
    if shared_q() is None:  # no cuBLAS FP8 GEMM here
        pieces = [p for p in pieces if p[1] is not shared_q]
    out = []
    for name, fn, fl, by, peak in pieces:
        out.append(row("triton.mega_moe piece", f"T={T} {name}", time_ms(fn, device=dev),
                       flops=fl, bytes=by, peak=peak))
    return out


# cuBLAS switched off (the Triton FP8-block GEMMs run), for the rows that time Triton next to it
NO_CUBLAS = GemmConfig(cublas_fp8=False)


def cublas_note(dev) -> str:
    from megagraph.kernels.gemm import cublas_fp8

    form = cublas_fp8.supported(dev.index or 0) if dev.type == "cuda" else None
    return f"cuBLAS block-scaled FP8, weight scales {form}" if form else ""


LINEAR_SHAPES = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wo_b", 5120, 8192)]
LINEAR_TINY = [("wq_a", 96, 256)]


def quant_rows(dims, T, dev, g) -> list[dict]:
    """triton.quantize_act (FP8 1x128 of a bf16 activation) vs the capturable chain, at the widths
    the slice quantizes (hidden, and the attention output's 64 x 512); bytes: read + codes + scales."""
    from megagraph.kernels.fused import capturable as cf
    from megagraph.kernels.fused import reference as rf
    from megagraph.kernels.dense import triton_quant as tq

    out = []
    for K in ((dims["d"], 32768) if dims["d"] == V41["d"] else (dims["d"],)):
        x = torch.randn(T, K, device=dev, generator=g).bfloat16()
        got, want = tq.quantize_act(x, act_fmt="fp8_1x128"), rf.quantize_act(x, act_fmt="fp8_1x128")
        same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and \
            torch.equal(got[1], want[1])
        ms = time_ms(lambda: tq.quantize_act(x, act_fmt="fp8_1x128"), device=dev)
        base = time_ms(lambda: cf.quantize_act(x, act_fmt="fp8_1x128"), device=dev)
        out.append(row("triton.quantize_act", f"T={T} width {K}", ms, bytes=T * K * 3 + T * K // 32,
                       baseline="capturable", baseline_ms=base, rel_err=0.0 if same else 1.0,
                       notes="bitwise == reference" if same else "NOT bitwise equal to the reference"))
    return out


def linear_rows(dims, w, T, dev, t_end) -> list[dict]:
    from megagraph.kernels import formats
    from megagraph.kernels.fused import capturable as cf
    from megagraph.kernels.fused import reference as rf
    from megagraph.kernels.moe import triton as tm

    g = torch.Generator(device=dev)
    g.manual_seed(T + 7)
    out = quant_rows(dims, T, dev, g)
    shapes = LINEAR_SHAPES if dims["d"] == V41["d"] else LINEAR_TINY
    for name, N, K in shapes:
        if time.perf_counter() > t_end:
            break
        x = torch.randn(T, K, device=dev, generator=g)
        xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
        wq, ws = formats.quantize_fp8_block(torch.randn(N, K, device=dev, generator=g) * 0.02, 32)
        kw = dict(fmt="fp8_block", act_fmt="fp8_1x128", out_dtype="bf16")
        tri = tm.linear_q(xq, xs, wq, ws, **kw, kernel_config=NO_CUBLAS)
        ref = rf.linear_q(xq, xs, wq, ws, **kw)
        ms = time_ms(lambda: tm.linear_q(xq, xs, wq, ws, **kw, kernel_config=NO_CUBLAS),
                     device=dev)
        base = time_ms(lambda: cf.linear_q(xq, xs, wq, ws, **kw), device=dev)
        comp = None
        if COMPILE and name == "wq_a" and T <= 256 and time.perf_counter() < t_end - 60:
            try:
                fc = _compiled(lambda a: cf.linear_q(a, xs, wq, ws, **kw))
                fc(xq)
                comp = time_ms(lambda: fc(xq), device=dev, graph=False)
            except Exception as e:  # noqa: BLE001
                log(f"compile linear_q failed: {e}")
        sm = None
        try:
            wt = wq.t()
            one = torch.ones((), device=dev)
            sm = time_ms(lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one,
                                                  out_dtype=torch.bfloat16), device=dev)
        except Exception as e:  # noqa: BLE001
            log(f"_scaled_mm {name}: {e}")
        out.append(row("triton.fp8_block_gemm", f"T={T} {name} {N}x{K}", ms,
                       flops=2 * T * N * K, bytes=N * K + N * K // 1024 + T * K + T * N * 2,
                       peak="fp8", baseline="capturable", baseline_ms=base, compile_ms=comp,
                       rel_err=rel_err(tri, ref), scaled_mm_ms=sm,
                       notes=(f"torch._scaled_mm per-tensor FP8 {1e3 * sm:.1f} us" if sm else "")))
        note = cublas_note(dev)
        if note:
            cub = tm.linear_q(xq, xs, wq, ws, **kw)
            ms_c = time_ms(lambda: tm.linear_q(xq, xs, wq, ws, **kw), device=dev)
            out.append(row("cublas.fp8_block_gemm", f"T={T} {name} {N}x{K}", ms_c,
                           flops=2 * T * N * K, bytes=N * K + N * K // 1024 + T * K + T * N * 2,
                           peak="fp8", baseline="triton", baseline_ms=ms,
                           rel_err=rel_err(cub, ref), notes=note + "; weight reblocked from 32x32 "
                           "(kernels/gemm/cublas_fp8.py); linear_q's default"))
    if time.perf_counter() < t_end:
        G, O, In = (8, 1024, 4096) if dims["d"] == V41["d"] else (2, 64, 128)
        x = torch.randn(T, G * In, device=dev, generator=g)
        xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
        wq, ws = formats.quantize_fp8_block(torch.randn(G * O, In, device=dev, generator=g) * 0.02,
                                            32)
        kw = dict(groups=G, fmt="fp8_block", act_fmt="fp8_1x128", out_dtype="bf16")
        tri = tm.grouped_linear_q(xq, xs, wq, ws, **kw, kernel_config=NO_CUBLAS)
        ref = rf.grouped_linear_q(xq, xs, wq, ws, **kw)
        ms = time_ms(lambda: tm.grouped_linear_q(xq, xs, wq, ws, **kw, kernel_config=NO_CUBLAS),
                     device=dev)
        base = time_ms(lambda: cf.grouped_linear_q(xq, xs, wq, ws, **kw), device=dev)
        out.append(row("triton.grouped_fp8_gemm", f"T={T} wo_a 8x{O}x{In}", ms,
                       flops=2 * T * G * O * In, bytes=G * O * In + T * G * In + T * G * O * 2,
                       peak="fp8", baseline="capturable", baseline_ms=base,
                       rel_err=rel_err(tri, ref)))
        note = cublas_note(dev)
        if note:  # one cuBLAS GEMM per group (grouped_linear_q's default from 256 rows)
            yc = torch.empty_like(tri)
            b = tm.bank(wq, ws, "fp8_block")
            gc = GemmConfig()
            if tm._cublas_groups(xq, xs, wq, ws, G, b, yc, gc):
                ms_c = time_ms(lambda: tm._cublas_groups(xq, xs, wq, ws, G, b, yc, gc),
                               device=dev)
                out.append(row("cublas.grouped_fp8_gemm", f"T={T} wo_a 8x{O}x{In}", ms_c,
                               flops=2 * T * G * O * In,
                               bytes=G * O * In + T * G * In + T * G * O * 2, peak="fp8",
                               baseline="triton", baseline_ms=ms, rel_err=rel_err(yc, ref),
                               notes=note + f"; {G} GEMMs; grouped_linear_q's default from "
                               f"{GemmConfig().cublas_grouped_min_rows} rows"))
    return out


def device_rows(device, dims: dict, Ts, budget_s: float, sweep: bool = True) -> list[dict]:
    """Every GPU row at dims for each token count in Ts (also runs on the CPU under the Triton
    interpreter: the dry run of tests/benchmarks)."""
    t0 = time.perf_counter()
    t_end = t0 + budget_s
    out: list[dict] = []
    w = make_weights(dims, device)
    log(f"weights ready at {time.perf_counter() - t0:.0f} s")
    for T in Ts:
        for name, fn in (("mega_mhc", mhc_rows),
                         ("mega_moe", lambda *a: moe_rows(*a, sweep=sweep)),
                         ("fp8 GEMMs", linear_rows)):
            if time.perf_counter() > t_end:
                out.append({"kernel": name, "case": f"T={T}", "error": "skipped: time budget"})
                continue
            try:
                out += fn(dims, w, T, device, t_end)
            except Exception as e:  # noqa: BLE001
                out.append({"kernel": name, "case": f"T={T}", "error": f"{type(e).__name__}: {e}",
                            "trace": traceback.format_exc(limit=6)})
                log(traceback.format_exc(limit=6))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"T={T} {name} done at {time.perf_counter() - t0:.0f} s")
    return out


def rows(device, smoke: bool = False) -> list[dict]:
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_rows(smoke)
    if smoke:
        return device_rows(device, TINY, (8, 64), 60.0)
    return device_rows(device, V41, (64, 8192), BUDGET_S)
