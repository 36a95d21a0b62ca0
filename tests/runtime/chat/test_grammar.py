"""Structured output with the real xgrammar and the real V4 vocab: random-logit sampling under the
masks always yields valid output; thinking stays unconstrained; tool calls follow their schemas."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from megagraph.runtime.chat import (ChatFormatConfig, ChatFormatError, ChatPromptBuilder,
                                    GrammarFactory, GrammarUnavailable, MaskWorker,
                                    OutputConstraint, ThinkingGrammarState, UnconstrainedState,
                                    make_grammar_state, parse_completion)

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "city": {"type": "string", "maxLength": 8}},
            "required": ["zip"], "additionalProperties": False},
        "kind": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age", "active", "tags", "address", "kind"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"enum": ["metric", "imperial"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                                         "utc": {"type": "boolean"}},
        "required": ["tz"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="session")
def factory(tok) -> GrammarFactory:
    return GrammarFactory(tok)


@pytest.fixture(scope="session")
def factory41(tok41) -> GrammarFactory:
    return GrammarFactory(tok41)


def _sample(factory, state, seed, max_steps=400):
    """Random logits (seeded), masked, argmax: uniform over the allowed tokens."""
    gen = torch.Generator().manual_seed(seed)
    bm = factory.allocate_bitmask(1)
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, factory.vocab_size, generator=gen)
        if state.fill_mask(bm[0]):
            factory.apply_bitmask(logits, bm)
        t = int(torch.argmax(logits))
        assert state.accept(t), t
        if state.is_terminated():
            assert t == factory.eos_id
            return out
        out.append(t)
    raise AssertionError(f"no termination in {max_steps} steps: {factory.tokenizer.decode(out)!r}")


def _drive(factory, state, ids):
    """Feed known ids; returns the index of the first id the mask forbids (or None)."""
    bm = factory.allocate_bitmask(1)
    for n, t in enumerate(ids):
        state.fill_mask(bm[0])
        if not (int(bm[0, t // 32]) >> (t % 32)) & 1:
            return n
        assert state.accept(t)
    return None


def test_json_schema_random_sampling_validates(factory, tok):
    c = OutputConstraint(kind="json_schema", field="response_format.json_schema",
                         schema_json=json.dumps(SCHEMA))
    for seed in range(40):
        text = tok.decode(_sample(factory, factory.state_for(c), seed))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_any_json(factory, tok):
    for kind, schema in (("json_object", None), ("json_schema", "{}")):
        c = OutputConstraint(kind=kind, field="response_format", schema_json=schema)
        st = factory.state_for(c)
        assert _drive(factory, st, tok.encode('{"a": [1, "x", null]}') + [tok.special.eos]) is None
        assert st.is_terminated()
        assert _drive(factory, factory.state_for(c), tok.encode("nope")) == 0


def test_regex_and_ebnf_sampling(factory, tok):
    rx = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{0,4})?"
    ebnf = 'root ::= "yes" | "no" | "maybe " digit digit? \ndigit ::= [0-9]'
    ebnf_rx = r"yes|no|maybe [0-9][0-9]?"
    for kind, pat, check in (("regex", rx, rx), ("ebnf", ebnf, ebnf_rx)):
        c = OutputConstraint(kind=kind, field=kind, pattern=pat)
        seen = set()
        for seed in range(25):
            text = tok.decode(_sample(factory, factory.state_for(c), seed))
            assert re.fullmatch(check, text), (kind, text)
            seen.add(text)
        assert len(seen) > 3


def test_thinking_wrapper(factory, tok):
    c = OutputConstraint(kind="json_schema", field="response_format.json_schema",
                         schema_json=json.dumps(SCHEMA), thinking=True)
    st = factory.state_for(c)
    assert isinstance(st, ThinkingGrammarState)
    bm = factory.allocate_bitmask(1)
    reasoning = tok.encode("Let me think: nope, not JSON {{{ <｜User｜> 中文 🎉")
    for t in reasoning:
        bm.zero_()
        assert st.fill_mask(bm[0]) is False  # nothing to apply
        assert bool((bm == -1).all())
        assert st.accept(t) and st.in_reasoning
    assert st.accept(tok.special.think_end) and not st.in_reasoning
    nope = tok.encode("nope")[0]
    assert st.fill_mask(bm[0]) is True
    assert not (int(bm[0, nope // 32]) >> (nope % 32)) & 1  # constrained now
    # roll back across </think>: unconstrained again, then redo
    st.rollback(2)
    assert st.in_reasoning and st.num_accepted == len(reasoning) - 1
    assert st.accept(reasoning[-1]) and st.accept(tok.special.think_end)
    tail = _sample(factory, st, seed=3)
    jsonschema.validate(json.loads(tok.decode(tail)), SCHEMA)
    text = tok.decode(reasoning + [tok.special.think_end] + tail)
    msg = parse_completion(text)
    assert msg.reasoning_content == tok.decode(reasoning)
    jsonschema.validate(json.loads(msg.content), SCHEMA)


def _tool_request(builder, model, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": "weather and time?"}],
            "tools": TOOLS, **kw}
    return builder.build(body)


def _check_calls(msg, allowed):
    assert msg.tool_calls and not msg.notes and msg.finish_reason == "tool_calls"
    for call in msg.tool_calls:
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_required_tool_calls_follow_schemas(factory, builder, tok):
    p = _tool_request(builder, "megagraph-v4", tool_choice="required",
                      thinking={"type": "disabled"})
    assert p.constraint.starts_in_tool_calls
    names = set()
    for seed in range(15):
        out = _sample(factory, make_grammar_state(factory, p.constraint), seed, max_steps=600)
        msg = parse_completion(tok.decode(out), p.parser_options)
        _check_calls(msg, {"get_weather", "get_time"})
        names |= {c.name for c in msg.tool_calls}
    assert names == {"get_weather", "get_time"}


def test_named_tool_in_thinking_mode(factory, builder, tok):
    p = _tool_request(builder, "megagraph-v4", parallel_tool_calls=False,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert p.thinking and p.constraint.thinking and p.constraint.required
    for seed in range(8):
        st = make_grammar_state(factory, p.constraint)
        reasoning = tok.encode(f"Thinking #{seed}: the user wants the time.")
        assert _drive(factory, st, reasoning + [tok.special.think_end]) is None
        out = _sample(factory, st, seed, max_steps=300)
        text = tok.decode(reasoning + [tok.special.think_end] + out)
        assert text.split("</think>", 1)[1].startswith("\n\n<｜DSML｜tool_calls>\n")
        msg = parse_completion(text, p.parser_options)
        _check_calls(msg, {"get_time"})
        assert len(msg.tool_calls) == 1


def test_v41_required_calls(tok41, builder41, factory41):
    f41 = factory41
    p = _tool_request(builder41, "megagraph", tool_choice="required",
                      thinking={"type": "disabled"}, parallel_tool_calls=False)
    assert p.prompt_text.endswith("</think>\n\n<｜DSML｜ calls>\n")
    for seed in range(5):
        out = _sample(f41, make_grammar_state(f41, p.constraint), seed, max_steps=300)
        text = tok41.decode(out)
        assert "<｜DSML｜ invoke name=" in text
        _check_calls(parse_completion(text, p.parser_options), {"get_weather", "get_time"})


def test_auto_strict_tools_and_format_or_call(factory, builder, tok):
    eos = tok.special.eos
    call = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter '
            'name="tz" string="true">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    bad_call = call.replace("get_time", "rm_rf")
    auto = OutputConstraint(kind="tool_calls", field="tools", tools_json=json.dumps(TOOLS),
                            tool_mode="auto", family="v4")
    st = factory.state_for(auto)
    assert _drive(factory, st, tok.encode("Sure, checking." + call) + [eos]) is None
    assert st.is_terminated()
    assert _drive(factory, factory.state_for(auto), tok.encode("Plain answer.") + [eos]) is None
    assert _drive(factory, factory.state_for(auto), tok.encode("x" + bad_call)) is not None
    either = OutputConstraint(kind="json_schema", field="response_format.json_schema",
                              schema_json=json.dumps({"type": "object", "properties": {
                                  "a": {"type": "integer"}}}), tools_json=json.dumps(TOOLS),
                              family="v4")
    for text, ok in (('{"a": 5}', True), (call, True), ("hello", False)):
        res = _drive(factory, factory.state_for(either), tok.encode(text) + [eos])
        assert (res is None) == ok, text


def test_compile_errors_name_the_field(factory):
    bad = [OutputConstraint(kind="regex", field="regex", pattern="([a-z"),
           OutputConstraint(kind="ebnf", field="ebnf", pattern="root ::= undefined_rule"),
           OutputConstraint(kind="json_schema", field="response_format.json_schema",
                            schema_json=json.dumps({"type": "nonsense"}))]
    for c in bad:
        with pytest.raises(ChatFormatError) as e:
            factory.state_for(c)
        assert e.value.field == c.field


def test_cache_and_mask_worker(factory, tok):
    c = OutputConstraint(kind="regex", field="regex", pattern="[a-c]{4}")
    assert factory.compile(c) is factory.compile(c)
    states = [factory.state_for(c), None,
              factory.state_for(OutputConstraint(kind="json_object", field="response_format"))]
    states[0].accept(tok.encode("a")[0])
    bm = factory.allocate_bitmask(3)
    worker = MaskWorker()
    try:
        flags = worker.submit(states, bm).result(timeout=30)
    finally:
        worker.close()
    assert flags == [True, False, True]
    ref = factory.allocate_bitmask(3)
    states[0].fill_mask(ref, 0)
    states[2].fill_mask(ref, 2)
    assert torch.equal(bm[0], ref[0]) and torch.equal(bm[2], ref[2])
    assert bool((bm[1] == -1).all())  # untouched row: all allowed


def test_rollback(factory, tok):
    c = OutputConstraint(kind="regex", field="regex", pattern="ab(c|d)")
    st = factory.state_for(c)
    ids = tok.encode("a") + tok.encode("b")
    for t in ids:
        assert st.accept(t)
    assert not st.accept(tok.encode("x")[0])
    st.rollback(1)
    assert st.num_accepted == 1 and st.accept(ids[1])
    with pytest.raises(ValueError):
        st.rollback(5)


def test_missing_xgrammar(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(GrammarUnavailable):
        GrammarFactory(tok)
    assert GrammarFactory.maybe_create(tok) is None
    c = OutputConstraint(kind="json_schema", field="response_format.json_schema",
                         schema_json="{}")
    with pytest.raises(GrammarUnavailable) as e:
        make_grammar_state(None, c)
    err = e.value.to_openai()["error"]
    assert e.value.status == 400 and err["param"] == "response_format.json_schema"
    assert "xgrammar" in err["message"] and "megagraph[grammar]" in err["message"]
    optional = OutputConstraint(kind="tool_calls", field="tool_choice", tools_json="[]",
                                tool_mode="required", required=False)
    assert make_grammar_state(None, optional) is None
    assert make_grammar_state(None, None) is None


def test_prepared_request_to_state(factory, tok):
    """The server path: body -> PreparedChat -> state, for a thinking json_schema request."""
    builder = ChatPromptBuilder(tok, ChatFormatConfig(served_model_name="m", family="v4"))
    p = builder.build({"model": "m", "messages": [{"role": "user", "content": "json please"}],
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": "s", "schema": SCHEMA}}})
    st = make_grammar_state(factory, p.constraint)
    assert isinstance(st, ThinkingGrammarState)


# ---------------------------------------------------------------------------- reasoning budget
def _allowed(row, vocab_size: int) -> list[int]:
    """Token ids whose bit is set in one int32 bitmask row (bit i of word w = token 32w + i)."""
    bits = (row.to(torch.int64).view(-1, 1) >> torch.arange(32)) & 1
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist()


def test_reasoning_budget_forces_think_end(factory, tok):
    end = tok.special.think_end
    c = OutputConstraint(kind="regex", field="regex", pattern="ok", thinking=True,
                         reasoning_budget=3)
    st = factory.state_for(c)
    bm = factory.allocate_bitmask(1)
    words = tok.encode(" one two three four")
    for t in words[:3]:
        assert st.fill_mask(bm[0]) is False and st.accept(t)
    assert st.budget_spent and st.fill_mask(bm[0]) is True
    assert _allowed(bm[0], factory.vocab_size) == [end]
    logits = torch.randn(1, factory.vocab_size)
    factory.apply_bitmask(logits, bm)
    assert int(torch.argmax(logits)) == end
    assert not st.accept(words[3]) and st.in_reasoning  # refused, state unchanged
    st.rollback(1)  # back under the budget: free again
    assert not st.budget_spent and st.fill_mask(bm[0]) is False and st.accept(words[3])
    assert st.accept(end) and not st.in_reasoning
    assert _drive(factory, st, tok.encode("ok") + [tok.special.eos]) is None
    assert st.is_terminated()
    # a token id in the sign bit of its word (i % 32 == 31) is encoded right too
    high = ThinkingGrammarState(UnconstrainedState(factory.vocab_size), 31 * 32 + 31, 0)
    assert high.fill_mask(bm[0]) is True
    assert _allowed(bm[0], factory.vocab_size) == [31 * 32 + 31]


@pytest.mark.parametrize("family", ["v4", "v4.1"])
def test_forced_call_fits_after_bounded_reasoning(family, factory, builder, tok, tok41,
                                                  builder41, factory41):
    """Random logits never end the reasoning on their own: the budget ends it, and the call
    that the grammar forces then completes within max_tokens."""
    f, b, t = (factory, builder, tok) if family == "v4" else (factory41, builder41, tok41)
    model = "megagraph-v4" if family == "v4" else "megagraph"
    p = _tool_request(b, model, tool_choice="required", max_tokens=300, parallel_tool_calls=False)
    assert p.thinking and p.reasoning_budget == 300 - 1 - 150
    for seed in range(3):
        out = _sample(f, make_grammar_state(f, p.constraint), seed, max_steps=300)
        assert out.index(t.special.think_end) == p.reasoning_budget
        msg = parse_completion(t.decode(out), p.parser_options)
        assert msg.reasoning_content
        _check_calls(msg, {"get_weather", "get_time"})


def test_budget_from_request_and_defaults(builder, factory):
    ask = {"model": "megagraph-v4", "messages": [{"role": "user", "content": "json please"}]}
    rf = {"response_format": {"type": "json_object"}}
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    cases = [  # (extra body, reasoning budget, constraint kind)
        (dict(max_tokens=100, **named), 100 - 1 - 50, "tool_calls"),
        (dict(max_tokens=10_000, **named), 10_000 - 1 - 1024, "tool_calls"),
        (dict(max_tokens=1, **named), 0, "tool_calls"),
        (dict(max_tokens=100, **rf), 49, "json_object"),
        (dict(max_tokens=100, thinking_budget=7, **named), 7, "tool_calls"),
        (dict(max_tokens=100, thinking_token_budget=9, **rf), 9, "json_object"),
        (dict(thinking_budget=5, thinking_token_budget=9), 5, "text"),
        (dict(max_tokens=100, tools=TOOLS), None, None),  # auto, not strict: nothing forced
        (dict(max_tokens=100, thinking={"type": "disabled"}, thinking_budget=5, **named), None,
         "tool_calls"),  # no reasoning to bound
    ]
    for extra, budget, kind in cases:
        p = builder.build({**ask, **extra})
        assert p.reasoning_budget == budget, extra
        assert (p.constraint.kind if p.constraint else None) == kind, extra
        if p.constraint is not None:
            assert p.constraint.reasoning_budget == budget
    # a budget alone: bounded reasoning, then free text
    p = builder.build({**ask, "thinking_budget": 2})
    st = make_grammar_state(factory, p.constraint)
    assert isinstance(st.inner, UnconstrainedState) and st.reasoning_budget == 2
    with pytest.raises(GrammarUnavailable) as e:
        make_grammar_state(None, p.constraint)
    assert e.value.field == "thinking_budget"
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ChatFormatError) as e:
            builder.build({**ask, "thinking_token_budget": bad})
        assert e.value.field == "thinking_token_budget"
