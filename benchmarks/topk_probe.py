"""Times the indexer's top-k selection (op topk_select) and candidate mask (op candidate_mask) on
the GPU: kernels/indexer/triton_topk.py's two variants - "radix" (the default: one program per row, every
8-bit radix digit re-reads the row) and "stream" (the row read once into a small candidate
buffer per program, the exact select over the buffer; docs/kernels/topk.md) - at the
V4.1 prefill shapes (8192 tokens over 135168 / 67584 / 34816 compressed entries: ratio-1 layers
at a 131072-token context, and shorter) and decode shapes (64 x 135168, 128 x 32768), top-512;
candidate blocks of 8, 2048 kept; topk_select also under that candidate mask (the reindex layers'
call). Rows: random normal scores with the causal visible prefix of a prefill (row t sees
C - T + t + 1 entries, -inf after); at the 135168-column shapes also "relu" rows (half exact
zeros) and "asc" rows (scores rising with the column: the stream's hard case, most entries enter
its buffer). Every stream output is compared with the radix one (torch.equal), the radix one with
the capturable torch kernel (all rows up to 8192 x 34816, else the first and last 256 rows);
then a sweep of the stream knobs at 8192 x 135168 and 64 x 135168. Timing:
gluon_probe_common.time_ms (CUDA-graph replays of a batch of calls, median of 5).

    python benchmarks/topk_probe.py --out /tmp/topk   # CUDA; elsewhere it says so, exit 0
    (--no-sweep: the main table only; --capturable-ms: also time the capturable kernel where it
    is compared on all rows)

Writes topk_probe.json (every number, the knobs, versions) and topk_probe.md (the tables).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gluon_probe_common import time_ms  # noqa: E402  (after the sys.path entry)

K = 512
BLOCK, KEEP_BLOCKS = 8, 2048  # V4.1-Flash candidate_block_size / candidate_topk_blocks
SHAPES = [("prefill 8K x 132K", 8192, 135168), ("prefill 8K x 66K", 8192, 67584),
          ("prefill 8K x 34K", 8192, 34816), ("decode 64 x 132K", 64, 135168),
          ("decode 128 x 32K", 128, 32768)]
EXTRA_KINDS = {135168: ("relu", "asc")}  # more row kinds at these widths
# stream knob sets swept (name, {topk module attribute: value}); "default" = the module's own
SWEEP = [("default", {}),
         ("block 2048", dict(STREAM_BLOCK=2048, STREAM_TB=256)),
         ("block 512", dict(STREAM_BLOCK=512)),
         ("cap 8192", dict(STREAM_CAP=8192)),
         ("cap 2048", dict(STREAM_CAP=2048)),
         ("tb 512", dict(STREAM_TB=512)),
         ("8 warps, block 2048", dict(STREAM_WARPS=8, STREAM_BLOCK=2048)),
         ("merge tb 256", dict(STREAM_MERGE_TB=256)),
         ("cand merge tb 512", dict(CAND_MERGE_TB=512)),
         ("cand elems 1024", dict(CAND_STREAM_ELEMS=1024)),
         ("cand elems 4096", dict(CAND_STREAM_ELEMS=4096))]
SEG_SWEEP = [1, 4, 8, 16]  # SEGMENTS at the decode shape (0 = auto is the default row)


@contextlib.contextmanager
def knobs(**values):
    """topk module attributes set for the block (read at each launch: a timed graph captures
    them), restored after."""
    from megagraph.kernels.indexer import triton_topk as tk

    old = {n: getattr(tk, n) for n in values}
    try:
        for n, v in values.items():
            setattr(tk, n, v)
        yield
    finally:
        for n, v in old.items():
            setattr(tk, n, v)


def make_scores(T: int, C: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(T, C, device="cuda", generator=g)
    if kind == "relu":
        s = s.relu_()
    elif kind == "asc":
        s = s.mul_(0.05).add_(torch.arange(C, device="cuda", dtype=torch.float32) / C)
    vis = (torch.arange(T, device="cuda") + (C - T + 1)).clamp(1, C)
    return s.masked_fill_(torch.arange(C, device="cuda")[None, :] >= vis[:, None],
                          float("-inf"))


def same_as_capturable(fn_cap, got: torch.Tensor, s: torch.Tensor, full: bool) -> bool:
    """got (a whole-matrix output) against the capturable kernel: on every row, or on the first
    and last 256 rows (rows are independent)."""
    if full:
        return bool(torch.equal(got, fn_cap(s)))
    T = s.shape[0]
    ok = True
    for sl in (slice(0, min(256, T)), slice(max(0, T - 256), T)):
        ok &= bool(torch.equal(got[sl], fn_cap(s[sl])))
    return ok


def kind_row(name: str, T: int, C: int, kind: str, cap_ms: bool) -> dict:
    """One shape and row kind: both variants of topk_select, candidate_mask and topk_select
    under the candidate mask, checked (stream against radix, radix against the capturable
    kernel), then timed."""
    from megagraph.kernels.indexer.capturable import candidate_mask as cap_cand
    from megagraph.kernels.indexer.capturable import topk_select as cap_topk
    from megagraph.kernels.indexer import triton_topk as tk

    full = T * C <= 8192 * 34816
    s = make_scores(T, C, kind, seed=T + C)
    row = dict(shape=name, T=T, C=C, k=K, kind=kind)
    want = tk.topk_select(s, None, k=K, variant="radix")
    row["radix_vs_capturable"] = same_as_capturable(lambda x: cap_topk(x, None, k=K), want, s,
                                                    full)
    row["stream_equal"] = bool(torch.equal(tk.topk_select(s, None, k=K, variant="stream"), want))
    if cap_ms and full:
        row["capturable_ms"] = time_ms(lambda: cap_topk(s, None, k=K))
    row["radix_ms"] = time_ms(lambda: tk.topk_select(s, None, k=K, variant="radix"))
    row["stream_ms"] = time_ms(lambda: tk.topk_select(s, None, k=K, variant="stream"))
    # candidate mask, then topk_select under it (the reindex layers)
    cand = tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS, variant="radix")
    row["cand_radix_vs_capturable"] = same_as_capturable(
        lambda x: cap_cand(x, block=BLOCK, topk_blocks=KEEP_BLOCKS), cand, s, full)
    row["cand_stream_equal"] = bool(torch.equal(
        tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS, variant="stream"), cand))
    row["cand_radix_ms"] = time_ms(
        lambda: tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS, variant="radix"))
    row["cand_stream_ms"] = time_ms(
        lambda: tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS, variant="stream"))
    mwant = tk.topk_select(s, cand, k=K, variant="radix")
    row["masked_stream_equal"] = bool(torch.equal(tk.topk_select(s, cand, k=K, variant="stream"),
                                                  mwant))
    row["masked_radix_ms"] = time_ms(lambda: tk.topk_select(s, cand, k=K, variant="radix"))
    row["masked_stream_ms"] = time_ms(lambda: tk.topk_select(s, cand, k=K, variant="stream"))
    with knobs(STREAM_MASKED_LOADS=False):
        row["masked_stream_allloads_equal"] = bool(torch.equal(
            tk.topk_select(s, cand, k=K, variant="stream"), mwant))
        row["masked_stream_allloads_ms"] = time_ms(
            lambda: tk.topk_select(s, cand, k=K, variant="stream"))
    print(row, flush=True)
    return row


def shape_rows(name: str, T: int, C: int, cap_ms: bool) -> list[dict]:
    rows = []
    for kind in ("randn",) + EXTRA_KINDS.get(C, ()):
        rows.append(kind_row(name, T, C, kind, cap_ms))
        torch.cuda.empty_cache()
    return rows


def sweep_row(label: str, values: dict, s: torch.Tensor, cand: torch.Tensor, want: torch.Tensor,
              mwant: torch.Tensor, row: dict) -> dict:
    """The stream variant under one knob set: topk_select, masked topk_select, candidate_mask,
    each checked against the radix output, then timed."""
    from megagraph.kernels.indexer import triton_topk as tk

    try:
        with knobs(VARIANT="stream", **values):
            row["equal"] = bool(
                torch.equal(tk.topk_select(s, None, k=K), want)
                and torch.equal(tk.topk_select(s, cand, k=K), mwant)
                and torch.equal(tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS), cand))
            row["stream_ms"] = time_ms(lambda: tk.topk_select(s, None, k=K))
            row["masked_stream_ms"] = time_ms(lambda: tk.topk_select(s, cand, k=K))
            row["cand_stream_ms"] = time_ms(
                lambda: tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS))
    except Exception as exc:  # noqa: BLE001  (a knob set that fails is reported, not fatal)
        row["error"] = repr(exc)[:300]
    print(row, flush=True)
    return row


def sweep_rows(name: str, T: int, C: int) -> list[dict]:
    """The stream variant under each knob set of SWEEP (and SEGMENTS at few rows) on random
    normal rows."""
    from megagraph.kernels.indexer import triton_topk as tk

    s = make_scores(T, C, "randn", seed=T + C)
    want = tk.topk_select(s, None, k=K, variant="radix")
    cand = tk.candidate_mask(s, block=BLOCK, topk_blocks=KEEP_BLOCKS, variant="radix")
    mwant = tk.topk_select(s, cand, k=K, variant="radix")
    sets = list(SWEEP) + ([(f"segments {n}", dict(SEGMENTS=n)) for n in SEG_SWEEP]
                          if T < 1024 else [])
    return [sweep_row(label, values, s, cand, want, mwant,
                      dict(shape=name, T=T, C=C, knobs=label, values=values))
            for label, values in sets]


def ms(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "-"


def ratio(row: dict, a: str, b: str) -> str:
    return f"{row[a] / row[b]:.2f}x" if a in row and b in row and row[b] > 0 else "-"


def markdown(res: dict) -> str:
    out = [f"# Indexer top-k probe: {res['device']} (torch {res['torch']}, Triton "
           f"{res['triton']}), {res['date']}", "", f"Command: `{res['command']}`", "",
           f"Stream knobs: {res['knobs']}", "",
           ("topk_select (top-512) and candidate_mask (blocks of 8, 2048 kept), ms per call; "
            "'masked': topk_select under that candidate mask. radix = the current default."), "",
           ("| shape | rows | topk radix | topk stream | speedup | masked radix | masked stream "
            "| masked stream, all loads | cand radix | cand stream | speedup | outputs equal |"),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        eq = all(r.get(k, True) for k in ("stream_equal", "cand_stream_equal",
                                          "masked_stream_equal", "masked_stream_allloads_equal",
                                          "radix_vs_capturable", "cand_radix_vs_capturable"))
        out.append(f"| {r['shape']} | {r['kind']} | {ms(r, 'radix_ms')} | {ms(r, 'stream_ms')} | "
                   f"{ratio(r, 'radix_ms', 'stream_ms')} | {ms(r, 'masked_radix_ms')} | "
                   f"{ms(r, 'masked_stream_ms')} | {ms(r, 'masked_stream_allloads_ms')} | "
                   f"{ms(r, 'cand_radix_ms')} | {ms(r, 'cand_stream_ms')} | "
                   f"{ratio(r, 'cand_radix_ms', 'cand_stream_ms')} | {'yes' if eq else 'NO'} |")
    if res.get("sweep"):
        out += ["", "Stream knob sweep (random normal rows), ms per call:", "",
                "| shape | knobs | topk | masked topk | cand | equal |", "|---|---|---:|---:|---:|---|"]
        for r in res["sweep"]:
            out.append(f"| {r['shape']} | {r['knobs']} | {ms(r, 'stream_ms')} | "
                       f"{ms(r, 'masked_stream_ms')} | {ms(r, 'cand_stream_ms')} | "
                       f"{'yes' if r.get('equal') else r.get('error', 'NO')} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--capturable-ms", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("topk_probe: needs CUDA")
        return
    import datetime

    import triton

    from megagraph.kernels.indexer import triton_topk as tk

    rows = [r for name, T, C in SHAPES for r in shape_rows(name, T, C, args.capturable_ms)]
    sweep = []
    if not args.no_sweep:
        for name, T, C in SHAPES:
            if C == 135168:
                sweep += sweep_rows(name, T, C)
                torch.cuda.empty_cache()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, command=" ".join(sys.argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               knobs={n: getattr(tk, n) for n in dir(tk) if n.startswith(("STREAM_", "CAND_"))
                      or n in ("SEGMENTS", "VARIANT", "RADIX_BITS", "BLOCK")},
               rows=rows, sweep=sweep)
    table = markdown(res)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for fname, text in (("topk_probe.json", json.dumps(res, indent=1)),
                            ("topk_probe.md", table)):
            tmp = out / (fname + ".tmp")
            tmp.write_text(text)
            tmp.replace(out / fname)


if __name__ == "__main__":
    sys.exit(main())
