"""Times the prefill sparse attention (op sparse_attn_q, kernels/attention/triton.py) at launch
shapes given on the command line against the plan's default launch (attention.PREFILL), at the
5-layer V4.1-Flash slice's prefill step: 2 requests x 4096 new tokens after a 131072-token
context, 64 heads x 512, window 128, top-512 compressed entries, ratios 1 and 2 (the kernel-table
rows of benchmarks/kernel_rows/attention.py use one request of 8192 tokens).

Each launch's FP8 output is compared with the default launch's (dequantized, max |diff| over the
row's max |value|: only the summation order of the online softmax differs) before it is timed
(gluon_probe_common.time_ms: CUDA-graph replays, median of 5). FLOPs: two 64 x 512 products per
(token, key), bf16 dense peak 989 TFLOP/s (profile h200).

    python benchmarks/probes/attn_probe.py --configs "16,32,4,2,1/64,32,8,2,1" --out /tmp/attn
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
from kernel_rows.attention import ROPE, _count_attn, _deq, attn_case  # noqa: E402

PEAK_BF16 = 989e12


def parse_configs(spec: str) -> list[tuple]:
    """ "block_h,block_n,warps,stages,pipe" items separated by '/'."""
    return [tuple(int(x) for x in item.split(",")) for item in spec.split("/") if item.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="16,32,4,2,1", help="launches, see parse_configs")
    ap.add_argument("--ratios", default="1,2")
    ap.add_argument("--decode", action="store_true", help="also 64 decode requests at 32K")
    args = cuda_probe_args(ap, argv, "attn_probe", "a small context", "attn-probe")
    if args is None:
        return 0
    from megagraph.kernels.attention import triton as A

    rows = []
    new, ctx = (64, 2048) if args.smoke else (4096, 131072 + 4096)
    cases = [(ratio, 2, new, ctx, 1) for ratio in (int(r) for r in args.ratios.split(","))]
    if args.decode:  # 64 requests x 1 token at 32K, the key list split (flash-decoding)
        cases.append((1, 64, 1, 2048 if args.smoke else 32768, 0))
    for ratio, R, new, ctx, splits in cases:
        a, kw = attn_case("cuda", R, ctx, ratio, new=new)
        byt, fl = _count_attn(a, ratio)
        run = lambda cfg: A.launch(*a[:10], window=128, scale=kw["scale"], ratio=ratio,  # noqa: E731
                                   attend_all=False, quant=("fp8_1x128", ROPE),
                                   launch_shape=cfg)
        ref = _deq(run(None))
        scale = ref.abs().amax(1, keepdim=True) + 1e-6
        launches = [("default " + str(A.pick_launch(a[0].shape[0])), None)]
        for bh, bn, w, st, pipe in parse_configs(args.configs):
            launches.append((f"h{bh} n{bn} w{w} s{st} pipe{pipe}",
                             A.AttnLaunch(bh, bn, w, st, splits, bool(pipe))))
        for label, cfg in launches:
            row = dict(ratio=ratio, T=a[0].shape[0], requests=R, launch=label)
            try:
                err = float(((_deq(run(cfg)) - ref).abs() / scale).max())
                ms = time_ms(lambda c=cfg: run(c))
                row.update(ms=ms, err=err, tflops=fl / ms / 1e9, pct=100 * fl / ms / 1e-3 / PEAK_BF16)
            except Exception as e:  # noqa: BLE001 - a launch Triton rejects must not lose the rest
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        a = ref = None
        torch.cuda.empty_cache()
    md = ["| ratio | T | launch | ms | TFLOP/s | % bf16 peak | max err vs default |",
          "|---|---|---|---:|---:|---:|---:|"]
    md += [f"| {r['ratio']} | {r['T']} | {r['launch']} | " + (
        f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['pct']:.1f} | {r['err']:.1e} |" if "ms" in r
        else f"{r['error']} | | | |") for r in rows]
    write_rows(args.out, "attn-probe", argv, rows, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
