"""Captured steps: one CUDA graph per (segment, bucket), static buffers, eager breaks between.

A bucket b holds a step of T <= b tokens in R <= R_b requests, padded to (b, R_b) (runtime/batch.py):
R_b = b unless the engine caps it (`bucket_reqs`): a prefill bucket of 8192 tokens serves a few
requests, and every request row costs per-request work (its logits row, request tiles, state
gathers), so the engine gives it as many rows as it has slots plus the pad rows its pad tokens need.
Every value that crosses a segment boundary, and the step's metadata, lives in one buffer sized
for the largest bucket; a bucket's graphs read and write leading slices of them, so addresses
never change. State updates go straight into the state pools when no later segment still reads
the old state. On CPU (or for segments whose kernels are not capturable) the same callables run
uncaptured: the padding and buffer logic is identical, only `torch.cuda.graph` is skipped.

A graph may read runtime inputs besides the step metadata (`extra_inputs`: the bounded-replay
suffix's kept bridge rows, runtime/replay.py); each gets a static buffer too, filled per replay
(leading rows from the caller, pad rows zeroed so they stay finite and deterministic). Metadata
the graph does not read gets no buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megagraph.graph.types import TORCH_DTYPES

from .batch import StepBatch
from .step import METADATA, StepProgram


@dataclass
class StaticBuffers:
    """Tensors captured graphs read and write, allocated once at the largest bucket."""

    tensors: dict[str, torch.Tensor]  # value name -> buffer (or a state pool it aliases)
    env_max: dict[str, int]  # dims the buffers were sized with

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        buf = self.tensors[name]
        return buf if tuple(buf.shape) == shape else buf[tuple(slice(0, n) for n in shape)]


@dataclass
class CaptureReport:
    """What start-up capture did, for the start-up report."""

    buckets: list[int] = field(default_factory=list)
    captured_segments: list[int] = field(default_factory=list)
    eager_segments: dict[int, str] = field(default_factory=dict)  # segment -> why eager
    seconds: float = 0.0
    graph_memory_bytes: int = 0  # device memory taken by the graphs' pool during capture


class GraphRunner:
    """Padded steps over static buffers, replayed from CUDA graphs where the plan allows."""

    def __init__(self, step: StepProgram, buckets: tuple[int, ...], *, capturable: set[int],
                 eager_reasons: dict[int, str], device: torch.device, capture: bool = True,
                 wrap: Callable[[int, Callable], Callable] | None = None,
                 bucket_reqs: dict[int, int] | None = None, extra_inputs: tuple[str, ...] = ()):
        """`capturable`: segment indices to capture (CUDA only, unless `capture` is off);
        `wrap(seg, program)`: torch.compile; `bucket_reqs`: request rows per bucket (default b,
        never more than b, nondecreasing in b); `extra_inputs`: graph inputs other than metadata,
        state and constants, given to each `replay`."""
        self.step, self.device = step, device
        self.meta_inputs = tuple(m for m in METADATA if m in step.graph.inputs)
        self.extra_inputs = tuple(extra_inputs)
        unknown = [v for v in self.extra_inputs if v not in step.graph.inputs]
        if unknown:
            raise ValueError(f"graph {step.graph.name}: extra input(s) {unknown} are not inputs")
        self.buckets = tuple(sorted(buckets))
        self.bucket_reqs = {b: min(b, (bucket_reqs or {}).get(b, b)) for b in self.buckets}
        if any(self.bucket_reqs[a] > self.bucket_reqs[b] for a, b in zip(self.buckets, self.buckets[1:])):
            raise ValueError(f"request rows per bucket must not decrease: {self.bucket_reqs}")
        self.use_graphs = device.type == "cuda" and capture
        self.capturable = capturable if self.use_graphs else set()
        self.report = CaptureReport(list(self.buckets), sorted(self.capturable), dict(eager_reasons))
        self.fns = [wrap(i, p) if wrap else p for i, p in enumerate(step.programs)]
        self.compiled = any(f is not p for f, p in zip(self.fns, step.programs))
        self.buffers = self._allocate() if self.buckets else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.envs: dict[int, dict[str, torch.Tensor]] = {}  # bucket -> value views
        self.pool = None

    # -- the four methods ------------------------------------------------------------------------
    def can_run(self, batch: StepBatch) -> bool:
        return bool(self.buckets) and batch.num_tokens <= self.buckets[-1]

    def reqs(self, b: int) -> int:
        """Request rows of bucket b."""
        return self.bucket_reqs[b]

    def padded_size(self, num_tokens: int) -> int:
        """Smallest bucket holding `num_tokens` tokens."""
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def replay(self, batch: StepBatch,
               extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Run a batch already padded to a bucket; returns views of the output buffers. `extra`:
        a value for each of `extra_inputs` (its real leading rows; omitted: the buffers as they
        are, for warm-up)."""
        b = batch.padded_tokens
        if b not in self.buckets or batch.padded_reqs != self.bucket_reqs[b]:
            raise ValueError(f"batch padded to (T={b}, R={batch.padded_reqs}) is not a bucket")
        env = self._env(b)
        for name in self.meta_inputs:
            env[name].copy_(batch.meta[name], non_blocking=True)
        if extra is not None:
            self._fill_extra(env, extra)
        for k in range(len(self.fns)):
            g = self.graphs.get((b, k))
            if g is not None:
                g.replay()
            else:
                self._run_segment(k, env)
        self._commit(env)
        return {lab: env[v] for lab, v in self.step.graph.outputs if lab in self.step.result_labels}

    def _fill_extra(self, env: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]) -> None:
        missing = [v for v in self.extra_inputs if v not in extra]
        if missing:
            raise ValueError(f"graph {self.step.graph.name}: no value for extra input(s) {missing}")
        for v in self.extra_inputs:
            dst, src = env[v], extra[v]
            if src.shape[1:] != dst.shape[1:] or src.shape[0] > dst.shape[0]:
                raise ValueError(f"extra input {v}: shape {tuple(src.shape)} does not fit the "
                                 f"bucket's buffer {tuple(dst.shape)}")
            n = src.shape[0]
            dst[:n].copy_(src, non_blocking=True)
            dst[n:].zero_()

    def close(self) -> None:
        """Drop graphs and buffers (before any distributed teardown, or the process can hang)."""
        self.graphs.clear()
        self.envs.clear()
        self.buffers = None
        self.pool = None

    # -- capture ---------------------------------------------------------------------------------
    def capture(self, *, scratch_slot: int, capacity: int) -> CaptureReport:
        """Warm up and capture every (capturable segment, bucket), largest bucket first."""
        from .batch import pad_batch

        t0 = time.perf_counter()
        empty = StepBatch({k: torch.zeros(0, dtype=torch.int64) for k in METADATA}, 0, 0)
        if self.use_graphs and self.capturable:
            torch.cuda.synchronize(self.device)
            free0 = torch.cuda.mem_get_info(self.device)[0]
            self.pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            batch = pad_batch(empty, b, self.bucket_reqs[b], scratch_slot=scratch_slot,
                              capacity=capacity)
            self.replay(batch)  # warm-up: lazy init, torch.compile, every pad row on the scratch slot
            if not (self.use_graphs and self.capturable):
                continue
            if self.compiled:
                self.replay(batch)  # a frame that recompiles on its second call does so here
            env = self._env(b)
            for k in sorted(self.capturable):
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g, pool=self.pool), _no_recompiles(self.compiled):
                        self._run_segment(k, env)
                except RecompileError as e:
                    raise RuntimeError(
                        f"segment {k}, bucket {b}: torch.compile recompiled during CUDA-graph "
                        f"capture (compiling there breaks the capture); its guards changed between "
                        f"warm-up and capture: {e}") from e
                self.graphs[(b, k)] = g
        if self.use_graphs and self.capturable:
            torch.cuda.synchronize(self.device)
            self.report.graph_memory_bytes = free0 - torch.cuda.mem_get_info(self.device)[0]
        self.report.seconds = time.perf_counter() - t0
        return self.report

    # -- buffers ---------------------------------------------------------------------------------
    def _allocate(self) -> StaticBuffers:
        g, st = self.step.graph, self.step.state
        any_pool = next(iter(st.values()), None)
        dims = {"T": self.buckets[-1], "R": self.bucket_reqs[self.buckets[-1]]}
        if any_pool is not None:
            dims["S"] = any_pool.shape[0]
        dims["N"] = _capacity(g, st)
        self.aliased = self._aliasable()
        tensors: dict[str, torch.Tensor] = {}
        values = [*self.meta_inputs, *self.extra_inputs,
                  *(v for io in self.step.ios for v in io.outputs)]
        for v in dict.fromkeys(values):
            if v in self.aliased:
                tensors[v] = st[self.aliased[v]]
                continue
            t = g.types[v]
            tensors[v] = torch.zeros(t.concrete(dims), dtype=TORCH_DTYPES[t.dtype], device=self.device)
        return StaticBuffers(tensors, dims)

    def _aliasable(self) -> dict[str, str]:
        """State update value -> its pool, where no later segment reads the old state."""
        g, ios = self.step.graph, self.step.ios
        made_in = {v: k for k, io in enumerate(ios) for v in io.outputs}
        out = {}
        for lab, v in g.outputs:
            if lab not in self.step.state or v not in made_in:
                continue
            k = made_in[v]
            if not any(lab in io.inputs for io in ios[k + 1:]):
                out[v] = lab
        return out

    def _env(self, b: int) -> dict[str, torch.Tensor]:
        env = self.envs.get(b)
        if env is None:
            g, bufs = self.step.graph, self.buffers
            dims = {**bufs.env_max, "T": b, "R": self.bucket_reqs[b]}
            env = {**self.step.constants, **self.step.state}
            for v in bufs.tensors:
                env[v] = bufs.view(v, g.types[v].concrete(dims))
            self.envs[b] = env
        return env

    def _run_segment(self, k: int, env: dict[str, torch.Tensor]) -> None:
        out = self.fns[k](env)
        for v, t in out.items():
            dst = env[v]
            if t.data_ptr() != dst.data_ptr():
                dst.copy_(t)

    def _commit(self, env: dict[str, torch.Tensor]) -> None:
        for lab, v in self.step.graph.outputs:
            pool = self.step.state.get(lab)
            if pool is not None and v not in self.aliased and env[v].data_ptr() != pool.data_ptr():
                pool.copy_(env[v])


def _capacity(g, state) -> int:
    """N, read back from a pool whose type has an N dim."""
    for name, pool in state.items():
        if name not in g.types:  # a pool this graph does not read (the suffix's rows graph)
            continue
        for d, n in zip(g.types[name].shape, pool.shape):
            if isinstance(d, str) and d.startswith("N"):
                return n * int(d.split("/")[1]) if "/" in d else n
    return 0


try:
    from torch._dynamo.exc import RecompileError
except ImportError:  # pragma: no cover - torch without dynamo
    class RecompileError(Exception):
        pass


def _no_recompiles(compiled: bool):
    """Inside a CUDA-graph capture a torch.compile recompile (code generation, module loads) breaks
    the capture with an opaque CUDA error; this turns it into a RecompileError naming the guard."""
    import contextlib

    if not compiled:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(error_on_recompile=True)
