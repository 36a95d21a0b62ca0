"""The command line and the run shared by prefill.py and decode.py: compile + weights, the step
costs per batch size, the sweep, the result files."""
from __future__ import annotations

from pathlib import Path

import torch

from . import T0
from .budget import Budget, attempt
from .costs import extrapolate, layer_mapping, step_costs
from .engines import kernel_summary
from .env import ceilings, environment, hw_peaks, libraries
from .models import MODELS, Model, hw_for, load_model
from .report import results_dir
from .routing import install_balanced_routing
from .sweep import MODES, Sweep


def parser(doc: str, kind: str, *, context: int, batches: str, warmup: int, iters: int,
           graph_limit_help: str):
    """The argument parser of prefill.py / decode.py with the options they share."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", help=f"folder for {kind}.md / {kind}.json / {kind}.png (default: "
                   "benchmarks/results/<hw>/, hw = --hw or this device's profile)")
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
    if not args.out and not args.replot:  # the product result: benchmarks/results/<hw>/
        args.out = str(results_dir(args.hw or hw_for(torch.device(args.device))))
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.modes) - set(MODES))
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    cb = args.compile_batches
    args.compile_batches = [int(b) for b in cb.split(",")] if cb else args.batches[:1]
    return args


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
