"""Offline generation over `Engine.step`: a FIFO continuous-batching loop with streaming.

Each completion is one sequence with its own state slot (n > 1 prefills the prompt n times).
A step packs, in arrival order, decode tokens and prompt chunks up to `max_step_tokens`; new
sequences are admitted whenever a slot is free. Stop strings are held back until they can no
longer begin in the text already produced, so streamed text never shows one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from .batch import SeqChunk
from .sampling import SampleState, SamplingParams, new_state, sample
from .tokenizer import Detokenizer

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    index: int  # 0..n-1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (stop token/string, EOS) or "length"


@dataclass
class Output:
    """A prompt and its completions."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[Completion]

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token."""

    request_id: int
    index: int  # completion index
    token_id: int
    text: str  # text released by this token (may be "")
    finish_reason: str | None  # set on the completion's last event


@dataclass
class _Seq:
    request_id: int
    prompt_ids: list[int]
    sampler: SampleState
    out: Completion
    detok: Detokenizer
    slot: int = -1
    fed: int = 0  # tokens already in state (prompt, then outputs)
    emitted: int = 0  # characters of detok.text released

    @property
    def params(self) -> SamplingParams:
        return self.sampler.params

    def next_chunk(self, budget: int) -> tuple[int, ...]:
        if self.fed < len(self.prompt_ids):
            return tuple(self.prompt_ids[self.fed:self.fed + budget])
        return (self.out.token_ids[-1],)


class Generator:
    """Runs requests to completion on one engine."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.rng = torch.Generator(engine.device).manual_seed(engine.config.seed)
        self.next_id = 0

    def generate(self, prompts, params=None) -> list[Output]:
        outputs: dict[int, Output] = {}
        for ev in self._run(prompts, params, outputs):
            pass
        return [outputs[k] for k in sorted(outputs)]

    def stream(self, prompts, params=None) -> Iterator[TokenEvent]:
        return self._run(prompts, params, {})

    # -- the loop --------------------------------------------------------------------------------
    def _run(self, prompts, params, outputs: dict[int, Output]) -> Iterator[TokenEvent]:
        waiting = deque(self._sequences(prompts, params, outputs))
        running: list[_Seq] = []
        try:
            yield from self._loop(waiting, running)
        finally:  # a consumer that stops early must not leak slots
            for s in running:
                self.engine.release(s.slot)

    def _loop(self, waiting: deque, running: list[_Seq]) -> Iterator[TokenEvent]:
        eng = self.engine
        while waiting or running:
            while waiting and eng.slots.can_allocate():
                s = waiting.popleft()
                s.slot = eng.slots.allocate()
                running.append(s)
            chunks, fed = [], []
            budget = eng.config.max_step_tokens
            for s in running:
                if budget <= 0:
                    break
                toks = s.next_chunk(budget)
                chunks.append(SeqChunk(s.slot, toks))
                fed.append(s)
                budget -= len(toks)
            logits = eng.step(chunks)
            rows = dict(zip((id(s) for s in fed), eng.last_rows.tolist()))
            ready = []
            for s, ch in zip(fed, chunks):
                s.fed += len(ch.tokens)
                if s.fed >= len(s.prompt_ids):
                    ready.append(s)
            if not ready:
                continue
            picked = logits[[rows[id(s)] for s in ready]]
            tokens = sample(picked, [s.sampler for s in ready], self.rng)
            for s, tok in zip(ready, tokens):
                yield self._accept(s, tok)
                if s.out.finish_reason is not None:
                    eng.release(s.slot)
                    running.remove(s)

    def _sequences(self, prompts, params, outputs: dict[int, Output]) -> list[_Seq]:
        eng = self.engine
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = []
        for prompt, p in zip(prompts, plist):
            ids = self._encode(prompt)
            if len(ids) >= eng.config.capacity:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit a sequence of capacity "
                                 f"{eng.config.capacity} (EngineConfig.capacity / --capacity)")
            rid = self.next_id
            self.next_id += 1
            out = Output(rid, prompt if isinstance(prompt, str) else None, ids, [])
            outputs[rid] = out
            for i in range(p.n):
                c = Completion(i)
                out.completions.append(c)
                seqs.append(_Seq(rid, ids, new_state(p, ids, i, eng.device), c,
                                 Detokenizer(eng.tokenizer)))
        return seqs

    def _encode(self, prompt) -> list[int]:
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            if not ids or not all(0 <= t < self.engine.cfg.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be non-empty and in 0..{self.engine.cfg.vocab_size - 1}")
            return ids
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(f"{self.engine.cfg.name} has no tokenizer: pass prompts as token ids")
        return tok.encode(prompt)

    def _accept(self, s: _Seq, tok: int) -> TokenEvent:
        p, out = s.params, s.out
        out.token_ids.append(tok)
        s.sampler.output_ids.append(tok)
        s.detok.push(out.token_ids)
        text = s.detok.text
        if tok in p.stop_token_ids or (tok == self.engine.cfg.eos_token_id and not p.ignore_eos):
            out.finish_reason = "stop"
        hit = min((i for i in (text.find(st) for st in p.stop) if i >= 0), default=-1)
        if hit >= 0:
            text, out.finish_reason = text[:hit], "stop"
        if out.finish_reason is None and (len(out.token_ids) >= p.max_tokens
                                          or len(s.prompt_ids) + len(out.token_ids) >= self.engine.config.capacity):
            out.finish_reason = "length"
        hold = 0 if out.finish_reason else max((len(st) - 1 for st in p.stop), default=0)
        upto = max(s.emitted, len(text) - hold)
        delta, s.emitted = text[s.emitted:upto], upto
        out.text = text[:upto] if out.finish_reason is None else text
        return TokenEvent(s.request_id, out.index, tok, delta, out.finish_reason)
