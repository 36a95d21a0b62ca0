"""Acceptance rules: greedy by hand; the sampled rule's emitted tokens have the target's
distribution (chi-square over many seeded requests), and a wrong rule is caught."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from megagraph.runtime.sampling import SamplingParams, new_state
from megagraph.runtime.speculative.accept import (accept, accept_greedy, accept_sampled,
                                                  one_hot_proposal)

V, K = 6, 3


def test_greedy_by_hand():
    target = torch.tensor([[4, 2, 9, 7], [4, 2, 9, 7], [4, 2, 9, 7], [5, 1, 1, 1]])
    drafts = torch.tensor([[4, 2, 9], [4, 3, 9], [1, 2, 9], [5, 1, 1]])
    lengths = torch.tensor([3, 3, 3, 2])
    a = accept_greedy(target, drafts, lengths)
    assert a.accepted.tolist() == [3, 1, 0, 2]
    assert [a.emitted(r) for r in range(4)] == [[4, 2, 9, 7], [4, 2], [4], [5, 1, 1]]
    assert a.tokens[1].tolist() == [4, 2, -1, -1]


def test_greedy_through_accept_uses_processed_argmax():
    """A repetition penalty changes the argmax of row j only through the drafts before it."""
    logits = torch.tensor([[[0.0, 3.0, 2.9, 0.0], [0.0, 3.0, 2.9, 0.0], [0.0, 3.0, 2.9, 0.0]]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    st = new_state(params, [0], 0, torch.device("cpu"))
    a = accept(logits, torch.tensor([[1, 2]]), torch.tensor([2]), [st], torch.Generator())
    # row 0: token 1 best; row 1 sees [1]: 3.0/2 < 2.9 -> 2; row 2 sees [1, 2]: 1 again
    assert a.emitted(0) == [1, 2, 1]


def _reference_probs(logits: torch.Tensor, temp: float, top_k: int, top_p: float) -> torch.Tensor:
    """The plain sampler's distribution for one row, written out directly."""
    p = torch.softmax(logits.double() / temp, dim=-1)
    order = p.argsort(descending=True).tolist()
    keep = order[:top_k or len(order)]
    mass, kept = 0.0, []
    sub = p[keep] / p[keep].sum()
    for i, t in enumerate(keep):
        if mass >= top_p:
            break
        kept.append(t)
        mass += float(sub[i])
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def _joint_counts(a, logits_table, drafts, params, gen):
    """(first, second) token counts: the second from the block, or (first rejected) from a plain
    step after the first, as the decode loop would draw it."""
    t1 = a.tokens[:, 0]
    t2 = a.tokens[:, 1].clone()
    need = a.accepted == 0
    if bool(need.any()):
        probs = torch.stack([_reference_probs(r, params.temperature, params.top_k, params.top_p)
                             for r in logits_table[t1[need]]])
        t2[need] = torch.multinomial(probs.float(), 1, generator=gen)[:, 0]
    return torch.bincount(t1 * V + t2, minlength=V * V).double()


CASES = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
         SamplingParams(temperature=1.3, top_p=0.8)]


def _setup(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    row0 = torch.randn(V, generator=g) * 1.5
    table = torch.randn(V, V, generator=g) * 1.5  # target logits after token x: table[x]
    draw = torch.softmax(torch.randn(V, generator=g) * 2, dim=0)  # drafts skewed away from p
    drafts = torch.multinomial(draw.expand(n, V), K, replacement=True, generator=g)
    logits = torch.empty(n, K + 1, V)
    logits[:, 0] = row0
    logits[:, 1:] = table[drafts]
    return row0, table, drafts, logits


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_sampled_acceptance_keeps_the_target_distribution(params):
    n = 40000
    row0, table, drafts, logits = _setup(1, n)
    states = [new_state(params, [0], 0, torch.device("cpu")) for _ in range(n)]
    gen = torch.Generator().manual_seed(2)
    a = accept(logits, drafts, torch.full((n,), K), states, gen)
    got = _joint_counts(a, table, drafts, params, gen)
    p0 = _reference_probs(row0, params.temperature, params.top_k, params.top_p)
    p1 = torch.stack([_reference_probs(table[x], params.temperature, params.top_k, params.top_p)
                      for x in range(V)])
    want = (p0[:, None] * p1).reshape(-1) * n
    live = want > 0
    assert got[~live].sum() == 0, "a token outside the target's support was emitted"
    assert chisquare(got[live], want[live]).pvalue > 1e-3
    assert 0 < float(a.accepted.float().mean()) < K  # both branches were exercised


def test_a_wrong_rule_fails_the_same_test():
    """Declaring a uniform proposal for argmax drafts (wrong q) changes the distribution, and the
    chi-square test sees it."""
    n = 40000
    params = CASES[0]
    row0, table, drafts, logits = _setup(1, n)
    p = torch.softmax(logits / params.temperature, dim=-1)
    gen = torch.Generator().manual_seed(2)
    u = torch.rand(n, K, generator=gen)
    e = torch.empty(n, V).exponential_(generator=gen)
    wrong = accept_sampled(p, torch.full((n, K, V), 1.0 / V), drafts, torch.full((n,), K), (u, e))
    right = accept_sampled(p, one_hot_proposal(drafts, V), drafts, torch.full((n,), K), (u, e))
    p0 = torch.softmax(row0.double() / params.temperature, dim=0)
    p1 = torch.softmax(table.double() / params.temperature, dim=1)
    want = (p0[:, None] * p1).reshape(-1) * n
    for a, ok in ((right, True), (wrong, False)):
        got = _joint_counts(a, table, drafts, params, torch.Generator().manual_seed(3))
        assert (chisquare(got, want).pvalue > 1e-3) == ok


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"need \[R, K \+ 1, V\]"):
        accept(torch.zeros(2, 3, V), torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 3]),
               [], torch.Generator())
    with pytest.raises(ValueError, match="lengths"):
        accept(torch.zeros(1, 3, V), torch.zeros(1, 2, dtype=torch.long), torch.tensor([5]),
               [], torch.Generator())
