"""Row provider (benchmarks/kernels.py) for the CSA2 attention path's Triton kernels
(kernels/triton/): decode and prefill sparse attention with sink (+ inverse RoPE + FP8 1x128
epilogue), lightning-indexer scores and the top-512 that follows, the fused compressor, the batched
ring copies, Engram hash + gate. Each row: time, the bytes / FLOPs the op must move / do (every
input read once, every output written once; formulas in `_count_*`), and the same op through the
capturable torch kernels (the baseline the plan ran before) with the relative error between them.

    python benchmarks/kernels.py --only attention --out /tmp/k    # GPU; CPU gets no rows

Attention rows also time a few launch shapes (heads per program, warps, keys per tile) and name the
fastest; indexer rows the three product precisions. Inputs are fresh random data on the device;
the large cases exceed L2. Rows stop being added after BUDGET_S seconds (leases are short).
"""
from __future__ import annotations

import sys
import time
import traceback

import torch

from kernel_rows import rel_err, row, time_ms, time_once_ms

ROPE = dict(rope_dim=64, theta=160000.0, yarn_factor=16.0, yarn_original=65536, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0)
BUDGET_S = 170.0  # stop adding rows after this long (device leases are short)


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


def _meta(reqs, device):
    pos, req = [], []
    for r, (_, c, n) in enumerate(reqs):
        pos += range(c, c + n)
        req += [r] * n
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return (i64(pos), i64(req), i64([s for s, _, _ in reqs]), i64([c for _, c, _ in reqs]))


def _topk(positions, ratio, C, k=512):
    """Per token: k distinct visible entries (sorted, -1 padded), spread over the whole context."""
    T = positions.shape[0]
    vis = ((positions + 1) // ratio).clamp(max=C)
    r = torch.rand(T, C, device=positions.device)
    r = torch.where(torch.arange(C, device=positions.device)[None, :] < vis[:, None], r, -1.0)
    vals, idx = r.topk(min(k, C), dim=-1)
    return torch.where(vals >= 0, idx, -1).sort(dim=-1).values


def attn_case(device, R, ctx, ratio, new=1):
    """R requests of `new` tokens each after `ctx - new` cached tokens (bf16, V4.1 dims)."""
    reqs = [(i, ctx - new, new) for i in range(R)]
    pos, req, slots, cached = _meta(reqs, device)
    T = pos.shape[0]
    C = ctx // ratio
    bf = torch.bfloat16
    args = (torch.randn(T, 64, 512, device=device, dtype=bf),
            torch.randn(T, 512, device=device, dtype=bf),
            torch.randn(R, 128, 512, device=device, dtype=bf),
            torch.randn(R, C, 512, device=device, dtype=bf),
            _topk(pos, ratio, C), torch.randn(64, device=device), pos, req, slots, cached)
    kw = dict(window=128, scale=512 ** -0.5, ratio=ratio, attend_all_compressed=False, **ROPE,
              act_fmt="fp8_1x128")
    return args, kw


def _count_attn(args, ratio: int) -> tuple[int, int]:
    """Bytes: q, the distinct key rows the step reads (each request's ring rows in any of its
    tokens' windows, the step rows, the top-k entries - at most the slot's visible compressed rows),
    topk ids, o_q + scales. FLOPs: two 64 x 512 products per (token, key)."""
    q, topk, pos, req, slots, cached = args[0], args[4], *args[6:]
    T, R = q.shape[0], slots.shape[0]
    c = cached[req]
    ring_keys = (c - (pos - 127)).clamp(0, 128).clamp(max=c)
    step_keys = (pos - c + 1).clamp(max=128)
    comp = (topk >= 0).sum(-1)
    keys = int((ring_keys + step_keys + comp).sum())
    per_req = lambda v: torch.zeros(R, dtype=torch.int64, device=pos.device).scatter_reduce(  # noqa: E731
        0, req, v, reduce="amax")
    ring_rows = int(per_req(ring_keys).sum())
    vis = ((pos + 1) // ratio).clamp(max=args[3].shape[1])
    comp_rows = min(int(comp.sum()), int(per_req(vis).sum()))
    byt = q.numel() * 2 + (ring_rows + T + comp_rows) * 1024 + topk.numel() * 8 \
        + T * (64 * 512 + 64 * 4 * 4)
    return byt, 4 * 64 * 512 * keys


def index_case(device, R, ctx, ratio, new=1):
    from megagraph.kernels.dense.capturable import fake_quant

    reqs = [(i, ctx - new, new) for i in range(R)]
    pos, req, slots, _ = _meta(reqs, device)
    T = pos.shape[0]
    C = ctx // ratio
    qi = fake_quant(torch.randn(T, 32, 128, device=device), fmt="mxfp4", block=32).bfloat16()
    # the engine's index-key cache: MXFP4 keys stored bf16 (exact; models/v41.py)
    ikey = fake_quant(torch.randn(R, C, 128, device=device), fmt="mxfp4", block=32).bfloat16()
    w = torch.randn(T, 32, device=device, dtype=torch.bfloat16)
    return (qi, w, ikey, pos, req, slots), dict(ratio=ratio, weight_scale=128 ** -0.5 * 32 ** -0.5)


def _count_index(args, kw) -> tuple[int, int]:
    qi, _, ikey, pos, req, slots = args
    vis = ((pos + 1) // kw["ratio"]).clamp(max=ikey.shape[1])
    per_req = torch.zeros(slots.shape[0], dtype=torch.int64, device=pos.device).scatter_reduce(
        0, req, vis, reduce="amax")
    byt = (int(per_req.sum()) * 128 * ikey.element_size() + qi.numel() * 2
           + pos.shape[0] * ikey.shape[1] * 4)
    return byt, 2 * 32 * 128 * int(vis.sum())


def compressor_case(device, R, ctx, ratio, new=1):
    reqs = [(i, ctx - new, new) for i in range(R)]
    pos, req, slots, _ = _meta(reqs, device)
    T = pos.shape[0]
    bf = torch.bfloat16
    rn = lambda *s, sc=1.0: torch.randn(*s, device=device) * sc  # noqa: E731
    C = ctx // ratio
    args = (rn(T, 5120).to(bf), rn(512, 5120, sc=5120 ** -0.5).to(bf),
            rn(512, 5120, sc=5120 ** -0.5).to(bf) if ratio > 1 else None,
            rn(R, ratio, 512) if ratio > 1 else None, rn(R, ratio, 512) if ratio > 1 else None,
            rn(512) + 1, rn(128, 512, sc=512 ** -0.5).to(bf), rn(128) + 1,
            rn(R, C, 128).to(bf), rn(R, C, 512).to(bf), pos, req, slots)  # ikey bf16 (V4.1)
    kw = dict(ratio=ratio, eps=1e-20, offset=1 - ratio, ikey_fmt="mxfp4", ckv_fmt="nvfp4", **ROPE)
    return args, kw


def _count_compressor(args, kw) -> tuple[int, int]:
    x = args[0]
    T = x.shape[0]
    r = kw["ratio"]
    nproj = 2 if r > 1 else 1
    rows = T // r if T > 1 else T
    byt = x.numel() * 2 + nproj * 512 * 5120 * 2 + 128 * 512 * 2 + rows * (512 * 2 + 128 * 2)
    return byt, 2 * T * 5120 * 512 * nproj + 2 * rows * 512 * 128


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


def _row(kernel, case, ms, byt, flops, base_ms=None, err=None, notes="", **extra) -> dict:
    return row(kernel, case, ms, flops=flops, bytes=byt, peak="bf16" if flops else "",
               baseline="capturable" if base_ms is not None else None, baseline_ms=base_ms,
               rel_err=err, notes=notes or None, **extra)


def _variants_note(times: dict) -> str:
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    return "launch shapes (us): " + ", ".join(
        f"{k} {1e3 * v:.1f}" if isinstance(v, float) else f"{k} failed" for k, v in times.items()) + \
        f"; fastest {min(ok, key=ok.get)}"


def _deq(o):
    from megagraph.kernels.fused.reference import dequant_act

    return dequant_act(o[0], o[1], act_fmt="fp8_1x128")


def attention_rows(device, smoke, t_end) -> list[dict]:
    from megagraph.kernels.fused.capturable import sparse_attn_q as cap
    from megagraph.kernels.attention import triton as A

    out = []
    decode = [(32, 8192), (64, 8192), (128, 8192), (256, 8192), (32, 32768), (128, 32768),
              (256, 32768), (32, 131072), (64, 131072), (128, 131072), (256, 131072)]
    if smoke:
        decode = [(4, 1024)]
    variants = {"default": None,
                "h16w4": A.AttnLaunch(16, 32, 4, 2, 0), "h32w8": A.AttnLaunch(32, 32, 8, 2, 0),
                "h64w8": A.AttnLaunch(64, 32, 8, 2, 0), "h16w8n16": A.AttnLaunch(16, 16, 8, 2, 0),
                "h16w8s1": A.AttnLaunch(16, 32, 8, 1, 0)}
    for ratio in (2, 1):
        for R, ctx in decode:
            if time.perf_counter() > t_end:
                return out
            if ratio == 1 and ctx == 131072 and R > 64:
                continue  # 128K x ratio 1 x 256 slots = 34 GB of compressed KV: one size is enough
            args, kw = attn_case(device, R, ctx, ratio)
            byt, fl = _count_attn(args, ratio)
            fn = lambda cfg=None: A.launch(  # noqa: E731
                *args[:10], window=128, scale=kw["scale"], ratio=ratio, attend_all=False,
                quant=("fp8_1x128", ROPE), launch_shape=cfg)
            times = {}
            for name, cfg in variants.items():
                if name != "default" and (smoke or ctx != 8192 or ratio != 2 or R not in (64, 256)):
                    continue  # sweep launch shapes on two decode sizes
                try:
                    times[name] = time_ms(lambda: fn(cfg))
                except Exception as e:  # noqa: BLE001 (a shape Triton rejects on this GPU)
                    times[name] = f"{type(e).__name__}: {str(e)[:80]}"
            base = err = None
            if R * ctx <= 64 * 131072:
                try:
                    base = time_ms(lambda: cap(*args, **kw))
                    err = rel_err(_deq(A.sparse_attn_q(*args, **kw)), _deq(cap(*args, **kw)))
                except torch.OutOfMemoryError:
                    base = None
            out.append(_row("triton.sparse_attn_q", f"decode R={R} ctx={ctx // 1024}K r={ratio}",
                            times["default"], byt, fl, base, err,
                            _variants_note(times) if len(times) > 1 else "", variants=times))
            args = None
            torch.cuda.empty_cache()
    # prefill: 8K new tokens of one request over a 128K context (and 16K)
    for ratio, ctx, T in ((2, 131072, 8192), (1, 131072, 8192), (2, 16384, 8192)) if not smoke else ((2, 2048, 16),):
        if time.perf_counter() > t_end:
            return out
        args, kw = attn_case(device, 1, ctx, ratio, new=T)
        byt, fl = _count_attn(args, ratio)
        times = {}
        for name, cfg in {"prefill-default": None, "h64w8": A.AttnLaunch(64, 32, 8, 2, 1),
                          "h32w8": A.AttnLaunch(32, 32, 8, 2, 1),
                          "h16w4": A.AttnLaunch(16, 32, 4, 2, 1)}.items():
            try:
                times[name] = time_ms(lambda: A.launch(
                    *args[:10], window=128, scale=kw["scale"], ratio=ratio, attend_all=False,
                    quant=("fp8_1x128", ROPE), launch_shape=cfg))
            except Exception as e:  # noqa: BLE001 (a shape Triton rejects on this GPU)
                times[name] = f"{type(e).__name__}: {str(e)[:80]}"
        base = err = None
        if ctx <= 16384:
            base = time_once_ms(lambda: cap(*args, **kw))
            err = rel_err(_deq(A.sparse_attn_q(*args, **kw)), _deq(cap(*args, **kw)))
        out.append(_row("triton.sparse_attn_q", f"prefill T={T} new, ctx={ctx // 1024}K r={ratio}",
                        times["prefill-default"], byt, fl, base, err, _variants_note(times),
                        variants=times))
        args = None
        torch.cuda.empty_cache()
    return out


def indexer_rows(device, smoke, t_end) -> list[dict]:
    from megagraph.kernels.indexer.capturable import index_scores as cap, topk_select
    from megagraph.kernels.indexer.config import IndexerConfig
    from megagraph.kernels.indexer.triton import index_scores

    out = []
    cases = [(32, 8192, 2), (128, 8192, 2), (256, 8192, 2), (32, 32768, 2), (256, 32768, 2),
             (32, 131072, 2), (128, 131072, 2), (64, 131072, 1)]
    if smoke:
        cases = [(4, 2048, 2)]
    for R, ctx, ratio in cases:
        if time.perf_counter() > t_end:
            return out
        args, kw = index_case(device, R, ctx, ratio)
        byt, fl = _count_index(args, kw)
        times = {p: time_ms(lambda p=p: index_scores(
            *args, **kw, kernel_config=IndexerConfig(index_precision=p)))
            for p in ("tf32x3", "bf16", "ieee")}
        sc = index_scores(*args, **kw)
        tk_ms = time_ms(lambda: topk_select(sc, k=512))
        base = err = None
        if R * ctx <= 128 * 32768:
            base = time_ms(lambda: cap(*args, **kw))
            err = rel_err(sc, cap(*args, **kw))
        out.append(_row("triton.index_scores", f"decode R={R} ctx={ctx // 1024}K r={ratio}",
                        times["tf32x3"], byt, fl, base, err,
                        "products (us): " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in times.items())
                        + f"; then top-512 (torch.topk) {1e3 * tk_ms:.1f}", precision_ms=times,
                        topk512_ms=tk_ms))
        args = sc = None
        torch.cuda.empty_cache()
    if not smoke and time.perf_counter() < t_end:
        args, kw = index_case(device, 1, 16384, 2, new=1024)
        byt, fl = _count_index(args, kw)
        ms = time_ms(lambda: index_scores(*args, **kw))
        ms_bf = time_ms(lambda: index_scores(*args, **kw,
                                             kernel_config=IndexerConfig(index_precision="bf16")))
        base = time_once_ms(lambda: cap(*args, **kw))
        out.append(_row("triton.index_scores", "prefill T=1024 new, ctx=16K r=2", ms, byt, fl, base,
                        rel_err(index_scores(*args, **kw), cap(*args, **kw)),
                        f"bf16 products {1e3 * ms_bf:.1f} us", precision_ms={"tf32x3": ms, "bf16": ms_bf}))
    return out


def compressor_rows(device, smoke, t_end) -> list[dict]:
    from megagraph.kernels.fused.capturable import compressor as cap
    from megagraph.kernels.state.triton_compressor import compressor

    out = []
    cases = [(256, 8192, 2, 1), (256, 8192, 1, 1), (1, 16384, 2, 8192), (1, 16384, 1, 8192)]
    if smoke:
        cases = [(4, 1024, 2, 1)]
    for R, ctx, ratio, new in cases:
        if time.perf_counter() > t_end:
            return out
        args, kw = compressor_case(device, R, ctx, ratio, new)
        byt, fl = _count_compressor(args, kw)
        ms = time_ms(lambda: compressor(*args, **kw, inplace=True))
        base = time_ms(lambda: cap(*args, **kw, inplace=True))
        a = compressor(*args, **kw)
        b = cap(*args, **kw)
        err = max(rel_err(x, y) for x, y in zip(a, b))
        out.append(_row("triton.compressor", f"T={R * new} r={ratio}", ms, byt, fl, base, err,
                        "5120 -> 512 latent + 128 index dims, ikey mxfp4, ckv nvfp4; in place"))
        args = None
        torch.cuda.empty_cache()
    return out


def ring_engram_rows(device, smoke) -> list[dict]:
    from megagraph.kernels.attention.capturable import ring_update_batched as cap_rings
    from megagraph.kernels.engram.capturable import engram_gate as cap_gate, engram_hash as cap_hash
    from megagraph.kernels.engram.reference import engram_layout
    from megagraph.kernels.engram.triton import engram_gate, engram_hash
    from megagraph.kernels.state.triton_ring import ring_update_batched

    out = []
    R = 4 if smoke else 256
    pos, req, slots, cached = _meta([(i, 1000 + i, 1) for i in range(R)], device)
    L = 43  # 40 layers + 3 DSpark rings
    ops = []
    for _ in range(L):
        ops += [torch.randn(R, 128, 512, device=device, dtype=torch.bfloat16),
                torch.randn(R, 512, device=device, dtype=torch.bfloat16)]
    ms = time_ms(lambda: ring_update_batched(pos, req, slots, *ops, window=128, inplace=True))
    base = time_ms(lambda: cap_rings(pos, req, slots, *ops, window=128, inplace=True))
    out.append(_row("triton.ring_copy_batched", f"{L} rings, R={R} decode rows", ms,
                    L * R * 512 * 2 * 2, 0, base, 0.0, "in place"))
    ops = None
    lay = engram_layout([1], None, max_ngram=4, n_heads=8, vocab_start=16_000_000,
                        compressed_vocab=99092)[1]
    kwh = dict(multipliers=lay.multipliers, primes=lay.primes, offsets=lay.offsets, pad_id=2, max_ngram=4)
    cids = torch.randint(0, 99092, (R,), device=device)
    hist = torch.randint(-1, 99092, (R, 3), device=device)
    ms = time_ms(lambda: engram_hash(cids, hist, pos, req, slots, cached, **kwh))
    base = time_ms(lambda: cap_hash(cids, hist, pos, req, slots, cached, **kwh))
    same = torch.equal(engram_hash(cids, hist, pos, req, slots, cached, **kwh),
                       cap_hash(cids, hist, pos, req, slots, cached, **kwh))
    out.append(_row("triton.engram_hash", f"R={R} tokens, 24 columns", ms, R * 24 * 8 + R * 8 * 5, 0,
                    base, 0.0 if same else 1.0))
    H = torch.randn(R, 4, 5120, device=device, dtype=torch.bfloat16)
    kv = torch.randn(R, 5 * 5120, device=device, dtype=torch.bfloat16)
    qw, kw_ = torch.randn(4, 5120, device=device), torch.randn(4, 5120, device=device)
    ms = time_ms(lambda: engram_gate(H, kv, qw, kw_, eps=1e-20))
    base = time_ms(lambda: cap_gate(H, kv, qw, kw_, eps=1e-20))
    out.append(_row("triton.engram_gate", f"R={R} tokens, 4 streams x 5120", ms,
                    R * (2 * 4 * 5120 * 2 + 5 * 5120 * 2), R * 4 * 5120 * 8, base,
                    rel_err(engram_gate(H, kv, qw, kw_, eps=1e-20), cap_gate(H, kv, qw, kw_, eps=1e-20))))
    return out


def rows(device, smoke: bool = False) -> list[dict]:
    device = torch.device(device)
    if device.type != "cuda":
        return []
    t_end = time.perf_counter() + (30 if smoke else BUDGET_S)
    out: list[dict] = []
    for name, fn in (("attention", lambda: attention_rows(device, smoke, t_end)),
                     ("indexer", lambda: indexer_rows(device, smoke, t_end)),
                     ("compressor", lambda: compressor_rows(device, smoke, t_end)),
                     ("ring/engram", lambda: ring_engram_rows(device, smoke))):
        try:
            out += fn()
        except Exception as e:  # noqa: BLE001 (keep the other groups' rows)
            out.append({"kernel": name, "case": "FAILED", "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc(limit=4)})
        torch.cuda.empty_cache()
        print(f"[attention rows] {name} done at {time.perf_counter() - t_end + BUDGET_S:.0f}s",
              file=sys.stderr, flush=True)
    return out
