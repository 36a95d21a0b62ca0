"""OpenAI chat request -> prompt token ids (through deepseek-recipe) + everything decoding needs.

Why deepseek-recipe does the rendering: V4.1 ships no Jinja template; DeepSeek's own encoder is the
authority (system/effort prefix, tool-result merging, dropped past reasoning, DSML tool history), and
deepseek-recipe is its official Rust port with OpenAI request conversion. What this module adds:

* The request spellings users of other servers send (docs/chat-format.md): DeepSeek's
  `thinking: {"type": "enabled"|"disabled"}` (also a bare bool), SGLang/vLLM's
  `chat_template_kwargs: {"thinking": bool}` / `{"enable_thinking": bool}`, OpenAI's
  `reasoning_effort` (`"none"` turns thinking off), the `developer` role, SGLang's top-level
  `regex` / `ebnf`. They are normalized to DeepSeek's spelling before conversion.
* Thinking default: `ChatFormatConfig.default_thinking`, True like DeepSeek's API and the recipe;
  the HTTP server sets it from `--thinking-default`, off unless set, as SGLang serves this model.
* Our served model name(s) as aliases of exactly one model version, and nothing else: a server for
  V4-Flash must not accept "DeepSeek-V4.1-Flash" and render the wrong format.
* `tool_choice: "required"` / a named function while thinking: DeepSeek's API (and the recipe)
  reject it; we render the thinking prompt with the (named) tool(s) and let the grammar force a
  call after `</think>` (needs xgrammar; see grammar.py). A forced call or format would be useless
  if the reasoning could spend all of `max_tokens`, so the reasoning is bounded: `</think>` is
  forced after `max_tokens - 1 - min(answer_reserve, max_tokens // 2)` reasoning tokens, or after
  the request's `thinking_budget` (vLLM's `thinking_token_budget` is the same field), which also
  bounds the reasoning of any other thinking request.
* Every problem becomes a `ChatFormatError` naming the field.

Prompt ids come from the recipe's prompt encoding with our tokenizer file, which keeps special-token
spellings inside user text as plain text (prompt-injection safe); `Tokenizer.decode(prompt_ids)`
gives back `prompt_text` exactly (tested).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .errors import ChatFormatError
from .grammar import OutputConstraint
from .parser import ParserOptions
from .tokenizer import SPECIAL, Tokenizer

__all__ = ["ChatFormatConfig", "SamplingParams", "PreparedChat", "ChatPromptBuilder",
           "REASONING_EFFORTS", "resolve_thinking"]

Family = Literal["v4.1", "v4"]

#: reasoning_effort values accepted (strings only: the recipe maps minimal->low, medium->high).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_CANONICAL_NAME = {"v4.1": "DeepSeek-V4.1-Flash", "v4": "DeepSeek-V4-Flash"}


@dataclass(frozen=True)
class ChatFormatConfig:
    """Server-wide chat settings.

    served_model_name: the name clients pass as `model` (also the canonical DeepSeek name of the
        family, and `extra_model_names`, are accepted).
    family: "v4.1" (DeepSeek-V4.1-Flash, `DeepseekV41Encoding`, spaced DSML) or "v4" (V4-Flash,
        `DeepseekV4Encoding`, `<｜DSML｜tool_calls>`).
    default_thinking: thinking mode when the request does not say.
    forced_tools_with_thinking: allow `tool_choice` required/named in thinking mode (enforced by
        grammar after `</think>`); False answers 400 like DeepSeek's API.
    context_limit: model context in tokens, for the default `max_tokens` and the length check.
    answer_reserve: in thinking mode with a forced tool call or format, the tokens of `max_tokens`
        kept for what follows the reasoning (at most half of `max_tokens`); see the module
        docstring. A request's `thinking_budget` replaces the bound this gives.
    """

    served_model_name: str = "deepseek-v4.1-flash"
    family: Family = "v4.1"
    extra_model_names: tuple[str, ...] = ()
    default_thinking: bool = True
    forced_tools_with_thinking: bool = True
    context_limit: int = 1_048_576
    answer_reserve: int = 1024

    def model_version(self):
        import deepseek_recipe as dr

        return {"v4.1": dr.ModelVersion.DeepseekV41Flash, "v4": dr.ModelVersion.DeepseekV4Pro}[
            self.family]

    def encoding(self):
        import deepseek_recipe as dr

        return {"v4.1": dr.DeepseekV41Encoding, "v4": dr.DeepseekV4Encoding}[self.family]()

    def model_names(self) -> tuple[str, ...]:
        names = [self.served_model_name, _CANONICAL_NAME[self.family], *self.extra_model_names]
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings as the recipe resolved them (temperature is 1.0 in thinking mode)."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    logprobs: bool
    top_logprobs: int | None
    stop: tuple[str, ...]


@dataclass
class PreparedChat:
    """A converted request: what the scheduler runs and how to read its output.

    `constraint` is None or what `grammar.GrammarFactory.state_for(...)` compiles; `parser_options`
    builds the `ChatOutputParser`; `recipe_request` is the deepseek-recipe `ConversationRequest`
    for servers that want its response objects.
    """

    model: str
    family: Family
    prompt_ids: list[int]
    prompt_text: str
    thinking: bool
    reasoning_effort: str | None
    reasoning_budget: int | None  # reasoning tokens before `</think>` is forced (None: unbounded)
    tools: list[dict[str, Any]]
    tool_choice: str  # "auto" | "none" | "required" | "named"
    parallel_tool_calls: bool
    constraint: OutputConstraint | None
    parser_options: ParserOptions
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    recipe_request: Any = field(repr=False, default=None)


def _bool_field(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ChatFormatError(name, f"must be a boolean, got {json.dumps(value)}")


def resolve_thinking(body: Mapping[str, Any], default: bool) -> tuple[bool, str | None]:
    """(thinking on?, reasoning_effort to render) from the request's spellings.

    Precedence: `thinking` > `chat_template_kwargs.thinking` / `.enable_thinking` >
    `reasoning_effort` ("none" turns thinking off, any other effort turns it on) > `default`.
    The effort is also read from `chat_template_kwargs.reasoning_effort`; it only matters when
    thinking is on.
    """
    effort = body.get("reasoning_effort")
    effort_field = "reasoning_effort"
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, Mapping):
        raise ChatFormatError("chat_template_kwargs", "must be an object")
    ctk = ctk or {}
    if effort is None and ctk.get("reasoning_effort") is not None:
        effort, effort_field = ctk["reasoning_effort"], "chat_template_kwargs.reasoning_effort"
    if effort is not None:
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            raise ChatFormatError(effort_field, f"must be one of {', '.join(REASONING_EFFORTS)}; "
                                  f"got {json.dumps(effort)}")

    thinking: bool | None = None
    t = body.get("thinking")
    if t is not None:
        if isinstance(t, bool):
            thinking = t
        elif isinstance(t, Mapping) and t.get("type") in ("enabled", "disabled"):
            thinking = t["type"] == "enabled"
        else:
            raise ChatFormatError("thinking", 'must be {"type": "enabled"} or '
                                  '{"type": "disabled"} (or a boolean)')
    if thinking is None:
        for key in ("thinking", "enable_thinking"):
            if ctk.get(key) is not None:
                thinking = _bool_field(ctk[key], f"chat_template_kwargs.{key}")
                break
    if thinking is None and effort is not None:
        thinking = effort != "none"
    if thinking is None:
        thinking = default
    if not thinking:
        return False, None
    return True, (None if effort == "none" else effort)


_FIELD_HINTS = (  # substrings of recipe error messages -> request field
    ("model", "model"), ("tool_choice", "tool_choice"), ("tool_call", "tool_choice"),
    ("tools", "tools"), ("function", "tools"), ("required properties", "tools"),
    ("strict", "tools"), ("response_format", "response_format"),
    ("'json'", "response_format"), ("json_schema", "response_format"),
    ("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
    ("top_logprobs", "top_logprobs"), ("logprobs", "logprobs"), ("n value", "n"),
    ("stop", "stop"), ("seed", "seed"), ("reasoning", "reasoning_effort"),
    ("thinking", "thinking"), ("messages", "messages"), ("message", "messages"),
    ("role", "messages"), ("content", "messages"),
)


def _guess_field(message: str) -> str | None:
    low = message.lower()
    for needle, fld in _FIELD_HINTS:
        if needle in low:
            return fld
    return None


def _from_recipe_error(exc: Exception, default_field: str | None = None) -> ChatFormatError:
    """ConversionError (status + OpenAI body) or ValueError (body did not deserialize)."""
    status = getattr(exc, "status_code", 400) or 400
    message, param = str(exc), None
    body = getattr(exc, "body", None)
    if body:
        try:
            err = json.loads(body)["error"]
            message, param = err.get("message", message), err.get("param")
        except (ValueError, KeyError, TypeError):
            message = str(body)
    message = re.sub(r"^invalid request body:\s*", "", message)
    fld = param or _guess_field(message) or default_field
    return ChatFormatError(fld, message, status=status if 400 <= status < 500 else 400)


_BUDGET_FIELDS = ("thinking_budget", "thinking_token_budget")  # ours/SGLang's, vLLM's


def _thinking_budget(out: dict[str, Any]) -> tuple[str, int] | None:
    """(field, value) of the request's reasoning-token cap, popped from the body the recipe sees;
    `thinking_budget` wins over `thinking_token_budget`."""
    found = None
    for name in _BUDGET_FIELDS:
        v = out.pop(name, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ChatFormatError(name, f"must be a non-negative integer (reasoning tokens), got "
                                  f"{json.dumps(v)}")
        found = found or (name, v)
    return found


class ChatPromptBuilder:
    """Turns request bodies into `PreparedChat`. One per server (thread-safe: no mutable state)."""

    def __init__(self, tokenizer: Tokenizer, config: ChatFormatConfig = ChatFormatConfig()) -> None:
        import deepseek_recipe as dr

        self.tokenizer = tokenizer
        self.config = config
        needed = ["bos", "eos", "think_start", "think_end", "user", "assistant", "dsml"]
        if config.family == "v4.1":
            needed.append("system")
        missing = [SPECIAL[k] for k in needed if tokenizer.maybe_token_id(SPECIAL[k]) is None]
        if missing:
            raise ValueError(
                f"tokenizer lacks special token(s) {missing} needed by the {config.family} chat "
                f"format (the V4 tokenizer.json has no <｜System｜>: V4.1 prompts need the V4.1 "
                f"checkpoint's tokenizer.json)")
        version = config.model_version()
        self._options = dr.ConversionOptions().with_model_versions_by_name(
            {name: version for name in config.model_names()}).with_default_thinking_mode(
            config.default_thinking)
        self._encoding = config.encoding().with_tokenizer(tokenizer.recipe_tokenizer())
        self._render = config.encoding()

    # ------------------------------------------------------------------------------------ body
    def _normalize(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Our request spellings -> the body deepseek-recipe converts, plus what we keep aside."""
        if not isinstance(body, Mapping):
            raise ChatFormatError(None, "the request body must be a JSON object")
        out = copy.deepcopy(dict(body))
        side: dict[str, Any] = {}
        out.setdefault("model", self.config.served_model_name)
        if not isinstance(out["model"], str):
            raise ChatFormatError("model", "must be a string")

        msgs = out.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ChatFormatError("messages", "must be a non-empty array of messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ChatFormatError(f"messages[{i}]", "must be an object")
            role = m.get("role")
            if role == "developer":  # OpenAI's newer name for the system role
                m["role"] = "system"
            elif role not in ("system", "user", "assistant", "tool", "latest_reminder"):
                raise ChatFormatError(f"messages[{i}].role",
                                      f"unsupported role {json.dumps(role)} (use system, "
                                      f"developer, user, assistant or tool)")
            content = m.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, Mapping) and part.get("type") not in (None, "text"):
                        raise ChatFormatError(f"messages[{i}].content[{j}]",
                                              f"content part type {json.dumps(part.get('type'))}"
                                              f" is not supported (text only)")

        mct = out.pop("max_completion_tokens", None)  # OpenAI's newer name; the recipe reads
        if mct is not None and out.get("max_tokens") is None:  # only max_tokens
            out["max_tokens"] = mct

        thinking, effort = resolve_thinking(out, self.config.default_thinking)
        out.pop("chat_template_kwargs", None)
        out["thinking"] = {"type": "enabled" if thinking else "disabled"}
        if effort is None:
            out.pop("reasoning_effort", None)
        else:
            out["reasoning_effort"] = effort
        side["thinking"], side["effort"] = thinking, effort
        side["thinking_budget"] = _thinking_budget(out)

        # tools / tool_choice
        tools = out.get("tools") or []
        if not isinstance(tools, list):
            raise ChatFormatError("tools", "must be an array")
        tc = out.get("tool_choice", "auto" if tools else "none")
        named = None
        if isinstance(tc, Mapping):
            named = (tc.get("function") or {}).get("name") if isinstance(
                tc.get("function"), Mapping) else None
            if tc.get("type") != "function" or not isinstance(named, str):
                raise ChatFormatError("tool_choice", 'a named tool choice must be {"type": '
                                      '"function", "function": {"name": ...}}')
            mode = "named"
        elif tc in ("auto", "none", "required"):
            mode = tc
        else:
            raise ChatFormatError("tool_choice", 'must be "auto", "none", "required" or a named '
                                  'function')
        if mode in ("required", "named") and not tools:
            raise ChatFormatError("tool_choice", f"tool_choice {json.dumps(tc)} needs `tools`")
        ptc = out.pop("parallel_tool_calls", True)
        side["parallel_tool_calls"] = _bool_field(ptc, "parallel_tool_calls")
        side["tool_mode"], side["forced_in_thinking"] = mode, False
        if mode in ("required", "named") and thinking:
            if not self.config.forced_tools_with_thinking:
                raise ChatFormatError("tool_choice", "thinking mode does not support this "
                                      "tool_choice (disable thinking or use \"auto\")")
            side["forced_in_thinking"] = True
            out["tool_choice"] = "auto"
            if named is not None:
                keep = [t for t in tools if isinstance(t, Mapping) and isinstance(
                    t.get("function"), Mapping) and t["function"].get("name") == named]
                if not keep:
                    raise ChatFormatError("tool_choice", f"no function named {named!r} was "
                                          f"specified in the 'tools' parameter")
                out["tools"] = keep

        # structured output spellings (SGLang)
        for key in ("regex", "ebnf"):
            if key in out:
                val = out.pop(key)
                if val is not None:
                    if not isinstance(val, str) or not val:
                        raise ChatFormatError(key, "must be a non-empty string")
                    side[key] = val
        rf = out.get("response_format")
        if rf is not None and not isinstance(rf, Mapping):
            raise ChatFormatError("response_format", "must be an object")
        rf_type = (rf or {}).get("type", "text")
        given = [k for k, on in (("response_format", rf_type != "text"), ("regex", "regex" in side),
                                 ("ebnf", "ebnf" in side)) if on]
        if len(given) > 1:
            raise ChatFormatError(given[1], f"only one of {', '.join(given)} may be set")
        if rf_type == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, Mapping) or not isinstance(js.get("schema", {}), (Mapping, bool)):
                raise ChatFormatError("response_format.json_schema",
                                      'must be {"name": ..., "schema": {...}}')
        return out, side

    # ------------------------------------------------------------------------------------ build
    def build(self, body: Mapping[str, Any] | bytes | str) -> PreparedChat:
        """Validate, convert, render and encode one Chat Completions request body."""
        import deepseek_recipe as dr

        if isinstance(body, (bytes, str)):
            try:
                body = json.loads(body)
            except ValueError as e:
                raise ChatFormatError(None, f"the request body is not valid JSON: {e}") from None
        out, side = self._normalize(body)
        try:
            req = dr.ChatCompletionRequest(out).convert(self._options)
        except (dr.ConversionError, ValueError) as e:
            raise _from_recipe_error(e) from None
        conv = req.conversation
        rendered = self._render.render_conversation(conv)
        if rendered.image_sources:
            raise ChatFormatError("messages", "image inputs are not supported by this server")
        try:
            ids = self._encoding.encode(conv)
        except RuntimeError as e:
            raise ChatFormatError("messages", f"could not encode the prompt: {e}") from None
        try:
            max_tokens = req.resolve_max_tokens(len(ids), self.config.context_limit)
        except dr.ConversionError as e:
            raise _from_recipe_error(e, "max_tokens") from None

        thinking = bool(conv.thinking_mode)
        po = req.parsing_options
        parser_options = ParserOptions.from_recipe(po)
        tools = [json.loads(json.dumps(t)) for t in (out.get("tools") or [])]
        constraint = self._constraint(req, side, thinking, parser_options)
        constraint = self._bound_reasoning(constraint, side, thinking, max_tokens)
        inf = req.inference_options
        so = out.get("stream_options") or {}
        return PreparedChat(
            model=out["model"], family=self.config.family, prompt_ids=ids,
            prompt_text=rendered.prompt, thinking=thinking,
            reasoning_effort=conv.reasoning_effort if thinking else None,
            reasoning_budget=constraint.reasoning_budget if constraint is not None else None,
            tools=tools, tool_choice=side["tool_mode"],
            parallel_tool_calls=side["parallel_tool_calls"], constraint=constraint,
            parser_options=parser_options,
            sampling=SamplingParams(
                temperature=float(inf.temperature if inf.temperature is not None else 1.0),
                top_p=float(inf.top_p if inf.top_p is not None else 1.0), max_tokens=max_tokens,
                seed=inf.seed, logprobs=bool(inf.logprobs), top_logprobs=inf.top_logprobs,
                stop=tuple(po.stop_sequences)),
            stream=bool(req.stream), include_usage=bool(isinstance(so, Mapping)
                                                        and so.get("include_usage")),
            recipe_request=req)

    def _bound_reasoning(self, c: OutputConstraint | None, side: dict[str, Any], thinking: bool,
                         max_tokens: int) -> OutputConstraint | None:
        """Set the reasoning budget (module docstring): the request's `thinking_budget`, else room
        for a forced call or format. Ignored without thinking, as `reasoning_effort` is."""
        if not thinking:
            return c
        asked = side["thinking_budget"]
        forced = c is not None and (c.kind != "tool_calls" or c.tool_mode == "required")
        if asked is not None:
            budget = asked[1]
        elif forced:
            budget = max(0, max_tokens - 1 - min(self.config.answer_reserve, max_tokens // 2))
        else:
            return c
        if c is None:  # a budget alone: unconstrained after the reasoning
            return OutputConstraint(kind="text", field=asked[0], thinking=True,
                                    family=self.config.family, reasoning_budget=budget)
        return dataclasses.replace(c, reasoning_budget=budget)

    def _constraint(self, req, side: dict[str, Any], thinking: bool,
                    parser_options: ParserOptions) -> OutputConstraint | None:
        """What grammar (if any) decoding must follow; see grammar.OutputConstraint."""
        conv = req.conversation
        tools_json = None
        if conv.tools and side["tool_mode"] != "none":
            tools_json = json.dumps([{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters,
                "strict": t.strict}} for t in conv.tools])
        common = dict(thinking=thinking, family=self.config.family,
                      parallel_tool_calls=side["parallel_tool_calls"])
        mode = side["tool_mode"]
        if mode in ("required", "named"):
            return OutputConstraint(
                kind="tool_calls", field="tool_choice", tools_json=tools_json,
                tool_mode="required", starts_in_tool_calls=parser_options.starts_in_tool_calls,
                # without thinking the prompt itself opens the calls block; with thinking only the
                # grammar can force the call
                required=side["forced_in_thinking"], **common)
        auto_tools = tools_json if mode == "auto" else None
        rf = conv.response_format
        if "regex" in side:
            return OutputConstraint(kind="regex", field="regex", pattern=side["regex"],
                                    tools_json=auto_tools, **common)
        if "ebnf" in side:
            return OutputConstraint(kind="ebnf", field="ebnf", pattern=side["ebnf"],
                                    tools_json=auto_tools, **common)
        if rf == "json_schema":
            return OutputConstraint(kind="json_schema", field="response_format.json_schema",
                                    schema_json=json.dumps(conv.response_schema),
                                    tools_json=auto_tools, **common)
        if rf == "json_object":
            return OutputConstraint(kind="json_object", field="response_format",
                                    tools_json=auto_tools, **common)
        if rf == "regex":
            return OutputConstraint(kind="regex", field="response_format",
                                    pattern=conv.response_regex, tools_json=auto_tools, **common)
        if auto_tools and any(t.strict for t in conv.tools):
            return OutputConstraint(kind="tool_calls", field="tools", tools_json=auto_tools,
                                    tool_mode="auto", **common)
        return None
