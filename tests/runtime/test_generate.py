"""Engine.generate / stream: greedy equals a reference greedy loop; stops, n > 1, seeds, streaming."""

from __future__ import annotations

import pytest
import torch

from megagraph.runtime.sampling import SamplingParams
from tests.runtime.conftest import make_engine
from tests.tiny import SeqChunk, random_tokens, session, tiny

MODEL = "v4.1-flash-tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(compiled):
    return make_engine(compiled(MODEL), MODEL, max_step_tokens=16)


def _reference_greedy(prompt, n):
    cfg, g, w, c = tiny(MODEL, act_dtype="f32")
    ref = session(cfg, g, w, c, slots=2, capacity=128)
    out, feed = [], tuple(prompt)
    for _ in range(n):
        out.append(int(ref.step([SeqChunk(0, feed)])[-1].argmax()))
        feed = (out[-1],)
    return out


def test_greedy_matches_reference_with_chunked_prefill_and_batching(engine):
    prompts = [list(random_tokens(21, 5)), list(random_tokens(4, 6)), list(random_tokens(9, 7))]
    outs = engine.generate(prompts, GREEDY)  # 16-token steps: the first prompt prefills in chunks
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.token_ids == _reference_greedy(p, 6)
        assert o.completions[0].finish_reason == "length"
    assert engine.slots.num_free == engine.config.max_slots  # every slot released


def test_stop_token_and_stop_string(engine):
    prompt = "Hello world"
    base = engine.generate(prompt, GREEDY)[0]
    ids = base.token_ids
    cut = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 stop_token_ids=(ids[2],)))[0]
    first = ids.index(ids[2])
    assert cut.token_ids == ids[:first + 1] and cut.completions[0].finish_reason == "stop"
    text = base.text
    assert len(text) > 3, text  # the bundled V4 tokenizer decodes the tiny model's ids
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 stop=(stop,)))[0]
    assert out.text == text[:text.index(stop)]
    assert out.completions[0].finish_reason == "stop"


def test_n_completions_with_seed_are_reproducible(engine):
    p = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    a = engine.generate([[5, 6, 7, 8]], p)[0]
    b = engine.generate([[5, 6, 7, 8]], p)[0]
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    assert len({tuple(c.token_ids) for c in a.completions}) > 1  # different per-completion seeds


def test_stream_events_add_up_to_outputs(engine):
    events = list(engine.stream(["Hello world", "One engine step"], GREEDY))
    outs = engine.generate(["Hello world", "One engine step"], GREEDY)
    for o in outs:
        mine = [e for e in events if e.request_id - events[0].request_id == o.request_id - outs[0].request_id]
        assert [e.token_id for e in mine] == o.token_ids
        assert "".join(e.text for e in mine) == o.text
        assert mine[-1].finish_reason == "length" and all(e.finish_reason is None for e in mine[:-1])


def test_prompt_errors(engine):
    with pytest.raises(ValueError, match="capacity"):
        engine.generate([list(range(3, 200))], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[10**9]], GREEDY)


def test_step_api_rejects_bad_slots(engine):
    with pytest.raises(ValueError, match="not a request slot"):
        engine.step([SeqChunk(engine.slots.scratch_slot, (1,))])
    assert torch.is_tensor(engine.step([SeqChunk(0, (3, 4))]))
    engine.cached.pop(0, None)
