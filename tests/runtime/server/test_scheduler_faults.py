"""One request's end or failure is its own: requests that finish while their step is in flight
(length 1, a stop token at the first token, an abort), and a step that raises for one request,
never fail the other requests, never leak a slot, and leave the others' greedy tokens as they
would be without the incident."""

from __future__ import annotations

import threading

import pytest

from megagraph.runtime.cache_manager import CacheManager, size_cache
from megagraph.runtime.engine import Engine
from megagraph.runtime.sampling import SamplingParams, new_state
from megagraph.runtime.scheduler import InvalidRequest, Scheduler, SchedulerConfig
from megagraph.runtime.sequence import Sequence

CAP = 256
SLOTS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(20 + 3 * i, 20 + 3 * i + 12 + 5 * i)) for i in range(6)]
POISON = 4093  # a token id that the fault-injecting engine refuses (in the tiny vocabulary)


class FaultyEngine:
    """The real engine, except that a step holding the token `POISON` raises (after checking
    its chunks, before running anything: the way a bad input or a kernel's refusal fails)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.failures = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, chunks, *, exact: bool = False):
        if any(POISON in ch.tokens for ch in chunks):
            self.failures += 1
            raise RuntimeError("injected kernel failure")
        return self._engine.step(chunks, exact=exact)


@pytest.fixture(scope="module")
def engine(artifacts):
    return Engine.from_artifacts(artifacts, max_slots=SLOTS, capacity=CAP, progress=False,
                                 random_weights="fast")


class Run:
    """A fresh scheduler over `engine`; collects each sequence's tokens and final event."""

    def __init__(self, engine, **cfg):
        self.cache = CacheManager(engine, size_cache(engine.plan.graph, capacity=CAP,
                                                     max_running=SLOTS))
        self.sch = Scheduler(engine, self.cache, SchedulerConfig(**cfg))
        self.engine = engine
        self.tokens: dict[int, list[int]] = {}
        self.final: dict[int, object] = {}
        self._lock = threading.Lock()
        self._all = threading.Event()
        self._want = 0

    def seq(self, i: int, prompt: list[int], params: SamplingParams = GREEDY) -> Sequence:
        def sink(ev):
            with self._lock:
                self.tokens.setdefault(i, []).extend(ev.token_ids)
                if ev.finish_reason is not None:
                    assert i not in self.final, "a second final event"
                    self.final[i] = ev
                    if len(self.final) == self._want:
                        self._all.set()
        return Sequence(i, list(prompt), new_state(params, prompt, 0, self.engine.device), sink,
                        eos_id=1)

    def go(self, seqs: list[Sequence], timeout: float = 120) -> "Run":
        self._want += len(seqs)
        self._all.clear()
        self.sch.submit(seqs)
        assert self._all.wait(timeout), f"finished {sorted(self.final)} of {self._want}"
        return self

    def close(self) -> None:
        self.sch.close()
        assert self.cache.tokens_used == 0 and self.cache.usage().slots_used == 0
        assert self.engine.slots.num_free == SLOTS, "a slot leaked"
        assert self.sch.num_waiting() == 0 and not self.sch.running


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_that_ends_at_its_first_token_alone(engine, overlap):
    """max_tokens 1 on an idle scheduler: its slot is released while its only step is still in
    flight; the step must still run on the slot it was assembled with."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for rep in range(5):
        r = Run(engine, overlap=overlap)
        r.go([r.seq(0, PROMPTS[rep], one)])
        assert r.final[0].finish_reason == "length", r.final[0].error
        assert len(r.tokens[0]) == 1
        r.close()


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt's greedy tokens on its own (no overlap, nothing else in the steps)."""
    out = []
    for i, p in enumerate(PROMPTS):
        r = Run(engine, overlap=False)
        r.go([r.seq(i, p)])
        out.append(r.tokens[i])
        r.close()
    return out


def test_a_stop_token_or_abort_at_the_first_token_in_a_batch(engine, alone):
    """Sequences ending while their next step is already assembled (a stop token at the first
    token, an abort right after submission) leave the batch's others untouched."""
    r = Run(engine, max_prefill_tokens=32)
    stop_first = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(alone[0][0],))
    seqs = [r.seq(0, PROMPTS[0], stop_first)] + [r.seq(i, PROMPTS[i]) for i in range(1, 5)]
    r._want += len(seqs)
    r.sch.submit(seqs)
    r.sch.abort([4])
    assert r._all.wait(120)
    assert r.final[0].finish_reason == "stop" and r.tokens[0] == alone[0][:1]
    assert r.final[4].finish_reason == "abort"
    for i in (1, 2, 3):
        assert r.final[i].finish_reason == "length" and r.tokens[i] == alone[i]
    r.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_failing_for_one_request_fails_only_that_request(engine, alone, overlap):
    """One prompt carries a token the engine refuses; it shares steps with five others (more
    than the slots: admission and chunked prefill keep running). It ends with an error after
    failing once in a batch and once alone; every other request gets exactly its tokens."""
    faulty = FaultyEngine(engine)
    r = Run(faulty, overlap=overlap, max_prefill_tokens=16)
    poisoned = PROMPTS[2][:5] + [POISON] + PROMPTS[2][6:]
    r.go([r.seq(i, poisoned if i == 2 else p) for i, p in enumerate(PROMPTS)])
    assert r.final[2].finish_reason == "error" and "RuntimeError" in r.final[2].error
    assert "injected" not in r.final[2].error  # exception texts stay in the log
    assert faulty.failures == 2  # once in a batch, once alone
    for i in set(range(len(PROMPTS))) - {2}:
        assert r.final[i].finish_reason == "length", (i, r.final[i].error)
        assert r.tokens[i] == alone[i], i
    assert r.sch.stats.errors == 2
    # the scheduler goes on serving: no cascade of failed steps after the incident
    r.go([r.seq(10 + i, p) for i, p in enumerate(PROMPTS[:3])])
    assert [r.tokens[10 + i] for i in range(3)] == alone[:3]
    r.close()


def test_a_failure_is_logged_with_its_request_ids(engine, caplog):
    faulty = FaultyEngine(engine)
    r = Run(faulty)
    s = r.seq(0, [POISON] + PROMPTS[0])
    s.request_id = "cmpl-test-42"
    with caplog.at_level("ERROR", logger="megagraph.scheduler"):
        r.go([s])
    assert r.final[0].finish_reason == "error"
    rec = [x for x in caplog.records if "cmpl-test-42" in x.getMessage()]
    assert rec and rec[0].exc_info is not None  # the traceback goes to the log
    r.close()


@pytest.mark.parametrize("prompt, params, match", [
    ([], GREEDY, "no tokens"),
    ([5, 10**6, 7], GREEDY, "outside the vocabulary"),
    ([3, -1], GREEDY, "outside the vocabulary"),
    (list(range(10, 10 + CAP - 4)), GREEDY, "exceed the context"),
])
def test_a_request_the_engine_cannot_run_is_refused_at_submission(engine, prompt, params, match):
    r = Run(engine)
    with pytest.raises(InvalidRequest, match=match):
        r.sch.submit([r.seq(0, PROMPTS[0]), r.seq(1, prompt, params)])
    assert r.sch.num_waiting() == 0  # nothing of the refused batch was queued
    r.close()


def test_prompt_logprobs_match_one_prefill_of_the_prompt(engine):
    """Prompt logprobs come from the rows of every prompt chunk (chunked here, over several
    steps, beside other requests); they equal log_softmax of one whole-prompt prefill at the
    next prompt token (f32 plan: chunked and one-shot prefill agree to ~5e-6 in the logits)."""
    import torch

    from megagraph.runtime.batch import SeqChunk

    prompt = PROMPTS[5]
    slot = engine.slots.allocate()
    try:
        ref = torch.log_softmax(engine.step([SeqChunk(slot, tuple(prompt))]).float(), -1)
    finally:
        engine.release(slot)
    r = Run(engine, max_prefill_tokens=8)
    s = r.seq(0, prompt)
    s.prompt_logprobs = 3
    got = {}
    sink = s.sink
    s.sink = lambda ev: (got.setdefault("p", ev.prompt_logprobs) if ev.prompt_logprobs else None,
                         sink(ev))
    r.go([s, r.seq(1, PROMPTS[1])])
    lps = got["p"]
    assert len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        lp = lps[pos]
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        top_v, top_i = ref[pos - 1].topk(3)
        assert [t for t, _ in lp.top] == top_i.tolist()
    r.close()
