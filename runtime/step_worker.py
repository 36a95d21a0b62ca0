"""The device side of a step: forward, logit processing (bias, grammar masks), sampling, logprobs.

`StepWorker` runs `StepJob`s one at a time on its own thread (on a GPU this is the stream the
kernels are launched on; on CPU it is where the forward's compute happens), so the scheduler
thread can assemble step N+1 and post-process step N-1 while step N runs. A job may name a
decode input as "the token this sequence sampled in the previous step" (`None` in its chunk):
the worker resolves it from its own last results, as SGLang's future token map does on device.

Before sampling, a job waits for `ready`: the scheduler sets it once it has committed the
previous step's tokens into the sampler states (penalties) and filled this step's grammar
bitmask, which it does while this job's forward runs.

`lockstep` (one rank of a data-parallel job, runtime/distributed): every rank must take part in
every global step, so with no job queued the worker joins the step with no tokens
(`RankEngine.step([])`: the expert-parallel layers still serve the other ranks), waiting a few
milliseconds between steps only while no rank has work; `close()` ends with `finish()`.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch import SeqChunk
from .sampling import sample
from .sequence import Sequence, TokenLogprob


class UpstreamStepFailed(RuntimeError):
    """A decode input is the sample of the step before, which failed: nothing of this step ran
    (no state was written), so its requests can be rerun as they are."""


@dataclass
class StepJob:
    """One step: chunks (slot, tokens; a None token = the previous step's sample of `seqs[i]`).

    `slots` and `epochs` are the sequences' fields as of assembly: the scheduler may release a
    sequence's slot (its last token is in this step) or void its work before the worker runs
    the step, so the worker must never read those live fields."""

    seqs: list[Sequence]  # one per chunk
    tokens: list[list[int | None]]  # per chunk
    samples: list[int]  # indices into seqs of the sequences that sample
    continues: bool  # assembled in a busy period (worker idle before it is our overhead)
    slots: list[int] = field(default_factory=list)  # per chunk, at assembly
    starts: list[int] = field(default_factory=list)  # per chunk: position of its first token
    epochs: list[int] = field(default_factory=list)  # per chunk, at assembly
    isolated: bool = False  # a step of one sequence under suspicion (after a failed step)
    num_decode: int = 0  # leading chunks that are single decode tokens
    reset_slots: list[int] = field(default_factory=list)  # released since the last job
    #: prefix-cache work ordered with the step (runtime/prefix_state.py): `before` runs after the
    #: resets and before the forward (snapshots of released slots, then restores of admitted
    #: ones), `after` once the forward has written the state (snapshots at chunk ends); their
    #: return values come back in StepResult.before / .after
    before: list = field(default_factory=list)
    after: list = field(default_factory=list)
    cache_meta: Any = None  # the scheduler's bookkeeping of `before` / `after`
    ready: threading.Event = field(default_factory=threading.Event)
    bitmask: Any = None  # int32 [len(samples), V/32] (grammar rows), or None
    mask_rows: list[int] = field(default_factory=list)  # rows of `bitmask` to apply
    future: Future = field(default_factory=Future)
    submitted_at: float = 0.0


@dataclass
class StepResult:
    tokens: list[int]  # per sampling sequence
    logprobs: list[TokenLogprob | None]
    num_tokens: int  # tokens fed in the step
    started_at: float
    forward_s: float  # forward only
    sample_s: float  # waiting for `ready` excluded
    wait_ready_s: float
    idle_before_s: float  # worker idle between the previous job's end and this one's start
    #: chunk index -> (first position, logprobs of the prompt tokens at the positions after
    #: each of the chunk's rows), for sequences that asked for prompt logprobs
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    before: list = field(default_factory=list)  # StepJob.before's return values
    after: list = field(default_factory=list)  # StepJob.after's return values


class StepWorker:
    """Runs jobs on a thread; `submit(job)` returns at once, `job.future` gives a StepResult."""

    IDLE_WAIT_S = 0.005  # between global steps nobody had tokens for (lockstep)

    def __init__(self, engine, grammar_factory=None, *, seed: int = 0, lockstep: bool = False):
        self.engine = engine
        self.lockstep = lockstep
        self.grammar = grammar_factory
        self.rng = torch.Generator(engine.device).manual_seed(seed)
        self._q: queue.Queue[StepJob | None] = queue.Queue()
        self._last: dict[int, int] = {}  # seq id -> token sampled in the previous job
        self._end = None  # when the previous job ended
        self._thread = threading.Thread(target=self._run, name="megagraph-step", daemon=True)
        self._thread.start()

    def submit(self, job: StepJob) -> None:
        job.submitted_at = time.perf_counter()
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def _next(self) -> StepJob | None:
        """The next job; in lockstep mode, idle global steps until one comes."""
        if not self.lockstep:
            return self._q.get()
        wait = 0.0
        while True:
            try:
                return self._q.get(timeout=wait) if wait else self._q.get_nowait()
            except queue.Empty:
                pass
            skipped = self.engine.stats.skipped
            try:
                self.engine.step([])
            except Exception:  # noqa: BLE001 - another rank's bad step: its requests fail there
                pass
            self._end = None
            wait = self.IDLE_WAIT_S if self.engine.stats.skipped > skipped else 0.0

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                if self.lockstep:
                    self.engine.finish()
                return
            t0 = time.perf_counter()
            idle = t0 - self._end if (self._end is not None and job.continues) else 0.0
            try:
                job.future.set_result(self._step(job, t0, idle))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the scheduler
                self._last = {}
                job.future.set_exception(e)
            self._end = time.perf_counter()

    def _step(self, job: StepJob, t0: float, idle: float) -> StepResult:
        for slot in job.reset_slots:  # previous owners' steps have all run
            self.engine.cached.pop(slot, None)
        before = [op() for op in job.before]
        chunks = []
        for s, slot, toks in zip(job.seqs, job.slots, job.tokens):
            if None in toks and s.seq_id not in self._last:
                raise UpstreamStepFailed("the previous step failed, so this step has no input "
                                         "token")
            ids = [self._last[s.seq_id] if t is None else t for t in toks]
            chunks.append(SeqChunk(slot, tuple(ids)))
        exact = any(s.prompt_logprobs is not None for s in job.seqs)  # every row's logits
        logits = self.engine.step(chunks, exact=exact)
        after = [op() for op in job.after]
        rows = self._sample_rows(chunks, job.samples)
        picked = logits[rows].float() if rows else logits[:0].float()
        prompt_lps = self._prompt_logprobs(logits, chunks, job)
        t1 = time.perf_counter()
        job.ready.wait()
        t2 = time.perf_counter()
        seqs = [job.seqs[i] for i in job.samples]
        tokens, lps = self._sample(picked, seqs, job)
        self._last = {s.seq_id: t for s, t in zip(seqs, tokens)}
        return StepResult(tokens, lps, sum(len(c.tokens) for c in chunks), t0, t1 - t0,
                          time.perf_counter() - t2, t2 - t1, idle, prompt_lps, before, after)

    def _prompt_logprobs(self, logits: torch.Tensor, chunks: list[SeqChunk], job: StepJob):
        """Row r of a chunk starting at position a predicts the token at a + r + 1: its
        log-probability (raw logits, as the sampled tokens' logprobs) where that is a prompt
        token. Needs per-token logits (`check_runnable` refuses other plans)."""
        out = {}
        end = 0
        for i, (s, c) in enumerate(zip(job.seqs, chunks)):
            begin, end = end, end + len(c.tokens)
            if s.prompt_logprobs is None or not job.starts:
                continue
            a = job.starts[i]
            targets = s.prompt_ids[a + 1: a + len(c.tokens) + 1]
            if not targets:
                continue
            logp = torch.log_softmax(logits[begin: begin + len(targets)].float(), dim=-1)
            tgt = torch.tensor(targets, dtype=torch.long, device=logp.device)
            own = logp.gather(1, tgt[:, None])[:, 0].tolist()
            k = s.prompt_logprobs
            top_v, top_i = (logp.topk(k, dim=-1) if k else (None, None))
            lps = [TokenLogprob(t, own[r], tuple(zip(top_i[r].tolist(), top_v[r].tolist()))
                                if k else ()) for r, t in enumerate(targets)]
            out[i] = (a + 1, lps)
        return out

    def _sample_rows(self, chunks: list[SeqChunk], samples: list[int]) -> list[int]:
        """Each sampling chunk's row of the step's logits: the engine's `last_rows` (its last
        token's row; one row per request for logits=last, per kept row on bounded replay)."""
        last = self.engine.last_rows.tolist()
        return [int(last[i]) for i in samples]

    def _sample(self, x: torch.Tensor, seqs: list[Sequence], job: StepJob):
        if not seqs:
            return [], []
        raw = x
        biased = [i for i, s in enumerate(seqs) if s.logit_bias]
        if biased or job.mask_rows:
            x = x.clone()
        for i in biased:
            ids = torch.tensor(list(seqs[i].logit_bias), dtype=torch.long)
            x[i, ids] += torch.tensor(list(seqs[i].logit_bias.values()), dtype=x.dtype)
        if job.mask_rows:
            self.grammar.apply_bitmask(x, job.bitmask, indices=job.mask_rows)
        tokens = sample(x, [s.sampler for s in seqs], self.rng)
        lps: list[TokenLogprob | None] = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if want:
            logp = torch.log_softmax(raw[want], dim=-1)
            k = max(seqs[i].logprobs for i in want)
            top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
            for r, i in enumerate(want):
                t = tokens[i]
                n = seqs[i].logprobs
                top = tuple(zip(top_i[r, :n].tolist(), top_v[r, :n].tolist())) if n else ()
                lps[i] = TokenLogprob(t, float(logp[r, t]), top)
        return tokens, lps
