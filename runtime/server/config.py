"""`ServeConfig`: every start-up choice of `megagraph runtime serve` (CLI defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    artifacts: str = "artifacts"  # dir written by `megagraph compile`
    weights: str | None = None  # checkpoint dir; None = seeded random weights
    tokenizer: str | None = None  # tokenizer.json (or its dir); default: the checkpoint's
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1/* when set
    served_model_name: str | None = None  # default: the model config's name
    device: str = "cpu"
    capacity: int = 1024  # tokens per request (prompt + output): the context limit served
    max_running: int = 32  # concurrent sequences (state slots), before the memory cap
    mem_fraction: float = 0.9  # of free device memory after weights, for the state pools
    state_bytes: int | None = None  # explicit state-pool budget in bytes (overrides the fraction)
    max_total_tokens: int | None = None  # token ledger (default: every slot full)
    max_prefill_tokens: int | None = None  # prompt tokens per step (default: the plan's limit)
    # prompt tokens in a step that also has decode rows (default: max_prefill_tokens)
    max_mixed_prefill_tokens: int | None = None
    max_queue: int = 4096  # waiting sequences before 503
    # prefix cache (runtime/prefix_cache.py): on by default
    prefix_cache: bool = True
    prefix_cache_mode: str = "replay"  # "replay" (encoder replay when it saves work) or "exact"
    prefix_cache_bytes: int | None = None  # device tier (default: as many bytes as the pools)
    host_cache_bytes: int = 0  # host-memory tier (0: off)
    prefix_replay_tokens: int | None = None  # tokens an encoder replay re-runs (default: window)
    overlap: bool = True  # assemble step N+1 while step N runs
    # thinking mode when a chat request does not say: off, as SGLang serves V4.1 (clients that do
    # not know the field get content, not a budget spent in reasoning); --thinking-default on
    default_thinking: bool = False
    grammar: bool = True  # structured output with xgrammar when it is installed
    seed: int = 0  # random weights and unseeded sampling
    random_weights: str = "fast"  # without a checkpoint: "fast" or "seeded" (the tests' values)
    drain_timeout: float = 30.0  # seconds in-flight requests get on shutdown
    max_n: int = 16  # choices per request
    # engine choices shared with `megagraph runtime generate` (runtime/engine.py:EngineConfig)
    compile: str = "none"  # torch.compile backend around the captured segments
    compile_numerics: str = "eager"  # Inductor rounding: eager or fast (docs/compile.md)
    cuda_graphs: bool = True  # capture the plan's buckets on CUDA
    bounded_replay: str = "plan"  # plan, on or off: approximate prefill of large steps
    allow_fallback: bool = False  # run kernels this device lacks as their reference kernels
    allow_edited_artifacts: bool = False  # serve artifacts whose files differ from the manifest
    log_level: str = "info"

    def prefix_cache_config(self):
        from ..prefix_cache import PrefixCacheConfig

        return PrefixCacheConfig(enabled=self.prefix_cache, mode=self.prefix_cache_mode,
                                 device_bytes=self.prefix_cache_bytes,
                                 host_bytes=self.host_cache_bytes,
                                 replay_tokens=self.prefix_replay_tokens)

    def prefill_cap(self, plan, replay: bool = False) -> int:
        """Prompt tokens per step: the flag, capped so that they and one decode token per
        running sequence fit the plan's per-GPU graph token limit, unless the engine has the
        bounded-replay path (`replay`), which is what steps above the limit take."""
        from_plan = _plan_token_limit(plan)
        want = self.max_prefill_tokens or 256
        if from_plan and not (replay and self.max_prefill_tokens):
            want = min(want, max(from_plan - self.max_running, 1))
        return max(1, want)

    def engine_config(self, slots: int):
        from ..engine import EngineConfig

        return EngineConfig(device=self.device, max_slots=slots, capacity=self.capacity,
                            max_step_tokens=self.max_prefill_tokens or 256, seed=self.seed,
                            random_weights=self.random_weights, progress=False,
                            compile=self.compile, compile_numerics=self.compile_numerics,
                            cuda_graphs=self.cuda_graphs, allow_fallback=self.allow_fallback,
                            tokenizer=self.tokenizer, bounded_replay=self.bounded_replay)


def _plan_token_limit(plan) -> int:
    """The plan's `buckets.graph_token_limit` (0 on profiles without CUDA graphs)."""
    src = getattr(plan, "source", None)
    if src is None:
        return 0
    import yaml

    try:
        with open(src / "plan.yaml") as f:
            return int((yaml.safe_load(f).get("buckets") or {}).get("graph_token_limit") or 0)
    except (OSError, ValueError, AttributeError):
        return 0
