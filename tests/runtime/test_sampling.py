"""Sampling: parameter validation, greedy, distributions, seeds, truncation, penalties."""

from __future__ import annotations

import pytest
import torch

from megagraph.runtime.sampling import SamplingError, SamplingParams, new_state, sample

CPU = torch.device("cpu")


def _states(params, n, prompt=(1, 2, 3)):
    return [new_state(params, list(prompt), i, CPU) for i in range(n)]


def _draws(logits, params, n=4000, seed=0):
    """n draws from one row's distribution, batched as n identical rows."""
    rows = logits.expand(n, -1)
    return torch.tensor(sample(rows, _states(params, n), torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("field,value", [("n", 0), ("max_tokens", 0), ("temperature", -1.0),
                                         ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
                                         ("min_p", 2.0), ("repetition_penalty", 0.0),
                                         ("frequency_penalty", 3.0), ("presence_penalty", -3.0),
                                         ("stop", ("",)), ("stop_token_ids", (-1,))])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_stop_string_becomes_tuple():
    assert SamplingParams(stop="END").stop == ("END",)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    got = sample(logits, _states(SamplingParams(temperature=0), 5), torch.Generator())
    assert got == logits.argmax(-1).tolist()


def test_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    freq = torch.bincount(_draws(logits, SamplingParams(temperature=1.0)), minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)
    hot = torch.bincount(_draws(logits, SamplingParams(temperature=2.0)), minlength=4).float() / 4000
    torch.testing.assert_close(hot, torch.softmax(logits[0] / 2, -1), atol=0.03, rtol=0)


def test_top_k_top_p_min_p_truncate():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert set(_draws(logits, SamplingParams(top_k=2)).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.7)).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(_draws(logits, SamplingParams(min_p=0.4)).tolist()) == {0, 1}  # 0.15 < 0.4 * 0.5
    assert set(_draws(logits, SamplingParams(top_p=0.01)).tolist()) == {0}


def test_seeded_rows_do_not_depend_on_the_batch():
    p = SamplingParams(seed=7)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    alone = sample(logits[1:2], [new_state(p, [], 0, CPU)], torch.Generator().manual_seed(5))
    others = [new_state(SamplingParams(), [], 0, CPU), new_state(p, [], 0, CPU),
              new_state(SamplingParams(), [], 0, CPU)]
    batched = sample(logits, others, torch.Generator().manual_seed(99))
    assert batched[1] == alone[0]
    again = sample(logits[1:2], [new_state(p, [], 0, CPU)], torch.Generator().manual_seed(123))
    assert again == alone


def test_penalties():
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0]])
    s = new_state(SamplingParams(temperature=0, repetition_penalty=2.0), [0], 0, CPU)
    assert sample(logits, [s], torch.Generator()) == [1]  # token 0 (in the prompt) halved
    s = new_state(SamplingParams(temperature=0, frequency_penalty=1.0), [], 0, CPU)
    s.output_ids += [0, 0]
    assert sample(logits, [s], torch.Generator()) == [1]  # 3.0 - 2 * 1.0 < 2.9
    s = new_state(SamplingParams(temperature=0, presence_penalty=0.5), [], 0, CPU)
    s.output_ids += [0, 1, 1]
    assert sample(logits, [s], torch.Generator()) == [0]  # both lose 0.5: order kept
    s = new_state(SamplingParams(temperature=0, repetition_penalty=2.0), [3], 0, CPU)
    assert sample(torch.tensor([[-1.0, -2.0, -3.0, -1.5]]), [s], torch.Generator()) == [0]  # neg x2
