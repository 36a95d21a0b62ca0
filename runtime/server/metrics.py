"""Prometheus metrics (text exposition format 0.0.4, no client library needed).

Requests (by route, status and outcome), tokens, TTFT / inter-token latency / end-to-end
latency histograms, queue and running sequences, state-cache usage (slots, tokens, bytes,
preemptions) and scheduler timings: step count, forward seconds, and the scheduling overhead
left exposed by the overlap; the batch composition of the steps (decode rows alone, or mixed
with prompt tokens); device memory of the allocator, on CUDA.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)
OVERHEAD_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters the routes and the scheduler update; `render()` for GET /metrics."""

    def __init__(self, service):
        self.service = service
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int, str], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0
        self.http_active = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.overhead = Histogram(OVERHEAD_BUCKETS)
        self.step_time = Histogram(LATENCY_BUCKETS)

    # -- updates ---------------------------------------------------------------------------------
    def requests_started(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def request_done(self, endpoint: str, status: int, outcome: str) -> None:
        """`outcome`: ok | rejected (4xx) | error (5xx, or a stream the engine failed) |
        aborted (client gone, server shutting down); see middleware.py."""
        with self.lock:
            self.requests[(endpoint, status, outcome)] += 1

    def tokens(self, n: int) -> None:
        with self.lock:
            self.generation_tokens += n

    def latency(self, ttft: float | None, itls: list[float], e2e: float) -> None:
        with self.lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            for x in itls:
                self.itl.observe(x)
            self.e2e.observe(e2e)

    def on_step(self, job, res) -> None:  # scheduler thread
        with self.lock:
            self.step_time.observe(res.forward_s + res.sample_s)
            if job.continues:
                self.overhead.observe(res.idle_before_s + res.wait_ready_s)

    # -- exposition ------------------------------------------------------------------------------
    def render(self) -> str:
        svc = self.service
        sch, cache = svc.scheduler, svc.cache.usage()
        st = sch.stats
        model = svc.model_name
        out: list[str] = []

        def metric(name, kind, help_, value=None, labels=""):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            if value is not None:
                out.append(f"{name}{labels} {value}")

        with self.lock:
            metric("megagraph_requests_total", "counter", "HTTP requests answered, by route, "
                   "status line and how they ended (ok, rejected, error, aborted: a stream "
                   "that failed after its 200 status line counts as error)")
            for (ep, status, outcome), n in sorted(self.requests.items()):
                out.append(f'megagraph_requests_total{{endpoint="{ep}",status="{status}",'
                           f'outcome="{outcome}"}} {n}')
            metric("megagraph_http_requests_active", "gauge", "HTTP requests being served",
                   self.http_active)
            metric("megagraph_requests_aborted_total", "counter", "requests aborted (client "
                   "disconnect, shutdown)", self.aborted)
            metric("megagraph_prompt_tokens_total", "counter", "prompt tokens admitted",
                   self.prompt_tokens)
            metric("megagraph_generation_tokens_total", "counter", "tokens generated",
                   self.generation_tokens)
            for name, h, help_ in (
                    ("megagraph_time_to_first_token_seconds", self.ttft, "time to first token"),
                    ("megagraph_inter_token_latency_seconds", self.itl, "time between tokens"),
                    ("megagraph_e2e_request_latency_seconds", self.e2e, "request latency"),
                    ("megagraph_step_seconds", self.step_time, "engine step (forward + sample)"),
                    ("megagraph_scheduler_overhead_seconds", self.overhead,
                     "worker idle between consecutive busy steps (scheduling overhead left)")):
                metric(name, "histogram", help_)
                out += h.lines(name)
        metric("megagraph_num_requests_running", "gauge", "sequences holding a state slot",
               len(sch.running))
        metric("megagraph_num_requests_waiting", "gauge", "sequences queued", sch.num_waiting())
        metric("megagraph_cache_slots_used", "gauge", "state slots in use", cache.slots_used)
        metric("megagraph_cache_slots_total", "gauge", "state slots", cache.slots_total)
        metric("megagraph_cache_tokens_used", "gauge", "tokens reserved in the state ledger",
               cache.tokens_used)
        metric("megagraph_cache_tokens_total", "gauge", "token ledger size", cache.tokens_total)
        metric("megagraph_cache_usage_ratio", "gauge", "max(slot, token) usage in [0, 1]",
               f"{cache.fraction:.6f}")
        metric("megagraph_cache_bytes_used", "gauge", "state bytes of the reserved tokens",
               cache.bytes_used)
        metric("megagraph_cache_bytes_total", "gauge", "state pool bytes", cache.bytes_total)
        labelled(metric, out, "megagraph_cache_slot_bytes", "gauge",
                 "state bytes of the slots in use, by kind", "kind", cache.by_kind_bytes)
        metric("megagraph_cache_preemptions_total", "counter", "sequences preempted "
               "(recomputed later)", cache.preemptions)
        prefix_metrics(metric, out, sch.prefix)
        for name, v, help_ in (
                ("steps", st.steps, "engine steps"),
                ("prefill_tokens", st.prefill_tokens, "prompt tokens run"),
                ("decode_tokens", st.decode_tokens, "decode tokens run"),
                ("decode_only_steps", st.decode_only_steps, "steps of decode rows alone"),
                ("mixed_steps", st.mixed_steps, "steps with decode rows and prompt tokens"),
                ("mixed_decode_tokens", st.mixed_decode_tokens, "decode rows of mixed steps"),
                ("mixed_prefill_tokens", st.mixed_prefill_tokens,
                 "prompt tokens of mixed steps")):
            metric(f"megagraph_scheduler_{name}_total", "counter", help_, v)
        metric("megagraph_scheduler_forward_seconds_total", "counter", "time in forward passes",
               f"{st.forward_s:.6f}")
        metric("megagraph_scheduler_exposed_overhead_seconds_total", "counter",
               "worker idle between consecutive busy steps", f"{st.exposed_s:.6f}")
        metric("megagraph_scheduler_cpu_seconds_total", "counter", "scheduler thread work "
               "(assembly + processing, overlapped with steps)", f"{st.cpu_s:.6f}")
        metric("megagraph_scheduler_overhead_ratio", "gauge", "exposed overhead / busy time",
               f"{st.overhead_fraction:.6f}")
        metric("megagraph_engine_errors_total", "counter", "failed engine steps", st.errors)
        metric("megagraph_engine_healthy", "gauge", "1 while the engine loop runs",
               int(svc.healthy))
        metric("megagraph_kernel_fallback", "gauge", "1 per kernel key the plan asked for that "
               "could not load here and runs its reference kernel (--allow-fallback)")
        for key in sorted(getattr(getattr(svc.engine, "kernels", None), "fallbacks", {}) or {}):
            out.append(f'megagraph_kernel_fallback{{kernel="{key}"}} 1')
        for name, v, help_ in device_memory(getattr(svc.engine, "device", None)):
            metric(f"megagraph_device_memory_{name}_bytes", "gauge", help_, v)
        out.append(f'megagraph_model_info{{model="{model}",capacity="{svc.capacity}"}} 1')
        return "\n".join(out) + "\n"


def prefix_metrics(metric, out: list[str], cache) -> None:
    """The prefix cache (runtime/prefix_cache.py): lookups and hits by tier, tokens saved and
    replayed, evictions by tier (and of window tails alone), bytes and nodes held by tier."""
    metric("megagraph_prefix_cache_enabled", "gauge", "1 when the prefix cache is on",
           int(cache is not None))
    if cache is None:
        return
    st = cache.stats
    for name, v, help_ in (
            ("lookups", st.lookups, "admissions that looked up the prefix cache"),
            ("lookup_tokens", st.lookup_tokens, "tokens those admissions could have resumed"),
            ("hit_tokens", st.hit_tokens, "tokens resumed from the cache instead of prefilled"),
            ("exact_hits", st.exact_hits, "hits whose restored state is that of a cold prefill"),
            ("replay_hits", st.replay_hits, "hits that rebuilt the windows by encoder replay"),
            ("derived_hits", st.derived_hits, "hits that restored the kept windows of a node "
             "snapshotted from a request that had resumed by replay (approximate too)"),
            ("replayed_tokens", st.replayed_tokens, "tokens re-run by encoder replay"),
            ("inserts", st.inserts, "snapshots added to the cache"),
            ("host_loads", st.host_loads, "nodes copied back from the host tier"),
            ("flushes", st.flushes, "POST /flush_cache calls")):
        metric(f"megagraph_prefix_cache_{name}_total", "counter", help_, v)
    p = "megagraph_prefix_cache_"
    labelled(metric, out, p + "hits_total", "counter", "lookups that resumed, by the lowest "
             "tier they read (host: part of the prefix came back from host memory)", "tier",
             st.hits)
    metric(p + "hit_rate", "gauge", "hit tokens / lookup tokens", f"{st.hit_rate:.6f}")
    labelled(metric, out, p + "evictions_total", "counter", "evictions: device (a node left "
             "the device), host (a node left the host tier), window (a window tail alone)",
             "tier", st.evictions)
    labelled(metric, out, p + "bytes", "gauge", "bytes held, by tier", "tier", cache.bytes)
    labelled(metric, out, p + "capacity_bytes", "gauge", "budget, by tier", "tier",
             {"device": cache.device_budget, "host": cache.host_budget})
    labelled(metric, out, p + "nodes", "gauge", "radix tree nodes, by tier", "tier",
             cache.count)


def labelled(metric, out: list[str], name: str, kind: str, help_: str, label: str,
             values: dict) -> None:
    """One metric's HELP/TYPE lines and a sample per `label` value."""
    metric(name, kind, help_)
    for k, v in values.items():
        out.append(f'{name}{{{label}="{k}"}} {v}')


def device_memory(device) -> list[tuple[str, int, str]]:
    """The CUDA caching allocator's view of the engine's device (none on the CPU): allocated is
    what tensors hold, reserved what the allocator holds from the driver (what nvidia-smi counts
    of this process, less the CUDA context), peak the most allocated since start-up, so that a
    soak can tell growth of live tensors from allocator caching."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return []
    return [("allocated", torch.cuda.memory_allocated(device), "device memory held by tensors"),
            ("reserved", torch.cuda.memory_reserved(device),
             "device memory held by the caching allocator"),
            ("peak_allocated", torch.cuda.max_memory_allocated(device),
             "most device memory held by tensors since start-up")]

