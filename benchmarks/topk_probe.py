"""Times the indexer's top-k selection (op topk_select) and candidate mask (op candidate_mask) on
the GPU: the capturable torch kernel (the reference's code) against kernels/triton/topk.py - its
radix select with 4-bit digits counted by comparison (the default) and with 8-bit tl.histogram
digits - at the prefill shape of the 5-layer V4.1-Flash slice (8192 tokens, 34816 visible
compressed entries = (131072 + 8192) / 4, top-512) and a decode shape (64 tokens, 8192 entries).
Every Triton output is compared with the capturable one (torch.equal) before it is timed; CUDA
events, median of 5 after a warm-up.

    python benchmarks/topk_probe.py --out /tmp/topk        # CUDA; elsewhere it says so, exit 0
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

SHAPES = [("prefill", 8192, 34816, 512), ("decode", 64, 8192, 512)]


def time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("topk_probe: needs CUDA")
        return
    from megagraph.kernels.capturable.indexer import candidate_mask as cap_cand
    from megagraph.kernels.capturable.indexer import topk_select as cap_topk
    from megagraph.kernels.triton import topk as tk

    rows = []
    for name, T, C, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(T + C)
        s = torch.randn(T, C, device="cuda", generator=g)
        s[:, C - 100:] = float("-inf")  # the indexer's invisible suffix
        want = cap_topk(s, None, k=k)
        row = dict(shape=name, T=T, C=C, k=k, capturable_ms=time_ms(lambda: cap_topk(s, None, k=k)))
        for bits in (4, 8):
            tk.RADIX_BITS = bits
            got = tk.topk_select(s, None, k=k)
            row[f"radix{bits}_equal"] = bool(torch.equal(got, want))
            row[f"radix{bits}_ms"] = time_ms(lambda: tk.topk_select(s, None, k=k))
        tk.RADIX_BITS = 4
        cm = cap_cand(s, block=8, topk_blocks=2048)
        row["cand_equal"] = bool(torch.equal(tk.candidate_mask(s, block=8, topk_blocks=2048), cm))
        row["cand_capturable_ms"] = time_ms(lambda: cap_cand(s, block=8, topk_blocks=2048))
        row["cand_triton_ms"] = time_ms(lambda: tk.candidate_mask(s, block=8, topk_blocks=2048))
        rows.append(row)
        print(row, flush=True)
    res = dict(device=torch.cuda.get_device_name(), rows=rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "topk_probe.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out / "topk_probe.json")


if __name__ == "__main__":
    sys.exit(main())
