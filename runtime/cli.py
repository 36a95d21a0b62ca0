"""runtime: run compiled artifacts (`megagraph runtime generate ARTIFACTS --prompt ...`,
`megagraph runtime serve ARTIFACTS`: runtime/server/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys

from .engine import REPLAY_MODES, EngineConfig
from .sampling import SamplingParams

E, S = EngineConfig, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="runtime_verb", required=True)
    g = sub.add_parser("generate", help="complete prompts offline, streaming tokens to stdout")
    g.add_argument("artifacts", metavar="ARTIFACTS", help="artifact dir written by `megagraph compile`")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    g.add_argument("--prompt-ids", action="append", default=[], metavar="ID,ID,...",
                   help="a prompt as token ids (models without a tokenizer)")
    g.add_argument("--weights", metavar="DIR",
                   help="checkpoint dir (official layout); default: seeded random weights")
    g.add_argument("--tokenizer", metavar="PATH",
                   help="the model's tokenizer.json (or its dir), for text and V4.1's Engram token "
                        "map; default: the one beside --weights (needed when there is none)")
    g.add_argument("--device", default=E.device, help=f"cpu, cuda or cuda:N (default {E.device})")
    g.add_argument("--max-tokens", type=int, default=S.max_tokens)
    g.add_argument("--temperature", type=float, default=S.temperature, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=S.top_k)
    g.add_argument("--top-p", type=float, default=S.top_p)
    g.add_argument("--min-p", type=float, default=S.min_p)
    g.add_argument("--repetition-penalty", type=float, default=S.repetition_penalty)
    g.add_argument("--frequency-penalty", type=float, default=S.frequency_penalty)
    g.add_argument("--presence-penalty", type=float, default=S.presence_penalty)
    g.add_argument("--n", type=int, default=S.n, help="completions per prompt")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=E.seed,
                   help="random weights and sampling seed (per-request seeds derive from it)")
    g.add_argument("--compile", choices=("none", "eager", "inductor"), default=E.compile,
                   help="wrap segments with torch.compile (default: the plan's choice, else none)")
    g.add_argument("--compile-numerics", choices=("eager", "fast"), default=E.compile_numerics,
                   help="Inductor rounding: eager (fp32 division and bf16 casts rounded as eager "
                        "rounds them, the default) or fast (Inductor's own defaults); neither is "
                        "bitwise the uncompiled engine (docs/compile.md)")
    g.add_argument("--compile-tile-loops", action="store_true",
                   help="let torch.compile trace the capturable kernels' tile loops too (attention, "
                        "indexer, MoE: minutes per bucket at V4.1 sizes)")
    g.add_argument("--compile-dynamic", action="store_true",
                   help="one torch.compile for every bucket (dynamic shapes) instead of one each")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly on CUDA")
    g.add_argument("--buckets", metavar="B,B,...", help="capture these step sizes instead of the plan's")
    g.add_argument("--kernels", choices=("plan", "capturable"), default=E.kernels,
                   help="'capturable': capturable kernels wherever the plan chose reference")
    g.add_argument("--bounded-replay", choices=REPLAY_MODES, default=E.bounded_replay,
                   help="approximate prefill for large steps: late layers on each prompt's last "
                        "rows only; plan: as the plan's bounded_replay.default says (on for GPU "
                        "plans, above the graph token limit); docs/bounded-replay.md")
    g.add_argument("--allow-fallback", action="store_true",
                   help="run artifacts for another device, with reference kernels where needed")
    g.add_argument("--max-slots", type=int, default=E.max_slots, help="concurrent sequences")
    g.add_argument("--capacity", type=int, default=E.capacity, help="tokens per sequence")
    g.add_argument("--max-step-tokens", type=int, default=E.max_step_tokens)
    g.add_argument("--json", action="store_true", help="print the outputs as JSON at the end")
    g.add_argument("--quiet", action="store_true", help="no start-up report on stderr")
    from .server.cli import add_serve_arguments

    add_serve_arguments(sub)


def main(args: argparse.Namespace) -> int:
    if args.runtime_verb == "serve":
        from .server.cli import serve_main

        return serve_main(args)
    from megagraph.models.checkpoint import CheckpointError
    from megagraph.models.config import ConfigError

    from .engine import Engine
    from .weights import FitError

    try:
        params = SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        prompts = list(args.prompt) + [[int(t) for t in p.split(",")] for p in args.prompt_ids]
        if not prompts:
            raise ValueError("nothing to generate: pass --prompt TEXT or --prompt-ids ID,ID,...")
        buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
        eng = Engine.from_artifacts(
            args.artifacts, args.weights, device=args.device, seed=args.seed,
            max_slots=args.max_slots, capacity=args.capacity, max_step_tokens=args.max_step_tokens,
            compile=args.compile, compile_dynamic=args.compile_dynamic,
            compile_numerics=args.compile_numerics, compile_tile_loops=args.compile_tile_loops,
            cuda_graphs=not args.no_cuda_graphs, buckets=buckets,
            kernels=args.kernels, allow_fallback=args.allow_fallback, progress=not args.quiet,
            bounded_replay=args.bounded_replay, tokenizer=args.tokenizer)
        if not args.quiet:
            for line in [*eng.report.lines(), eng.replay_summary()]:
                print(f"[megagraph] {line}", file=sys.stderr)
        outputs: dict = {}
        for ev in eng.stream(prompts, params):
            piece = ev.text if eng.tokenizer is not None else f"{ev.token_id} "
            if len(prompts) * params.n > 1:
                piece = f"[{ev.request_id}.{ev.index}] {piece!r}\n"
            sys.stdout.write(piece)
            sys.stdout.flush()
            outputs.setdefault((ev.request_id, ev.index), []).append(ev.token_id)
        sys.stdout.write("\n")
        if args.json:
            print(json.dumps([{"request": r, "index": i, "token_ids": ids}
                              for (r, i), ids in sorted(outputs.items())]))
        eng.close()
        return 0
    except (ValueError, FitError, CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"megagraph runtime: error: {e}", file=sys.stderr)
        return 2
