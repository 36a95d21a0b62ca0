"""The per-op time split of a step: one eager step with every node timed (device time per node
from the torch profiler on CUDA, CUDA events where the profiler attributes too little, wall time
on the CPU), grouped into attention / MoE / mHC / other and per layer.

The timed step runs a copy of the engine's StepProgram whose segment programs have each node's
kernel wrapped through `Program.with_wrapped` (the runtime's way to wrap kernels); the engine
itself is left as it was.
"""
from __future__ import annotations

import copy
import functools
import time

import torch

CLASSES = ("attention", "moe", "mhc", "other")
CLASS_TITLES = {"attention": "attention", "moe": "MoE", "mhc": "mHC", "other": "other"}

MHC_OPS = {"hc_embed", "hc_mixer", "hc_collapse", "hc_expand", "hc_head_mix", "mega_mhc"}
MOE_OPS = {"mega_moe", "moe_experts", "moe_experts_q", "route", "hash_route", "swiglu_mlp",
           "swiglu_mlp_q", "ep_place", "ep_dispatch", "ep_combine"}
ATTN_OPS = {"sparse_attn", "sparse_attn_q", "index_scores", "candidate_mask", "topk_select",
            "compressor", "compress_pool", "cache_write", "ring_update", "ring_update_batched",
            "v4_compressor", "v4_compress_pool"}


def op_class(op: str, name: str) -> str:
    """attention (the whole attention sub-layer: projections, compressor, indexer, top-k, sparse
    attention, ring copies), moe (router, experts, shared expert, combine), mhc (hyper-connection
    mixers, collapse, expand), other (embedding, Engram, LM head, casts)."""
    if op in MHC_OPS:
        return "mhc"
    if op in MOE_OPS or ".ffn." in name:
        return "moe"
    if op in ATTN_OPS or ".attn." in name:
        return "attention"
    return "other"


def node_layer(name: str) -> int | None:
    head = name.split(".", 1)[0]
    return int(head[1:]) if head.startswith("L") and head[1:].isdigit() else None


def node_scope(op: str, name: str) -> str:
    """Where a node's cost goes in the 40-layer extrapolation: 'L<i>' (one layer), 'L<i>.engram'
    (that layer's Engram), 'all layers' (one op for every layer: the batched ring copies) or
    'step' (embedding, LM head, ...)."""
    if op == "ring_update_batched":
        return "all layers"
    layer = node_layer(name)
    if layer is None:
        return "step"
    return f"L{layer}.engram" if ".engram." in name else f"L{layer}"


def time_ops(eng, chunks, context: int, device) -> dict:
    """One eager step of `eng` at exact shapes (its StepProgram, as Engine.step runs a step no
    bucket holds) with every node timed. CUDA: device time of the kernels each node launched
    (torch.profiler, one record_function per node); if the profiler attributes too little of the
    kernel time, CUDA events around each node instead. CPU: wall time per node. The state is
    left at `context` cached tokens per request."""
    from megagraph.runtime.batch import make_batch

    prog = eng.program
    g = prog.graph
    ops = {n.outputs[0]: n.op for n in g.nodes}
    for ch in chunks:
        eng.cached[ch.slot] = context
    batch = make_batch(chunks, eng.cached)
    meta = {k: v.to(eng.device) for k, v in batch.meta.items()}
    out: dict = {}
    try:
        if device.type == "cuda":
            try:
                out = _time_ops_profiler(prog, meta, device)
            except Exception as e:  # noqa: BLE001
                out = {"profiler_error": f"{type(e).__name__}: {e}"[:300]}
            if not out.get("ok"):
                why = out.get("profiler_error") or (
                    f"profiler attributed {out.get('coverage', 0):.0%} of the kernel time")
                out = {**_time_ops_events(prog, meta, device), "why_not_profiler": why}
        else:
            out = _time_ops_wall(prog, meta)
    finally:
        for ch in chunks:
            eng.cached[ch.slot] = context
    out["ops"] = [{"name": n, "op": ops[n], "cls": op_class(ops[n], n),
                   "scope": node_scope(ops[n], n), "ms": round(ms, 5)}
                  for n, ms in out.pop("times").items()]
    return out


def _wrapped(prog, wrap):
    """A copy of the StepProgram `prog` whose every node's kernel runs through wrap(name, fn) (the
    same state pools, weights and constants; `prog` itself unchanged)."""
    g = prog.graph
    programs = []
    for seg, p in zip(prog.segments, prog.programs):
        for i in seg.nodes:
            name = g.nodes[i].outputs[0]
            p = p.with_wrapped({name}, functools.partial(wrap, name))
        programs.append(p)
    timed = copy.copy(prog)
    timed.programs = programs
    return timed


def _time_ops_wall(prog, meta) -> dict:
    times: dict[str, float] = {}

    def wrap(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            times[name] = times.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
            return r
        return run

    timed = _wrapped(prog, wrap)
    t0 = time.perf_counter()
    timed.run(meta)
    total = 1e3 * (time.perf_counter() - t0)
    return {"method": "wall time per node (CPU)", "times": times, "step_ms": total, "ok": True}


def _time_ops_events(prog, meta, device) -> dict:
    events: dict[str, list] = {}

    def wrap(name, fn):
        def run(*a, **k):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            r = fn(*a, **k)
            e.record()
            events.setdefault(name, []).append((s, e))
            return r
        return run

    timed = _wrapped(prog, wrap)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    timed.run(meta)
    torch.cuda.synchronize(device)
    total = 1e3 * (time.perf_counter() - t0)
    times = {n: sum(s.elapsed_time(e) for s, e in ev) for n, ev in events.items()}
    return {"method": "CUDA events around each node (includes launch gaps)", "times": times,
            "step_ms": total, "ok": True}


def _time_ops_profiler(prog, meta, device) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    tag = "mg::"

    def wrap(name, fn):
        def run(*a, **k):
            with record_function(tag + name):
                return fn(*a, **k)
        return run

    timed = _wrapped(prog, wrap)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        timed.run(meta)
        torch.cuda.synchronize(device)
        total = 1e3 * (time.perf_counter() - t0)
    times: dict[str, float] = {}
    kernel_us = 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:  # kernels, copies (not the GPU spans of our ranges)
            if not getattr(e, "is_user_annotation", False):
                kernel_us += e.time_range.elapsed_us()
        elif e.name.startswith(tag):
            dt = getattr(e, "device_time_total", None)
            if dt is None:
                dt = getattr(e, "cuda_time_total", 0.0)
            name = e.name[len(tag):]
            times[name] = times.get(name, 0.0) + dt / 1e3
    attributed = sum(times.values())
    coverage = attributed / (kernel_us / 1e3) if kernel_us > 0 else 0.0
    return {"method": "torch.profiler: device time of the kernels each node launched",
            "times": times, "step_ms": total, "kernel_ms": kernel_us / 1e3,
            "coverage": round(coverage, 3), "ok": 0.5 <= coverage <= 1.5}


def split_step(ops: list[dict], step_ms: float) -> dict:
    """The per-node times of one profiled eager step (`ops` from time_ops) applied to a step
    timed at `step_ms` (graphs or eager): node times are kept where they sum to less than the
    step (the rest is host work and launch gaps: metadata, copies, host-side Engram gathers, idle
    GPU), or scaled down to the step where they sum to more."""
    k = sum(o["ms"] for o in ops)
    scale = min(1.0, step_ms / k) if k > 0 else 0.0
    classes = {c: 0.0 for c in CLASSES}
    scopes: dict[str, dict[str, float]] = {}
    by_op: dict[str, float] = {}
    for o in ops:
        ms = o["ms"] * scale
        classes[o["cls"]] += ms
        s = scopes.setdefault(o["scope"].split(".")[0], {c: 0.0 for c in CLASSES})
        s[o["cls"]] += ms
        by_op[o["op"]] = by_op.get(o["op"], 0.0) + ms
    return {"step_ms": step_ms, "node_ms": k, "scale": scale,
            "host_gap_ms": max(0.0, step_ms - k), "classes_ms": classes,
            "scopes_ms": dict(sorted(scopes.items(), key=lambda kv: _scope_order(kv[0]))),
            "by_op_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def _scope_order(s: str):
    layer = node_layer(s + ".")
    return (0, layer) if layer is not None else (1, s)


# ---------------------------------------------------------------------------------------------
