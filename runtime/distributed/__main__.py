"""python -m megagraph.runtime.distributed generate ARTIFACTS --nproc N --prompt-ids 1,2,3 ...

Offline generation on a DP/EP job: prompts go round-robin to the ranks (prompt i -> rank i mod N),
each rank generates its own, results are gathered on rank 0 and printed in prompt order. Without
WORLD_SIZE in the environment and with --nproc > 1 the command re-runs itself under torchrun;
under torchrun (one or many nodes) it is one rank. The serve command reuses the same pieces
(docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megagraph.runtime.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    g = sub.add_parser("generate", help="complete prompts on N ranks")
    g.add_argument("artifacts", help="artifact dir from `megagraph compile --dp N --ep N ...`")
    g.add_argument("--nproc", type=int, default=1, help="ranks on this node (torchrun --nproc-per-node)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes (multi-node: see docs/parallelism.md)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous for --nnodes > 1")
    g.add_argument("--prompt-ids", action="append", default=[], metavar="ID,ID,...")
    g.add_argument("--weights", metavar="DIR", help="checkpoint dir (default: seeded random weights)")
    g.add_argument("--tokenizer", metavar="PATH",
                   help="the model's tokenizer.json (or its dir) for V4.1's Engram token map; "
                        "default: the one beside --weights (needed when there is none)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--max-tokens", type=int, default=8)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-slots", type=int, default=8)
    g.add_argument("--capacity", type=int, default=1024)
    g.add_argument("--max-step-tokens", type=int, default=256)
    g.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS",
                   help="rebalance experts every STEPS global steps (0 = never)")
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--allow-fallback", action="store_true")
    g.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    g.add_argument("--json", action="store_true", help="print the outputs as JSON (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from .launch import relaunch_under_torchrun

    relaunch_under_torchrun(args.nproc, argv, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                            module="megagraph.runtime.distributed")
    return generate(args)


def generate(args) -> int:
    import torch.distributed as dist

    from ..sampling import SamplingParams
    from .group import init_from_env, shutdown
    from .runner import rank_engine_from_artifacts

    ctx = init_from_env(device=args.device, timeout_s=args.timeout)
    ok = False
    try:
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
        mine = [i for i in range(len(prompts)) if i % ctx.world == ctx.rank]
        eng = rank_engine_from_artifacts(
            args.artifacts, ctx, args.weights, eplb_interval=args.eplb_interval, seed=args.seed,
            max_slots=args.max_slots, capacity=args.capacity, max_step_tokens=args.max_step_tokens,
            cuda_graphs=not args.no_cuda_graphs, allow_fallback=args.allow_fallback, progress=False,
            tokenizer=args.tokenizer)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                ignore_eos=args.ignore_eos, seed=args.seed)
        outs = eng.generate([prompts[i] for i in mine], params)
        mine_out = [(i, o.token_ids) for i, o in zip(mine, outs)]
        stats = {"rank": ctx.rank, "ran": eng.stats.ran, "idle": eng.stats.idle,
                 "skipped": eng.stats.skipped, "steps": eng.stats.steps,
                 "rebalances": len(eng.stats.rebalances)}
        gathered = [(mine_out, stats)]
        if ctx.world > 1:
            gathered = [None] * ctx.world
            dist.all_gather_object(gathered, (mine_out, stats), group=ctx.control_group)
        if ctx.rank == 0:
            rows = sorted(r for part, _ in gathered for r in part)
            for _, st in gathered:
                print(f"[megagraph] rank {st['rank']}: {st['steps']} steps, ran {st['ran']}, "
                      f"idle {st['idle']}, skipped {st['skipped']}, rebalances {st['rebalances']}",
                      file=sys.stderr)
            if args.json:
                print(json.dumps([{"prompt": i, "token_ids": ids} for i, ids in rows]))
            else:
                for i, ids in rows:
                    print(f"[{i}] {' '.join(map(str, ids))}")
        sys.stdout.flush()
        ok = True
        return 0
    finally:
        shutdown(ctx, barrier=ok)


if __name__ == "__main__":
    sys.exit(main())
