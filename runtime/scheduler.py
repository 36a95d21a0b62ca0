"""Continuous batching: request queue, decode-first steps with chunked prefill, preemption by
recompute, and step N+1 assembled while step N runs.

The scheduler thread owns every sequence. Each loop it takes new sequences and aborts from its
inbox, releases the slots of sequences that will not be scheduled again (steps run in order, so a
slot can take a new owner while its old owner's last step is still in flight), assembles a
step and hands it to the `StepWorker`, then processes the oldest in-flight step's samples. With
`overlap` (default) it keeps two steps in flight: while the worker runs step N, the scheduler
builds step N+1 (decode inputs are the not-yet-known samples of step N, resolved by the worker),
commits step N-1's tokens into sampler and grammar states, fills step N+1's grammar bitmask and
detokenizes/streams step N-1. A sequence that finishes at step N (EOS, stop string) was already
scheduled in N+1; that extra row is discarded. The worker's idle gap between consecutive steps is
the scheduling overhead that remains (`SchedulerStats`).

Step policy: every running sequence that can decode gets its token first (inter-token latency),
then prompt chunks (continuing prefills, then newly admitted requests, FIFO) fill the prefill
budget (`max_prefill_tokens`, within the plan's per-GPU graph token limit when it has one). A
step that has decode rows takes at most `max_mixed_prefill_tokens` prompt tokens when that is
set (the analogue of vLLM's `max_num_batched_tokens`, which bounds a step's tokens, and of
SGLang's `--chunked-prefill-size`, which bounds a prompt chunk): the prompt chunks of arriving
requests lengthen every decode step they join, so the bound trades time to first token for
inter-token latency; a chunk over it waits for a step without decode rows (chunks are never
cut smaller for it, so the cut stays independent of the batch).
Chunks are aligned to multiples of `max_prefill_tokens`, so a request is cut the same way
whatever it is batched with (greedy output alone == batched). Admission
asks the `CacheManager`; when decode growth does not fit its token ledger, the newest running
sequences are preempted: they leave their slot and are recomputed (prompt + outputs so far)
when admitted again, with their sampler and grammar states kept.

Failure isolation. A step is assembled from sequence fields that the scheduler keeps changing
while the step runs (a sequence whose last token is in flight gives its slot back at once), so a
job carries its chunks' slots as of assembly and the worker reads nothing else of a sequence. A
request the engine cannot run is refused at `submit` (`InvalidRequest`: no prompt token, a token
id outside the vocabulary, more tokens than a slot holds). A step that still raises is logged
with its traceback and request ids; its sequences (and those of the step after it, which ran
nothing: its inputs were the failed step's samples) lose their slots and are recomputed, the
ones of the failed step one at a time in steps of their own: a sequence that fails again alone
is the cause and ends with an error, the others rejoin the batch with the tokens they would
have had.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from .cache_manager import CacheManager
from .sequence import FINISHED, RUNNING, WAITING, SeqEvent, Sequence
from .step_worker import StepJob, StepResult, StepWorker, UpstreamStepFailed

log = logging.getLogger("megagraph.scheduler")

#: failed steps a sequence may be part of before it is failed itself: one (in a batch, where
#: any of its neighbours may be the cause); the second is a step it ran alone in
MAX_FAULTS = 1
#: cache-aware admission: how many waiting sequences are ranked by their cached prefix, and how
#: many later arrivals may be admitted before a passed-over sequence goes first
CACHE_AWARE_WINDOW = 32
MAX_BYPASS = 8


class Overloaded(RuntimeError):
    """The queue is full, or the scheduler is shutting down / dead (the server answers 503)."""


class InvalidRequest(ValueError):
    """A sequence the engine cannot run (the server answers 400); nothing was queued."""


def check_runnable(s: Sequence, vocab_size: int, capacity: int) -> None:
    """What every step needs of a sequence, checked before it can reach one."""
    n = len(s.prompt_ids)
    if n == 0:
        raise InvalidRequest("the prompt has no tokens; a request needs at least one")
    bad = next((t for t in s.prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if n + s.params.max_tokens > capacity:
        raise InvalidRequest(f"{n} prompt tokens + max_tokens {s.params.max_tokens} exceed the "
                             f"context of {capacity} tokens")


def check_prompt_logprobs(engine) -> None:
    """Prompt logprobs need a logit row per token: a plan compiled with logits for every row
    (steps with such a request skip bounded replay, which keeps only the last rows of a long
    chunk: StepWorker passes `exact`)."""
    g = engine.plan.graph
    if g.types[g.output_value("logits")].shape[0] != "T":
        raise InvalidRequest("prompt logprobs (echo with logprobs) need a plan that computes "
                             "logits for every token; this plan computes the last row only")


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 256  # prompt tokens per step (chunked prefill)
    max_queue: int = 4096  # waiting sequences before submissions are refused
    overlap: bool = True  # assemble step N+1 while step N runs
    # prompt tokens in a step that also has decode rows (None: max_prefill_tokens)
    max_mixed_prefill_tokens: int | None = None
    cache_aware: bool = True  # with the prefix cache: longest cached prefix first (bounded)

    def __post_init__(self):
        if self.max_mixed_prefill_tokens is not None and self.max_mixed_prefill_tokens < 0:
            raise ValueError("max_mixed_prefill_tokens must be >= 0 (0: no prompt token beside "
                             "decode rows)")


@dataclass
class SchedulerStats:
    """Running totals (read by /metrics; written by the scheduler thread only)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_s: float = 0.0
    sample_s: float = 0.0
    exposed_s: float = 0.0  # worker idle between consecutive busy steps (+ waiting for `ready`)
    busy_steps: int = 0  # steps that followed another without the queue running dry
    cpu_s: float = 0.0  # scheduler thread work (assembly + processing), mostly hidden
    errors: int = 0
    # steps with decode rows and prompt tokens both, and their tokens: the batch composition
    # a served step had, for an engine-alone baseline at the same mix (benchmarks/engine_step.py)
    mixed_steps: int = 0
    mixed_decode_tokens: int = 0
    mixed_prefill_tokens: int = 0
    decode_only_steps: int = 0  # steps of decode rows alone
    recent_exposed: deque = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def overhead_fraction(self) -> float:
        return self.exposed_s / max(self.exposed_s + self.forward_s + self.sample_s, 1e-9)


class Scheduler:
    """Call `submit`/`abort` from any thread; everything else runs on the scheduler thread."""

    def __init__(self, engine, cache: CacheManager, config: SchedulerConfig = SchedulerConfig(),
                 grammar_factory=None, *, seed: int = 0,
                 on_step: Callable[[StepJob, StepResult], None] | None = None,
                 on_flush: Callable[[], None] | None = None, lockstep: bool = False,
                 prefix_cache=None):
        """`prefix_cache`: (PrefixCache, SlotCache) from runtime/prefix_state.py
        `build_prefix_cache`, or None (every request prefills from scratch)."""
        self.engine, self.cache, self.config = engine, cache, config
        self.prefix, self.slot_cache = prefix_cache or (None, None)
        self._before: list = []  # prefix-cache ops for the next job (snapshots, then restores)
        self._released: list = []  # (sequence, op) snapshots of released slots, same job
        self._after: list = []  # (sequence, epoch, op) snapshots at chunk ends, same job
        self._flushes: list = []  # futures of /flush_cache calls
        self.grammar = grammar_factory
        self.worker = StepWorker(engine, grammar_factory, seed=seed, lockstep=lockstep)
        self.stats = SchedulerStats()
        self.on_step = on_step
        self.on_flush = on_flush or (lambda: None)  # after each batch of sink() calls
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[tuple[int, str]] = []
        self._by_id: dict[int, Sequence] = {}
        self._inflight: deque[StepJob] = deque()  # submitted, results not processed yet
        self._stopping = False
        self._isolated_turn = True  # whether a suspect's step may come next
        self._abort_everything: str | None = None
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="megagraph-scheduler", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue `seqs`; raises InvalidRequest (nothing queued) or Overloaded."""
        vocab, cap = self.engine.cfg.vocab_size, self.engine.config.capacity
        for s in seqs:
            check_runnable(s, vocab, cap)
        if any(s.prompt_logprobs is not None for s in seqs):
            check_prompt_logprobs(self.engine)
        for s in seqs:
            if s.prompt_logprobs is not None:
                s.prompt_lps = [None] * len(s.prompt_ids)
        if self.prefix is not None and len(seqs) > 1 and seqs[0].prompt_logprobs is None:
            for s in seqs[1:]:  # the other choices resume from the first one's prompt
                if s.prompt_ids == seqs[0].prompt_ids:
                    s.leader, seqs[0].has_followers = seqs[0], True
        with self._cv:
            if self.dead is not None:
                raise Overloaded(f"the engine loop stopped: {self.dead}")
            if self._stopping:
                raise Overloaded("the server is shutting down")
            if len(self.waiting) + len(self._inbox) + len(seqs) > self.config.max_queue:
                raise Overloaded(f"too many queued requests ({self.config.max_queue}); retry later")
            self._inbox.extend(seqs)
            self._cv.notify()

    def abort(self, seq_ids, reason: str = "abort") -> None:
        with self._cv:
            self._aborts.extend((i, reason) for i in seq_ids)
            self._cv.notify()

    def abort_all(self, reason: str = "abort") -> None:
        """Abort every queued and running sequence (shutdown)."""
        with self._cv:
            self._abort_everything = reason
            self._cv.notify()

    def flush_cache(self, timeout: float = 30.0) -> dict:
        """Drop every cached prefix no running request holds (POST /flush_cache); returns
        {nodes, bytes, kept}. Runs on the scheduler thread between steps."""
        if self.prefix is None:
            return {"nodes": 0, "bytes": 0, "kept": 0, "enabled": False}
        fut: Future = Future()
        with self._cv:
            if self.dead is not None:
                raise Overloaded(f"the engine loop stopped: {self.dead}")
            self._flushes.append(fut)
            self._cv.notify()
        return fut.result(timeout)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def close(self, timeout: float = 30.0) -> None:
        """Finish what is queued and running (abort it first to stop sooner), then stop."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        self.worker.close()

    # -- scheduler thread ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - never leave a request hanging
            self.dead = e
            for job in self._inflight:  # let the worker finish what it holds
                job.ready.set()
            for s in list(self._by_id.values()) + self._inbox:
                if not s.finished:
                    s.finish_reason = "error"
                    s.sink(SeqEvent(s.seq_id, [], "", finish_reason="error",
                                    error=f"engine loop failed: {type(e).__name__}: {e}"))
            self.on_flush()

    def _loop(self) -> None:
        inflight = self._inflight
        while True:
            self._take_inbox()
            self.on_flush()
            if self._stopping and not (self.waiting or self.running or inflight):
                return
            self._release()
            if not inflight:  # the worker is idle: snapshot and reset released slots here
                self._snapshot_now()
                for slot in self.cache.take_resets():
                    self.engine.cached.pop(slot, None)
            job = None
            if not inflight or (self.config.overlap and len(inflight) < 2):
                t0 = time.perf_counter()
                job = self._assemble(continues=bool(inflight or self.running))
                if job is not None:
                    if not inflight:
                        self._arm(job)
                    self.worker.submit(job)
                    inflight.append(job)
                self.stats.cpu_s += time.perf_counter() - t0
            if inflight and (job is None or len(inflight) >= 2 or not self.config.overlap):
                done = inflight.popleft()
                self._process(done, inflight[0] if inflight else None)
            elif not inflight:
                with self._cv:
                    if not (self._inbox or self._aborts or self._stopping or self._flushes):
                        self._cv.wait(timeout=0.5)

    def _take_inbox(self) -> None:
        with self._cv:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            everything, self._abort_everything = self._abort_everything, None
            flushes, self._flushes = self._flushes, []
        for fut in flushes:
            fut.set_result(self.prefix.flush())
        for s in new:
            self._by_id[s.seq_id] = s
            self.waiting.append(s)
        if everything:
            aborts += [(sid, everything) for sid in self._by_id]
        for sid, reason in aborts:
            s = self._by_id.get(sid)
            if s is None or s.finished:
                continue
            s.finish_reason = reason
            s.sink(SeqEvent(s.seq_id, [], "", finish_reason=reason,
                            num_prompt_tokens=len(s.prompt_ids),
                            num_output_tokens=len(s.output_ids)))
            if s.status == WAITING:
                self.waiting.remove(s)
                self._forget(s)

    def _forget(self, s: Sequence) -> None:
        s.status = FINISHED
        self._by_id.pop(s.seq_id, None)

    def _release(self) -> None:
        """Free the slots of sequences that will not be scheduled again (finished, preempted,
        or with their last token in flight); forget / requeue them once no sample is pending."""
        keep = []
        for s in self.running:
            if s.slot >= 0 and (s.finished or s.preempt or not s.can_sample_more()):
                self._snapshot_released(s)
                self.cache.release(s.seq_id)
                s.slot = -1
            if s.slot < 0 and s.pending == 0 and (s.finished or s.preempt):
                if s.finished:
                    self._forget(s)
                else:  # preempted: recompute prompt + outputs when admitted again
                    s.status, s.scheduled, s.preempt = WAITING, 0, False
                    self.waiting.appendleft(s)
                continue
            keep.append(s)
        self.running = keep

    # -- assembly --------------------------------------------------------------------------------
    def _assemble(self, continues: bool) -> StepJob | None:
        seqs: list[Sequence] = []
        tokens: list[list[int | None]] = []
        samples: list[int] = []

        slots: list[int] = []
        epochs: list[int] = []
        starts: list[int] = []

        def add(s: Sequence, toks: list[int | None], samples_now: bool) -> None:
            assert s.slot >= 0 and toks, f"sequence {s.seq_id} is not runnable"
            if samples_now:
                samples.append(len(seqs))
                s.pending += 1
            seqs.append(s)
            tokens.append(toks)
            slots.append(s.slot)
            epochs.append(s.epoch)
            starts.append(s.scheduled)
            s.scheduled += len(toks)
            s.inflight += 1

        suspect = self._next_suspect()
        if suspect is not None:  # after a failed step: one suspect alone, every other step
            self._isolated_turn = False
            if self._add_alone(suspect, add):
                return self._with_cache_ops(StepJob(
                    seqs, tokens, samples, continues, num_decode=0,
                    reset_slots=self.cache.take_resets(), slots=slots, epochs=epochs,
                    starts=starts, isolated=True))
        self._isolated_turn = True

        # decode first
        decodes = []
        for s in self.running:
            if s.finished or s.preempt or s.slot < 0 or s.faults or not s.can_sample_more():
                continue
            unfed = s.num_known - s.scheduled
            if (s.pending and unfed == 0) or (not s.pending and unfed == 1):
                decodes.append(s)
        for s in decodes:
            if s.preempt:
                continue
            while not self.cache.grow(s.seq_id, 1):
                victim = next(v for v in reversed(self.running)
                              if v.slot >= 0 and not (v.preempt or v.finished))
                self._preempt(victim)
                if victim is s:
                    break
            if not s.preempt:
                add(s, [None] if s.pending else [s.token_at(s.scheduled)], True)
        # then prompt chunks: continuing prefills, then admissions (decodes are not counted)
        budget = self.config.max_prefill_tokens
        mixed = self.config.max_mixed_prefill_tokens
        if seqs and mixed is not None:
            budget = min(budget, mixed)
        for s in self.running:
            if s.finished or s.preempt or s.pending or s.slot < 0 or s.faults \
                    or s.num_known - s.scheduled <= 1 or s in seqs:
                continue
            n = self._chunk_len(s)
            if n > budget:
                break
            budget -= self._add_chunk(s, n, add)
        admitted = []
        for s in self._admission_order():
            if self._held_back(s):
                continue
            if self._chunk_len(s, 0) > budget or not self._admit(s):
                break
            admitted.append(s)
            budget -= self._add_chunk(s, self._chunk_len(s), add)
        self._count_bypasses(admitted)
        if not seqs:
            return None
        return self._with_cache_ops(StepJob(
            seqs, tokens, samples, continues, num_decode=len(decodes),
            reset_slots=self.cache.take_resets(), slots=slots, epochs=epochs, starts=starts))

    def _admission_order(self) -> list[Sequence]:
        """Waiting sequences in the order admission tries them: FIFO, or with the prefix cache
        (`cache_aware`) and more waiting than free slots, the first `CACHE_AWARE_WINDOW` by the
        longest cached prefix of their prompt (they prefill least, and share what they resume
        from while it is hot), within a fairness bound: one passed over by `MAX_BYPASS` later
        arrivals goes first (FIFO)."""
        queue = [w for w in self.waiting if not w.faults]
        if self.prefix is None or not self.config.cache_aware or \
                len(queue) <= self.cache.slots_free:  # all fit: arrival order (no one waits)
            return queue
        head, tail = queue[:CACHE_AWARE_WINDOW], queue[CACHE_AWARE_WINDOW:]
        rank = {id(w): (w.bypassed < MAX_BYPASS, -self.prefix.match_len(w.prompt_ids), i)
                for i, w in enumerate(head)}
        return sorted(head, key=lambda w: rank[id(w)]) + tail

    def _count_bypasses(self, admitted: list[Sequence]) -> None:
        """Every waiting sequence that arrived before one admitted now was passed over once."""
        if not admitted or self.prefix is None:
            return
        last = max(a.arrival for a in admitted)
        for w in self.waiting:
            if w.arrival < last:
                w.bypassed += 1

    def _admit(self, s: Sequence) -> bool:
        """Give a waiting sequence a slot, if one and its tokens fit."""
        headroom = sum(1 for r in self.running if r.slot >= 0 and not r.preempt)
        if not self.cache.can_admit(s.num_known, headroom):
            return False
        self.waiting.remove(s)
        s.slot = self.cache.admit(s.seq_id, s.num_known)
        s.status, s.scheduled = RUNNING, 0
        self.running.append(s)
        self._resume(s)
        return True

    def _next_suspect(self) -> Sequence | None:
        """The suspect whose turn it is (every other step while there are any), or None."""
        if not self._isolated_turn:
            return None
        for s in self.running:
            if s.faults and not (s.finished or s.preempt) and s.slot >= 0 and not s.inflight:
                return s
        return next((s for s in self.waiting if s.faults), None)

    def _add_alone(self, s: Sequence, add) -> bool:
        """Add the suspect's next work (its recompute chunk or a decode token) as a whole step."""
        if s.status == WAITING and not self._admit(s):
            return False
        if s.num_known - s.scheduled > 1:
            self._add_chunk(s, self._chunk_len(s), add)
        elif (s.can_sample_more() and s.num_known - s.scheduled == 1
              and self.cache.grow(s.seq_id, 1)):
            add(s, [s.token_at(s.scheduled)], True)
        return bool(s.inflight)

    def _chunk_len(self, s: Sequence, start: int | None = None) -> int:
        """Tokens of the next prompt chunk. Chunks end at multiples of the prefill cap (or the
        prompt's end), whatever else is in the step: a request is cut the same way alone or
        batched, so its numerics (and greedy output) do not depend on its neighbours."""
        c = self.config.max_prefill_tokens
        start = s.scheduled if start is None else start
        n = min(s.num_known - start, c - start % c)
        cut = next((x for x in s.cuts if x > start), None)
        return n if cut is None else min(n, cut - start)

    def _add_chunk(self, s: Sequence, n: int, add) -> int:
        toks = [s.token_at(i) for i in range(s.scheduled, s.scheduled + n)]
        add(s, toks, s.scheduled + n == s.num_known)
        if self.prefix is not None and s.cacheable and (
                s.scheduled == s.num_known or s.scheduled in s.cuts):
            self._after.append((s, s.epoch, self.slot_cache.capture(
                s.slot, s.snap_from, s.scheduled, s.approx)))
        return n

    def _preempt(self, s: Sequence) -> None:
        s.preempt = True
        self.cache.unreserve(s.seq_id)
        self.cache.preemptions += 1

    def _arm(self, job: StepJob) -> None:
        """Fill the job's grammar bitmask (sequence states are current) and let it sample."""
        rows = [r for r, i in enumerate(job.samples)
                if job.seqs[i].grammar is not None and not job.seqs[i].finished]
        if rows and self.grammar is not None:
            job.bitmask = self.grammar.allocate_bitmask(len(job.samples))
            job.mask_rows = [r for r in rows
                             if job.seqs[job.samples[r]].grammar.fill_mask(job.bitmask, r)]
        job.ready.set()

    # -- prefix cache ----------------------------------------------------------------------------
    def _resume(self, s: Sequence) -> None:
        """Start an admitted sequence from the longest cached prefix of its tokens (the restore
        runs with the job), and cut its prompt where its match ends (a branch point: the
        snapshot there lets the next request with this prefix resume exactly) and, for the
        first of `n` choices, one token before its end (where the others resume: a request's
        last token always runs)."""
        s.cacheable, s.snap_from, s.cuts, s.approx = True, 0, (), False
        if self.prefix is None or s.prompt_logprobs is not None:
            return
        tokens = [s.token_at(i) for i in range(s.num_known)]
        resume, matched = self.prefix.lookup(tokens, s.num_known - 1)
        if resume is not None:
            s.scheduled = s.snap_from = resume.end
            s.anchor, s.approx = resume.anchor, resume.approx
            self._before.append(self.slot_cache.restore(s.slot, resume, tokens))
        cuts = {matched} if matched > s.scheduled else set()
        if s.has_followers and not s.output_ids:
            cuts.add(len(s.prompt_ids) - 1)
        s.cuts = tuple(sorted(x for x in cuts if x > s.scheduled))
        if not s.output_ids:
            s.cached_tokens = min(s.scheduled, len(s.prompt_ids))

    def _held_back(self, s: Sequence) -> bool:
        """Not admitted yet: its released state is still being cached, or it is a further
        choice of a request whose first choice has not cached the prompt."""
        if s.releasing:
            return True
        lead = s.leader
        return lead is not None and not (lead.prompt_done or lead.finished)

    def _snapshot_released(self, s: Sequence) -> None:
        """A slot is given back: snapshot what it holds (with the next job, or now when no step
        is in flight), so a later turn, choice or recompute resumes from it."""
        if self.prefix is None:
            return
        if s.cacheable and s.scheduled > s.snap_from and s.finish_reason != "error":
            s.releasing = True
            self._released.append((s, self.slot_cache.capture(s.slot, s.snap_from, s.scheduled,
                                                              s.approx)))
        else:
            self._let_go(s)

    def _snapshot_now(self) -> None:
        released, self._released = self._released, []
        for s, op in released:
            self._insert_released(s, op())

    def _with_cache_ops(self, job: StepJob) -> StepJob:
        job.before = [op for _, op in self._released] + self._before
        job.after = [op for _, _, op in self._after]
        job.cache_meta = (self._released, self._after)
        self._released, self._before, self._after = [], [], []
        return job

    def _cache_results(self, job: StepJob, res: StepResult | None) -> None:
        """Insert a processed job's snapshots (res None: the job failed, drop them)."""
        if job.cache_meta is None:
            return
        released, after = job.cache_meta
        for i, (s, _) in enumerate(released):
            self._insert_released(s, res.before[i] if res is not None else None)
        for (s, epoch, _), snap in zip(after, res.after if res is not None else ()):
            if epoch == s.epoch and s.cacheable:
                self._insert(s, snap)

    def _insert(self, s: Sequence, snap) -> None:
        node = self.prefix.insert([s.token_at(i) for i in range(snap.end)], snap)
        if node is not None:
            self.prefix.lock(node)
            self._let_go(s)
            s.anchor, s.snap_from = node, snap.end

    def _insert_released(self, s: Sequence, snap) -> None:
        s.releasing = False
        if snap is not None:
            self.prefix.insert([s.token_at(i) for i in range(snap.end)], snap)
        self._let_go(s)
        s.snap_from = 0

    def _let_go(self, s: Sequence) -> None:
        if s.anchor is not None:
            self.prefix.unlock(s.anchor)
            s.anchor = None

    # -- results ---------------------------------------------------------------------------------
    def _process(self, job: StepJob, next_job: StepJob | None) -> None:
        try:
            res = job.future.result()
        except BaseException as e:  # noqa: BLE001 - an engine error is isolated, not fatal
            self._recover(job, e)
            self.on_flush()
            return
        t0 = time.perf_counter()
        for s in job.seqs:
            s.inflight -= 1
        self._cache_results(job, res)
        for i, (first, lps) in res.prompt_logprobs.items():
            s = job.seqs[i]
            if job.epochs[i] == s.epoch and s.prompt_lps is not None:
                s.prompt_lps[first: first + len(lps)] = lps
        committed = []
        for idx, tok, lp in zip(job.samples, res.tokens, res.logprobs):
            s = job.seqs[idx]
            s.pending -= 1
            s.prompt_done = True
            if not s.finished and job.epochs[idx] == s.epoch:
                self._commit(s, tok)
                committed.append((s, tok, lp))
                if job.isolated:
                    s.faults = 0  # it ran alone and sampled: it rejoins the batch
        if next_job is not None:
            self._arm(next_job)
        for s, tok, lp in committed:
            self._emit(s, tok, lp)
        self._account(job, res)
        self.on_flush()
        self.stats.cpu_s += time.perf_counter() - t0

    def _commit(self, s: Sequence, tok: int) -> None:
        """The cheap part: sampler/grammar state and count/token-based finishes."""
        p = s.params
        s.output_ids.append(tok)
        if s.grammar is not None and not s.grammar.accept(tok):
            s.finish_reason = "stop"  # masked sampling makes this unreachable; stop cleanly
        elif tok in p.stop_token_ids or (tok == s.eos_id and not p.ignore_eos):
            s.finish_reason = "stop"
        elif s.grammar is not None and s.grammar.is_terminated():
            s.finish_reason = "stop"
        elif len(s.output_ids) >= p.max_tokens:
            s.finish_reason = "length"

    def _emit(self, s: Sequence, tok: int, lp) -> None:
        """Detokenize, cut stop strings (holding back a possible prefix), send the event."""
        now = time.monotonic()
        s.first_token_at = s.first_token_at or now
        s.last_token_at = now
        stops = s.params.stop
        if s.detok is not None:
            s.text += s.detok.push(tok)
            if s.finished:
                s.text += s.detok.flush()
            if stops:
                start = max(0, s.emitted - max(len(x) for x in stops))
                hits = [i for i in (s.text.find(x, start) for x in stops) if i >= 0]
                if hits:
                    s.text, s.finish_reason = s.text[:min(hits)], "stop"
            if s.finished:
                s.detok = None
        hold = 0 if s.finished or not stops else max(len(x) for x in stops) - 1
        upto = max(s.emitted, len(s.text) - hold)
        delta, s.emitted = s.text[s.emitted:upto], upto
        prompt_lps = None
        if s.prompt_lps is not None and len(s.output_ids) == 1:
            prompt_lps, s.prompt_lps = s.prompt_lps, None
        s.sink(SeqEvent(s.seq_id, [tok], delta, [lp] if lp is not None else None,
                        s.finish_reason, num_prompt_tokens=len(s.prompt_ids),
                        num_output_tokens=len(s.output_ids), prompt_logprobs=prompt_lps,
                        num_cached_tokens=s.cached_tokens))

    def _recover(self, job: StepJob, e: BaseException) -> None:
        """A step raised: log it, void its sequences' work in flight and recompute them (the
        step after it, already with the worker, is drained first: its inputs include this
        step's samples). A sequence in a failed step for the second time without a good step
        alone in between is the cause: it ends with an error."""
        upstream = isinstance(e, UpstreamStepFailed)
        ids = sorted({s.request_id or str(s.seq_id) for s in job.seqs})
        if not upstream:
            self.stats.errors += 1
            log.error("step failed (%d chunks, %d tokens) for requests %s", len(job.seqs),
                      sum(len(t) for t in job.tokens), ", ".join(ids),
                      exc_info=(type(e), e, e.__traceback__))
        for s in job.seqs:
            s.inflight -= 1
            s.cacheable = False  # its slot's state is void: nothing of it enters the cache
        for i in job.samples:
            job.seqs[i].pending -= 1
        self._cache_results(job, None)
        for s in dict.fromkeys(job.seqs):
            if s.finished:
                continue
            s.epoch += 1
            if not upstream:
                s.faults += 1
            if s.faults > MAX_FAULTS:
                self._fail(s, e)
            elif not s.preempt:
                s.preempt = True  # `_release` frees the slot; recomputed when admitted again
                self.cache.unreserve(s.seq_id)
        if self._inflight:
            nxt = self._inflight.popleft()
            self._arm(nxt)
            self._process(nxt, None)

    def _fail(self, s: Sequence, e: BaseException) -> None:
        s.finish_reason = "error"
        s.sink(SeqEvent(s.seq_id, [], "", finish_reason="error",
                        error=f"the engine failed on this request ({type(e).__name__})",
                        num_prompt_tokens=len(s.prompt_ids),
                        num_output_tokens=len(s.output_ids)))

    def _account(self, job: StepJob, res: StepResult) -> None:
        st = self.stats
        st.steps += 1
        n_dec = job.num_decode
        st.decode_tokens += n_dec
        n_pre = res.num_tokens - n_dec
        st.prefill_tokens += n_pre
        if n_dec and n_pre:
            st.mixed_steps += 1
            st.mixed_decode_tokens += n_dec
            st.mixed_prefill_tokens += n_pre
        elif n_dec:
            st.decode_only_steps += 1
        st.forward_s += res.forward_s
        st.sample_s += res.sample_s
        if job.continues:
            exposed = res.idle_before_s + res.wait_ready_s
            st.exposed_s += exposed
            st.busy_steps += 1
            st.recent_exposed.append(exposed)
        if self.on_step is not None:
            self.on_step(job, res)
