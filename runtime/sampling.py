"""Sampling parameters and a batched sampler (greedy, temperature, top-k/p, min-p, penalties).

Every transform is vectorized over the batch; only the random draw is per request when the
request has its own seed, so a seeded request samples the same tokens whatever else is in the
batch. Sampling is an exponential race: argmax(p / q) with q ~ Exp(1) picks token i with
probability p_i, and needs no sort or cumulative sum of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """A bad SamplingParams field; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (field meanings as in the OpenAI / vLLM APIs)."""

    n: int = 1  # completions per prompt
    max_tokens: int = 16  # new tokens per completion
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set with this much probability
    min_p: float = 0.0  # drop tokens below min_p * the top probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    presence_penalty: float = 0.0  # minus this if the token occurs in the output
    seed: int | None = None  # per-request seed (completion i uses seed + i)
    stop: tuple[str, ...] = ()  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # stop tokens (included in token_ids)
    ignore_eos: bool = False  # keep going past the model's EOS token

    def __post_init__(self):
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise SamplingError(f"SamplingParams.{name} {msg}, got {getattr(self, name)!r}")

        need(isinstance(self.n, int) and self.n >= 1, "n", "must be an int >= 1")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
        need(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an int >= 0 (0 = off)")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1 = off)")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an int or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SampleState:
    """What the sampler keeps per sequence: its seen tokens and, if seeded, its generator."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def new_state(params: SamplingParams, prompt_ids: list[int], index: int,
              device: torch.device) -> SampleState:
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device).manual_seed(params.seed + index)
    return SampleState(params, list(prompt_ids), [], gen)


def sample(logits: torch.Tensor, states: list[SampleState], generator: torch.Generator) -> list[int]:
    """One token per row of `logits` [B, V]; `generator` draws for rows without their own seed."""
    x = logits.float().clone()
    B, V = x.shape
    dev = x.device
    x = _penalize(x, states)
    ps = [s.params for s in states]
    temp = torch.tensor([p.temperature for p in ps], device=dev)
    greedy_rows = temp == 0
    x = x / torch.where(greedy_rows, torch.ones_like(temp), temp)[:, None]
    x = _truncate(x, ps)
    probs = torch.softmax(x, dim=-1)
    q = torch.empty(B, V, device=dev).exponential_(generator=generator)
    for i, s in enumerate(states):
        if s.generator is not None:
            q[i] = torch.empty(V, device=dev).exponential_(generator=s.generator)
    drawn = (probs / q).argmax(dim=-1)
    best = x.argmax(dim=-1)
    return torch.where(greedy_rows, best, drawn).tolist()


def _penalize(x: torch.Tensor, states: list[SampleState]) -> torch.Tensor:
    ps = [s.params for s in states]
    if all(p.repetition_penalty == 1 and not p.frequency_penalty and not p.presence_penalty for p in ps):
        return x
    B, V = x.shape
    dev = x.device
    counts = torch.zeros(B, V, device=dev)
    seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
    for i, s in enumerate(states):
        if s.output_ids:
            ids = torch.tensor(s.output_ids, device=dev)
            counts[i].index_add_(0, ids, torch.ones(len(ids), device=dev))
        if s.prompt_ids:
            seen[i, torch.tensor(s.prompt_ids, device=dev)] = True
    seen |= counts > 0
    rep = torch.tensor([p.repetition_penalty for p in ps], device=dev)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in ps], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in ps], device=dev)[:, None]
    return x - freq * counts - pres * (counts > 0).float()


def _truncate(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside top-k, top-p and min-p (each row keeps at least its best token)."""
    if all(p.top_k == 0 and p.top_p == 1 and p.min_p == 0 for p in ps):
        return x
    B, V = x.shape
    dev = x.device
    srt, idx = x.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None, :]
    k = torch.tensor([p.top_k or V for p in ps], device=dev)[:, None]
    drop = rank >= k
    probs = torch.softmax(srt.masked_fill(drop, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in ps], device=dev)[:, None]
    drop |= (probs.cumsum(-1) - probs) >= top_p
    min_p = torch.tensor([p.min_p for p in ps], device=dev)[:, None]
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    return x.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
