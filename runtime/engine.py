"""The offline engine: artifacts + weights -> steps -> sampled tokens.

`Engine.step(chunks)` runs one step of the plan (a captured bucket when one fits, else eagerly;
a prefill step the plan's bounded-replay rule picks through runtime/replay.py) and returns
logits; `generate` / `stream` drive it with a FIFO continuous-batching loop
(runtime/generate.py). The full scheduler (prefill caps, preemption, overlap) is a later issue
and only needs `step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from .batch import SeqChunk, make_batch, pad_batch
from .compile import (StartupReport, cache_dir, cache_key, check_backend, check_numerics,
                      point_caches)
from .cuda_graphs import GraphRunner
from .kernels import resolve_kernels
from .plan import ArtifactsError, RunPlan
from .sampling import SamplingParams
from .state import SlotAllocator, allocate_state, state_bytes_per_slot
from .step import StepProgram
from .weights import (available_bytes, check_fit, fast_random_weights, graph_weight_specs,
                      host_resident, load_weights, memory_need, seeded_weights)


@dataclass(frozen=True)
class EngineConfig:
    """Start-up choices (CLI flags map 1:1; defaults here are the CLI's)."""

    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    max_slots: int = 8  # concurrent sequences (one more slot is the padding scratch slot)
    capacity: int = 1024  # tokens per sequence (prompt + output)
    max_step_tokens: int = 256  # tokens per step (longer prompts prefill in chunks)
    compile: str = "none"  # torch.compile backend: none, eager, inductor (aot_eager: debugging)
    compile_dynamic: bool = False  # one torch.compile for all buckets (dynamic shapes)
    compile_numerics: str = "eager"  # "eager": Inductor rounds divisions/casts as eager; "fast"
    compile_tile_loops: bool = False  # also trace the capturable tile-loop kernels (minutes)
    cuda_graphs: bool = True  # capture the plan's buckets on CUDA
    buckets: tuple[int, ...] | None = None  # override the plan's buckets (CPU: none unless given)
    allow_fallback: bool = False  # run kernels this device lacks as reference kernels
    kernels: str = "plan"  # "capturable": capturable kernels where the plan says reference
    bounded_replay: str = "plan"  # approximate prefill through the plan's prefix/suffix graphs
    #                               for the steps its rule picks: "plan" (its default), "on", "off"
    suffix_buckets: tuple[int, ...] | None = None  # override the plan's suffix row buckets
    #                                               (CPU: none unless given)
    seed: int = 0  # random weights (no checkpoint) and unseeded sampling
    random_weights: str = "seeded"  # without a checkpoint: "seeded" (tests' values) or "fast"
    memory_budget: int | None = None  # bytes the fit check may use (default: free memory)
    progress: bool = True  # progress bar while loading a checkpoint
    tokenizer: str | None = None  # tokenizer.json (or its dir) for text and the Engram token map;
    #                              default: the checkpoint's (runtime/token_map.py)


REPLAY_MODES = ("plan", "on", "off")


def untraced_nodes(g, tile_loops: bool = True) -> set[str]:
    """Nodes torch.compile calls untraced: those whose op Inductor miscompiles (kernels/capturable
    INDUCTOR_UNSAFE_OPS), and with `tile_loops` those whose capturable kernel loops over tile chunks
    in Python (TILE_LOOP_OPS: minutes of tracing for little gain)."""
    try:
        from megagraph.kernels.capturable_table import INDUCTOR_UNSAFE_OPS, TILE_LOOP_OPS
    except ImportError:
        return set()
    ops = set(INDUCTOR_UNSAFE_OPS) | (set(TILE_LOOP_OPS) if tile_loops else set())
    return {n.outputs[0] for n in g.nodes if n.op in ops}


def bucket_reqs(buckets: Sequence[int], max_slots: int, capacity: int) -> dict[int, int]:
    """Request rows of each bucket: every slot's request, plus enough pad rows that the bucket's
    pad tokens fit (at most `capacity` per pad request); never more than the bucket's tokens."""
    return {b: min(b, max_slots + -(-b // max(1, capacity))) for b in buckets}


class Engine:
    """One model on one device: state pools, segments, captured graphs, a sampler."""

    def __init__(self, plan: RunPlan, weights: dict | str | Path | None = None,
                 config: EngineConfig | None = None, report: StartupReport | None = None, *,
                 token_map: torch.Tensor | None = None):
        """`weights`: a checkpoint dir, tensors by name, or None (random weights). `token_map`:
        the Engram token map i64[vocab_size] of a V4.1 model (runtime/token_map.py
        token_map_from_tokenizer builds it from a tokenizer.json); without it the map comes from
        `config.tokenizer` or the checkpoint's tokenizer.json, and only random weights get a
        stand-in. Start-up refuses a checkpoint or given tensors with no source of the map."""
        self.plan, self.cfg, self.config = plan, plan.cfg, config or EngineConfig()
        c = self.config
        self.report = report or StartupReport()
        self.device = torch.device(c.device)
        self.ckpt_dir, origin = self._weights_origin(weights)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is available (torch "
                               f"{torch.__version__}); use --device cpu")
        g = plan.graph
        with self.report.timed("kernels"):
            self.kernels = resolve_kernels(plan, [g], self.device, allow_fallback=c.allow_fallback,
                                           override=c.kernels)
        self.report.kernel_fallbacks = dict(self.kernels.fallbacks)
        self.report.kernel_configs = {fam: ", ".join(f"{k}={v}" for k, v in c.to_dict().items())
                                      for fam, c in plan.kernel_configs.items()}
        self.report.hardware = f"artifacts for {plan.hw_name} ({plan.hw_arch}) on {self.device}"
        specs = graph_weight_specs([g])
        host = host_resident(g) if self.device.type == "cuda" else set()
        self.kernels.run_on_host(g, host)
        if c.buckets is not None:
            buckets = tuple(c.buckets)
        else:  # the plan's buckets are for captured graphs; on CPU nothing is gained by padding
            buckets = plan.buckets if self.device.type == "cuda" and c.cuda_graphs else ()
        pools = int(plan.memory.get("graph_pools_bytes", {}).get("decode", 0)) if buckets else 0
        replay_on = self._replay_on()
        if replay_on and self.device.type == "cuda" and c.cuda_graphs:
            pools += int(plan.memory.get("graph_pools_bytes", {}).get("suffix", 0))
        need = memory_need(specs, host, state_bytes=state_bytes_per_slot(g, c.capacity) * (c.max_slots + 1),
                           graph_pools=pools)
        check_fit(self.cfg, need, available_bytes(self.device, c.memory_budget), str(self.device))
        self._token_map_given = token_map
        self.token_map_source = None  # before the weights: a missing tokenizer fails fast
        if "engram_token_map" in g.inputs:
            from .token_map import token_map_source

            self.token_map_source = token_map_source(
                self.cfg, given=token_map is not None, tokenizer=c.tokenizer, ckpt_dir=self.ckpt_dir,
                origin=origin)
            self.report.token_map = self.token_map_source.describe()
        with self.report.timed("weights"):
            self.weights = self._bind(weights, specs, host)
        with self.report.timed("state"):
            self.state = allocate_state(g, num_slots=c.max_slots + 1, capacity=c.capacity,
                                        device=self.device)
            self.slots = SlotAllocator(c.max_slots + 1)
            self.cached: dict[int, int] = {}
            self.constants = self._constants()
            self.program = StepProgram(g, plan.segments, self.kernels, self.weights,
                                       self.constants, self.state)
        self.replay = self._bounded_replay(host) if replay_on else None
        self.last_rows = torch.zeros(0, dtype=torch.int64)  # set by step()
        self.runner = None
        if buckets:
            self._start_runner(buckets)
        self.suffix_report = None  # CaptureReport of the suffix row buckets, if any
        if self.replay is not None and self.replay.runner is not None:
            with self.report.timed("suffix capture"):
                self.suffix_report = self.replay.capture()
            self.report.graph_memory_bytes += self.suffix_report.graph_memory_bytes
        self.report.remember()
        from .generate import Generator

        self.generator = Generator(self)

    @classmethod
    def from_artifacts(cls, path: str | Path, weights: str | Path | None = None, *,
                       device: str = "cpu", seed: int = 0, token_map: torch.Tensor | None = None,
                       **config) -> "Engine":
        """Load compiled artifacts, bind weights (checkpoint dir, or seeded random), start up."""
        report = StartupReport()
        with report.timed("artifacts"):
            plan = RunPlan.from_artifacts(path)
        return cls(plan, weights, EngineConfig(device=device, seed=seed, **config), report,
                   token_map=token_map)

    # -- start-up --------------------------------------------------------------------------------
    def _weights_origin(self, weights) -> tuple[Path | None, str]:
        """(checkpoint dir or None, "checkpoint" | "given" | "random") of the `weights` argument."""
        if isinstance(weights, (str, Path)):
            return Path(weights), "checkpoint"
        return None, "random" if weights is None else "given"

    def _bind(self, weights, specs, host) -> dict[str, torch.Tensor]:
        c = self.config
        if isinstance(weights, dict):
            self.report.weights = "given tensors"
            w = {k: v.to(self.device) if k not in host else v for k, v in weights.items()}
        elif weights is not None:
            self.report.weights = f"checkpoint {weights}"
            w = load_weights(specs, host, weights, device=self.device, cfg=self.cfg, progress=c.progress)
        elif c.random_weights == "fast":
            self.report.weights = f"random (fast, on device, seed {c.seed})"
            w = fast_random_weights(specs, self.cfg, seed=c.seed, device=self.device)
        else:
            self.report.weights = f"random (seeded, seed {c.seed})"
            w = seeded_weights(specs, self.cfg, seed=c.seed, device=self.device)
        for name in host:
            w[name] = w[name].cpu()
        return w

    def _constants(self) -> dict[str, torch.Tensor]:
        if self.token_map_source is None:
            return {}
        from .token_map import build_token_map

        m = build_token_map(self.token_map_source, self.cfg, self._token_map_given)
        return {"engram_token_map": m.to(self.device)}

    def _replay_on(self) -> bool:
        """EngineConfig.bounded_replay resolved against the plan: "plan" follows its
        `bounded_replay.default` (off when the plan has no such graphs), "on" needs the graphs."""
        mode = self.config.bounded_replay
        if mode not in REPLAY_MODES:
            raise ValueError(f"bounded_replay must be one of {', '.join(REPLAY_MODES)}; got "
                             f"{mode!r}")
        if mode == "plan":
            return self.plan.replay.get("default") == "on"
        return mode == "on"

    def _bounded_replay(self, host: set[str]):
        from .replay import BoundedReplay, SuffixCapture

        names = self.plan.replay.get("graphs", {})
        graphs = [self.plan.extra_graphs.get(names.get(k, "")) for k in ("prefix", "suffix")]
        if None in graphs:
            raise ArtifactsError(f"{self.plan.source or 'artifacts'}: no bounded-replay graphs; "
                                 "compile with `megagraph compile ... --bounded-replay`")
        c = self.config
        if c.suffix_buckets is not None:
            suffix_buckets = tuple(sorted(c.suffix_buckets))
        elif self.device.type == "cuda" and c.cuda_graphs:
            suffix_buckets = tuple(self.plan.replay.get("suffix_row_buckets") or ())
        else:  # as for the step graphs: padding gains nothing without capture
            suffix_buckets = ()
        capture = SuffixCapture(suffix_buckets, self.device, c.cuda_graphs, self.slots.scratch_slot,
                                c.capacity, lambda b: bucket_reqs(b, c.max_slots, c.capacity))
        kernels = []
        for g in graphs:
            ks = resolve_kernels(self.plan, [g], self.device, allow_fallback=self.config.allow_fallback,
                                 override=self.config.kernels)
            ks.run_on_host(g, host)
            kernels.append(ks)
        return BoundedReplay(*graphs, tuple(kernels), self.weights, self.constants, self.state,
                             int(self.plan.replay["keep"]),
                             step_tokens_above=int(self.plan.replay.get("step_tokens_above", 0)),
                             capture=capture)

    def replay_summary(self) -> str:
        """One start-up line: whether bounded replay is on, when it is used, what is captured."""
        r, c = self.replay, self.config
        if r is None:
            has = "graphs in the plan" if self.plan.replay else "no graphs in the plan"
            return f"bounded replay: off ({c.bounded_replay}; {has})"
        when = (f"steps of more than {r.step_tokens_above} tokens" if r.step_tokens_above
                else "steps") + f" with a chunk longer than {r.keep} rows"
        rep = self.suffix_report
        if rep is None:
            how = "suffix eager (no row buckets)"
        elif rep.captured_segments:
            how = (f"suffix captured for {len(rep.buckets)} row buckets {rep.buckets[0]}.."
                   f"{rep.buckets[-1]} (segments {rep.captured_segments})")
        else:
            how = f"suffix padded to row buckets {rep.buckets[0]}..{rep.buckets[-1]}, uncaptured"
        return f"bounded replay: on ({c.bounded_replay}), {when}; {how}"

    def _start_runner(self, buckets: tuple[int, ...]) -> None:
        c, g = self.config, self.plan.graph
        capturable = {s.index for s in self.plan.segments if s.kind == "graph"
                      and all(g.nodes[i].outputs[0] in self.kernels.capture_safe for i in s.nodes)}
        reasons = {}
        for s in self.plan.segments:
            if s.index in capturable:
                continue
            if s.kind != "graph":
                reasons[s.index] = s.why_eager or "the plan runs it eagerly"
            else:
                bad = sorted({g.nodes[i].op for i in s.nodes
                              if g.nodes[i].outputs[0] not in self.kernels.capture_safe})
                reasons[s.index] = f"kernels not capturable (reference): {', '.join(bad[:6])}" + \
                    (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        if self.device.type != "cuda" or not c.cuda_graphs:
            why = "no CUDA on this device" if self.device.type != "cuda" else "CUDA graphs are off"
            reasons = {s.index: f"{why} (plan: {reasons.get(s.index, 'capturable')})"
                       for s in self.plan.segments}
            capturable = set()
        backend = check_backend(c.compile if c.compile != "none" else (self.plan.compile_backend or "none"))
        check_numerics(c.compile_numerics)
        wrap_fn = None
        if backend != "none":
            from .compile import cache_counters, load_megacache, numerics_options, wrap

            before = cache_counters()
            d = cache_dir(self.plan.source, cache_key(self._plan_id(), self.device, backend,
                                                         c.compile_numerics))
            point_caches(d)
            self.report.cache_dir, self.report.compile_backend = str(d), backend
            self.report.compile_options = numerics_options(backend, c.compile_numerics)
            self.report.megacache_loaded = load_megacache(d)
            targets = {s.index for s in self.plan.segments if s.kind == "graph"}
            untraced = self.kernels.opaque | untraced_nodes(g, tile_loops=not c.compile_tile_loops)

            def wrap_fn(i, fn):
                if i not in targets:
                    return fn
                return wrap(fn, backend, len(buckets), c.compile_dynamic, untraced,
                            numerics=c.compile_numerics)

        with self.report.timed("warm-up+capture"):
            self.runner = GraphRunner(self.program, buckets, capturable=capturable,
                                      eager_reasons=reasons, device=self.device,
                                      capture=c.cuda_graphs, wrap=wrap_fn,
                                      bucket_reqs=bucket_reqs(buckets, c.max_slots, c.capacity))
            rep = self.runner.capture(scratch_slot=self.slots.scratch_slot, capacity=c.capacity)
        self.report.buckets, self.report.captured_segments = rep.buckets, rep.captured_segments
        self.report.eager_segments, self.report.graph_memory_bytes = rep.eager_segments, rep.graph_memory_bytes
        if backend != "none":
            from .compile import save_megacache

            self.report.cache = {k: v - before[k] for k, v in cache_counters().items()}
            save_megacache(Path(self.report.cache_dir))

    def _plan_id(self) -> str:
        src = self.plan.source
        manifest = src / "manifest.yaml" if src else None
        if manifest is not None and manifest.is_file():
            return manifest.read_text()
        return str(self.plan.graph)

    # -- stepping --------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if not hasattr(self, "_tokenizer"):
            from .token_map import tokenizer_file
            from .tokenizer import Tokenizer, find_tokenizer

            p = (tokenizer_file(self.config.tokenizer) if self.config.tokenizer
                 else find_tokenizer(self.cfg, self.plan.tokenizer, self.ckpt_dir))
            self._tokenizer = Tokenizer(p, self.cfg) if p else None
        return self._tokenizer

    @property
    def replay_possible(self) -> bool:
        """Whether some step may take bounded replay (its logits then hold kept rows only)."""
        return self.replay is not None

    def takes_replay(self, chunks: Sequence[SeqChunk], exact: bool = False) -> bool:
        """Whether `step(chunks, exact=exact)` takes bounded replay (the plan's rule)."""
        if self.replay is None or exact or not chunks:
            return False
        return self.replay.applies(torch.tensor([len(ch.tokens) for ch in chunks]))

    def step(self, chunks: Sequence[SeqChunk], *, exact: bool = False) -> torch.Tensor:
        """Run one step over `chunks` (slot, new tokens); returns the logits of the real rows (one
        per token, one per request for a plan with logits=last, or one per kept row on the
        bounded-replay path), on the device. `self.last_rows` then holds each request's last row.
        `exact`: never bounded replay (a request wants a logit row per prompt token)."""
        for ch in chunks:
            if not 0 <= ch.slot < self.slots.scratch_slot:
                raise ValueError(f"slot {ch.slot} is not a request slot (0..{self.slots.scratch_slot - 1})")
            if self.cached.get(ch.slot, 0) + len(ch.tokens) > self.config.capacity:
                raise ValueError(f"slot {ch.slot}: {self.cached.get(ch.slot, 0)} cached + "
                                 f"{len(ch.tokens)} new tokens exceed the capacity {self.config.capacity}")
        batch = make_batch(chunks, self.cached)
        per_token = self.plan.graph.types[self.plan.graph.output_value("logits")].shape[0] == "T"
        self.last_rows = batch.last_token_rows if per_token else torch.arange(batch.num_reqs)
        if self.takes_replay(chunks, exact):
            out, rows = self.replay.run(batch.meta)
            self.last_rows = torch.cumsum(batch.meta["seq_new"].clamp(max=self.replay.keep), 0) - 1
            self._advance(chunks)
            return out["logits"][: len(rows)].clone()
        if self.runner is not None and self.runner.can_run(batch):
            b = self.runner.padded_size(batch.num_tokens)
            padded = pad_batch(batch, b, self.runner.reqs(b), scratch_slot=self.slots.scratch_slot,
                               capacity=self.config.capacity, pad_token_id=self.cfg.pad_token_id)
            out = self.runner.replay(padded)
        else:
            out = self.program.run({k: v.to(self.device) for k, v in batch.meta.items()})
        self._advance(chunks)
        return out["logits"][: batch.num_tokens if per_token else batch.num_reqs].clone()

    def _advance(self, chunks: Sequence[SeqChunk]) -> None:
        for ch in chunks:
            self.cached[ch.slot] = self.cached.get(ch.slot, 0) + len(ch.tokens)

    def release(self, slot: int) -> None:
        """Forget a finished sequence and free its slot."""
        self.cached.pop(slot, None)
        self.slots.free(slot)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list:
        """Complete every prompt; returns one `Output` per prompt, in order."""
        return self.generator.generate(prompts, sampling_params)

    def stream(self, prompts, sampling_params=None) -> Iterator:
        """Yield a `TokenEvent` per sampled token as the batch runs."""
        return self.generator.stream(prompts, sampling_params)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.replay is not None and self.replay.runner is not None:
            self.replay.runner.close()


__all__ = ["Engine", "EngineConfig", "ArtifactsError"]
