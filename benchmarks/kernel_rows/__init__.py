"""Row providers of benchmarks/kernels.py: every module in this folder that defines
`rows(device, smoke) -> list[dict]` contributes rows to the kernel table.

A row is a dict with at least
  kernel  str    the implementation (e.g. "triton.mega_moe")
  case    str    shape / regime (e.g. "T=8192 prefill")
  ms      float  median time per call
and, where they apply,
  flops   int    arithmetic the op must do (2 per multiply-add)
  bytes   int    bytes the op must move at least (each input read once, each output written once)
  peak    str    which measured matrix ceiling the FLOP rate is compared with: "fp8" or "bf16"
  baseline, baseline_ms   the torch path of the same op (capturable / reference) and its time
  compile_ms              torch.compile of that path
  ref_ms                  the pure-torch reference kernel
  rel_err                 ||out - reference|| / ||reference|| on the row's inputs
  notes   str
Anything else is kept in kernels.json. A failing provider contributes a row with "error".

Shared helpers for providers: time_ms (CUDA-graph replay or eager timing), rel_err, row.
"""
from __future__ import annotations

import statistics
import time

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, *, device="cuda", graph: bool = True, reps: int = 7, min_ms: float = 2.0) -> float:
    """Median ms per call of fn. CUDA: warmed up, captured in a CUDA graph and replayed (eager if
    graph=False), batches of >= min_ms timed with events; CPU: perf_counter."""
    dev = torch.device(device)
    fn()
    sync(dev)
    if dev.type != "cuda":
        t = []
        for _ in range(max(1, reps // 2)):
            t0 = time.perf_counter()
            fn()
            t.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(t)
    run = fn
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(200, int(min_ms * 1e-3 / one)))
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        st.record()
        for _ in range(inner):
            run()
        en.record()
        torch.cuda.synchronize()
        out.append(st.elapsed_time(en) / inner)
    return statistics.median(out)


def time_once_ms(fn, *, device="cuda") -> float:
    """Wall time of one call (slow baselines), after nothing but a synchronize."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0)


def rel_err(a, b) -> float:
    def flat(t):
        return torch.cat([x.detach().double().flatten() for x in (t if isinstance(t, (tuple, list))
                                                                 else (t,))])

    a, b = flat(a).cpu(), flat(b).cpu()
    fin = torch.isfinite(b)
    if not bool(torch.isfinite(a[fin]).all()):
        return float("nan")
    a, b = torch.where(fin, a, 0), torch.where(fin, b, 0)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def row(kernel: str, case: str, ms: float, *, flops: int = 0, bytes: int = 0, peak: str = "",
        **extra) -> dict:
    r = {"kernel": kernel, "case": case, "ms": round(float(ms), 4), "flops": int(flops),
         "bytes": int(bytes)}
    if peak:
        r["peak"] = peak
    if ms > 0:
        r["tflops"] = round(flops / ms / 1e9, 2)
        r["gbps"] = round(bytes / ms / 1e6, 1)
    for k, v in extra.items():
        if v is not None:
            r[k] = round(v, 4) if isinstance(v, float) and k.endswith("_ms") else v
    return r


__all__ = ["rel_err", "row", "sync", "time_ms", "time_once_ms"]
