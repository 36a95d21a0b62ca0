"""Decode step time of the runtime: eager vs CUDA graphs vs CUDA graphs + torch.compile.

Baseline: the same engine run eagerly at exact shapes (`eager`). Modes: `graphs` (one CUDA graph per
(segment, bucket), eager breaks between), `graphs+compile` (segments wrapped with torch.compile
before capture), and `padded` (the graphs' padding and buffers without capture: the reference for
the token check, since padded and unpadded batches round differently). Models: the tiny V4.1
(seeded random weights) and a full-dimension V4.1-Flash layer slice: 4 layers (L0 window-only +
Engram, L1 ratio-2 KV/index source, L2 ratio-2 reuse, L3 ratio-1 KV/index/candidate source) at the
release widths and formats (FP8 + e8m0 projections, MXFP4 experts, 384 experts), random weights made
on the device. Its Engram table is cut from 384M to 2.4M rows (prime search from 100,000 instead of
16M); lookups still go through the host like the real tables. A step = host metadata + copies +
replay (or eager kernels) + logits copy, timed with a device synchronize around it; the table shows
the median over `--steps` decode steps after a `--context`-token prefill of every request.

    python benchmarks/probes/decode_runtime.py --out /tmp/dr            # GPU: everything
    python benchmarks/probes/decode_runtime.py --smoke --out /tmp/x     # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # the sibling probes, benchmarks/harness
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from harness.engines import sync  # noqa: E402
from harness.env import environment  # noqa: E402
from harness.models import load_model  # noqa: E402

MODES = ("eager", "padded", "graphs", "graphs+compile")
DEFAULT_MODES = ("eager", "graphs", "graphs+compile")


def engine_for(plan, weights, mode: str, args, device, batches: tuple[int, ...]) -> "object":
    from megagraph.runtime.engine import Engine, EngineConfig

    need = args.context + args.warmup + max(args.steps, args.slice_steps)
    conf = dict(device=str(device), max_slots=max(args.batches), capacity=-(-need // 128) * 128,
                max_step_tokens=args.prefill_tokens, kernels="capturable", progress=False,
                allow_fallback=device.type == "cpu")
    if mode == "eager":
        conf.update(cuda_graphs=False, buckets=())
    elif mode == "padded":
        conf.update(cuda_graphs=False, buckets=batches)
    else:
        conf.update(cuda_graphs=True, buckets=batches,
                    compile=args.compile_backend if mode == "graphs+compile" else "none",
                    compile_numerics=args.compile_numerics,
                    compile_dynamic=args.compile_dynamic)
    from megagraph.runtime.token_map import stand_in_token_map

    return Engine(plan, dict(weights), EngineConfig(**conf), token_map=stand_in_token_map(plan.cfg))


def run_batch(eng, n: int, args, device) -> tuple[float, list[list[int]], torch.Tensor]:
    """Prefill n requests, then time decode steps; returns (median ms/step, argmax tokens, the
    last step's logits on the CPU)."""
    from megagraph.runtime.batch import SeqChunk

    gen = torch.Generator().manual_seed(1234)
    vocab = eng.cfg.vocab_size
    steps = args.slice_steps if "slice" in eng.cfg.name else args.steps
    prompts = torch.randint(3, vocab, (n, args.context), generator=gen).tolist()
    inputs = torch.randint(3, vocab, (args.warmup + steps, n), generator=gen).tolist()
    slots = [eng.slots.allocate() for _ in range(n)]
    try:
        per_step = max(1, args.prefill_tokens // args.context)
        for i in range(0, n, per_step):
            eng.step([SeqChunk(slots[j], tuple(prompts[j]))
                      for j in range(i, min(n, i + per_step))])
        times, tokens = [], []
        for k, row in enumerate(inputs):
            sync(device)
            t0 = time.perf_counter()
            logits = eng.step([SeqChunk(s, (t,)) for s, t in zip(slots, row)])
            sync(device)
            if k >= args.warmup:
                times.append(time.perf_counter() - t0)
                tokens.append(logits.argmax(-1).tolist())
        return 1e3 * statistics.median(times), tokens, logits.float().cpu()
    finally:
        for s in slots:
            eng.release(s)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def setup_model(name: str, args, device, root: Path, log) -> tuple[dict, object, dict]:
    """Compile the model's artifacts for this device's profile and make its weights once."""
    m = load_model(name, device, root, log=log)
    cfg = m.cfg
    res = {"model": cfg.name, "hw_profile": m.hw, "layers": cfg.num_layers,
           "hidden": cfg.hidden_size, "experts": cfg.n_routed_experts,
           "weight_bytes": m.weight_bytes, "setup_s": m.setup_s, "modes": {}, "tokens": {}}
    return res, m.plan, m.weights


def run_mode(res: dict, plan, weights, mode: str, batches: list[int], args, device, tokens: dict,
             log, over_budget) -> None:
    """Start an engine in `mode` for `batches`, time each, keep the argmax tokens and logits."""
    row = res["modes"].setdefault(mode, {"ms_per_step": {}, "startup_s": 0.0, "capture_s": 0.0,
                                         "graph_memory_mib": 0.0})
    for group in [batches]:
        if over_budget():
            row.setdefault("skipped", []).extend(group)
            continue
        try:
            t1 = time.perf_counter()
            eng = engine_for(plan, weights, mode, args, device, tuple(group))
            rep = eng.report
            row["startup_s"] = round(row["startup_s"] + time.perf_counter() - t1, 2)
            row["capture_s"] = round(row["capture_s"] + rep.phases.get("warm-up+capture", 0.0), 2)
            row["graph_memory_mib"] = round(
                row["graph_memory_mib"] + rep.graph_memory_bytes / 2**20, 1)
            row.update(captured_segments=rep.captured_segments, cache=rep.cache,
                       eager_segments={str(k): v for k, v in rep.eager_segments.items()})
            log(f"  {res['model']} {mode}: start-up {time.perf_counter() - t1:.1f}s for buckets "
                f"{group} (graphs {rep.graph_memory_bytes / 2**20:.1f} MiB, captured segments "
                f"{rep.captured_segments})")
            for n in group:
                ms, toks, logits = run_batch(eng, n, args, device)
                row["ms_per_step"][str(n)] = round(ms, 3)
                tokens[(mode, n)] = (toks, logits)
                log(f"  {res['model']} {mode:15s} B={n:4d}  {ms:9.3f} ms/step")
            eng.close()
            del eng
        except Exception as e:  # keep the rest of the table
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"  {res['model']} {mode}: FAILED {row['error']}\n{traceback.format_exc(limit=6)}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res["tokens"] = token_checks(tokens, args.batches)


def token_checks(tokens: dict, batches) -> dict:
    """Argmax tokens of every timed step (same inputs in every mode: teacher forcing) and the last
    step's logits, of `graphs` / `graphs+compile` against `padded` (same shapes, uncaptured: must be
    identical) and `eager` (exact shapes: equal up to summation order, which FP8 rounding can
    amplify)."""
    out = {}
    for mode in ("graphs", "graphs+compile"):
        for ref in ("padded", "eager"):
            pairs = [(tokens[(mode, n)], tokens[(ref, n)]) for n in batches
                     if (mode, n) in tokens and (ref, n) in tokens]
            if pairs:
                exact = all(a[0] == b[0] for a, b in pairs)
                agree = statistics.mean(agreement(a[0], b[0]) for a, b in pairs)
                diff = max((a[1] - b[1]).abs().max().item() for a, b in pairs)
                scale = max(b[1].abs().max().item() for _, b in pairs)
                out[f"{mode} vs {ref}"] = {"identical": exact, "agreement": round(agree, 4),
                                           "logits_max_abs_diff": diff,
                                           "logits_max_abs": scale}
    return out


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = ["# Decode step time: eager vs CUDA graphs vs graphs + torch.compile", "",
             f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}, commit "
             f"{env.get('commit', '?')}", f"`{env['command']}`", ""]
    for m in results["models"]:
        bs = [str(b) for b in results["batches"]]
        lines += [f"## {m['model']} ({m['layers']} layers, hidden {m['hidden']}, {m['experts']} "
                  "experts, "
                  f"weights {m['weight_bytes'] / 2**30:.2f} GiB, profile {m['hw_profile']})", "",
                  "| mode | " + " | ".join(f"B={b} ms/step" for b in bs)
                  + " | capture s | graph MiB |",
                  "|---|" + "---|" * (len(bs) + 2)]
        for mode, row in m["modes"].items():
            if "error" in row:
                first = row["error"].splitlines()[0][:120]
                lines.append(f"| {mode} | failed: {first} |")
                continue
            cells = [f"{row['ms_per_step'][b]:.3f}" if b in row["ms_per_step"] else "skipped"
                     for b in bs]
            lines.append(f"| {mode} | " + " | ".join(cells) +
                         f" | {row['capture_s']:.2f} | {row['graph_memory_mib']:.1f} |")
        for k, v in m.get("tokens", {}).items():
            lines.append(f"- tokens {k}: {'identical' if v['identical'] else 'differ'} "
                         f"(agreement {100 * v['agreement']:.1f}%; last-step logits max |diff| "
                         f"{v['logits_max_abs_diff']:.3g} of max |logit| "
                         f"{v['logits_max_abs']:.3g})")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for decode_runtime.json / .md")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, B=1,4, 2 steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="tiny,slice")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"any of {', '.join(MODES)} (padded: buffers + padding, no capture)")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps (tiny)")
    p.add_argument("--slice-steps", type=int, default=3, help="timed decode steps (layer slice)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--context", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="tokens per prefill step")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "eager"))
    p.add_argument("--compile-numerics", default="eager", choices=("eager", "fast"),
                   help="Inductor rounding (runtime/compile.py:numerics_options)")
    p.add_argument("--compile-dynamic", action=argparse.BooleanOptionalAction, default=False,
                   help="one torch.compile for every bucket (dynamic shapes) instead of one each")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds after which no further engine is started (a torch.compile "
                        "bucket that has started still finishes: minutes)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.models, args.batches, args.steps, args.warmup = "cpu", "tiny", "1,4", 2, 1
        args.slice_steps = 1
        args.context, args.modes = 16, "eager,padded,graphs"
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.modes) - set(MODES))
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    results = {"environment": environment(device), "batches": args.batches, "steps": args.steps,
               "context": args.context, "models": []}
    t_start = time.perf_counter()

    def save():
        (out / "decode_runtime.json").write_text(json.dumps(results, indent=1))
        (out / "decode_runtime.md").write_text(markdown(results))

    with tempfile.TemporaryDirectory(prefix="megagraph-bench-") as tmp:
        models = []
        for name in args.models.split(","):
            res, plan, weights = setup_model(name, args, device, Path(tmp), log)
            results["models"].append(res)
            models.append((res, plan, weights, {}))
        # every model's cheap modes first, torch.compile last: a slow compile cannot starve the rest
        def over_budget():
            return time.perf_counter() - t_start > args.time_budget

        # every model's cheap modes first; then torch.compile one bucket at a time (B=1 of every
        # model, then B=8, ...), so the time budget is checked between Inductor compiles (minutes
        # each for these graphs) and a slow compile cannot starve the rest of the table
        runs = [(m, list(args.batches)) for m in args.modes if m != "graphs+compile"]
        if "graphs+compile" in args.modes:
            runs += [("graphs+compile", [n]) for n in args.batches]
        for mode, batches in runs:
            for res, plan, weights, tokens in models:
                run_mode(res, plan, weights, mode, batches, args, device, tokens, log, over_budget)
                save()
    save()
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
