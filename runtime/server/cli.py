"""`megagraph runtime serve ARTIFACTS`: flags (defaults from ServeConfig) and the uvicorn run.

uvicorn handles SIGTERM/SIGINT: it stops accepting, lets in-flight requests finish for up to
`--drain-timeout` seconds, then the app's lifespan aborts what is left and stops the engine.
`--nproc N` runs N ranks under torchrun (dp_router.py says how requests reach them).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from .config import ServeConfig

C = ServeConfig


def add_serve_arguments(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over compiled artifacts")
    s.add_argument("artifacts", metavar="ARTIFACTS",
                   help="artifact dir written by `megagraph compile`")
    s.add_argument("--weights", metavar="DIR", help="checkpoint dir; default: random weights")
    s.add_argument("--tokenizer", metavar="PATH",
                   help="the model's tokenizer.json (or its dir), for text and V4.1's Engram token "
                        "map; default: the one beside --weights (needed when there is none)")
    s.add_argument("--host", default=C.host, help=f"bind address (default {C.host}: this "
                   "machine only; 0.0.0.0 to listen on every interface)")
    s.add_argument("--port", type=int, default=C.port)
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
    s.add_argument("--served-model-name", default=None, help="name clients pass as `model` "
                   "(default: the model config's name)")
    s.add_argument("--device", default=C.device, help="cpu, cuda or cuda:N")
    s.add_argument("--capacity", type=int, default=C.capacity,
                   help=f"context limit per request, prompt + output (default {C.capacity})")
    s.add_argument("--max-running", type=int, default=C.max_running,
                   help="concurrent sequences (state slots), before the memory limit")
    s.add_argument("--mem-fraction", type=float, default=C.mem_fraction,
                   help="fraction of free device memory after weights for the state pools")
    s.add_argument("--state-bytes", type=int, default=None,
                   help="state-pool budget in bytes (instead of --mem-fraction)")
    s.add_argument("--max-total-tokens", type=int, default=None,
                   help="token ledger for admission/preemption (default: every slot full)")
    s.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens per step (default and cap: the plan's per-GPU limit)")
    s.add_argument("--max-mixed-prefill-tokens", type=int, default=None,
                   help="prompt tokens in a step that also decodes: a lower bound than "
                   "--max-prefill-tokens keeps arriving prompts from lengthening decode steps, "
                   "at the cost of their time to first token (default: --max-prefill-tokens)")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every request from scratch (no radix prefix cache)")
    s.add_argument("--prefix-cache-mode", choices=("replay", "exact"), default=C.prefix_cache_mode,
                   help="replay (default): a hit whose sliding windows were not kept rebuilds "
                   "them by encoder replay (approximate); exact: resume only where the windows "
                   "were kept, else prefill")
    s.add_argument("--prefix-cache-bytes", type=int, default=None,
                   help="device bytes for cached prefixes (default: as many as the slot pools)")
    s.add_argument("--host-cache-bytes", type=int, default=C.host_cache_bytes,
                   help="host-memory tier for prefixes evicted from the device (default 0: off)")
    s.add_argument("--prefix-replay-tokens", type=int, default=None,
                   help="cached tokens an encoder replay re-runs (default: the window)")
    s.add_argument("--max-queue", type=int, default=C.max_queue,
                   help="queued sequences before new requests get 503")
    s.add_argument("--no-overlap", action="store_true",
                   help="do not prepare step N+1 while step N runs (for measuring)")
    s.add_argument("--thinking-default", choices=("on", "off"),
                   default="on" if C.default_thinking else "off",
                   help="thinking mode of chat requests that do not ask (`thinking`, "
                   "`chat_template_kwargs`, `reasoning_effort`); default off, as SGLang serves "
                   "V4.1")
    s.add_argument("--no-grammar", action="store_true", help="disable structured output")
    s.add_argument("--seed", type=int, default=C.seed)
    s.add_argument("--compile", choices=("none", "eager", "inductor"), default=C.compile,
                   help="wrap the captured segments with torch.compile (as `runtime generate`)")
    s.add_argument("--compile-numerics", choices=("eager", "fast"), default=C.compile_numerics,
                   help="Inductor rounding: eager (the default) or fast; docs/compile.md")
    s.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly on CUDA")
    s.add_argument("--bounded-replay", choices=("plan", "on", "off"), default=C.bounded_replay,
                   help="approximate prefill of large steps (docs/bounded-replay.md; as generate)")
    s.add_argument("--allow-fallback", action="store_true",
                   help="serve artifacts compiled for another device: kernels this one lacks run "
                        "as their reference kernels (the start-up report lists them)")
    s.add_argument("--allow-edited-artifacts", action="store_true",
                   help="serve artifacts whose files no longer match the hashes in their "
                   "manifest (hand-edited for an experiment); refused without it")
    s.add_argument("--drain-timeout", type=float, default=C.drain_timeout,
                   help="seconds in-flight requests get on shutdown")
    s.add_argument("--nproc", type=int, default=1,
                   help="ranks on this node for artifacts compiled with --dp N --ep N (re-runs "
                   "itself under torchrun; rank r > 0 serves 127.0.0.1:PORT+r for rank 0)")
    s.add_argument("--log-level", default=C.log_level)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        artifacts=args.artifacts, weights=args.weights, tokenizer=args.tokenizer, host=args.host,
        port=args.port,
        api_key=args.api_key, served_model_name=args.served_model_name, device=args.device,
        capacity=args.capacity, max_running=args.max_running, mem_fraction=args.mem_fraction,
        state_bytes=args.state_bytes, max_total_tokens=args.max_total_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        max_mixed_prefill_tokens=args.max_mixed_prefill_tokens, max_queue=args.max_queue,
        prefix_cache=not args.no_prefix_cache, prefix_cache_mode=args.prefix_cache_mode,
        prefix_cache_bytes=args.prefix_cache_bytes, host_cache_bytes=args.host_cache_bytes,
        prefix_replay_tokens=args.prefix_replay_tokens,
        overlap=not args.no_overlap, default_thinking=args.thinking_default == "on",
        grammar=not args.no_grammar, seed=args.seed, drain_timeout=args.drain_timeout,
        log_level=args.log_level, compile=args.compile, compile_numerics=args.compile_numerics,
        cuda_graphs=not args.no_cuda_graphs, allow_fallback=args.allow_fallback,
        allow_edited_artifacts=args.allow_edited_artifacts, bounded_replay=args.bounded_replay)


def serve_main(args: argparse.Namespace) -> int:
    from megagraph.models.checkpoint import CheckpointError
    from megagraph.models.config import ConfigError

    from ..cache_manager import CacheSizingError
    from ..plan import ArtifactsError
    from ..weights import FitError

    ctx = None
    from ..distributed.launch import is_rank_process

    if args.nproc > 1 or is_rank_process():  # ranks get the command without --nproc
        from ..distributed import init_from_env, relaunch_under_torchrun

        # not a rank yet: re-exec this command under torchrun (never returns)
        relaunch_under_torchrun(args.nproc, sys.argv[1:])
        ctx = init_from_env(device=args.device)
    try:
        import uvicorn

        from .app import create_app
        from .dp_router import DPRouter
        from .service import ServingEngine
    except ImportError as e:
        print(f"megagraph runtime serve: error: {e.name} is not installed "
              "(pip install 'megagraph[serve]')", file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    setup_logging(cfg.log_level)
    router = None
    if ctx is not None:
        if ctx.rank == 0:
            router = DPRouter(ctx.world, cfg.port)
        else:  # an internal server rank 0 proxies to
            cfg = dataclasses.replace(cfg, host="127.0.0.1", port=cfg.port + ctx.rank,
                                      api_key=None, log_level="warning")
    try:
        service = ServingEngine.start(cfg, ctx)
    except (ValueError, FitError, CheckpointError, ConfigError, FileNotFoundError,
            ArtifactsError, CacheSizingError) as e:
        print(f"megagraph runtime serve: error: {e}", file=sys.stderr)
        return 2
    if ctx is None or ctx.rank == 0:
        for line in startup_lines(service):
            print(f"[megagraph] {line}", file=sys.stderr)
    if ctx is not None:
        print(f"[megagraph] {ctx}: serving on http://{cfg.host}:{cfg.port}", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(
        create_app(service, router=router), host=cfg.host, port=cfg.port,
        log_level=cfg.log_level, timeout_graceful_shutdown=max(int(cfg.drain_timeout), 1)))
    try:
        server.run()
    finally:
        if ctx is not None:
            from ..distributed import shutdown

            shutdown(ctx)
    return 0


def setup_logging(level: str) -> None:
    """The megagraph.* loggers (failed requests with their ids, the scheduler's engine errors)
    to stderr at uvicorn's level; without a handler Python prints only warnings, bare."""
    lg = logging.getLogger("megagraph")
    if not lg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[megagraph] %(levelname)s %(name)s: %(message)s"))
        lg.addHandler(h)
    lg.setLevel({"trace": "DEBUG"}.get(level.lower(), level.upper()))


def startup_lines(service) -> list[str]:
    s = service
    sc = s.scheduler.config
    replay = getattr(s.engine, "replay_summary", None)
    return [*s.engine.report.lines(), *([replay()] if replay else []),
            f"state cache: {s.sizing.describe()}; token ledger {s.cache.max_total_tokens}",
            f"scheduler: prefill cap {sc.max_prefill_tokens} tokens/step, "
            + ("" if sc.max_mixed_prefill_tokens is None
               else f"{sc.max_mixed_prefill_tokens} beside decode rows, ")
            + f"overlap {'on' if sc.overlap else 'off'}",
            f"tokenizer: {s.tokenizer_note}",
            f"grammar: {'xgrammar' if s.grammar else 'off (structured output answers 400)'}",
            f"chat: thinking {'on' if s.config.default_thinking else 'off'} unless the request "
            "says (--thinking-default)",
            *(f"WARNING: {name} differs from the manifest's hash (served anyway: "
              "--allow-edited-artifacts)" for name in s.engine.plan.edited),
            f"serving '{s.model_name}' on http://{s.config.host}:{s.config.port}/v1"
            + (" (API key required)" if s.config.api_key else "")]
