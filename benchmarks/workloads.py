"""Shared pieces of the runtime benchmarks (decode_runtime.py, prefill.py, decode.py).

* models: the tiny V4.1 model and full-width V4.1-Flash layer slices (`slice_config`), compiled for
  this device's profile, with random weights in the release formats made on the device;
* kernel sets of one compiled plan: `plan` (what the plan chose: the Triton kernels where
  MEGAGRAPH_UNVALIDATED_KERNELS=1 picked them), `capturable` (pure torch, host-sync free, CUDA-graph
  capturable) and `reference` (pure torch, host syncs, loops over requests: what a plain PyTorch
  port does), all on the same step graph and weights;
* a long cached context without prefilling it: every state pool gets random contents and each
  request's `seq_cached` says how many tokens it holds (docs/step-convention.md: which rows are
  valid follows from seq_cached alone, so to every op the slot holds that context);
* balanced expert routing (round-robin experts through the hash-routing inputs of mega_moe);
* the per-op time split (an eager step with every node timed: device time per node from the torch
  profiler on CUDA, wall time on the CPU), grouped into attention / MoE / mHC / other;
* the FLOP and byte model of a step (from the compiled graph's weight shapes and the model config),
  the extrapolation of a slice to the 40 layers of V4.1-Flash, measured ceilings, the environment
  header, the time budget, Markdown and plot helpers.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()  # prefill.py / decode.py import this first: --time-budget counts from here

import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CLASSES = ("attention", "moe", "mhc", "other")
CLASS_TITLES = {"attention": "attention", "moe": "MoE", "mhc": "mHC", "other": "other"}

# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


def slice_config(layers: int = 4):
    """Full-width V4.1-Flash (release widths and formats, 384 experts) cut to a layer slice that
    covers every layer role: the shipped configs/models/v4.1-flash-slice{4,5}.yaml, so that the
    benchmarks and `megagraph compile --model v4.1-flash-slice5` build the same model
    (tests/models/test_slice_configs.py derives both from v4.1-flash.yaml field by field).

    4 layers: L0 window-only + Engram, L1 ratio-2 KV/index source, L2 ratio-2 reuse, L3 ratio-1
    KV/index/candidate source. 5 layers: the same plus L4, a ratio-1 reindex layer (its own indexer
    over L3's index keys, restricted to L3's candidate blocks)."""
    from megagraph.models.config import load_model_config

    if layers not in (4, 5):
        raise ValueError(f"no {layers}-layer slice (4 or 5)")
    return load_model_config(f"v4.1-flash-slice{layers}")


MODELS = {"tiny": "v4.1-flash-tiny (9 layers at toy width, seeded random weights)",
          "slice": "4-layer full-width V4.1-Flash slice", "slice4": "4-layer full-width slice",
          "slice5": "5-layer full-width V4.1-Flash slice (adds a reindex layer)"}


def model_config(name: str):
    from megagraph.models.config import load_model_config

    if name in ("slice", "slice4"):
        return slice_config(4)
    if name == "slice5":
        return slice_config(5)
    if name == "tiny":
        return load_model_config("v4.1-flash-tiny")
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def hw_for(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    from megagraph.runtime.kernels import device_arch

    arch = device_arch(device)
    return {"sm_90": "h200", "sm_100": "b200", "sm_103": "b300"}.get(arch, "h200")


def compile_artifacts(cfg, hw: str, root: Path, logits: str = "all") -> Path:
    from megagraph.passes import compile_model, load_hw_profile
    from megagraph.passes.artifacts import write_artifacts
    from megagraph.passes.pipeline import CompileOptions

    out = root / f"{cfg.name}-{hw}-{logits}"
    write_artifacts(compile_model(cfg, load_hw_profile(hw), CompileOptions(logits=logits)), out,
                    force=True)
    return out


@dataclass
class Model:
    """A compiled model with its weights on the device."""

    name: str  # "tiny", "slice", "slice5"
    cfg: object
    plan: object  # RunPlan
    weights: dict
    hw: str
    setup_s: float

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights.values())

    @property
    def device_weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights.values()
                   if w.device.type != "cpu")

    def describe(self) -> dict:
        c = self.cfg
        return {"model": c.name, "key": self.name, "hw_profile": self.hw, "layers": c.num_layers,
                "hidden": c.hidden_size, "experts": c.n_routed_experts,
                "compress_ratios": list(c.compress_ratios), "roles": layer_kinds(c),
                "weight_bytes": self.weight_bytes, "setup_s": self.setup_s}


def load_model(name: str, device: torch.device, root: Path, *, logits: str = "all",
               hw: str | None = None, log=print) -> Model:
    """Compile `name` for `hw` (default: this device's profile) and make its weights once
    (slices: fast random weights on the device; tiny: the tests' seeded weights)."""
    from megagraph.runtime.plan import RunPlan
    from megagraph.runtime.weights import (
        fast_random_weights,
        graph_weight_specs,
        seeded_weights,
    )

    cfg = model_config(name)
    hw = hw or hw_for(device)
    t0 = time.perf_counter()
    plan = RunPlan.from_artifacts(compile_artifacts(cfg, hw, root, logits))
    make = seeded_weights if name == "tiny" else fast_random_weights
    weights = make(graph_weight_specs([plan.graph]), plan.cfg, seed=0, device=device)
    m = Model(name, cfg, plan, weights, hw, round(time.perf_counter() - t0, 2))
    log(f"{cfg.name}: artifacts + weights ({m.weight_bytes / 2**30:.2f} GiB) in {m.setup_s}s")
    return m


def layer_kinds(cfg) -> list[str]:
    """'swa', 'full r2', 'reuse r1', ... per layer (+ ' +engram')."""
    from megagraph.models.v41 import layer_roles

    return [f"{r.kind}" + (f" r{r.ratio}" if r.ratio else "") +
            (" +engram" if r.engram_table is not None else "") for r in layer_roles(cfg)]


# ---------------------------------------------------------------------------------------------
# kernel sets, engines
# ---------------------------------------------------------------------------------------------

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


def is_oom(msg: str) -> bool:
    return "out of memory" in msg.lower() or "OutOfMemoryError" in msg


# ---------------------------------------------------------------------------------------------
# balanced routing
# ---------------------------------------------------------------------------------------------

_BALANCED: dict = {}


def _balanced_table(E: int, k: int, device) -> torch.Tensor:
    key = (E, k, str(device))
    if key not in _BALANCED:
        r = torch.arange(E, dtype=torch.int64, device=device)
        _BALANCED[key] = (r[:, None] * k + torch.arange(k, dtype=torch.int64, device=device)) % E
    return _BALANCED[key]


def install_balanced_routing() -> None:
    """Route every MoE round-robin: token t of a step takes experts (t*k + j) mod E, j < k (each
    expert gets T*k/E rows), the weights still coming from the gate's scores at those experts.
    Kernels with mega_moe's hash-routing inputs (Triton, reference) get a table of E rows and
    token index t mod E through them; the capturable mega_moe's router and unfused `route` nodes
    are replaced by the capturable hash router over the same table. For the whole process
    (benchmarks only)."""
    import megagraph.kernels.fused.capturable as capfused
    import megagraph.runtime.engine as engine_mod
    from megagraph.kernels.moe.capturable import hash_route

    if getattr(engine_mod, "_balanced_routing", False):
        return

    def route(x, gate_w, bias, *, topk, route_scale, norm_topk=True, score_func="sqrtsoftplus"):
        table = _balanced_table(gate_w.shape[0], topk, x.device)
        tok = torch.arange(x.shape[0], dtype=torch.int64, device=x.device) % gate_w.shape[0]
        return hash_route(x, gate_w, table, tok, topk=topk, route_scale=route_scale,
                          score_func=score_func, norm_topk=norm_topk)

    capfused.route = route  # what the capturable mega_moe calls

    def hashed(fn):
        def run(*args, **attrs):
            a = list(args) + [None] * (22 - len(args))
            x, gate_w = a[0], a[6]
            a[7] = None  # no selection bias with hash routing
            a[20] = _balanced_table(gate_w.shape[0], attrs["topk"], x.device)
            a[21] = torch.arange(x.shape[0], dtype=torch.int64, device=x.device) % gate_w.shape[0]
            return fn(*a, **attrs)

        for k in ("capturable",):
            if hasattr(fn, k):
                setattr(run, k, getattr(fn, k))
        return run

    resolve = engine_mod.resolve_kernels

    def resolve_balanced(plan, graphs, device, **kw):
        ks = resolve(plan, graphs, device, **kw)
        for g in graphs:
            for n in g.nodes:
                fn = ks.impls.get(n.outputs[0])
                if n.op == "mega_moe" and fn is not None and _takes(fn, "tid2eid"):
                    ks.impls[n.outputs[0]] = hashed(fn)
                elif n.op == "route":  # unfused graphs (the CPU profile)
                    ks.impls[n.outputs[0]] = route
        return ks

    engine_mod.resolve_kernels = resolve_balanced
    engine_mod._balanced_routing = True


def _takes(fn, param: str) -> bool:
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# per-op time split
# ---------------------------------------------------------------------------------------------

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
    saved = prog.programs
    out: dict = {}
    try:
        if device.type == "cuda":
            try:
                out = _time_ops_profiler(prog, saved, meta, device)
            except Exception as e:  # noqa: BLE001
                out = {"profiler_error": f"{type(e).__name__}: {e}"[:300]}
            if not out.get("ok"):
                why = out.get("profiler_error") or (
                    f"profiler attributed {out.get('coverage', 0):.0%} of the kernel time")
                out = {**_time_ops_events(prog, saved, meta, device), "why_not_profiler": why}
        else:
            out = _time_ops_wall(prog, saved, meta)
    finally:
        prog.programs = saved
        for ch in chunks:
            eng.cached[ch.slot] = context
    out["ops"] = [{"name": n, "op": ops[n], "cls": op_class(ops[n], n),
                   "scope": node_scope(ops[n], n), "ms": round(ms, 5)}
                  for n, ms in out.pop("times").items()]
    return out


def _wrapped(programs, wrap) -> list:
    new = []
    for p in programs:
        q = copy.copy(p)
        q.calls = tuple(dataclasses.replace(c, fn=wrap(c.outputs[0], c.fn)) for c in p.calls)
        new.append(q)
    return new


def _time_ops_wall(prog, saved, meta) -> dict:
    times: dict[str, float] = {}

    def wrap(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            times[name] = times.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
            return r
        return run

    prog.programs = _wrapped(saved, wrap)
    t0 = time.perf_counter()
    prog.run(meta)
    total = 1e3 * (time.perf_counter() - t0)
    return {"method": "wall time per node (CPU)", "times": times, "step_ms": total, "ok": True}


def _time_ops_events(prog, saved, meta, device) -> dict:
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

    prog.programs = _wrapped(saved, wrap)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    prog.run(meta)
    torch.cuda.synchronize(device)
    total = 1e3 * (time.perf_counter() - t0)
    times = {n: sum(s.elapsed_time(e) for s, e in ev) for n, ev in events.items()}
    return {"method": "CUDA events around each node (includes launch gaps)", "times": times,
            "step_ms": total, "ok": True}


def _time_ops_profiler(prog, saved, meta, device) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    tag = "mg::"

    def wrap(name, fn):
        def run(*a, **k):
            with record_function(tag + name):
                return fn(*a, **k)
        return run

    prog.programs = _wrapped(saved, wrap)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        prog.run(meta)
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
# FLOP / byte model
# ---------------------------------------------------------------------------------------------

GATHER_OPS = {"embed", "engram_lookup", "token_map"}


def _elems(t) -> int:
    n = math.prod(int(d) for d in t.shape)
    return 2 * n if t.dtype == "fp4x2" else n


def _positions(reqs) -> torch.Tensor:
    """Positions of every new token of requests given as (cached, new)."""
    return torch.cat([torch.arange(c, c + n, dtype=torch.int64) for c, n in reqs]) if reqs \
        else torch.zeros(0, dtype=torch.int64)


def touched_experts(E: int, k: int, tokens: int, routing: str) -> float:
    """Experts a step's routing touches: k distinct of E per token; uniform random (model routing
    of random weights) -> E * (1 - (1 - k/E)^T); balanced -> min(E, T*k)."""
    if routing == "balanced":
        return float(min(E, tokens * k))
    return E * (1.0 - (1.0 - k / E) ** tokens)


def step_costs(g, cfg, reqs: list[tuple[int, int]], *, routing: str = "model",
               host: set[str] = frozenset()) -> dict:
    """FLOPs (2 per multiply-add) and minimum bytes of one step of the compiled graph `g` over
    requests given as (cached tokens, new tokens), per node scope (see node_scope).

    FLOPs: every weight of rank >= 2 a node reads is a GEMM over its rows (token or request rows;
    compressor index keys once per group of `ratio`), stacked routed experts x top-k / E; sparse
    attention 2 * H * D per key (scores and values, K = V) over min(window, p+1) window keys plus
    min(top-k, (p+1)//ratio) compressed keys; indexer Hi * Di per visible index key (p+1)//ratio.
    Bytes (what a decode step must read at least): every device-resident weight once (routed
    experts: the fraction the routing touches), per request the window ring and the selected
    compressed rows of each attention layer and every visible index key of each indexer, in the
    state's storage dtypes. Elementwise work and activations are left out."""
    from megagraph.graph.types import eval_dim

    pos = _positions(reqs)
    T, R = int(pos.numel()), len(reqs)
    env = {"T": T, "R": R, "S": 1, "N": 1}  # row counts; S, N only bind state-first ops
    first_row = (torch.cat([torch.full((n,), i, dtype=torch.int64)
                            for i, (_, n) in enumerate(reqs)])
                 if reqs else torch.zeros(0, dtype=torch.int64))
    is_last = torch.ones(T, dtype=torch.bool)
    if T:
        is_last[:-1] = first_row[1:] != first_row[:-1]
    E, k = cfg.n_routed_experts, cfg.experts_per_token
    frac = touched_experts(E, k, T, routing) / E
    flops: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    seen: set[str] = set()
    weights = set(g.weights)

    def add(d, scope, v):
        d[scope] = d.get(scope, 0.0) + float(v)

    for n in g.nodes:
        scope = node_scope(n.op, n.outputs[0])
        x = n.inputs[0]
        rows = eval_dim(g.types[x].shape[0], env) if x is not None and g.types[x].rank else 0
        for w in n.inputs:
            if w is None or w not in weights:
                continue
            t = g.types[w]
            stacked = ".experts.*." in w
            if w not in seen and w not in host:
                seen.add(w)
                if n.op in GATHER_OPS:  # a lookup reads one row per token
                    add(nbytes, scope, rows * t.nbytes({}) / max(1, int(t.shape[0])))
                else:
                    add(nbytes, scope, t.nbytes({}) * (frac if stacked else 1.0))
            if n.op in GATHER_OPS or t.rank < 2 or t.dtype in ("e8m0", "i64", "i32"):
                continue
            per_row = _elems(t) * (k / int(t.shape[0]) if stacked else 1)
            r = rows
            if n.op == "compressor" and w.endswith("indexer.wk.weight"):
                r = rows / max(1, int(n.attr_dict.get("ratio", 1)))
            add(flops, scope, 2 * r * per_row)
        if n.op in ("sparse_attn", "sparse_attn_q"):
            a = n.attr_dict
            _, H, D = (int(d) if not isinstance(d, str) else T for d in g.types[n.inputs[0]].shape)
            W, ratio = int(a["window"]), int(a.get("ratio", 0))
            keys = torch.clamp(pos + 1, max=W).sum().item()
            K = 0
            if ratio and n.inputs[4] is not None:
                K = int(g.types[n.inputs[4]].shape[1])
                keys += torch.clamp((pos + 1) // ratio, max=K).sum().item()
            add(flops, scope, 2 * 2 * H * D * keys)
            add(nbytes, scope, R * g.types[n.inputs[2]].nbytes({"S": 1}))  # window rings
            if K:  # one compressed row: N = ratio gives N/ratio = 1 (and N = 1 for ratio 1)
                row_b = g.types[n.inputs[3]].nbytes({"S": 1, "N": ratio})
                sel = torch.clamp((pos + 1) // ratio, max=K)
                add(nbytes, scope, row_b * sel[is_last].sum().item())
        elif n.op == "index_scores":
            ratio = int(n.attr_dict["ratio"])
            Hi, Di = (int(d) for d in g.types[n.inputs[0]].shape[1:])
            vis = (pos + 1) // ratio
            add(flops, scope, 2 * Hi * Di * vis.sum().item())
            ik = g.types[n.inputs[2]]
            row_b = ik.nbytes({"S": 1, "N": ratio})  # one entry
            add(nbytes, scope, row_b * vis[is_last].sum().item())
    return {"tokens": T, "requests": R, "flops": sum(flops.values()), "bytes": sum(nbytes.values()),
            "flops_by_scope": flops, "bytes_by_scope": nbytes, "touched_experts": frac * E}


# ---------------------------------------------------------------------------------------------
# extrapolation to the 40 layers of V4.1-Flash
# ---------------------------------------------------------------------------------------------


def layer_mapping(cfg, full=None) -> dict:
    """Which layer of `cfg` stands for each layer of the full V4.1-Flash schedule: same role
    (swa / full = KV + index source / reindex / reuse) and compression ratio where the slice has
    one, else the same role, else (reindex) a KV source of that ratio. Returns
    {"counts": {layer: n}, "how": {"role rX": "L<i> x n"}, "layers": (full, slice),
    "engram": (full, slice)}."""
    from megagraph.models.config import load_model_config
    from megagraph.models.v41 import layer_roles

    full = full or load_model_config("v4.1-flash")
    mine = layer_roles(cfg)
    by_key: dict = {}
    for r in mine:
        by_key.setdefault((r.kind, r.ratio), r.layer)
        by_key.setdefault(r.kind, r.layer)
        by_key.setdefault(("ratio", r.ratio), r.layer)
    counts: dict[int, int] = {}
    how: dict[str, list] = {}
    for r in layer_roles(full):
        rep = by_key.get((r.kind, r.ratio), by_key.get(r.kind))
        if rep is None and r.kind == "reindex":
            rep = by_key.get(("full", r.ratio))
        if rep is None:
            rep = by_key.get(("ratio", r.ratio), 0)
        counts[rep] = counts.get(rep, 0) + 1
        key = f"{r.kind}" + (f" r{r.ratio}" if r.ratio else "")
        how.setdefault(key, [rep, 0])[1] += 1
    return {"counts": counts, "how": {k: f"L{v[0]} x {v[1]}" for k, v in how.items()},
            "layers": (full.num_layers, cfg.num_layers),
            "engram": (len(full.engram_layers), len(cfg.engram_layers))}


def extrapolate(by_scope: dict[str, float], mapping: dict, extra: float = 0.0) -> float:
    """A per-scope quantity of the slice (time, FLOPs, bytes) for the full model: each full layer
    takes its representative slice layer's value (without Engram), Engram layers the slice's
    mean Engram value, ops over all layers scale with the layer count, step-level values (and
    `extra`, e.g. host time) stay."""
    full_layers, slice_layers = mapping["layers"]
    full_eng, slice_eng = mapping["engram"]
    total = (extra + by_scope.get("step", 0.0)
             + by_scope.get("all layers", 0.0) * full_layers / slice_layers)
    for layer, n in mapping["counts"].items():
        total += n * by_scope.get(f"L{layer}", 0.0)
    eng = sum(v for s, v in by_scope.items() if s.endswith(".engram"))
    if slice_eng:
        total += full_eng * eng / slice_eng
    return total


def scope_ms(ops: list[dict], scale: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for o in ops:
        out[o["scope"]] = out.get(o["scope"], 0.0) + o["ms"] * scale
    return out


# ---------------------------------------------------------------------------------------------
# ceilings, hardware, libraries, environment
# ---------------------------------------------------------------------------------------------


def ceilings(device: torch.device, smoke: bool) -> dict:
    """benchmarks/kernels.py's measured ceilings (bf16 / FP8 GEMM TFLOP/s, copy TB/s)."""
    spec = importlib.util.spec_from_file_location("megagraph_bench_kernels", HERE / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ceilings(device, smoke)


def hw_peaks(hw: str) -> dict:
    """The hardware profile's datasheet numbers (configs/hw/<hw>.yaml)."""
    from megagraph.passes import load_hw_profile

    p = load_hw_profile(hw)
    return {"profile": hw, "fp8_tflops": p.tflops("fp8"), "bf16_tflops": p.tflops("bf16"),
            "hbm_tbps": p.hbm_tbps, "graph_token_limit": p.graph_token_limit}


def libraries() -> dict[str, str]:
    """DeepGEMM / FlashMLA: importable or not (an extra column where they are)."""
    out = {}
    for mod, name in (("deep_gemm", "DeepGEMM"), ("flash_mla", "FlashMLA")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        out[name] = "installed" if found else "not installed"
    return out


def environment(device) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "python": platform.python_version(),
           "command": " ".join([Path(sys.executable).name] + sys.argv),
           "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda"
           else platform.processor() or "cpu",
           "cuda": torch.version.cuda,
           "unvalidated_kernels": os.environ.get("MEGAGRAPH_UNVALIDATED_KERNELS", "")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    env["driver"] = "-"
    if torch.device(device).type == "cuda":
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0] if smi else "?"
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    if commit:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        env["commit"] = commit + ("+dirty" if dirty else "")
    return env


def _run(cmd) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=15, check=False)
        return p.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def env_lines(env: dict) -> list[str]:
    return [f"{env.get('device')} (driver {env.get('driver', '-')}), torch {env.get('torch')} "
            f"(CUDA {env.get('cuda')}), triton {env.get('triton')}, Python {env.get('python')}; "
            f"{env.get('date')}; commit {env.get('commit', '?')}; "
            f"MEGAGRAPH_UNVALIDATED_KERNELS={env.get('unvalidated_kernels') or '(unset)'}", "",
            f"`{env.get('command')}`"]


# ---------------------------------------------------------------------------------------------
# time budget
# ---------------------------------------------------------------------------------------------


class BudgetExceeded(BaseException):
    """Raised (from SIGALRM) when a benchmark's time budget is spent (not an Exception, so that
    code catching errors does not swallow it)."""


class Budget:
    """Seconds from now until the benchmark must stop starting and running work (`reserve`
    seconds kept back for writing the results). `guard()` runs a piece of work under a timer."""

    def __init__(self, seconds: float, reserve: float | None = None, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.seconds = seconds
        self.reserve = min(10.0, 0.05 * seconds) if reserve is None else reserve
        self.expired = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.reserve - self.elapsed()

    @contextlib.contextmanager
    def guard(self, limit: float | None = None):
        """Raise BudgetExceeded in the body once the budget is spent (or `limit` seconds, if
        less, have passed: then the budget itself is not marked expired)."""
        left = self.left() if limit is None else min(self.left(), limit)
        if left <= 0:
            self.expired = self.left() <= 0
            raise BudgetExceeded()
        timer = (threading.current_thread() is threading.main_thread()
                 and hasattr(signal, "setitimer"))
        old = None
        if timer:
            def on_alarm(signum, frame):
                self.expired = self.left() <= 0.5
                raise BudgetExceeded()

            old = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, left)
        try:
            yield
        finally:
            if timer:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)


def attempt(budget: Budget, row: dict, fn, log, what: str, limit: float | None = None) -> bool:
    """Run fn() under the budget (and `limit` seconds); on failure record it in `row` ("error" /
    "skipped") and go on. True when fn finished."""
    try:
        with budget.guard(limit):
            fn()
        return True
    except BudgetExceeded:
        row["skipped"] = (f"time budget ({budget.seconds:.0f} s) spent" if budget.expired else
                          f"time budget: stopped after {limit:.0f} s (the rest is kept for the "
                          "split)")
        log(f"  {what}: stopped ({row['skipped']})")
    except Exception as e:  # noqa: BLE001  (keep the rest of the table)
        import traceback

        if budget.expired:
            row["skipped"] = f"time budget ({budget.seconds:.0f} s) spent"
        else:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"  {what}: FAILED {type(e).__name__}: {str(e)[:300]}\n"
            f"{traceback.format_exc(limit=4)[-1500:]}")
    return False


# ---------------------------------------------------------------------------------------------
# the sweep: modes x batch sizes, one engine per mode, fail soft, inside the time budget
# ---------------------------------------------------------------------------------------------

MODES = {
    "megagraph": ("plan", "the plan's kernels; CUDA graphs for steps a bucket holds, eager above"),
    "capturable": ("capturable", "capturable torch kernels, same graphs / eager split"),
    "reference": ("reference", "reference torch kernels, eager (a plain PyTorch port)"),
    "compile": ("capturable", "capturable torch kernels under torch.compile, CUDA graphs"),
}
# first guess of a mode's step time against the megagraph row (before it has run a batch size)
GUESS = {"capturable": 3.0, "reference": 10.0, "compile": 1.5}


@dataclass
class Sweep:
    """What one benchmark sweeps: batch sizes (B: tokens of a step), the step's requests, how
    many steps, which B a CUDA-graph bucket holds, and where results go.

    Order: the megagraph row at every B, then the baselines (each mode one engine), then the
    split (a fresh eager engine with the plan's kernels, one profiled step per B). The split runs
    last and in a process without CUDA graphs (the profiler and captured graphs do not always get
    along), and its time is kept back from the baselines once the megagraph row has run."""

    kind: str  # "prefill" / "decode"
    model: Model
    device: torch.device
    budget: Budget
    batches: list[int]
    chunks_for: object  # B -> list[SeqChunk] (slots 0..R-1)
    context: int  # cached tokens per request before every timed step
    capacity: int  # tokens a slot must hold
    slots: int
    warmup: int
    iters: int
    graph_limit: int  # B <= graph_limit run through CUDA-graph buckets of size B
    res: dict
    log: object
    save: object
    split: bool = True
    scale_exp: float = 1.0  # step time ~ B ** scale_exp, to predict a row from a smaller one
    compile_backend: str = "inductor"
    compile_batches: tuple[int, ...] = ()
    compile_min_s: float = 60.0
    reserve_s: float = 0.0  # kept back for the split phase

    def rows(self, mode: str) -> list[dict]:
        return [r for r in self.res["rows"] if r["mode"] == mode]

    def left(self) -> float:
        return self.budget.left() - self.reserve_s

    def predict_ms(self, mode: str, B: int) -> float | None:
        """Step time a row will take, from this mode's largest measured B, else the megagraph row
        times a guess; None when nothing is known."""
        done = [r for r in self.rows(mode) if r.get("ms")]
        if done:
            r = max(done, key=lambda r: r["B"])
            return r["ms"] * max(1.0, B / r["B"]) ** self.scale_exp
        if mode != "megagraph":
            mg = [r for r in self.rows("megagraph") if r.get("ms") and r["B"] <= B]
            if mg:
                r = max(mg, key=lambda r: r["B"])
                return GUESS.get(mode, 3.0) * r["ms"] * (B / r["B"]) ** self.scale_exp
        return None

    def split_cost_s(self) -> float:
        """Seconds the split phase will take: an engine start and, per B, a profiled eager step
        (eager + profiler overhead: ~4x the timed step, at least 2 s)."""
        return 10.0 + sum(max(2.0, 4e-3 * r["ms"]) for r in self.rows("megagraph") if r.get("ms"))

    def run(self, modes: list[str]) -> None:
        for mode in modes:
            self.run_mode(mode)
            if mode == "megagraph" and self.split:
                self.reserve_s = self.split_cost_s()
                self.log(f"keeping {self.reserve_s:.0f} s for the split at the end")
            self.save()
        self.reserve_s = 0.0
        if self.split:
            self.run_split()
            self.save()

    def engine(self, mode: str, kernels: str, buckets: tuple[int, ...], compile: str = "none"):
        """Start an engine (state filled) under the budget: (engine or None, info or failure)."""
        box: dict = {}

        def start():
            t0 = time.perf_counter()
            box["eng"] = make_engine(self.model, self.device, kernels=kernels, slots=self.slots,
                                     capacity=self.capacity, buckets=buckets, graphs=True,
                                     compile=compile)
            fill_state(box["eng"])
            rep = box["eng"].report
            box["info"] = {"startup_s": round(time.perf_counter() - t0, 2),
                           "capture_s": round(rep.phases.get("warm-up+capture", 0.0), 2),
                           "graph_memory_mib": round(rep.graph_memory_bytes / 2**20, 1),
                           "buckets": list(buckets), "fallbacks": dict(rep.kernel_fallbacks)}

        self.log(f"{mode}: starting an engine ({kernels} kernels; buckets {list(buckets)}, "
                 f"{self.slots} slots x {round_capacity(self.capacity)} tokens"
                 + (f", torch.compile {compile}" if compile != "none" else "") + ")")
        fail: dict = {}
        limit = self.left() if self.reserve_s else None
        if not attempt(self.budget, fail, start, self.log, f"{mode} start-up", limit):
            close_engine(box.pop("eng", None), self.device)
            release_memory(self.device)
            return None, fail
        self.res.setdefault("engines", {})[mode] = box["info"]
        self.log(f"{mode}: engine up in {box['info']['startup_s']} s (capture "
                 f"{box['info']['capture_s']} s, graphs {box['info']['graph_memory_mib']} MiB)")
        return box.pop("eng"), box["info"]

    def run_mode(self, mode: str) -> None:
        kernels, _ = MODES[mode]
        batches = [b for b in self.batches if mode != "compile" or b in self.compile_batches]
        rows = {}
        for b in self.batches:
            row = {"mode": mode, "B": b, "kernels": kernels}
            if b not in batches:
                row["skipped"] = "torch.compile runs --compile-batches only (minutes per bucket)"
            self.res["rows"].append(row)
            rows[b] = row
        if not batches:
            return
        buckets = () if mode == "reference" else tuple(b for b in batches if b <= self.graph_limit)
        left = self.left()
        why = None
        if mode == "compile" and left < self.compile_min_s:
            why = (f"time budget: torch.compile needs minutes, {left:.0f} s left "
                   f"(< --compile-min-s {self.compile_min_s:.0f})")
        guess = self.predict_ms(mode, min(batches))
        if guess is not None and guess * (self.warmup + self.iters) / 1e3 > left:
            why = f"time budget: predicted {guess / 1e3:.1f} s/step, {left:.0f} s left"
        if left <= 0:
            why = (f"time budget: {max(0.0, self.budget.left()):.0f} s left, "
                   f"{self.reserve_s:.0f} s of it kept for the split")
        if why:
            for b in batches:
                rows[b]["skipped"] = why
            self.log(f"{mode}: skipped ({why})")
            return
        eng, info = self.engine(mode, kernels, buckets,
                                self.compile_backend if mode == "compile" else "none")
        if eng is None:
            for b in batches:
                rows[b].update({k: f"engine start-up: {v}" for k, v in info.items()})
            return
        oom_at = None
        try:
            for b in batches:
                if self.budget.expired:
                    rows[b]["skipped"] = f"time budget ({self.budget.seconds:.0f} s) spent"
                    continue
                if eng.runner is not None and b > max(buckets, default=0):
                    # eager from here on: hand the captured graphs' memory pool to the eager steps
                    eng.runner.close()
                    eng.runner = None
                    release_memory(self.device)
                    rows[b]["note"] = "CUDA graphs of the smaller B released before this eager row"
                self.run_row(mode, eng, b, rows[b], oom_at)
                if is_oom(rows[b].get("error", "")) and oom_at is None:
                    oom_at = b
                self.save()
        finally:
            close_engine(eng, self.device)
            del eng
            release_memory(self.device)

    def run_row(self, mode: str, eng, B: int, row: dict, oom_at: int | None) -> None:
        if oom_at is not None:
            row["skipped"] = f"B = {oom_at} ran out of memory"
            return
        pred = self.predict_ms(mode, B)
        left = self.left()
        if pred is not None and (self.warmup + self.iters) * pred / 1e3 > left:
            row["skipped"] = (f"time budget: predicted {self.warmup + self.iters} x "
                              f"{pred / 1e3:.2f} s, {left:.0f} s left")
            self.log(f"  {mode} B={B}: skipped ({row['skipped']})")
            return
        chunks = self.chunks_for(B)
        row.update(tokens=sum(len(c.tokens) for c in chunks), requests=len(chunks),
                   path=step_path(eng, sum(len(c.tokens) for c in chunks)))

        def timed():
            t = run_steps(eng, chunks, self.context, self.warmup, self.iters, self.device)
            row.update(ms=round(median(t), 4), times_ms=[round(x, 4) for x in t])

        if attempt(self.budget, row, timed, self.log, f"{mode} B={B}",
                   self.left() if self.reserve_s else None):
            self.log(f"  {mode:10s} B={B:6d}  {row['ms']:10.2f} ms/step  ({row['path']})")

    def run_split(self) -> None:
        """One profiled eager step per B the megagraph row measured, smallest B first."""
        splits = self.res.setdefault("split", {})
        todo = [r for r in sorted(self.rows("megagraph"), key=lambda r: r["B"]) if r.get("ms")]
        if not todo:
            return
        if self.budget.left() < 5.0:
            for r in todo:
                splits[str(r["B"])] = {"error": "time budget spent"}
            return
        eng, info = self.engine("split", "plan", ())
        if eng is None:
            for r in todo:
                splits[str(r["B"])] = {"error": f"engine start-up: {info}"}
            return
        try:
            for r in todo:
                splits[str(r["B"])] = self.split_one(eng, r)
                self.save()
        finally:
            close_engine(eng, self.device)
            del eng
            release_memory(self.device)

    def split_one(self, eng, mg: dict) -> dict:
        """The profiled eager step of B = mg["B"] (after a warm-up step where that is cheap: Triton
        kernels new to the eager shapes compile first)."""
        B = mg["B"]
        if self.budget.left() < max(2.0, 4e-3 * mg["ms"]):
            return {"error": f"time budget: {self.budget.left():.0f} s left"}
        chunks = self.chunks_for(B)
        box: dict = {}

        def split():
            if mg["ms"] < 500:
                run_steps(eng, chunks, self.context, 0, 1, self.device)
            box["prof"] = time_ops(eng, chunks, self.context, self.device)

        fail: dict = {}
        if not attempt(self.budget, fail, split, self.log, f"split B={B}"):
            return {"error": fail.get("error") or fail.get("skipped")}
        prof = box["prof"]
        s = {"method": prof.get("method"), "coverage": prof.get("coverage"),
             "why_not_profiler": prof.get("why_not_profiler"),
             "eager_step_ms": round(prof.get("step_ms", 0.0), 3), "ops": prof["ops"]}
        self.log(f"  split B={B}: {len(s['ops'])} nodes, {sum(o['ms'] for o in s['ops']):.2f} ms "
                 f"of node time in a {s['eager_step_ms']:.2f} ms eager step ({s['method']})")
        return s


def applied_split(res: dict, B: int) -> dict | None:
    """The per-node split of the nearest B that has one, applied to B's megagraph step time:
    {"split": split_step(...), "scopes": {scope: ms incl. 'step' += host/gaps}, "from": B'}."""
    row = next((r for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == B and r.get("ms")),
               None)
    have = {int(b): s for b, s in res.get("split", {}).items() if s.get("ops")}
    if row is None or not have:
        return None
    src = min(have, key=lambda b: (abs(math.log(b / B)), b))
    ops = have[src]["ops"]
    mg_src = next((r for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == src
                   and r.get("ms")), None)
    if mg_src is None:
        return None
    sp = split_step(ops, mg_src["ms"])
    f = row["ms"] / mg_src["ms"]  # same fractions at another B
    scopes = {k: v * f for k, v in scope_ms(ops, sp["scale"]).items()}
    scopes["step"] = scopes.get("step", 0.0) + sp["host_gap_ms"] * f
    for key in ("step_ms", "node_ms", "host_gap_ms"):
        sp[key] *= f
    sp["classes_ms"] = {k: v * f for k, v in sp["classes_ms"].items()}
    sp["scopes_ms"] = {s: {k: v * f for k, v in d.items()} for s, d in sp["scopes_ms"].items()}
    sp["by_op_ms"] = {k: v * f for k, v in sp["by_op_ms"].items()}
    return {"split": sp, "scopes": scopes, "from": src}


def mode_table_cell(res: dict, mode: str, B: int, value) -> str:
    """A mode's cell at B: value(row) where it ran, else why not."""
    row = next((r for r in res["rows"] if r["mode"] == mode and r["B"] == B), None)
    st = cell_status(row)
    return st if st is not None else value(row)


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return out


def cell_status(row: dict | None) -> str | None:
    """'failed: ...' / 'skipped: ...' for a row that has no time, else None."""
    if row is None:
        return "-"
    if row.get("error"):
        msg = row["error"].splitlines()[0]
        if is_oom(msg):
            return "failed: out of memory"
        return "failed: " + msg[:90].replace("|", "/")
    if row.get("skipped"):
        return "skipped: " + row["skipped"][:90]
    return None if row.get("ms") else "-"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_outputs(res: dict, out: Path, png: bool = True, *, name: str, markdown, plot) -> str:
    """NAME.json, NAME.md and (png) NAME.png in `out` from `res` alone; returns the Markdown."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    md = markdown(res)
    if png:
        plt = pyplot()
        err = "matplotlib is not installed (pip install 'megagraph[plot]', then --replot)"
        if plt is not None:
            try:
                err = plot(plt, res, out / f"{name}.png")  # None when written
            except Exception as e:  # noqa: BLE001  (the tables matter more than the picture)
                err = f"{type(e).__name__}: {e}"
        md += f"\nPlot not written: {err}\n" if err else f"\n![{name}]({name}.png)\n"
    (out / f"{name}.md").write_text(md)
    return md


def begin(kind: str, args, t0: float | None = None) -> tuple:
    """The common start of prefill.py / decode.py: (res, budget, device, out, log); the budget
    counts from `t0` (the script's start, imports included)."""
    budget = Budget(args.time_budget, t0=t0)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[{kind} {budget.elapsed():6.1f}s] {msg}", flush=True)

    res = {"benchmark": kind, "environment": environment(device), "args": dict(vars(args)),
           "rows": [], "split": {}, "costs": {}, "libraries": libraries()}
    if args.routing == "balanced":
        install_balanced_routing()
    row: dict = {}
    attempt(budget, row, lambda: res.update(ceilings=ceilings(device, args.smoke)), log, "ceilings")
    res.setdefault("ceilings", row)
    log(f"ceilings: {res['ceilings']}")
    return res, budget, device, out, log


def describe_run(res: dict, model: Model) -> None:
    """Model, profile peaks, kernel choices, 40-layer mapping into `res`."""
    res.update(model=model.describe(), hw=hw_peaks(model.hw), kernels=kernel_summary(model.plan),
               mapping=layer_mapping(model.cfg))


def peak_name(res: dict) -> tuple[str, float]:
    """(label, TFLOP/s) of the profile's dense FP8 peak (bf16 where it has no FP8)."""
    hw = res.get("hw", {})
    if hw.get("fp8_tflops"):
        return f"FP8 peak {hw['fp8_tflops']:.0f}", hw["fp8_tflops"]
    return f"bf16 peak {hw.get('bf16_tflops', 0):.0f}", hw.get("bf16_tflops") or 0.0


def state_note(res: dict, work: str) -> str:
    """The workload paragraph: `work`, how the context is set, routing, how a row is timed."""
    a = res["args"]
    return (f"**Workload.** {work} The cached context is **set as state, not prefilled**: every "
            "state pool holds random contents and seq_cached says each request holds the context "
            "(validity derives from seq_cached alone, docs/step-convention.md), so attention, "
            "indexer and compressor work over that context; every timed step starts from the same "
            f"context. Routing: {a['routing']}. {a['warmup']} warm-up + up to {a['iters']} timed "
            "steps per row (median; slow rows stop after 3 s); a step = host metadata + copies + "
            "graph replay (or eager kernels) + logits, with a device synchronize around it.")


def header_lines(res: dict, title: str, workload: str) -> list[str]:
    """Title, environment, workload, model, kernels and ceilings paragraphs of a report."""
    m, env = res.get("model", {}), res["environment"]
    ceil, hw = res.get("ceilings", {}), res.get("hw", {})
    lines = [f"# {title}: {env.get('device')}, {m.get('model', res['args'].get('model'))}", ""]
    lines += env_lines(env) + ["", workload, ""]
    if m:
        roles = ", ".join(f"L{i} {k}" for i, k in enumerate(m["roles"]))
        lines += [f"**Model.** {m['model']}: {m['layers']} layers ({roles}), hidden {m['hidden']}, "
                  f"{m['experts']} experts, weights {m['weight_bytes'] / 2**30:.2f} GiB (release "
                  f"formats, random, made on the device), profile {m['hw_profile']}.", ""]
    if res.get("kernels"):
        lines += ["**Kernels of the megagraph row** (graph nodes per implementation): " +
                  ", ".join(f"{k} x {v}" for k, v in res["kernels"].items()) + ".", ""]
    for mode, info in res.get("engines", {}).items():
        if info.get("fallbacks"):
            lines.append(f"- {mode}: kernel fallbacks {info['fallbacks']}")
    lines += [f"**Ceilings** measured in this run: bf16 GEMM {ceil.get('bf16_tflops', '-')} "
              f"TFLOP/s, FP8 `_scaled_mm` {ceil.get('fp8_tflops', '-')} TFLOP/s, copy "
              f"{ceil.get('copy_tbps', '-')} TB/s (read + write); profile "
              f"{hw.get('profile', '-')}: FP8 {hw.get('fp8_tflops', '-')} / bf16 "
              f"{hw.get('bf16_tflops', '-')} TFLOP/s dense, {hw.get('hbm_tbps', '-')} TB/s.", ""]
    return lines


def x40_intro(res: dict, what: str) -> list[str]:
    mp = res["mapping"]
    return [f"## Extrapolated to {mp['layers'][0]} layers (not measured)", "",
            f"Each of the {mp['layers'][0]} layers of V4.1-Flash takes the time of the slice layer "
            "with its role (" + ", ".join(f"{k}: {v}" for k, v in mp["how"].items()) +
            f"); Engram ({mp['engram'][0]} layers) the slice's Engram time per layer; the batched "
            "ring copies scale with the layer count; embedding, LM head, host work and launch gaps "
            "stay. Layer times come from the split below (the nearest B that has one). "
            f"{what} counted the same way.", ""]


def split_sections(res: dict, der: dict, batches: list[int]) -> list[str]:
    """Per-B class split, the per-layer split and the top ops at the largest B with a split of
    its own (`der[B]["split"]` = applied_split)."""
    have = [s for s in res.get("split", {}).values() if s.get("ops")]
    methods = sorted({s.get("method", "?") for s in have})
    cov = [s["coverage"] for s in have if s.get("coverage") is not None]
    if cov:
        methods.append(f"{100 * min(cov):.0f}-{100 * max(cov):.0f}% of the profiled kernel time "
                       "attributed to nodes")
    for s in have:
        if s.get("why_not_profiler"):
            methods.append(f"profiler not used: {s['why_not_profiler']}")
            break
    lines = ["## Where the time goes (megagraph row)", "",
             f"Node times of one eager step with every node timed ({', '.join(methods) or '-'}), "
             "applied to the timed step: kept where they sum to less (the rest is host work and "
             "launch gaps: metadata, copies, host-side Engram gathers, idle GPU), scaled down "
             "where they sum to more. Classes: attention = the whole attention sub-layer "
             "(projections, compressor, indexer, top-k, sparse attention, ring copies); MoE = "
             "router, routed + shared experts, combine; mHC = hyper-connection mixers, "
             "collapse, expand; other = embedding, Engram, LM head.", ""]
    hdr = ["B", "step ms"] + [CLASS_TITLES[c] + " ms (%)" for c in CLASSES] + \
        ["host + gaps ms (%)", "split from"]
    rows = []
    for B in batches:
        ap = der.get(B, {}).get("split")
        if not ap:
            err = res.get("split", {}).get(str(B), {}).get("error")
            rows.append([B, "-"] + ["-"] * len(CLASSES) + ["-", f"none ({err})" if err else "none"])
            continue
        sp = ap["split"]
        t = sp["step_ms"] or 1.0
        cells = [(sp["classes_ms"][c]) for c in CLASSES] + [sp["host_gap_ms"]]
        rows.append([B, f"{sp['step_ms']:.2f}"] + [f"{v:.2f} ({100 * v / t:.0f}%)" for v in cells]
                    + [f"B={ap['from']}"])
    lines += md_table(hdr, rows) + [""]
    own = [B for B in batches if der.get(B, {}).get("split") and der[B]["split"]["from"] == B]
    if not own:
        return lines
    B = max(own)
    sp = der[B]["split"]["split"]
    roles = res.get("model", {}).get("roles", [])
    lines += [f"### Per layer, B = {B} (ms)", ""]
    lr = []
    for scope, cls in sp["scopes_ms"].items():
        layer = node_layer(scope + ".")
        role = roles[layer] if layer is not None and layer < len(roles) else \
            ("ring copies of every layer" if scope == "all layers" else "embedding, LM head, ...")
        lr.append([scope, role] + [f"{cls[c]:.3f}" for c in CLASSES] + [f"{sum(cls.values()):.3f}"])
    lines += md_table(["layer", "role"] + [CLASS_TITLES[c] for c in CLASSES] + ["total"], lr)
    lines += ["", f"### Top ops, B = {B}", ""]
    tot = sp["step_ms"] or 1.0
    lines += md_table(["op", "ms", "% of step"], [[o, f"{v:.3f}", f"{100 * v / tot:.1f}%"]
                                                   for o, v in list(sp["by_op_ms"].items())[:10]])
    return lines + [""]


def stack_split(ax, der: dict, batches: list[int]) -> None:
    """Stacked bars: attention / MoE / mHC / other / host + gaps, ms per step, per B."""
    xs = [B for B in batches if der.get(B, {}).get("split")]
    bottom = [0.0] * len(xs)
    for c in list(CLASSES) + ["host"]:
        vals = [(der[B]["split"]["split"]["host_gap_ms"] if c == "host"
                 else der[B]["split"]["split"]["classes_ms"][c]) for B in xs]
        ax.bar([str(B) for B in xs], vals, bottom=bottom, label=CLASS_TITLES.get(c, "host + gaps"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("B")
    ax.set_ylabel("ms per step (layer slice)")
    ax.set_title("time split (megagraph row)")
    ax.legend(fontsize=8)


def common_notes(res: dict) -> list[str]:
    a = res["args"]
    out = [f"- Rows that did not run say why; `--time-budget {a['time_budget']:.0f}` s for the "
           f"whole run ({res.get('elapsed_s', '?')} s used)."]
    out += [f"- {r['mode']} B={r['B']}: {r['note']}." for r in res["rows"] if r.get("note")]
    for k, v in res.get("libraries", {}).items():
        out.append(f"- {k}: {v} (a kernel column only where importable; not wired into the plan).")
    return out + [""]


# ---------------------------------------------------------------------------------------------
# the command line and the run, shared by prefill.py and decode.py
# ---------------------------------------------------------------------------------------------


def parser(doc: str, kind: str, *, context: int, batches: str, warmup: int, iters: int,
           graph_limit_help: str):
    """The argument parser of prefill.py / decode.py with the options they share."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", help=f"folder for {kind}.md / {kind}.json / {kind}.png")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny model, 1 iteration, small context (CI: seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="slice5", choices=sorted(MODELS))
    p.add_argument("--hw", default=None,
                   help="compile for this hardware profile (default: this device's; another "
                        "profile's plan runs with fallbacks, e.g. --hw h200 on the CPU for tests)")
    p.add_argument("--context", type=int, default=context,
                   help="cached tokens per request (state: 2.3 KB per token and slot on the "
                        "5-layer slice)")
    p.add_argument("--batches", default=batches, help="B values (comma-separated)")
    p.add_argument("--graph-limit", type=int, default=None, help=graph_limit_help)
    p.add_argument("--routing", default="model", choices=("model", "balanced"),
                   help="model: the router's choice; balanced: round-robin experts")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--iters", type=int, default=iters, help="timed steps per row (median)")
    p.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    p.add_argument("--no-split", action="store_true", help="skip the profiled per-node split")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "eager"))
    p.add_argument("--compile-batches", default=None,
                   help="B values the compile row runs (default: the smallest)")
    p.add_argument("--compile-min-s", type=float, default=60.0,
                   help="start torch.compile only with this many seconds of budget left")
    p.add_argument("--time-budget", type=float, default=150.0,
                   help="seconds for the whole run (imports and setup included); work stops "
                        "when spent, results are written")
    p.add_argument("--replot", metavar="JSON", help=f"rewrite md + png from a {kind}.json")
    return p


def parse_args(p, argv, smoke: dict):
    """Parse; --smoke applies `smoke` (CPU, tiny, ...); batches, modes, compile batches as
    lists."""
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in {"device": "cpu", "model": "tiny", "warmup": 0, "iters": 1,
                     "compile_backend": "eager", "compile_min_s": 0.0, **smoke}.items():
            setattr(args, k, v)
        args.time_budget = min(args.time_budget, 120.0)
    if not args.out and not args.replot:
        p.error("--out is required")
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.modes) - set(MODES))
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    cb = args.compile_batches
    args.compile_batches = [int(b) for b in cb.split(",")] if cb else args.batches[:1]
    return args


def run_benchmark(kind: str, args, *, new_tokens, graph_limit, scale_exp: float, write,
                  t0: float = T0) -> int:
    """Compile + weights, the step costs per B, the sweep, the outputs. `new_tokens(B)`: new
    tokens of each request of a step; `graph_limit(plan, device)`: the default --graph-limit;
    `write(res, out, png)`: the benchmark's outputs."""
    import json
    import tempfile

    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        write(res, Path(args.out) if args.out else Path(args.replot).parent, True)
        return 0
    res, budget, device, out, log = begin(kind, args, t0)
    with tempfile.TemporaryDirectory(prefix=f"megagraph-{kind}-") as tmp:
        model = load_model(args.model, device, Path(tmp), logits="last", hw=args.hw, log=log)
        from megagraph.runtime.batch import SeqChunk
        from megagraph.runtime.weights import host_resident

        plan = model.plan
        limit = args.graph_limit if args.graph_limit is not None else graph_limit(plan, device)
        describe_run(res, model)
        res["graph_limit"] = limit
        host = host_resident(plan.graph)
        for B in args.batches:
            c = step_costs(plan.graph, model.cfg, [(args.context, n) for n in new_tokens(B)],
                           routing=args.routing, host=host)
            c["flops40"] = extrapolate(c["flops_by_scope"], res["mapping"])
            c["bytes40"] = extrapolate(c["bytes_by_scope"], res["mapping"])
            res["costs"][str(B)] = c
        vocab = model.cfg.vocab_size

        def chunks_for(B):
            gen = torch.Generator().manual_seed(B)
            return [SeqChunk(i, tuple(torch.randint(3, vocab, (n,), generator=gen).tolist()))
                    for i, n in enumerate(new_tokens(B))]

        sweep = Sweep(kind, model, device, budget, args.batches, chunks_for, args.context,
                      args.context + max(max(new_tokens(B)) for B in args.batches),
                      max(len(new_tokens(B)) for B in args.batches), args.warmup, args.iters,
                      limit, res, log, lambda: write(res, out, False), split=not args.no_split,
                      scale_exp=scale_exp, compile_backend=args.compile_backend,
                      compile_batches=tuple(args.compile_batches),
                      compile_min_s=args.compile_min_s)
        sweep.run(args.modes)
    res["elapsed_s"] = round(budget.elapsed(), 1)
    print(write(res, out, True), flush=True)
    return 0


def derive_split(res: dict, B: int) -> dict:
    """{"split": applied_split, "x40": {"ms", "tok_s"}} for B where the megagraph row and a split
    exist (the 40-layer step: the split's scopes through layer_mapping)."""
    ap = applied_split(res, B)
    if ap is None:
        return {}
    t40 = extrapolate(ap["scopes"], res["mapping"])
    tokens = next(r["tokens"] for r in res["rows"] if r["mode"] == "megagraph" and r["B"] == B)
    return {"split": ap, "x40": {"ms": t40, "tok_s": tokens / (t40 / 1e3) if t40 else None}}


def mode_rates(res: dict, B: int) -> dict:
    """mode -> its row at B (with ms and tok_s) for every mode that measured B."""
    return {r["mode"]: {**r, "tok_s": r["tokens"] / (r["ms"] / 1e3)} for r in res["rows"]
            if r["B"] == B and r.get("ms")}


def two_panels(plt, res: dict, path: Path, der: dict, *, y, x40: str, extra: tuple = (),
               xlabel: str, ylabel: str, title: str) -> None:
    """Left, on log axes over the batch sizes: every mode's y(row), the megagraph row's 40-layer
    extrapolation der[B]["x40"][x40], and `extra` lines [(label, [(x, y)], style)]; right: the
    time split per B. Saved to `path`."""
    batches = res["args"]["batches"]
    lines = [(m, [(B, y(r)) for B, r in pts], {"marker": "o"}) for m, pts in mode_lines(res)]
    lines.append(("megagraph, 40 layers (extrapolated)",
                  [(B, d["x40"][x40]) for B, d in der.items() if d.get("x40")],
                  {"marker": "x", "linestyle": "--"}))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, pts, style in [*lines, *extra]:
        if pts:
            ax.plot(*zip(*pts), label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}, {res.get('model', {}).get('model', '')}, "
                 f"{res['args']['context']:,}-token context", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    stack_split(bx, der, batches)
    env = res["environment"]
    fig.suptitle(f"{env.get('device')} ({env.get('date')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mode_lines(res: dict) -> list:
    """Plot lines of every mode's rows: (mode, [(B, row)])."""
    return [(m, [(r["B"], r) for r in res["rows"] if r["mode"] == m and r.get("ms")])
            for m in res["args"]["modes"]]


def baseline_cells(res: dict, B: int, value) -> list[str]:
    """The capturable / reference / torch.compile / DeepGEMM / FlashMLA cells of a table row."""
    libs = res.get("libraries", {})
    return [mode_table_cell(res, x, B, value) if x in res["args"]["modes"] else "not run"
            for x in ("capturable", "reference", "compile")] + \
        [libs.get("DeepGEMM", "-"), libs.get("FlashMLA", "-")]


__all__ = [
    "CLASSES",
    "Budget",
    "BudgetExceeded",
    "Model",
    "attempt",
    "ceilings",
    "environment",
    "extrapolate",
    "fill_state",
    "hw_peaks",
    "install_balanced_routing",
    "layer_mapping",
    "libraries",
    "load_model",
    "make_engine",
    "md_table",
    "run_steps",
    "slice_config",
    "split_step",
    "step_costs",
    "time_ops",
    "with_kernels",
]
