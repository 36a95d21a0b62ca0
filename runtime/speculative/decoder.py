"""The speculative decode loop in the offline engine: draft a block -> verify it in one target
step -> accept -> roll back the rejected rows -> commit.

`SpeculativeGenerator(engine)` has the API of runtime/generate.py's `Generator` (`generate`,
`stream`; the same stop-token / stop-string / `max_tokens` / capacity handling per emitted
token, so a stop inside an accepted block ends the request there and the rest of the block is
dropped). Per step, requests still in their prompt feed a prompt chunk and requests decoding
feed [anchor, d_1 .. d_k] (k = the block, less near `max_tokens` or the capacity): one verify
step (the step graph, passes/dspark_draft.py) runs both. The anchor is the last emitted token,
not yet in state; the bonus token becomes the next anchor.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from ..batch import SeqChunk
from ..generate import Generator, TokenEvent, _Seq
from ..sampling import sample
from .accept import accept
from .programs import SpecPrograms
from .rollback import Rollback


@dataclass(frozen=True)
class DraftRequest:
    """What a proposer sees of one decoding request."""

    slot: int
    anchor: int  # last emitted token (position = tokens in state)
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # emitted so far, the anchor last


@dataclass(frozen=True)
class Proposal:
    """A proposer's answer: drafts i64[R, block] and, if it has them, confidences f32[R, block]
    (estimated probability that each draft is accepted given the ones before it)."""

    drafts: torch.Tensor
    confidence: torch.Tensor | None = None


#: (requests, block) -> Proposal. The default runs the plan's DSpark draft graph.
Proposer = Callable[[Sequence[DraftRequest], int], Proposal]


@dataclass
class SpecStats:
    """Counters of a speculative run (the server exports these later): drafts proposed and
    accepted, target forwards that verified at least one draft block, tokens those emitted, and
    the histogram of accepted drafts per request-step (index = accepted count)."""

    proposed: int = 0
    accepted: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    emitted: int = 0
    histogram: Counter = field(default_factory=Counter)

    @property
    def tokens_per_target_forward(self) -> float:
        """Over the whole batch (with nothing accepted it is the number of decoding requests);
        `acceptance_length` is the per-request figure."""
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per request-step (accepted drafts + the bonus)."""
        n = sum(self.histogram.values())
        return sum((k + 1) * c for k, c in self.histogram.items()) / n if n else 0.0

    def to_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "target_forwards": self.target_forwards, "draft_forwards": self.draft_forwards,
                "emitted": self.emitted, "histogram": dict(sorted(self.histogram.items())),
                "tokens_per_target_forward": self.tokens_per_target_forward,
                "acceptance_length": self.acceptance_length}


class SpeculativeGenerator(Generator):
    """Generator whose decode steps draft a block and verify it in one target step."""

    def __init__(self, engine, *, block: int | None = None, min_confidence: float = 0.0,
                 draft_weights: Mapping[str, torch.Tensor] | None = None,
                 proposer: Proposer | None = None):
        """`block`: drafts verified per step (default and maximum: the plan's block size);
        `min_confidence`: verify d_j only while the running product of the confidences of
        d_1 .. d_j is at least this (vLLM's adaptive verification; 0 = always the block);
        `proposer`: replaces the DSpark draft graph (tests)."""
        super().__init__(engine)
        if not 0 <= min_confidence <= 1:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.min_confidence = min_confidence
        self.programs = SpecPrograms(engine, draft_weights)
        B = self.programs.block
        if block is not None and not 0 <= block <= B:
            raise ValueError(f"block {block}: the plan's draft graph proposes at most {B} tokens "
                             f"(speculative.block_size); use 0..{B}")
        self.block = B if block is None else block
        self.rollback = Rollback(self.programs.verify_graph, engine.state,
                                 engine.cfg.sliding_window)
        self.proposer = proposer or self._dspark
        self.stats = SpecStats()

    def _dspark(self, reqs: Sequence[DraftRequest], block: int) -> Proposal:
        self.stats.draft_forwards += 1
        out = self.programs.run_draft([r.slot for r in reqs], [r.anchor for r in reqs])
        return Proposal(out.drafts[:, :block], out.confidence[:, :block])

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self, waiting: deque, running: list[_Seq]) -> Iterator[TokenEvent]:
        eng = self.engine
        while waiting or running:
            while waiting and eng.slots.can_allocate():
                s = waiting.popleft()
                s.slot = eng.slots.allocate()
                running.append(s)
            decoding = [s for s in running if s.fed >= len(s.prompt_ids)]
            drafts, ks = self._propose(decoding)
            chunks = [SeqChunk(s.slot, (s.out.token_ids[-1], *drafts[i][:ks[i]]))
                      for i, s in enumerate(decoding)]
            saved = [self.rollback.save(s.slot, eng.cached.get(s.slot, 0), k + 1)
                     for s, k in zip(decoding, ks)]
            budget = eng.config.max_step_tokens - sum(len(c.tokens) for c in chunks)
            prefilling = []
            for s in running:
                if s.fed < len(s.prompt_ids) and (budget > 0 or not chunks):
                    toks = s.next_chunk(max(budget, 1))
                    chunks.append(SeqChunk(s.slot, toks))
                    prefilling.append(s)
                    budget -= len(toks)
            outs = self.programs.run_verify(chunks)
            logits = outs["logits"]
            starts = torch.cumsum(torch.tensor([0] + [len(c.tokens) for c in chunks]), 0).tolist()
            done = list(self._commit(decoding, drafts, ks, saved, logits, outs, starts))
            first = []
            for s, i in zip(prefilling, range(len(decoding), len(chunks))):
                s.fed += len(chunks[i].tokens)
                if s.fed >= len(s.prompt_ids):
                    first.append((s, starts[i + 1] - 1))
            if first:
                toks = sample(logits[[r for _, r in first]], [s.sampler for s, _ in first],
                              self.rng)
                for (s, _), tok in zip(first, toks):
                    done.append((s, [tok]))
            for s, toks in done:
                for tok in toks:
                    yield self._accept(s, tok)
                    if s.out.finish_reason is not None:
                        break
                if s.out.finish_reason is not None:
                    eng.release(s.slot)
                    running.remove(s)

    def _propose(self, decoding: list[_Seq]) -> tuple[list[list[int]], list[int]]:
        """Drafts per decoding request and how many of them to verify."""
        eng = self.engine
        ks = []
        for s in decoding:
            left = s.params.max_tokens - len(s.out.token_ids)  # tokens this request may still emit
            room = eng.config.capacity - eng.cached.get(s.slot, 0) - 1
            ks.append(max(0, min(self.block, left - 1, room)))
        if not decoding or max(ks) == 0:
            return [[] for _ in decoding], ks
        reqs = [DraftRequest(s.slot, s.out.token_ids[-1], tuple(s.prompt_ids),
                             tuple(s.out.token_ids)) for s in decoding]
        prop = self.proposer(reqs, self.block)
        if tuple(prop.drafts.shape) != (len(reqs), self.block):
            raise ValueError(f"proposer returned drafts {tuple(prop.drafts.shape)}, expected "
                             f"({len(reqs)}, {self.block})")
        if self.min_confidence > 0 and prop.confidence is not None:
            sure = (prop.confidence.float().cumprod(dim=1) >= self.min_confidence)
            budget = sure.long().cumprod(dim=1).sum(dim=1).tolist()
            ks = [min(k, b) for k, b in zip(ks, budget)]
        return prop.drafts.tolist(), ks

    def _commit(self, decoding, drafts, ks, saved, logits, outs, starts):
        """Accept each decoding request's drafts, roll back the rejected rows; yields (seq,
        tokens to emit)."""
        if not decoding:
            return
        eng, R, K = self.engine, len(decoding), max(ks)
        V = logits.shape[1]
        rows = torch.zeros(R, K + 1, V, device=logits.device)
        d = torch.zeros(R, K, dtype=torch.int64, device=logits.device)
        for i, k in enumerate(ks):
            rows[i, : k + 1] = logits[starts[i]: starts[i] + k + 1]
            if k:
                d[i, :k] = torch.tensor(drafts[i][:k], device=logits.device)
        lengths = torch.tensor(ks, device=logits.device)
        a = accept(rows, d, lengths, [s.sampler for s in decoding], self.rng)
        self.stats.target_forwards += 1
        for i, (s, sv) in enumerate(zip(decoding, saved)):
            n = int(a.accepted[i])
            self.rollback.restore(sv, n + 1, outs, starts[i])
            eng.cached[s.slot] = sv.cached + n + 1
            s.fed = eng.cached[s.slot]
            toks = a.emitted(i)
            self.stats.proposed += ks[i]
            self.stats.accepted += n
            self.stats.histogram[n] += 1
            self.stats.emitted += self._emittable(s, toks)
            yield s, toks

    def _emittable(self, s: _Seq, toks: list[int]) -> int:
        """Tokens of `toks` the request will emit before a stop token or its length ends it
        (stop strings are found later, by `_accept`; counted here as emitted)."""
        p, n = s.params, len(s.out.token_ids)
        for i, t in enumerate(toks):
            if (t in p.stop_token_ids or (t == self.engine.cfg.eos_token_id and not p.ignore_eos)
                    or n + i + 1 >= p.max_tokens):
                return i + 1
        return len(toks)
