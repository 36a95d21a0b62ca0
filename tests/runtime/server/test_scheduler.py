"""Scheduler + cache manager without HTTP: greedy output is the same alone, batched, with chunked
prefill, with and without overlap, under a bound on the prompt tokens mixed into decode steps,
and under preemption by recompute; admission never exceeds the token ledger; sizing from a byte
budget."""

from __future__ import annotations

import threading

import pytest

from megagraph.runtime.cache_manager import (CacheManager, CacheSizingError, size_cache,
                                             state_bytes_by_kind)
from megagraph.runtime.engine import Engine
from megagraph.runtime.sampling import SamplingParams, new_state
from megagraph.runtime.scheduler import Scheduler, SchedulerConfig
from megagraph.runtime.sequence import Sequence

CAP = 256
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(10 + i, 10 + i + 40 + 9 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def engine(artifacts):
    return Engine.from_artifacts(artifacts, max_slots=4, capacity=CAP, progress=False,
                                 random_weights="fast")


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt on its own through the scheduler, by prefill cap (the cap decides where a
    prompt is cut, and chunked prefill rounds differently from one-shot prefill)."""
    cache = {}

    def get(cap: int, params: SamplingParams = GREEDY) -> list[list[int]]:
        if (cap, params) not in cache:
            cache[cap, params] = [run(engine, [p], params, max_prefill_tokens=cap)[0][0]
                                  for p in PROMPTS]
        return cache[cap, params]

    return get


def run(engine, prompts, params, *, max_total_tokens=None, on_step=None, **cfg):
    """Run `prompts` through a fresh scheduler; returns (token ids per prompt, cache, stats)."""
    sizing = size_cache(engine.plan.graph, capacity=CAP, max_running=4)
    cache = CacheManager(engine, sizing, max_total_tokens)
    ledger_peak = [0]
    sch = Scheduler(engine, cache, SchedulerConfig(**cfg), on_step=on_step)
    out, done = {}, threading.Event()

    finished: set[int] = set()

    def sink_for(i):
        def sink(ev):  # scheduler thread
            ledger_peak[0] = max(ledger_peak[0], cache.tokens_used)
            out.setdefault(i, []).extend(ev.token_ids)
            if ev.finish_reason:
                finished.add(i)
                if len(finished) == len(prompts):
                    done.set()
        return sink

    seqs = [Sequence(i, p, new_state(params, p, 0, engine.device), sink_for(i), eos_id=1)
            for i, p in enumerate(prompts)]
    sch.submit(seqs)
    assert done.wait(120), "scheduler did not finish"
    sch.close()
    assert cache.tokens_used == 0 and cache.usage().slots_used == 0
    assert engine.slots.num_free == 4
    return [out[i] for i in range(len(prompts))], cache, sch.stats, ledger_peak[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_batched_and_chunked_equals_alone(engine, alone, overlap):
    got, _, stats, _ = run(engine, PROMPTS, GREEDY, max_prefill_tokens=32, overlap=overlap)
    assert got == alone(32)
    assert stats.steps > 0 and stats.decode_tokens > 0 and stats.prefill_tokens > 0


@pytest.mark.parametrize("mixed", [None, 16, 0])
def test_mixed_prefill_bound(engine, alone, mixed):
    """--max-mixed-prefill-tokens: a step with decode rows takes at most that many prompt
    tokens, chunks that do not fit wait (never cut smaller), and the tokens are those of each
    prompt alone; the mixed-step counters add up to the steps' own rows."""
    steps = []  # (decode rows, prompt tokens) per step, on the scheduler thread

    def on_step(job, res):
        steps.append((job.num_decode, res.num_tokens - job.num_decode))

    got, _, stats, _ = run(engine, PROMPTS, GREEDY, on_step=on_step, max_prefill_tokens=32,
                           max_mixed_prefill_tokens=mixed)
    assert got == alone(32)
    mixed_rows = [(d, p) for d, p in steps if d and p]
    assert max(p for _, p in steps) <= 32
    if mixed is None:
        assert mixed_rows  # the default mixes prompt chunks into decode steps
    else:
        assert all(p <= mixed for _, p in mixed_rows)
    assert stats.mixed_steps == len(mixed_rows)
    assert stats.mixed_prefill_tokens == sum(p for _, p in mixed_rows)
    assert stats.mixed_decode_tokens == sum(d for d, _ in mixed_rows)
    assert stats.decode_only_steps == sum(1 for d, p in steps if d and not p)
    if mixed == 0:
        assert stats.mixed_steps == 0


def test_mixed_prefill_bound_refuses_a_negative_value():
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens"):
        SchedulerConfig(max_mixed_prefill_tokens=-1)


def test_preemption_recomputes_the_same_tokens(engine, alone):
    longer = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got, cache, _, peak = run(engine, PROMPTS, longer, max_total_tokens=CAP,
                              max_prefill_tokens=64)
    assert cache.preemptions > 0
    assert peak <= CAP  # the ledger never overcommits
    assert got == alone(64, longer)


def test_seeded_sampling_is_the_same_with_overlap_and_preemption(engine):
    p = SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=24, ignore_eos=True,
                       repetition_penalty=1.2, presence_penalty=0.5)
    a, *_ = run(engine, PROMPTS, p, overlap=False)
    b, cache, *_ = run(engine, PROMPTS, p, overlap=True, max_total_tokens=CAP)
    assert cache.preemptions > 0
    assert a == b


def test_sizing_from_a_byte_budget(engine):
    g = engine.plan.graph
    per_slot = sum(state_bytes_by_kind(g, CAP).values())
    assert set(state_bytes_by_kind(g, CAP)) >= {"rings", "compressed_kv", "index_keys",
                                                "pending_rows", "engram_history", "draft_state"}
    s = size_cache(g, capacity=CAP, max_running=100, state_bytes=per_slot * 11)
    assert s.slots == 10 and s.limited_by == "memory"  # one slot is the scratch slot
    s = size_cache(g, capacity=CAP, max_running=3, state_bytes=per_slot * 11)
    assert s.slots == 3 and s.limited_by == "max_running"
    s = size_cache(g, capacity=CAP, max_running=8, mem_fraction=0.5, weight_bytes=1000,
                   free_bytes=1000 + 2 * per_slot * 9)
    assert s.slots == 8
    with pytest.raises(CacheSizingError, match="--capacity"):
        size_cache(g, capacity=CAP, max_running=8, state_bytes=per_slot)
