"""The MoE rows of benchmarks/kernels.py (kernel_rows/moe.py: mega_moe, routed experts with its
variants, FP8-H, pieces) at V4.1-Flash dims, without the FP8 GEMM / quantizer rows: for a short
device call after a MoE change. Writes OUT/moe-rows.json (rows as kernels.py's JSON holds them).

    python3 benchmarks/probes/moe_layer_rows.py --out DIR [--tokens 64,8192] [--budget 150]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),  # probes/ and benchmarks/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from kernel_rows import moe  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="64,8192")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of rows")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    Ts = tuple(int(t) for t in args.tokens.split(","))
    rows = moe.device_rows(torch.device("cuda"), moe.V41, Ts, args.budget, sweep=True)
    path = os.path.join(args.out, "moe-rows.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       rows=rows), f, indent=1)
    os.replace(path + ".tmp", path)
    for r in rows:
        print(r.get("kernel"), r.get("case"), r.get("ms"), r.get("gbps"), r.get("tflops"),
              r.get("rel_err"), r.get("best", ""), r.get("error", ""))


if __name__ == "__main__":
    main()
