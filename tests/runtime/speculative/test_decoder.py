"""The speculative loop on tiny V4.1 (fp32): greedy outputs equal plain decoding token for token
(stops inside a block included); a draft that proposes the target's own greedy continuation
gives block + 1 tokens per target forward; the counters add up."""

from __future__ import annotations

import pytest
import torch

from megagraph.runtime.sampling import SamplingParams
from megagraph.runtime.speculative.decoder import Proposal, SpeculativeGenerator

from tests.tiny import random_tokens


def _prompts(eng, lens=(7, 12, 5)):
    return [list(random_tokens(n, 100 + n, vocab=eng.cfg.vocab_size)) for n in lens]


@pytest.fixture(scope="module")
def reference(tiny_v41):
    """Plain greedy outputs (ignore_eos, 20 tokens) of the test prompts."""
    from tests.runtime.conftest import make_engine

    eng = make_engine(tiny_v41, "v4.1-flash-tiny")
    prompts = _prompts(eng)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


def test_greedy_equals_plain_decoding(engine, reference):
    prompts, want = reference
    eng = engine()
    gen = SpeculativeGenerator(eng)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),  # ends mid-block
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             stop_token_ids=(want[2][4],))]  # a stop token inside a block
    got = [o.token_ids for o in gen.generate(prompts, params)]
    assert got[0] == want[0]
    assert got[1] == want[1][:9]
    stop = want[2].index(want[2][4]) + 1
    assert got[2] == want[2][:stop]
    st = gen.stats
    assert st.draft_forwards >= 1 and st.target_forwards >= 1
    assert sum(st.histogram.values()) >= st.target_forwards
    assert st.accepted <= st.proposed
    assert eng.slots.num_free == eng.config.max_slots  # every slot released


def oracle(reference_outputs: dict[tuple[int, ...], list[int]]):
    """A proposer that drafts the target's own greedy continuation (the accept-all hook)."""

    def propose(reqs, block):
        rows = []
        for r in reqs:
            ref = reference_outputs[r.prompt_ids]
            nxt = ref[len(r.output_ids):len(r.output_ids) + block]
            rows.append(nxt + [0] * (block - len(nxt)))
        return Proposal(torch.tensor(rows, dtype=torch.int64))

    return propose


def test_accept_all_gives_block_plus_one_tokens_per_forward(engine, reference):
    prompts, want = reference
    eng = engine()
    gen = SpeculativeGenerator(eng, proposer=oracle({tuple(p): w for p, w in zip(prompts, want)}))
    B = gen.block
    n = 1 + 3 * (B + 1)  # the prefill's token, then three full blocks
    outs = gen.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert outs[0].token_ids == want[0][:n]
    st = gen.stats
    assert st.target_forwards == 3 and st.tokens_per_target_forward == B + 1
    assert dict(st.histogram) == {B: 3} and st.accepted == st.proposed == 3 * B
    assert st.acceptance_length == B + 1


def test_sampled_requests_run_alongside_greedy(engine, reference):
    prompts, want = reference
    gen = SpeculativeGenerator(engine())
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)]
    outs = gen.generate(prompts[:2], params)
    assert outs[0].token_ids == want[0][:12]
    assert len(outs[1].token_ids) == 12
    again = SpeculativeGenerator(engine()).generate(prompts[:2], params)
    assert again[1].token_ids == outs[1].token_ids  # seeded: reproducible


def test_block_larger_than_the_plan_is_refused(engine):
    with pytest.raises(ValueError, match="at most 5"):
        SpeculativeGenerator(engine(), block=6)


def test_stops_inside_an_accepted_block(engine, reference):
    """With every draft accepted, a stop token and a max_tokens inside a block end the request
    at that token; the rest of the block is dropped."""
    prompts, want = reference
    gen = SpeculativeGenerator(engine(),
                               proposer=oracle({tuple(p): w for p, w in zip(prompts, want)}))
    tok = want[1][4]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=(tok,))]
    outs = gen.generate(prompts[:2], params)
    assert outs[0].token_ids == want[0][:9] and outs[0].completions[0].finish_reason == "length"
    assert outs[1].token_ids == want[1][:want[1].index(tok) + 1]
    assert outs[1].completions[0].finish_reason == "stop"


def test_many_prompts_with_admission_mid_run(engine, tiny_v41):
    """Eight prompts on four slots: later prompts prefill in the same verify steps in which
    earlier ones decode; each output equals plain greedy decoding of its prompt."""
    from tests.runtime.conftest import make_engine

    plain = make_engine(tiny_v41, "v4.1-flash-tiny")
    prompts = [list(random_tokens(n, 200 + n, vocab=plain.cfg.vocab_size))
               for n in (3, 17, 8, 11, 1, 6, 14, 9)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    gen = SpeculativeGenerator(engine(max_step_tokens=16), block=3)
    assert [o.token_ids for o in gen.generate(prompts, params)] == want
    assert gen.stats.proposed > 0


def test_confidence_threshold_sets_the_verify_budget(engine, reference):
    """Drafts are verified while the running product of confidences stays >= min_confidence:
    with confidences (0.9, 0.8, 0.1, ...) and 0.5, two drafts per step; outputs unchanged."""
    prompts, want = reference
    propose = oracle({tuple(p): w for p, w in zip(prompts, want)})

    def with_confidence(reqs, block):
        p = propose(reqs, block)
        conf = torch.tensor([[0.9, 0.8] + [0.1] * (block - 2)] * len(reqs))
        return Proposal(p.drafts, conf)

    gen = SpeculativeGenerator(engine(), min_confidence=0.5, proposer=with_confidence)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert gen.generate(prompts[:1], params)[0].token_ids == want[0][:10]
    assert dict(gen.stats.histogram) == {2: 3} and gen.stats.proposed == 6  # 1 + 3 * 3 tokens
    with pytest.raises(ValueError, match="min_confidence"):
        SpeculativeGenerator(engine(), min_confidence=1.5)


def test_greedy_parity_on_a_gpu_plan(compiled):
    """The h200 plan (fused compressor: the verify graph recomputes its pending rows; FP8
    activation quantization), run here with reference kernels: speculative greedy outputs equal
    plain greedy outputs of the same plan."""
    from tests.runtime.conftest import make_engine

    path = compiled("v4.1-flash-tiny", "h200")
    plain = make_engine(path, "v4.1-flash-tiny", allow_fallback=True)
    prompts = [list(random_tokens(n, 400 + n, vocab=plain.cfg.vocab_size)) for n in (9, 4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    gen = SpeculativeGenerator(make_engine(path, "v4.1-flash-tiny", allow_fallback=True))
    assert len(gen.programs.verify_graph.nodes) > len(gen.engine.plan.graph.nodes)
    assert [o.token_ids for o in gen.generate(prompts, params)] == want



@pytest.mark.slow
def test_sampled_tokens_keep_the_target_distribution_end_to_end(compiled):
    """Top-k 3 sampling at temperature 1 through the real loop, the draft being the target's
    most likely token after the anchor (accepted only when the sample agrees): the joint
    distribution of the first token (prefill) and the second (the verify step's first) matches
    the target's, computed exactly with plain steps; chi-square over 256 seeded
    completions (9 cells)."""
    from scipy.stats import chisquare

    from megagraph.runtime.batch import SeqChunk
    from tests.runtime.conftest import make_engine

    path = compiled("v4.1-flash-tiny")
    ref = make_engine(path, "v4.1-flash-tiny", max_slots=8)
    prompt = list(random_tokens(5, 500, vocab=ref.cfg.vocab_size))

    def top3(logits):
        v, i = logits.double().topk(3)
        return i.tolist(), torch.softmax(v, dim=0).tolist()

    first, p1 = top3(ref.step([SeqChunk(0, prompt)])[-1])
    joint, best = {}, {}
    for s, (x, px) in enumerate(zip(first, p1), start=1):
        nxt, p2 = top3(ref.step([SeqChunk(s, prompt + [x])])[-1])
        joint.update({(x, y): px * py for y, py in zip(nxt, p2)})
        best[x] = nxt[0]

    def propose(reqs, block):
        return Proposal(torch.tensor([[best.get(r.anchor, 0)] * block for r in reqs]))

    counts = dict.fromkeys(joint, 0)
    gen = SpeculativeGenerator(make_engine(path, "v4.1-flash-tiny", max_slots=64), block=1,
                               proposer=propose)
    for batch in range(4):
        params = SamplingParams(n=64, temperature=1.0, top_k=3, max_tokens=3, seed=1000 * batch,
                                ignore_eos=True)
        for c in gen.generate([prompt], params)[0].completions:
            counts[tuple(c.token_ids[:2])] += 1  # a pair outside the support: KeyError
    accepted = gen.stats.histogram[1]
    n = 4 * 64
    got = torch.tensor([counts[k] for k in joint], dtype=torch.float64)
    want = torch.tensor([joint[k] for k in joint]) * n
    assert got.sum() == n and 0 < accepted < n  # both the accept and the reject branch ran
    assert chisquare(got, want).pvalue > 1e-3


def test_capacity_limits_the_block(engine, tiny_v41):
    """Near the slot's capacity fewer drafts are verified, and the request ends where plain
    decoding ends it (prompt + output = capacity), every draft being accepted."""
    from tests.runtime.conftest import make_engine

    plain = make_engine(tiny_v41, "v4.1-flash-tiny", capacity=32)
    prompt = list(random_tokens(23, 600, vocab=plain.cfg.vocab_size))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = plain.generate([prompt], params)[0].token_ids
    assert len(want) == 32 - 23
    gen = SpeculativeGenerator(engine(capacity=32), proposer=oracle({tuple(prompt): want}))
    out = gen.generate([prompt], params)[0]
    assert out.token_ids == want and out.completions[0].finish_reason == "length"
