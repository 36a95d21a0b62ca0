"""The decode index-key reading (`index_key_reading`, models/index_keys.py, docs/index-key-reading.md):
`owner` (the default) vs `vendor` (DeepSeek's inference/model.py).

What must hold: the setting is validated and recorded (config, plan, inspect, CLI); vendor ==
owner on prefill, bitwise (the same ops on the same values); vendor differs from owner exactly on
the decode rows the rule predicts (a ratio-2 owner leaves its group open, and more entries are
visible than the indexer keeps, so a different key set can change the selection) and is bitwise
owner elsewhere; a multi-row vendor step equals vendor decode token by token when it has at most
cached + 1 rows; DSpark greedy drafting runs and equals plain greedy decoding under both readings.

Numerics: act_dtype f32, quantize_kv off (reference numerics), as in test_v41_consistency: different
row counts reassociate fp32 GEMMs, measured |diff| <= 1.7e-5 on logits of std ~1, hence TOL
(rtol 1e-5, atol 5e-5); a reading applied on the wrong rows moves logits by O(1) (measured 0.7..3.6).
"""

import pytest
import torch

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.kernels.indexer.reference import index_scores, published_scores
from megagraph.main import main as cli
from megagraph.models.build import build_step
from megagraph.models.config import ConfigError, ModelConfig, load_model_config
from megagraph.models.index_keys import vendor_reads
from megagraph.models.session import step_metadata
from megagraph.passes import CompileOptions, compile_model, load_hw_profile
from megagraph.passes.artifacts import write_artifacts
from tests.models.test_dspark import with_draft
from tests.tiny import SeqChunk, random_tokens, session, tiny

TOL = dict(rtol=1e-5, atol=5e-5)
MODEL = "v4.1-flash-tiny"


@pytest.fixture(scope="module")
def owner():
    return tiny(MODEL, "f32", 0, quantize_kv=False)


@pytest.fixture(scope="module")
def vendor():
    return tiny(MODEL, "f32", 0, quantize_kv=False, index_key_reading="vendor")


# -- the setting ------------------------------------------------------------------------------------
def test_default_is_owner_and_vendor_reads_follow_the_release_rule():
    full = load_model_config("v4.1-flash")
    assert full.index_key_reading == "owner" and load_model_config(MODEL).index_key_reading == "owner"
    # spec §3.4.7: layers 2/8/14 read layer 20's keys; 20-36 (ratio 1) are unaffected
    assert vendor_reads(full.replace(index_key_reading="vendor")) == {2: 20, 8: 20, 14: 20}
    assert vendor_reads(load_model_config(MODEL).replace(index_key_reading="vendor")) == {2: 5, 4: 5}
    a, b = full, full.replace(index_key_reading="vendor")
    assert a.config_hash() != b.config_hash() and b.to_dict()["index_key_reading"] == "vendor"
    assert ModelConfig.from_dict(b.to_dict()) == b


@pytest.mark.parametrize("model,changes,match", [
    (MODEL, dict(index_key_reading="Vendor"), r"'index_key_reading': must be one of \('owner', 'vendor'\), got 'Vendor'"),
    (MODEL, dict(index_key_reading=1), r"'index_key_reading' must be a string"),
    ("v4-flash-tiny", dict(index_key_reading="vendor"), r"family v4 has none"),
    # a ratio-1 KV source before a ratio-2 one: the vendor would read layer 2's keys written at the
    # same token at layer 3, which is not V4.1's layout
    (MODEL, dict(index_key_reading="vendor", compress_ratios=[0, 0, 1, 2, 2, 1, 1, 1, 1],
                 kv_source_layers=[2, 3, 5], index_source_layers=[2, 3, 5, 7]),
     r"layer 3's indexer would read layer 2's keys written at the same token"),
])
def test_bad_readings_are_refused_naming_the_field(model, changes, match):
    d = {**load_model_config(model).to_dict(), **changes}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(d, "m.yaml")


def test_compile_records_the_reading_in_the_plan_and_inspect_shows_it(tmp_path, capsys):
    out = tmp_path / "vendor"
    assert cli(["compile", "--model", MODEL, "--hw", "cpu", "--out", str(out),
                "--index-key-reading", "vendor"]) == 0
    import yaml

    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert plan["index_keys"] == {"reading": "vendor", "published_reads": {"L2": "L5", "L4": "L5"}}
    assert yaml.safe_load((out / "model.yaml").read_text())["index_key_reading"] == "vendor"
    capsys.readouterr()
    assert cli(["inspect", str(out)]) == 0
    assert ("index keys: vendor (decode rows whose owner leaves a group open read the last published "
            "keys: L2 <- L5, L4 <- L5; decode != prefill)") in capsys.readouterr().out
    write_artifacts(compile_model(load_model_config(MODEL), load_hw_profile("cpu")), tmp_path / "owner")
    assert cli(["inspect", str(tmp_path / "owner"), str(out)]) == 0
    assert "index keys: {'published_reads': {}, 'reading': 'owner'} -> " in capsys.readouterr().out
    assert cli(["compile", "--model", "v4-flash-tiny", "--hw", "cpu", "--out", str(tmp_path / "v4"),
                "--index-key-reading", "vendor"]) == 2
    assert "family v4 has none" in capsys.readouterr().err


def test_vendor_graph_adds_one_score_and_a_row_choice_per_affected_layer(owner, vendor):
    go, gv = owner[1], vendor[1]
    assert set(go.inputs) == set(gv.inputs) and go.weights == gv.weights
    assert all(go.types[i] == gv.types[i] for i in go.inputs)  # the same state: nothing hidden
    extra = {k: gv.op_counts().get(k, 0) - go.op_counts().get(k, 0) for k in gv.op_counts()}
    assert {k: v for k, v in extra.items() if v} == {"index_scores": 2, "published_scores": 2}
    prod = gv.producers()
    for layer, src in ((2, 5), (4, 5)):
        n = prod[f"L{layer}.attn.indexer.scores_read"]
        assert prod[n.inputs[1]].inputs[2] == f"L{src}.ikey"  # the pool as the step found it
        assert n.attr("ratio") == 2 and n.attr("published_ratio") == 1
    # every graph of the pipeline, every profile: the reading survives, no in-place hazard
    from megagraph.kernels.capturable_table import inplace_hazards

    for hw in ("cpu", "h200", "gb300"):
        c = compile_model(vendor[0], load_hw_profile(hw), CompileOptions(bounded_replay=True))
        assert c.graph.op_counts()["published_scores"] == 2 and inplace_hazards(c.graph) == []


# -- the op -------------------------------------------------------------------------------------------
def test_published_scores_matches_a_row_by_row_transcription():
    g = torch.Generator().manual_seed(5)
    reqs = [(0, 7), (4, 5), (9, 1), (12, 3)]  # (cached, new): a first chunk, then decode rows
    meta = step_metadata([SeqChunk(i, tuple(range(3, 3 + n))) for i, (_, n) in enumerate(reqs)],
                         {i: c for i, (c, _) in enumerate(reqs)})
    pos, req, cached = meta["positions"], meta["token_req"], meta["seq_cached"]
    T = pos.shape[0]
    for C, Cp, pr in ((8, 16, 1), (8, 6, 1), (8, 8, 2)):
        scores, pub = torch.randn(T, C, generator=g), torch.randn(T, Cp, generator=g)
        got = published_scores(scores, pub, pos, req, cached, ratio=2, published_ratio=pr)
        for t in range(T):
            p, c = int(pos[t]), int(cached[req[t]])
            if c > 0 and (p + 1) % 2:
                want = torch.full((C,), float("-inf"))
                n = min(C, Cp, c // pr)
                want[:n] = pub[t, :n]
            else:
                want = scores[t]
            assert torch.equal(got[t], want), (t, C, Cp, pr)


# -- the reading in the model -------------------------------------------------------------------------
def test_vendor_equals_owner_on_prefill_bitwise(owner, vendor):
    a, b = session(*owner), session(*vendor)
    chunks = [SeqChunk(0, random_tokens(23, 31)), SeqChunk(2, random_tokens(6, 32))]
    assert torch.equal(a.step(chunks), b.step(chunks))
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    # a first chunk (17 rows: up to 8 entries visible, more than the indexer keeps) beside decode
    # rows, from the same state: its rows are the owner's (to fp32 noise: other rows' routing can
    # change the expert GEMMs' row counts)
    b.state, b.cached = dict(a.state), dict(a.cached)
    mixed = [SeqChunk(0, (40,)), SeqChunk(1, random_tokens(17, 33)), SeqChunk(2, (41, 42))]
    la, lb = a.step(mixed), b.step(mixed)
    torch.testing.assert_close(lb[1:18], la[1:18], **TOL)


def test_vendor_differs_from_owner_exactly_where_the_rule_says(owner, vendor):
    """Teacher-forced decode from the owner's state: at position p the ratio-2 index sources (L2,
    L4; owner's group open iff p is even) read L5's keys; with (p+1)//2 <= index_topk = 4 entries
    visible, the indexer keeps them all whatever it reads, so only even p >= 10 can change."""
    cfg = owner[0]
    toks = random_tokens(22, 34)
    a, b = session(*owner), session(*vendor)
    a.step([SeqChunk(0, toks[:8])])
    differ = []
    for p in range(8, 22):
        b.state, b.cached = dict(a.state), dict(a.cached)
        step = [SeqChunk(0, (toks[p],))]
        if p in (12, 13):  # the scores themselves: L5's pool (entries < p) on even p, the owner's on odd
            meta = step_metadata(step, b.cached)
            own = vendor[1].producers()["L2.attn.indexer.scores"]  # index_scores(qi, w, ikey, ...)
            out = interpret(vendor[1], {**meta, **b.state, **vendor[3]}, vendor[2],
                            reference_impls(),
                            keep=(*own.inputs[:2], own.outputs[0], "L2.attn.indexer.scores_read"))
            if p % 2 == 0:
                pub = index_scores(out[own.inputs[0]], out[own.inputs[1]], b.state["L5.ikey"],
                                   meta["positions"], meta["token_req"], meta["seq_slots"], ratio=2,
                                   weight_scale=own.attr("weight_scale"))
                read = out["L2.attn.indexer.scores_read"]
                assert torch.equal(read, pub[:, :read.shape[1]])  # entries j < (p+1)//2 = p/2 <= c
                assert not torch.equal(read, out["L2.attn.indexer.scores"])
            else:
                assert torch.equal(out["L2.attn.indexer.scores_read"], out["L2.attn.indexer.scores"])
        la, lb = a.step(step), b.step(step)
        if not torch.equal(la, lb):
            differ.append(p)
            assert (la - lb).abs().max() > 1e-3
    assert differ == [p for p in range(8, 22) if p % 2 == 0 and (p + 1) // 2 > cfg.index_topk]


def test_vendor_decode_diverges_from_its_own_prefill(vendor):
    """The documented reason owner is the default."""
    toks = random_tokens(16, 35)
    full = session(*vendor).step([SeqChunk(0, toks)])
    s = session(*vendor)
    inc = torch.cat([s.step([SeqChunk(0, (t,))]) for t in toks])
    torch.testing.assert_close(inc[:10], full[:10], **TOL)  # nothing can differ before p = 10
    assert (inc[10:] - full[10:]).abs().max() > 1e-2


def test_multi_row_vendor_steps_equal_vendor_decode_token_by_token(vendor):
    """A step of n <= cached + 1 rows (here 6 after 9 cached, and 3 after 12, batched with a first
    chunk and a decode row) is read as that many decode rows."""
    p0, p1, p2 = random_tokens(9, 36), random_tokens(12, 37), random_tokens(7, 38)
    tail0, tail1 = random_tokens(6, 39), random_tokens(3, 40)
    seq = session(*vendor)
    seq.step([SeqChunk(0, p0)])
    seq.step([SeqChunk(1, p1)])
    want0 = torch.cat([seq.step([SeqChunk(0, (t,))]) for t in tail0])
    want1 = torch.cat([seq.step([SeqChunk(1, (t,))]) for t in tail1])
    want2 = session(*vendor).step([SeqChunk(2, p2)])
    multi = session(*vendor)
    multi.step([SeqChunk(0, p0)])
    multi.step([SeqChunk(1, p1)])
    got = multi.step([SeqChunk(1, tail1), SeqChunk(2, p2), SeqChunk(0, tail0)])
    torch.testing.assert_close(got[:3], want1, **TOL)
    torch.testing.assert_close(got[3:10], want2, **TOL)
    torch.testing.assert_close(got[10:], want0, **TOL)


# -- DSpark ------------------------------------------------------------------------------------------
def _draft(model, s, anchor, slot):
    _, _, w, _, d = model
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    rings = {k: v for k, v in s.state.items() if k.startswith("mtp.")}
    out = interpret(d, {"anchor_ids": i64([anchor]), "seq_slots": i64([slot]),
                        "seq_cached": i64([s.cached[slot]]), **rings}, w, reference_impls())
    return out["drafts"][0].tolist()


def greedy_plain(model, prompt, n):
    cfg, g, w, consts, _ = model
    s = session(cfg, g, w, consts)
    logits, out = s.step([SeqChunk(0, prompt)]), []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = s.step([SeqChunk(0, (out[-1],))])
    return out


def greedy_dspark(model, prompt, n, oracle=None):
    """Draft B tokens, verify [x0, d1..dB] in one multi-row step, accept the longest greedy prefix,
    roll the step back (the session's state is functional: keep the old dict) and commit the
    accepted rows. `oracle`: drafts taken from this sequence instead of the drafter."""
    cfg, g, w, consts, _ = model
    B = cfg.dspark_block_size
    s = session(cfg, g, w, consts)
    x0 = int(s.step([SeqChunk(0, prompt)])[-1].argmax())
    out, accepted = [], 0
    while len(out) < n:
        drafts = _draft(model, s, x0, 0) if oracle is None else oracle[len(out) + 1:len(out) + 1 + B]
        assert len(drafts) == B
        before = (dict(s.state), dict(s.cached))
        verify = s.step([SeqChunk(0, (x0, *drafts))])
        a = 0
        while a < B and drafts[a] == int(verify[a].argmax()):
            a += 1
        s.state, s.cached = before
        committed = s.step([SeqChunk(0, (x0, *drafts[:a]))])
        out += [x0, *drafts[:a]]
        accepted += a
        x0 = int(committed[-1].argmax())
        assert x0 == int(verify[a].argmax())  # the bonus token, from the verify step
    return out[:n], accepted


@pytest.fixture(scope="module")
def drafted(owner, vendor):
    """{reading: (cfg, main graph, main + draft weights, constants, draft graph)}: the draft graph
    and its weights do not depend on the reading."""
    cfg, g, w, consts, d = with_draft(owner)
    return {"owner": (cfg, g, w, consts, d), "vendor": (vendor[0], vendor[1], w, consts, d)}


@pytest.mark.parametrize("reading", ["owner", "vendor"])
def test_dspark_greedy_drafting_equals_greedy_decoding(reading, drafted):
    model = drafted[reading]
    prompt = random_tokens(14, 41)  # decoding starts at p = 14: the readings differ at even p
    plain = greedy_plain(model, prompt, 12)
    assert greedy_dspark(model, prompt, 4)[0] == plain[:4]
    # drafts that are the greedy continuation: every block is accepted whole
    got, accepted = greedy_dspark(model, prompt, 12, oracle=plain)
    assert got == plain and accepted == 10


def test_dspark_verification_sees_the_reading(drafted):
    """A verify block read under the two readings: its first row (at p = the cached length) differs
    iff the ratio-2 owners leave a group open there (p even); later rows also see the first
    ones' keys through the window, so from the first even row on everything differs. (A row
    before it agrees to fp32 noise, not bitwise: the other rows' routing changes the expert GEMMs'
    row counts.)"""
    for n_prompt in (14, 15):
        prompt, block = random_tokens(n_prompt, 42), random_tokens(6, 43)
        logits = {}
        for reading, (cfg, g, w, consts, _) in drafted.items():
            s = session(cfg, g, w, consts)
            s.step([SeqChunk(0, prompt)])
            logits[reading] = s.step([SeqChunk(0, block)])
        diff = (logits["owner"] - logits["vendor"]).abs().amax(dim=-1)
        first_even = n_prompt % 2
        assert (diff[:first_even] < TOL["atol"]).all() and (diff[first_even:] > 1e-3).all(), (n_prompt, diff)


# -- the runtime ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", ["cpu", "h200"])
def test_the_runtime_runs_the_vendor_reading(hw, tmp_path):
    """Compiled artifacts run by the engine equal the reference session over the same compiled
    graph (the cpu plan bitwise; the h200 plan on CPU falls back to capturable kernels that sum in
    another order and write state pools in place, the published pool read before its in-place
    update), and differ from the owner reading's compiled graph where the rule says."""
    from tests.runtime.conftest import make_engine

    base = load_model_config(MODEL).replace(act_dtype="f32")
    c = {r: compile_model(base.replace(index_key_reading=r), load_hw_profile(hw)) for r in ("vendor", "owner")}
    eng = make_engine(write_artifacts(c["vendor"], tmp_path / hw), MODEL, allow_fallback=hw != "cpu")
    _, _, w, consts = tiny(MODEL, "f32", 0)
    ref = {r: session(c[r].cfg, c[r].graph, w, consts, slots=5, capacity=128) for r in c}
    steps = [[SeqChunk(0, random_tokens(12, 44)), SeqChunk(1, random_tokens(9, 45))],
             [SeqChunk(0, (17,)), SeqChunk(1, (23,))],  # p = 12 (more than top-k visible), p = 9
             [SeqChunk(1, (5, 6, 7)), SeqChunk(2, random_tokens(9, 46)), SeqChunk(0, (8,))]]
    tol = dict(rtol=0, atol=0) if hw == "cpu" else dict(rtol=1e-4, atol=1e-4)
    for i, chunks in enumerate(steps):
        got, want, own = eng.step(chunks), ref["vendor"].step(chunks), ref["owner"].step(chunks)
        torch.testing.assert_close(got, want, **tol)
        if i == 0:
            torch.testing.assert_close(got, own, **tol)  # prefill: the owner's
        if i == 1:
            assert (got[0] - own[0]).abs().max() > 1e-3
            torch.testing.assert_close(got[1], own[1], **TOL)  # fp32 noise: the MoE batches differ
