"""Times the indexer's top-k selection (op topk_select) and candidate mask (op candidate_mask) on
the GPU: the capturable torch kernel (the reference's code) against kernels/triton/topk.py - its
radix select with 4-bit digits counted by comparison (the default) and with 8-bit tl.histogram
digits - at the prefill shape of the 5-layer V4.1-Flash slice (8192 tokens, 34816 visible
compressed entries = (131072 + 8192) / 4, top-512) and a decode shape (64 tokens, 8192 entries).
Every Triton output is compared with the capturable one (torch.equal) before it is timed
(gluon_probe_common.time_ms: CUDA-graph replays of a batch of calls, median of 5; the tenth
session's topk-probe-h200.json was timed before that, eagerly, events around one call).

    python benchmarks/topk_probe.py --out /tmp/topk        # CUDA; elsewhere it says so, exit 0
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gluon_probe_common import time_ms  # noqa: E402  (after the sys.path entry)

SHAPES = [("prefill", 8192, 34816, 512), ("decode", 64, 8192, 512)]


def shape_row(name: str, T: int, C: int, k: int) -> dict:
    """One shape: every kernel checked against the capturable one, then timed."""
    from megagraph.kernels.capturable.indexer import candidate_mask as cap_cand
    from megagraph.kernels.capturable.indexer import topk_select as cap_topk
    from megagraph.kernels.triton import topk as tk

    g = torch.Generator(device="cuda").manual_seed(T + C)
    s = torch.randn(T, C, device="cuda", generator=g)
    s[:, C - 100:] = float("-inf")  # the indexer's invisible suffix
    want = cap_topk(s, None, k=k)
    row = dict(shape=name, T=T, C=C, k=k, capturable_ms=time_ms(lambda: cap_topk(s, None, k=k)))
    default = tk.RADIX_BITS
    try:
        for bits in (4, 8):
            tk.RADIX_BITS = bits  # read at launch: the timed graph captures this width
            row[f"radix{bits}_equal"] = bool(torch.equal(tk.topk_select(s, None, k=k), want))
            row[f"radix{bits}_ms"] = time_ms(lambda: tk.topk_select(s, None, k=k))
    finally:
        tk.RADIX_BITS = default
    cm = cap_cand(s, block=8, topk_blocks=2048)
    row["cand_equal"] = bool(torch.equal(tk.candidate_mask(s, block=8, topk_blocks=2048), cm))
    row["cand_capturable_ms"] = time_ms(lambda: cap_cand(s, block=8, topk_blocks=2048))
    row["cand_triton_ms"] = time_ms(lambda: tk.candidate_mask(s, block=8, topk_blocks=2048))
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("topk_probe: needs CUDA")
        return
    rows = [shape_row(name, T, C, k) for name, T, C, k in SHAPES]
    import datetime

    import triton

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, command=" ".join(sys.argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               rows=rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "topk_probe.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out / "topk_probe.json")


if __name__ == "__main__":
    sys.exit(main())
