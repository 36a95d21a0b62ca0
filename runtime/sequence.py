"""One sequence (a prompt + one completion) as the scheduler sees it, and what it reports back.

A request with `n` choices is `n` sequences (each with its own state slot, sampler, grammar
state and detokenizer). The scheduler thread owns every mutable field; consumers only receive
`SeqEvent`s through the sequence's `sink` (called on the scheduler thread: a server forwards them
to its event loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .sampling import SampleState, SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the `top` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SeqEvent:
    """Tokens produced by one step for one sequence (one token, or none with an error/finish)."""

    seq_id: int
    token_ids: list[int]
    text: str  # text released by these tokens (stop strings held back and cut)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # engine error message (finish_reason "error")
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (OpenAI's field)
    #: with the first token, when asked for: one per prompt token (None for the first, which no
    #: position predicts), each the prompt token's log-probability and the top alternatives
    prompt_logprobs: list[TokenLogprob | None] | None = None


WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    """A completion being generated. `sink(event)` receives its events (scheduler thread)."""

    seq_id: int
    prompt_ids: list[int]
    sampler: SampleState
    sink: Callable[[SeqEvent], None]
    grammar: Any = None  # GrammarState / ThinkingGrammarState, or None
    detok: Any = None  # IncrementalDetokenizer (None: no text)
    logprobs: int | None = None  # None: no logprobs; k: the sampled token + top k
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob + top k
    prompt_lps: list | None = None  # per prompt position, filled as its chunks run
    logit_bias: dict[int, float] | None = None
    eos_id: int | None = None
    arrival: float = field(default_factory=time.monotonic)
    status: str = WAITING
    slot: int = -1
    scheduled: int = 0  # tokens in state once the in-flight steps finish
    pending: int = 0  # sampled tokens in flight (ids not known yet)
    inflight: int = 0  # in-flight steps that include this sequence
    finish_reason: str | None = None
    preempt: bool = False  # leave the slot once no step is in flight, then recompute
    text: str = ""  # detokenized output so far (cut at a stop string)
    emitted: int = 0  # characters of `text` already sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    request_id: str = ""  # the client-facing id (logs name it when a step fails)
    epoch: int = 0  # bumped when in-flight work is voided (a failed step): stale results dropped
    faults: int = 0  # failed steps since the last good isolated step (1: run alone, 2: fail it)
    # prefix cache (runtime/prefix_cache.py; the scheduler's)
    cached_tokens: int = 0  # prompt tokens resumed from the cache at the first admission
    anchor: Any = None  # the cached node this sequence's state extends (locked while held)
    snap_from: int = 0  # position from which the slot's rows are not in the cache yet
    cuts: tuple[int, ...] = ()  # end prompt chunks here (branch points: snapshots for others)
    leader: "Sequence | None" = None  # n > 1: a choice waits until the first one cached the prompt
    has_followers: bool = False  # n > 1: the first choice (snapshots its prompt less one token)
    prompt_done: bool = False  # the prompt's snapshot reached the cache (or never will)
    cacheable: bool = True  # False once a failed step voided the slot's state
    releasing: bool = False  # its released slot's snapshot is not in the cache yet
    approx: bool = False  # its state descends from an encoder replay (its snapshots say so)
    bypassed: int = 0  # admissions of later arrivals while it waited (cache-aware admission)

    @property
    def params(self) -> SamplingParams:
        return self.sampler.params

    @property
    def output_ids(self) -> list[int]:
        return self.sampler.output_ids

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def can_sample_more(self) -> bool:
        """Another sample may be scheduled: not finished and under max_tokens with the in-flight
        samples counted."""
        return not self.finished and len(self.output_ids) + self.pending < self.params.max_tokens
