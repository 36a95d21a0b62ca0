"""The router's gate GEMM tile above 256 tokens (MoeConfig.gate_tile: rows, experts, warps,
stages) timed alone: route_ids at V4.1-Flash dims (hidden 5120, 384
experts, top-6, sqrtsoftplus with bias), each tile's ids and weights compared with the first
tile's (a layer-level A/B cannot see a 40 us change through the H200's clock drift).

    python3 benchmarks/probes/gate_tile_probe.py --out DIR [--tokens 8192]

Writes DIR/gate-tiles.json and DIR/gate-tiles.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),  # probes/ and benchmarks/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from kernel_rows import time_ms  # noqa: E402

# (rows, experts, warps, stages) per tile; the first is the default (MoeConfig.gate_tile)
TILES = [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4),
         (128, 64, 8, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    from megagraph.kernels.moe import triton as tm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T, D, E, k = args.tokens, 5120, 384, 6
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    gw = (torch.randn(E, D, device=dev, generator=g) * 0.05).bfloat16()
    bias = torch.randn(E, device=dev, generator=g) * 0.1
    counts = torch.zeros(E, dtype=torch.int32, device=dev)

    from megagraph.kernels.moe.config import MoeConfig

    def call(cfg):
        counts.zero_()
        return tm.route_ids(x, gw, bias, topk=k, route_scale=1.5, norm_topk=True,
                            score_func="sqrtsoftplus", counts=counts, cfg=cfg)

    rows, ref = [], None
    for tile in TILES:
        cfg = MoeConfig(gate_tile=tuple(tile))
        try:
            ids, wts = call(cfg)
            if ref is None:
                ref = (ids.clone(), wts.clone())
            same = bool(torch.equal(ids, ref[0]) and torch.equal(wts, ref[1]))
            rows.append(dict(tile=list(tile), us=1e3 * time_ms(lambda: call(cfg)),
                             same_bits=same))
        except Exception as e:  # a tile that does not compile is a row, not the end
            rows.append(dict(tile=list(tile), error=f"{type(e).__name__}: {e}"))
        print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, tokens=T, rows=rows)
    with open(os.path.join(args.out, "gate-tiles.json"), "w") as f:
        json.dump(meta, f, indent=1)
    lines = [f"# Gate GEMM tiles: {meta['device']} (torch {meta['torch']}), {T} tokens", "",
             "| rows x experts, warps, stages | route_ids us | ids + weights = first tile's |",
             "|---|---:|---|"]
    for r in rows:
        t = "{} x {}, {} warps, {} stages".format(*r["tile"])
        lines.append(f"| {t} | {r.get('us', float('nan')):.1f} | "
                     f"{r.get('same_bits', r.get('error'))} |")
    with open(os.path.join(args.out, "gate-tiles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
