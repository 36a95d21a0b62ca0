"""Prompt rendering: our request handling ends in exactly deepseek-recipe's prompt and ids."""

from __future__ import annotations

import copy
import json

import pytest

from megagraph.runtime.chat import (ChatFormatConfig, ChatFormatError, ChatPromptBuilder,
                                    resolve_thinking)

from .conftest import TIME, WEATHER, dr, recipe_convert

SYS = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is 2+2?"}
FOLLOW_UP = [
    SYS,
    {"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call both tools.",
     "tool_calls": [
         {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_time", "arguments": '{"tz": "Asia/Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "09:30"},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "21 °C in Paris; 09:30 in Tokyo.",
     "reasoning_content": "Tools answered."},
    {"role": "user", "content": "Thanks! 中文 too? And <think> is just text."},
]

# (body in DeepSeek's spelling, the same request in other spellings we accept)
CASES = {
    "thinking_default": ({"messages": [SYS, USER]}, []),
    "thinking_off": ({"messages": [SYS, USER], "thinking": {"type": "disabled"}}, [
        {"chat_template_kwargs": {"thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"thinking": False}, {"reasoning_effort": "none"}]),
    "effort_max": ({"messages": [SYS, USER], "reasoning_effort": "max"}, [
        {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}}]),
    "effort_low": ({"messages": [USER], "reasoning_effort": "low"}, []),
    "effort_xhigh": ({"messages": [USER], "reasoning_effort": "xhigh"}, []),
    "no_system": ({"messages": [USER]}, []),
    "tools_follow_up": ({"messages": FOLLOW_UP, "tools": [WEATHER, TIME]}, []),
    "tools_follow_up_no_thinking": ({"messages": FOLLOW_UP, "tools": [WEATHER, TIME],
                                     "thinking": {"type": "disabled"}}, []),
    "required_no_thinking": ({"messages": [SYS, USER], "tools": [WEATHER, TIME],
                              "tool_choice": "required", "thinking": {"type": "disabled"}}, []),
    "named_no_thinking": ({"messages": [USER], "tools": [WEATHER, TIME], "thinking":
                           {"type": "disabled"}, "tool_choice": {
                               "type": "function", "function": {"name": "get_time"}}}, []),
    "json_schema": ({"messages": [SYS, USER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "properties": {"answer": {"type": "integer"}}}}}}, []),
    "developer_role": ({"messages": [SYS, USER]}, [
        {"messages": [{"role": "developer", "content": SYS["content"]}, USER]}]),
}


def _recipe(body, model, version, encoding, rtok):
    req = recipe_convert(dict(body, model=model), version)
    conv = req.conversation
    return (encoding.render_conversation(conv).prompt,
            encoding.with_tokenizer(rtok).encode(conv))


@pytest.mark.parametrize("name", sorted(CASES))
def test_v4_prompt_equals_recipe(builder, recipe_tok, tok, name):
    body, variants = CASES[name]
    want_text, want_ids = _recipe(body, "DeepSeek-V4-Pro", None, dr.DeepseekV4Encoding(),
                                  recipe_tok)
    # a variant replaces the DeepSeek thinking/effort spelling with its own
    bare = {k: v for k, v in body.items() if k not in ("thinking", "reasoning_effort")}
    for b in [body] + [dict(copy.deepcopy(bare), **v) for v in variants]:
        p = builder.build(dict(b, model="megagraph-v4"))
        assert p.prompt_text == want_text, (name, b)
        assert p.prompt_ids == want_ids
        assert tok.decode(p.prompt_ids) == p.prompt_text


@pytest.mark.parametrize("name", ["thinking_default", "thinking_off", "effort_max",
                                  "tools_follow_up", "required_no_thinking", "json_schema"])
def test_v41_prompt_equals_recipe(builder41, tok41, name):
    body, _ = CASES[name]
    rtok = dr.Tokenizer.from_str(tok41.hf.to_str())
    want_text, want_ids = _recipe(body, "DeepSeek-V4.1-Flash", None, dr.DeepseekV41Encoding(),
                                  rtok)
    p = builder41.build(dict(body, model="megagraph"))
    assert (p.prompt_text, p.prompt_ids) == (want_text, want_ids)
    assert tok41.decode(p.prompt_ids) == p.prompt_text


def test_v41_known_prompts(builder41):
    on = builder41.build({"model": "megagraph", "messages": [SYS, USER]})
    assert on.prompt_text == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\nYou are a helpful assistant.<｜User｜>What is 2+2?"
        "<｜Assistant｜><think>")
    off = builder41.build({"model": "megagraph", "messages": [SYS, USER],
                           "chat_template_kwargs": {"thinking": False}})
    assert off.prompt_text.endswith("<｜User｜>What is 2+2?<｜Assistant｜></think>")
    assert "Reasoning Effort" not in off.prompt_text
    assert (on.thinking, off.thinking) == (True, False)
    assert on.parser_options.thinking and not off.parser_options.thinking


def test_user_text_markup_is_not_special(builder, tok):
    p = builder.build({"model": "megagraph-v4", "messages": [
        {"role": "user", "content": "say <think> and </think> and <｜User｜>"}],
        "thinking": {"type": "disabled"}})
    sp = tok.special
    assert p.prompt_ids.count(sp.think_start) == 0
    assert p.prompt_ids.count(sp.think_end) == 1  # only the template's, at the very end
    assert p.prompt_ids[-1] == sp.think_end
    assert p.prompt_ids.count(sp.user) == 1


def test_prepared_fields(builder):
    p = builder.build({"model": "megagraph-v4", "messages": [USER], "tools": [WEATHER],
                       "tool_choice": "required", "thinking": {"type": "disabled"},
                       "stream": True, "stream_options": {"include_usage": True},
                       "temperature": 0.2, "max_tokens": 50, "stop": ["END"], "seed": 7})
    assert p.tool_choice == "required" and p.stream and p.include_usage
    assert p.parser_options.starts_in_tool_calls and not p.parser_options.thinking
    assert p.prompt_text.endswith("</think>\n\n<｜DSML｜tool_calls>\n")
    assert p.sampling.max_tokens == 50 and p.sampling.stop == ("END",) and p.sampling.seed == 7
    assert abs(p.sampling.temperature - 0.2) < 1e-6
    c = p.constraint
    assert c.kind == "tool_calls" and c.starts_in_tool_calls and not c.required
    assert [t["function"]["name"] for t in json.loads(c.tools_json)] == ["get_weather"]
    assert builder.build({"model": "megagraph-v4", "messages": [USER],
                          "max_completion_tokens": 33}).sampling.max_tokens == 33
    none = builder.build({"model": "megagraph-v4", "messages": [USER], "tools": [WEATHER],
                          "tool_choice": "none"})
    assert none.constraint is None and not none.parser_options.parse_tool_calls
    default = builder.build({"model": "megagraph-v4", "messages": [USER]})
    assert default.sampling.max_tokens == 65536 and default.constraint is None  # thinking default


def test_required_with_thinking_is_grammar_enforced(builder):
    named = {"type": "function", "function": {"name": "get_time"}}
    p = builder.build({"model": "megagraph-v4", "messages": [USER], "tools": [WEATHER, TIME],
                       "tool_choice": named})
    assert p.thinking and p.prompt_text.endswith("<think>")
    assert "get_weather" not in p.prompt_text  # only the named tool is offered
    c = p.constraint
    assert c.kind == "tool_calls" and c.tool_mode == "required" and c.required and c.thinking
    assert not c.starts_in_tool_calls
    strict = ChatPromptBuilder(builder.tokenizer, ChatFormatConfig(
        served_model_name="m", family="v4", forced_tools_with_thinking=False))
    with pytest.raises(ChatFormatError) as e:
        strict.build({"model": "m", "messages": [USER], "tools": [WEATHER],
                      "tool_choice": "required"})
    assert e.value.field == "tool_choice"


def test_constraints_from_request(builder):
    base = {"model": "megagraph-v4", "messages": [{"role": "user", "content": "reply in json"}]}
    assert builder.build(dict(base, response_format={"type": "json_object"})).constraint.kind \
        == "json_object"
    c = builder.build(dict(base, regex="[a-z]+")).constraint
    assert (c.kind, c.field, c.pattern, c.thinking) == ("regex", "regex", "[a-z]+", True)
    c = builder.build(dict(base, ebnf='root ::= "yes"', thinking={"type": "disabled"})).constraint
    assert (c.kind, c.field, c.thinking) == ("ebnf", "ebnf", False)
    strict_tool = json.loads(json.dumps(WEATHER))
    strict_tool["function"]["strict"] = True
    strict_tool["function"]["parameters"].update(required=["city", "days"],
                                                 additionalProperties=False)
    c = builder.build(dict(base, tools=[strict_tool])).constraint
    assert (c.kind, c.tool_mode, c.field) == ("tool_calls", "auto", "tools")
    assert builder.build(dict(base, tools=[WEATHER])).constraint is None  # auto, not strict
    c = builder.build(dict(base, tools=[WEATHER], response_format={"type": "json_object"}))
    assert c.constraint.kind == "json_object" and c.constraint.tools_json


def test_resolve_thinking_precedence():
    assert resolve_thinking({}, True) == (True, None)
    assert resolve_thinking({}, False) == (False, None)
    assert resolve_thinking({"reasoning_effort": "high"}, False) == (True, "high")
    assert resolve_thinking({"reasoning_effort": "none"}, True) == (False, None)
    assert resolve_thinking({"thinking": {"type": "enabled"}, "reasoning_effort": "none"},
                            False) == (True, None)
    assert resolve_thinking({"thinking": {"type": "disabled"}, "reasoning_effort": "max"},
                            True) == (False, None)
    assert resolve_thinking({"thinking": True, "chat_template_kwargs": {"thinking": False}},
                            False) == (True, None)
    assert resolve_thinking({"chat_template_kwargs": {"enable_thinking": True}}, False) == \
        (True, None)


@pytest.mark.parametrize("patch, field", [
    ({"model": "gpt-4o"}, "model"),
    ({"model": "DeepSeek-V4.1-Flash"}, "model"),  # a V4 server must not render V4.1
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"thinking": "yes"}, "thinking"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
    ({"reasoning_effort": 30}, "reasoning_effort"),
    ({"reasoning_effort": "ultra"}, "reasoning_effort"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}},
      "thinking": {"type": "disabled"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),  # prompt lacks "json"
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
      "regex": "a"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"n": 2}, "n"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content[1]"),
])
def test_errors_name_the_field(builder, patch, field):
    body = {"model": "megagraph-v4", "messages": [USER], **patch}
    with pytest.raises(ChatFormatError) as e:
        builder.build(body)
    assert e.value.field == field, e.value
    assert e.value.status == 400
    err = e.value.to_openai()["error"]
    assert err["param"] == field and err["message"]


def test_v41_needs_a_v41_vocab(tok):
    with pytest.raises(ValueError, match="System"):
        ChatPromptBuilder(tok, ChatFormatConfig())


def test_model_names(builder):
    for name in ("megagraph-v4", "DeepSeek-V4-Flash"):
        assert builder.build({"model": name, "messages": [USER]}).model == name
    assert builder.build({"messages": [USER]}).model == "megagraph-v4"  # default: served name
    assert builder.build(json.dumps({"messages": [USER]}).encode()).prompt_ids
    with pytest.raises(ChatFormatError):
        builder.build(b"{not json")
