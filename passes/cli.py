"""compile: build a model's step graph, run the pipeline for a hardware profile, write artifacts."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megagraph.models.config import INDEX_KEY_READINGS

from .pipeline import PIPELINE, CompileOptions

DEFAULTS = CompileOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="NAME|PATH",
                   help="shipped model name (e.g. v4.1-flash), a model YAML, or a checkpoint dir")
    p.add_argument("--hw", required=True, metavar="NAME", help="hardware profile (configs/hw/NAME.yaml)")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory to write")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    p.add_argument("--bounded-replay", action=argparse.BooleanOptionalAction,
                   default=DEFAULTS.bounded_replay,
                   help="emit the approximate bounded-suffix (decoder replay) graphs or not "
                        "(default: the profile's bounded_replay_default, on for GPU profiles)")
    p.add_argument("--logits", choices=("all", "last"), default=DEFAULTS.logits,
                   help=f"logits for all rows or each request's last (default {DEFAULTS.logits})")
    p.add_argument("-p", "--passes", metavar="A,B,...",
                   help=f"run exactly these passes in order (default: {','.join(PIPELINE)})")
    p.add_argument("--keep", type=int, default=DEFAULTS.keep,
                   help="bounded replay: rows kept per request (default: window + draft backtracking)")
    p.add_argument("--numerics", choices=("default", "reference"), default=DEFAULTS.numerics,
                   help="reference: f32 activations and caches, no KV or activation quantization "
                        "(checking a checkpoint against an fp32 reference; models/numerics.py); "
                        "default: the model config's own (the release's bf16 + FP8)")
    p.add_argument("--context", type=int, default=DEFAULTS.context,
                   help=f"tokens per slot assumed by the memory plan (default {DEFAULTS.context})")
    p.add_argument("--index-key-reading", choices=INDEX_KEY_READINGS, metavar="|".join(INDEX_KEY_READINGS),
                   help="V4.1 decode index-key reading: owner (each indexer reads its own KV owner's "
                        "keys; decode == prefill) or vendor (as DeepSeek's inference/model.py); "
                        "default: the model config's (owner); see docs/index-key-reading.md")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME",
                   help="run the pipeline with pass NAME recorded as skipped (repeatable; -p "
                        "gives the whole list instead)")
    kc = p.add_argument_group("kernel configs (docs/compile.md, configs/kernels/)")
    kc.add_argument("--kernel-config", metavar="FILE",
                    help="YAML {family: {field: value}} over the profile's configs/kernels/HW.yaml")
    kc.add_argument("--set", action="append", default=[], metavar="FAMILY.FIELD=VALUE",
                    dest="set_", help="one kernel-config field, over --kernel-config (repeatable; "
                                      "e.g. --set moe.shared_stream=true)")
    kc.add_argument("--allow-unvalidated", action="store_true",
                    help="let the plan pick fast kernels built but not yet run on their device")
    par = p.add_argument_group("parallel layout (docs/parallelism.md)")
    par.add_argument("--dp", type=int, default=DEFAULTS.dp, metavar="N",
                     help="data-parallel attention ranks: each owns its requests' attention and state")
    par.add_argument("--ep", type=int, default=DEFAULTS.ep, metavar="N",
                     help="expert-parallel ranks (= --dp for DEP, 1 = experts replicated)")
    par.add_argument("--redundant-experts", type=int, default=DEFAULTS.redundant_experts, metavar="K",
                     help="extra expert replicas over the EP group, placed by EPLB (default 0)")
    par.add_argument("--ep-max-tokens", type=int, default=DEFAULTS.ep_max_tokens, metavar="T",
                     help="tokens per rank per step the static dispatch buffers hold (default: the "
                          "profile's graph token limit, or 256)")
    par.add_argument("--balanced-routing", action="store_true",
                     help="benchmarks only: assign experts round-robin instead of by the router")


def main(args: argparse.Namespace) -> int:
    from megagraph.graph.errors import IRError
    from megagraph.kernels.kernel_config import KernelConfigError, user_overrides
    from megagraph.models.config import ConfigError, load_model_config

    from .artifacts import ArtifactError, check_output_dir, write_artifacts
    from .base import PASSES, PassError
    from .hw import load_hw_profile
    from .pipeline import compile_model

    try:
        cfg = load_model_config(args.model)
        if args.index_key_reading is not None:
            cfg = cfg.replace(index_key_reading=args.index_key_reading)
        hw = load_hw_profile(args.hw)
        passes = None
        if args.passes:
            passes = tuple(x.strip() for x in args.passes.split(",") if x.strip())
            unknown = [x for x in passes if x not in PASSES]
            if unknown:
                raise ConfigError(f"-p: unknown pass(es) {unknown}; known: {', '.join(sorted(PASSES))}")
        overrides = user_overrides(args.kernel_config, args.set_)
        opt = CompileOptions(bounded_replay=args.bounded_replay, logits=args.logits, passes=passes,
                             keep=args.keep, context=args.context, dp=args.dp, ep=args.ep,
                             redundant_experts=args.redundant_experts,
                             ep_max_tokens=args.ep_max_tokens,
                             balanced_routing=args.balanced_routing, numerics=args.numerics,
                             disable_passes=tuple(args.disable_pass), kernel_config=overrides,
                             allow_unvalidated=args.allow_unvalidated)
        check_output_dir(Path(args.out), force=args.force)
        t0 = time.perf_counter()
        compiled = compile_model(cfg, hw, opt)
        out = write_artifacts(compiled, args.out, force=args.force, model_arg=args.model,
                              note=lambda line: print(line, file=sys.stderr))
        secs = time.perf_counter() - t0
    except (ConfigError, ArtifactError, PassError, IRError, KernelConfigError) as e:
        print(f"megagraph compile: error: {e}", file=sys.stderr)
        return 2
    extra = f" with {opt.numerics} numerics" if opt.numerics != "default" else ""
    print(f"compiled {cfg.name} for {hw.name}{extra} in {secs:.2f}s -> {out}")
    for r in compiled.records:
        print(f"  {r.index:02d} {r.name:<20} {r.status:<9} {r.note}")
    return 0

