"""Engines for the benchmarks and the timed step loop.

An engine is started through the runtime's public API (`Engine(plan, weights, EngineConfig)`),
with one of three kernel sets of the same compiled plan (`KERNEL_SETS`): the set is plan data (the
plan's kernel table), not a patch of the runtime. A long cached context is set as state, without
prefilling it: every state pool gets random contents and `Engine.cached` says how many tokens each
slot holds (docs/step-convention.md: which rows are valid follows from seq_cached alone, so to
every op the slot holds that context).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .models import Model


KERNEL_SETS = {
    "plan": "the plan's kernels (Triton where MEGAGRAPH_UNVALIDATED_KERNELS=1 picked them, else "
            "capturable torch)",
    "capturable": "capturable torch kernels (vectorized, host-sync free)",
    "reference": "reference torch kernels (host syncs, loops over requests: a plain PyTorch port)",
}


def with_kernels(plan, which: str):
    """`plan` with every op's kernel set to `which` ("plan" leaves it as compiled; "capturable"
    falls back to "reference" for ops without a capturable kernel)."""
    if which == "plan":
        return plan
    if which not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {which!r}")
    from megagraph.kernels.capturable_table import CAPTURABLE
    from megagraph.kernels.registry import kernel_key

    keys = {kernel_key(n.op, n.attr_dict): n.op for n in plan.graph.nodes}
    kern = {k: ("capturable" if which == "capturable" and op in CAPTURABLE else "reference")
            for k, op in keys.items()}
    return dataclasses.replace(plan, kernels=kern)


def kernel_summary(plan) -> dict[str, int]:
    """Implementation name -> number of graph nodes it runs."""
    from megagraph.kernels.registry import kernel_key

    out: dict[str, int] = {}
    for n in plan.graph.nodes:
        impl = plan.kernels.get(kernel_key(n.op, n.attr_dict), "reference")
        out[impl] = out.get(impl, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def round_capacity(tokens: int, multiple: int = 128) -> int:
    return -(-tokens // multiple) * multiple


def make_engine(model: Model, device: torch.device, *, kernels: str = "plan", slots: int,
                capacity: int, buckets: tuple[int, ...] = (), graphs: bool = True,
                compile: str = "none"):
    """An Engine over `model`'s weights (already on the device) with `kernels`, `slots` request
    slots of `capacity` tokens, CUDA graphs for `buckets` (padded but uncaptured on the CPU)."""
    from megagraph.runtime.engine import Engine, EngineConfig

    budget = None
    if device.type == "cuda":  # the weights are resident already; the fit check counts them again
        budget = torch.cuda.mem_get_info(device)[0] + model.device_weight_bytes
    conf = EngineConfig(device=str(device), max_slots=slots, capacity=round_capacity(capacity),
                        kernels="plan", progress=False, allow_fallback=True, memory_budget=budget,
                        cuda_graphs=graphs and bool(buckets), buckets=tuple(sorted(buckets)),
                        compile=compile)
    from megagraph.runtime.token_map import stand_in_token_map

    return Engine(with_kernels(model.plan, kernels), dict(model.weights), conf,
                  token_map=stand_in_token_map(model.plan.cfg))  # random weights


def step_path(eng, tokens: int) -> str:
    """How Engine.step runs a step of `tokens` tokens: a captured bucket, a padded bucket without
    capture (CPU), or eagerly at exact shapes."""
    r = eng.runner
    if r is None or not r.buckets or tokens > r.buckets[-1]:
        return "eager"
    b = r.padded_size(tokens)
    return f"graphs (bucket {b})" if r.graphs else f"padded bucket {b} (uncaptured)"


def close_engine(eng, device) -> None:
    """Drop an engine's graphs; the caller drops its references, then `release_memory`."""
    if eng is not None:
        eng.close()


def release_memory(device) -> None:
    """Collect dropped engines (an Engine and its Generator reference each other) and hand the
    cached blocks back, so the next engine's fit check sees the device's free memory."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def fill_state(eng, seed: int = 0) -> None:
    """Random contents in every state pool, every slot (rings, compressed KV, index keys, pending
    compressor rows; Engram history ids in the compressed vocabulary). With eng.cached[slot] = c a
    slot then holds a c-token context as far as every op can tell: validity derives from
    seq_cached (docs/step-convention.md), never from the contents."""
    g = torch.Generator(device=eng.device).manual_seed(seed)
    vocab = max(1, int(getattr(eng.cfg, "engram_compressed_vocab_size", 0) or 1))
    for pool in eng.state.values():
        if pool.dtype.is_floating_point:
            if pool.element_size() >= 2:
                pool.normal_(generator=g)
            else:  # fp8 pools: through a wider dtype
                pool.copy_(torch.randn(pool.shape, generator=g, device=pool.device))
        elif pool.dtype == torch.int64:
            pool.random_(0, vocab, generator=g)


def run_steps(eng, chunks, context: int, warmup: int, iters: int, device,
              cap_s: float = 3.0) -> list[float]:
    """Time up to `iters` steps over `chunks` after up to `warmup` untimed ones, every request
    starting from `context` cached tokens each time (the step is the same every time); ms per
    step. Slow paths stop early: no further warm-up after one that took more than `cap_s`, no
    further timed step once the timed ones add up to more than `cap_s` (at least one runs)."""
    times, spent = [], 0.0
    n_warm = 0
    while True:
        for ch in chunks:
            eng.cached[ch.slot] = context
        sync(device)
        t0 = time.perf_counter()
        eng.step(chunks)
        sync(device)
        dt = time.perf_counter() - t0
        if n_warm < warmup:
            n_warm = warmup if dt > cap_s else n_warm + 1
            continue
        times.append(1e3 * dt)
        spent += dt
        if len(times) >= iters or spent > cap_s:
            break
    for ch in chunks:
        eng.cached[ch.slot] = context
    return times


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def is_oom(msg: str) -> bool:
    return "out of memory" in msg.lower() or "OutOfMemoryError" in msg
