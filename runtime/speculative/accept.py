"""Acceptance of drafted tokens against the target's verify logits, vectorised over requests.

A verify step feeds each request [anchor, d_1 .. d_k]; its k + 1 logit rows give the target's
next-token distribution after each prefix. Two rules, both lossless (the emitted tokens have
exactly the distribution plain decoding would give):

* greedy: accept d_j while it equals the target's argmax after d_1 .. d_{j-1}; the target's
  argmax at the first mismatch (or after the last draft) is the bonus token;
* sampled (Leviathan et al. 2023, Chen et al. 2023): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token from the residual
  norm(max(0, p_j - q_j)); if every draft is accepted emit the bonus from p_k.

p is the target distribution after the processors the plain sampler applies (penalties,
temperature, top-k / top-p / min-p: runtime/sampling.py), computed for row j as if d_1 .. d_j
were already in the output, so penalties see the same history they would without drafting.
q is the draft's proposal distribution; DSpark's Markov chain proposes its argmax, so q is
one-hot (`one_hot_proposal`) and the acceptance probability is p_j(d_j).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..sampling import SampleState, _penalize, _truncate


@dataclass(frozen=True)
class Acceptance:
    """Per request: how many drafts were accepted and the tokens to emit (accepted drafts, then
    the correction or bonus token): `tokens[r, :accepted[r] + 1]`."""

    accepted: torch.Tensor  # i64[R], 0..k_r
    tokens: torch.Tensor  # i64[R, K + 1]; entries past accepted[r] + 1 are -1

    def emitted(self, r: int) -> list[int]:
        return self.tokens[r, : int(self.accepted[r]) + 1].tolist()


def _check(logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor) -> None:
    if drafts.dim() != 2 or logits.dim() != 3:
        raise ValueError(f"drafts must be [R, K] and logits [R, K + 1, V]; got "
                         f"{tuple(drafts.shape)} and {tuple(logits.shape)}")
    R, K = drafts.shape
    if logits.shape[:2] != (R, K + 1):
        raise ValueError(f"logits {tuple(logits.shape)} do not match drafts {tuple(drafts.shape)}: "
                         f"need [R, K + 1, V] = [{R}, {K + 1}, V] (one row per fed token)")
    if lengths.shape != (R,) or bool(((lengths < 0) | (lengths > K)).any()):
        raise ValueError(f"lengths must be i64[{R}] in 0..{K}, got {lengths.tolist()}")


def _valid(lengths: torch.Tensor, K: int) -> torch.Tensor:
    return torch.arange(K, device=lengths.device)[None, :] < lengths[:, None]


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """Number of leading True per row of a bool [R, K]."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def _pack(drafts: torch.Tensor, n: torch.Tensor, last: torch.Tensor) -> Acceptance:
    R, K = drafts.shape
    col = torch.arange(K + 1, device=drafts.device)[None, :]
    toks = torch.cat([drafts, torch.full((R, 1), -1, device=drafts.device)], dim=1)
    toks = torch.where(col == n[:, None], last[:, None], toks)
    toks = torch.where(col > n[:, None], torch.full_like(toks, -1), toks)
    return Acceptance(n, toks)


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor) -> Acceptance:
    """target i64[R, K + 1]: the target's greedy token after each prefix (argmax of the processed
    logits); drafts i64[R, K], of which the first lengths[r] are real."""
    R, K = drafts.shape
    n = _leading((drafts == target[:, :K]) & _valid(lengths, K))
    return _pack(drafts, n, target.gather(1, n[:, None])[:, 0])


def one_hot_proposal(drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """q of a deterministic (argmax) drafter: f32[R, K, V], 1 at each draft."""
    q = torch.zeros(*drafts.shape, vocab, device=drafts.device)
    return q.scatter_(2, drafts.clamp(min=0)[..., None], 1.0)


def exponential(shape, generators: list[torch.Generator | None], shared: torch.Generator,
                device) -> torch.Tensor:
    """Exp(1) noise [R, ...]; row r from its own generator when it has one (seeded requests
    draw the same values whatever else is batched), else from `shared`."""
    e = torch.empty(shape, device=device).exponential_(generator=shared)
    for r, g in enumerate(generators):
        if g is not None:
            e[r] = torch.empty(shape[1:], device=device).exponential_(generator=g)
    return e


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
                   noise: tuple[torch.Tensor, torch.Tensor]) -> Acceptance:
    """The rejection rule. p f32[R, K + 1, V] target probabilities, q f32[R, K, V] proposal
    probabilities, drafts i64[R, K] (first lengths[r] real), noise = (u f32[R, K] uniform in
    [0, 1), e f32[R, V] Exp(1)) for the accept tests and the one final draw (an exponential race
    over the residual or bonus distribution)."""
    R, K = drafts.shape
    u, e = noise
    idx = drafts.clamp(min=0)[..., None]
    pd = p[:, :K].gather(2, idx)[..., 0]
    qd = q.gather(2, idx)[..., 0]
    if bool(((qd <= 0) & _valid(lengths, K)).any()):
        raise ValueError("a draft token has proposal probability 0: q must give each draft > 0")
    ok = (u * qd < pd) & _valid(lengths, K)  # u < p/q without dividing by q
    n = _leading(ok)
    pn = p.gather(1, n[:, None, None].expand(R, 1, p.shape[2]))[:, 0]
    qn = torch.cat([q, q.new_zeros(R, 1, q.shape[2])], dim=1)
    qn = qn.gather(1, n[:, None, None].expand(R, 1, q.shape[2]))[:, 0]
    qn = torch.where((n < lengths)[:, None], qn, torch.zeros_like(qn))  # bonus: plain p_k
    res = (pn - qn).clamp(min=0)
    # p == q leaves an empty residual, but then every draft is accepted and it is never drawn
    res = torch.where(res.sum(1, keepdim=True) > 0, res, pn)
    return _pack(drafts, n, (res / e).argmax(dim=1))


@dataclass(frozen=True)
class TargetRows:
    """The processed target rows of a verify step, per request: probabilities (sampled) or the
    greedy token after each prefix."""

    probs: torch.Tensor  # f32[R, K + 1, V] (0 for greedy requests)
    greedy_tokens: torch.Tensor  # i64[R, K + 1]
    greedy: torch.Tensor  # bool[R]


def process_rows(logits: torch.Tensor, drafts: torch.Tensor,
                 states: list[SampleState]) -> TargetRows:
    """Apply the plain sampler's processors to every verify row; row j of request r sees
    output_ids + drafts[r, :j] (what the history would be had the drafts been sampled)."""
    R, K1, V = logits.shape
    x = logits.float().reshape(R * K1, V)
    rows = [s for s in states for _ in range(K1)]
    if any(s.params.repetition_penalty != 1 or s.params.frequency_penalty
           or s.params.presence_penalty for s in states):
        d = drafts.tolist()
        rows = [replace(s, output_ids=[*s.output_ids, *d[r][:j]])
                for r, s in enumerate(states) for j in range(K1)]
    x = _penalize(x, rows)
    temp = torch.tensor([s.params.temperature for s in rows], device=x.device)
    greedy_rows = temp == 0
    x = x / torch.where(greedy_rows, torch.ones_like(temp), temp)[:, None]
    best = x.argmax(dim=-1)
    x = _truncate(x, [s.params for s in rows])
    probs = torch.where(greedy_rows[:, None], torch.zeros_like(x), torch.softmax(x, dim=-1))
    return TargetRows(probs.reshape(R, K1, V), best.reshape(R, K1),
                      greedy_rows.reshape(R, K1)[:, 0])


def accept(logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
           states: list[SampleState], shared: torch.Generator,
           proposal: torch.Tensor | None = None) -> Acceptance:
    """Accept a verify step's drafts for a batch mixing greedy and sampled requests.

    logits f32[R, K + 1, V] (row j: after anchor, d_1 .. d_j); drafts i64[R, K]; lengths i64[R]
    (drafts actually fed per request); states: each request's SampleState; proposal: q
    f32[R, K, V] (None: the one-hot proposal of an argmax drafter)."""
    _check(logits, drafts, lengths)
    if len(states) != drafts.shape[0]:
        raise ValueError(f"{len(states)} sampler states for {drafts.shape[0]} requests")
    R, K = drafts.shape
    t = process_rows(logits, drafts, states)
    g = accept_greedy(t.greedy_tokens, drafts, lengths)
    if bool(t.greedy.all()):
        return g
    q = proposal if proposal is not None else one_hot_proposal(drafts, logits.shape[2])
    gens = [s.generator for s in states]
    u = 1 - exponential((R, K), gens, shared, logits.device).neg().exp()  # Exp -> U[0, 1)
    e = exponential((R, logits.shape[2]), gens, shared, logits.device)
    s = accept_sampled(t.probs, q.float(), drafts, lengths, (u, e))
    pick = t.greedy[:, None]
    return Acceptance(torch.where(t.greedy, g.accepted, s.accepted),
                      torch.where(pick, g.tokens, s.tokens))
