"""Times the host-side Engram row gather (runtime/host_gather.py) against a plain per-step gather,
at a prefill step's size: T tokens x 24 heads rows of 256 FP8 bytes + 8 e8m0 scale
bytes from a table of R rows (the 5-layer slice's 2.4M-row Engram table by default).

Rows (median of --reps, after one warm-up):
  fresh     table.index_select(0, ids).to(dev) per call (a plain gather into new tensors)
  staged    HostStaging.gather into the reused (pinned for CUDA) buffer, async copy for CUDA;
            with a CPU destination only its host half (HostStaging.stage: the gather into the
            reused buffer), against the fresh gather alone
  copy      torch copy of the same bytes between two already-touched host buffers: the host's
            memory-bandwidth roofline for moving them once (a gather reads them scattered)
Each time is the gather of rows + scales, synchronized (CUDA) so the device copy is included.

    python benchmarks/probes/host_gather.py --out /tmp/hg              # CPU destination
    python benchmarks/probes/host_gather.py --device cuda --out /tmp/hg
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _time(fn, reps: int, dev: torch.device) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    from megagraph.runtime.host_gather import HostStaging

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--rows", type=int, default=2_400_000)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 255, (args.rows, args.width), dtype=torch.uint8, generator=g)
    table = table.view(torch.float8_e4m3fn)
    scale = torch.randint(110, 130, (args.rows, args.width // 32), dtype=torch.uint8, generator=g)
    ids = torch.randint(0, args.rows, (args.tokens * args.heads,), generator=g)
    n_bytes = ids.numel() * (args.width + args.width // 32)

    def fresh():
        table.index_select(0, ids).to(dev)
        scale.index_select(0, ids).to(dev)

    st = HostStaging()

    def staged():
        if dev.type == "cpu":  # the host half (what precedes the device copy in the runtime)
            st.stage(table, ids, False)
            st.stage(scale, ids, False)
        else:
            st.gather(table, ids, dev)
            st.gather(scale, ids, dev)

    src = torch.empty(n_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    rows = {"fresh": _time(fresh, args.reps, dev), "staged": _time(staged, args.reps, dev),
            "copy": _time(lambda: dst.copy_(src), args.reps, torch.device("cpu"))}
    res = dict(device=str(dev), gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None,
               threads=torch.get_num_threads(), tokens=args.tokens, heads=args.heads,
               table_rows=args.rows, width=args.width, gathered_mb=n_bytes / 1e6, ms=rows,
               staged_speedup=rows["fresh"] / rows["staged"],
               staged_vs_copy_roofline=rows["copy"] / rows["staged"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_gather.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Host Engram gather: {res['gathered_mb']:.1f} MB ({ids.numel()} rows of "
             f"{args.width} + {args.width // 32} B) from {args.rows} rows, to {dev}"
             f"{' (' + res['gpu'] + ')' if res['gpu'] else ''}, {res['threads']} CPU threads",
             "", "| path | ms | vs fresh |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {rows['fresh'] / v:.2f}x |" for k, v in rows.items()]
    lines += ["", f"staged = {res['staged_vs_copy_roofline']:.0%} of the copy roofline "
              "(one host memcpy of the same bytes)"]
    (args.out / "host_gather.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
