"""Times the lightning indexer's scores (op index_scores) on the GPU: kernels/indexer/triton.py's
query-stationary kernel (index_scores_stream: its default two-class launch and explicit launches)
against the tile kernel it replaces (index_scores_fwd, queries reloaded per 64 entries), at the
5-layer V4.1-Flash slice's shapes: a captured 8192-token prefill bucket (two requests of 4096 new
tokens after a 131072-token context, padded to 8192 request rows as the plan's graph holds them)
at ratios 1 and 2, and decode (64 requests, one token each) at 32K and 128K contexts.

Every output is compared with the tile kernel's before it is timed (same -inf pattern; max |diff|
over 1 + the row's max |score|: only the fp32 summation order differs, the products are exact in
bf16 on MXFP4 inputs). Timing: gluon_probe_common.time_ms (CUDA-graph replays, median of 5).
Roofline columns: FLOPs 2 x Hi x Di per visible (token, entry); bytes = the keys once per request +
queries + the f32 scores written, against the profile's bf16 peak (989 TFLOP/s) and 4.8 TB/s.

    python benchmarks/probes/index_probe.py --out /tmp/idx [--configs "8,64,1,8,2/16,32,0,8,2"]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # probes/ and benchmarks/
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from gluon_probe_common import cuda_probe_args, time_ms, write_rows  # noqa: E402  (sys.path)

HI, DI = 32, 128  # V4.1-Flash's index heads x head dim
PEAK_BF16, HBM = 989e12, 4.8e12  # profile h200 (dense bf16 FLOP/s, bytes/s)
# (name, real requests, new tokens each, context, ratio, request rows of the bucket)
CASES = [("prefill 8K r1", 2, 4096, 131072, 1, 8192), ("prefill 8K r2", 2, 4096, 131072, 2, 8192),
         ("decode 64 ctx32K r1", 64, 1, 32768, 1, 64), ("decode 64 ctx32K r2", 64, 1, 32768, 2, 64),
         ("decode 64 ctx128K r1", 64, 1, 131072, 1, 64)]
SMOKE = [("prefill smoke", 2, 64, 2048, 1, 256), ("decode smoke", 8, 1, 4096, 2, 8)]


def make_case(R: int, new: int, ctx: int, ratio: int, rows: int, ikey_dtype, seed: int):
    """Inputs of one step: R requests of `new` tokens after `ctx` cached ones, in `rows` request
    rows (the rest empty, on slot R), MXFP4-valued queries and keys, f32 index-key cache."""
    from megagraph.kernels.dense.capturable import fake_quant

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    T = R * new
    pos = (ctx + torch.arange(new, device=dev)).repeat(R)
    req = torch.arange(R, device=dev).repeat_interleave(new)
    slots = torch.full((rows,), R, dtype=torch.int64, device=dev)
    slots[:R] = torch.arange(R, device=dev)
    C = (ctx + new) // ratio
    qi = fake_quant(torch.randn(T, HI, DI, device=dev, generator=g), fmt="mxfp4", block=32)
    ikey = fake_quant(torch.randn(R + 1, C, DI, device=dev, generator=g), fmt="mxfp4", block=32)
    w = torch.randn(T, HI, device=dev, generator=g).bfloat16()
    args = (qi.bfloat16(), w, ikey.to(ikey_dtype), pos, req, slots)
    kw = dict(ratio=ratio, weight_scale=DI ** -0.5 * HI ** -0.5, products="bf16")
    vis = int(((pos + 1) // ratio).clamp(max=C).sum())
    flops = 2 * HI * DI * vis
    byt = R * C * DI * ikey.element_size() + qi.numel() * 2 + T * C * 4
    return args, kw, flops, byt


def parse_configs(spec: str) -> list[tuple]:
    """ "bt,bc,keys_m,warps,stages[,span_keys]" items separated by '/' (not ';': the device
    script benchmarks/h200_check.sh splits its steps on ';'); bt 1 sets the short class's launch
    (decode requests), other bt the long class's (requests of >= LONG_REQUEST tokens)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.replace(";", "/").split("/"))):
        v = [int(x) for x in item.split(",")]
        out.append((v[0], v[1], bool(v[2]), v[3], v[4], v[5] if len(v) > 5 else None))
    return out


def case_rows(name, R, new, ctx, ratio, rows, configs, ikey_dtype) -> list[dict]:
    from megagraph.kernels.indexer import triton as I
    from megagraph.kernels.indexer.config import IndexerConfig

    tile = IndexerConfig(index_kernel_bf16="tile", index_kernel_fp32="tile")
    stream = IndexerConfig(index_kernel_bf16="stream", index_kernel_fp32="stream")

    args, kw, flops, byt = make_case(R, new, ctx, ratio, rows, ikey_dtype, seed=ctx + new + ratio)
    T, C = args[0].shape[0], args[2].shape[1]
    ref = torch.empty(T, C, device="cuda")
    out = torch.empty_like(ref)
    I.index_scores(*args, **kw, kernel_config=tile, out=ref)
    fin = torch.isfinite(ref)
    scale = 1 + torch.where(fin, ref.abs(), 0).amax(1, keepdim=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [("tile", dict(kernel_config=tile)),
                ("stream (default)", dict(kernel_config=stream))]
    for bt, bc, km, warps, stages, span_keys in configs:
        nt = -(-T // bt)
        span_keys = span_keys or (stream.index_span_keys if bt > 1 else None)
        span = I._spans(C, bc, nt, sms, span_keys, stream.index_programs_per_sm)
        cfg = I.StreamConfig(bt, bc, km, warps, stages, span)
        which = "short_config" if bt == 1 else "config"  # 1-token tiles: the short class
        variants.append((f"stream bt{bt} bc{bc} {'keysM' if km else 'qM'} w{warps} s{stages} "
                         f"span{span}", {"kernel_config": stream, which: cfg}))
    res = []
    for label, opt in variants:
        row = dict(case=name, T=T, C=C, requests=R, rows=rows, ratio=ratio, kernel=label)
        try:
            out.fill_(float("nan"))
            I.index_scores(*args, **kw, **opt, out=out)
            torch.cuda.synchronize()
            same_inf = bool(torch.equal(torch.isfinite(out), fin))
            err = float(torch.where(fin, (out - ref).abs(), 0).div(scale).max())
            row.update(same_inf=same_inf, err=err,
                       ms=time_ms(lambda o=opt: I.index_scores(*args, **kw, **o, out=out)))
            row.update(tflops=flops / row["ms"] / 1e9, pct_bf16=100 * flops / row["ms"] / 1e-3 / PEAK_BF16,
                       tbps=byt / row["ms"] / 1e9, pct_hbm=100 * byt / row["ms"] / 1e-3 / HBM)
        except Exception as e:  # noqa: BLE001 - one failing launch must not lose the others' rows
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        res.append(row)
    args = ref = out = None  # free the device buffers before the next case
    torch.cuda.empty_cache()
    return res


def markdown(rows: list[dict], argv: list[str]) -> str:
    lines = ["# Indexer scores: query-stationary vs tile kernel (H200)", "",
             f"`python3 benchmarks/probes/index_probe.py {' '.join(argv)}`", "",
             "| case | T x C | kernel | ms | TFLOP/s | % bf16 peak | TB/s (ideal bytes) | % HBM | "
             "err vs tile | -inf same |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['T']} x {r['C']} | {r['kernel']} | {r['error']} |"
                         " | | | | | |")
            continue
        lines.append(f"| {r['case']} | {r['T']} x {r['C']} | {r['kernel']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} | {r['pct_bf16']:.1f} | {r['tbps']:.2f} | "
                     f"{r['pct_hbm']:.1f} | {r['err']:.1e} | {r['same_inf']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="", help="explicit stream launches, see parse_configs")
    ap.add_argument("--cases", default="", help="substrings of case names to keep (',')")
    ap.add_argument("--ikey", choices=["f32", "bf16"], default="f32", help="index-key cache dtype")
    args = cuda_probe_args(ap, argv, "index_probe", "small shapes", "index-probe")
    if args is None:
        return 0
    cases = SMOKE if args.smoke else CASES
    if args.cases:
        keep = args.cases.split(",")
        cases = [c for c in cases if any(k in c[0] for k in keep)]
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[args.ikey]
    rows = []
    for c in cases:
        rows += case_rows(*c, parse_configs(args.configs), dt)
    argv_s = sys.argv[1:] if argv is None else argv
    write_rows(args.out, "index-probe", argv_s, rows, markdown(rows, argv_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
