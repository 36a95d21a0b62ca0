"""The top-level request fields of /v1/completions and /v1/chat/completions: their JSON types,
ranges and whether the server uses them; one table that both checks requests and writes the
request schemas of /openapi.json, so that the two cannot disagree.

Unknown fields get a 400 naming them, as OpenAI answers ("Unrecognized request argument
supplied"): a misspelt `max_token` or `temprature` silently ignored is a wrong answer, not
forward compatibility. A field is one of

* used: the server implements it;
* ignored: accepted with no effect because it has none here (`user`, `metadata`, `store`, ...:
  bookkeeping fields of OpenAI's platform that official clients and proxies send);
* unsupported: an OpenAI field this server cannot honour (`audio`, `prediction`, ...): 400 saying
  so, unless its value is null.

A null value means the field is absent (OpenAI's reading); nulls are dropped before the routes
see the body. The routes check what depends on more than one field or on the model (context
length, vocabulary ids, prompt shapes); the table checks each field alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import bad_request, brief
from .protocol import context_error

INT64 = (-2**63, 2**63 - 1)
INT32_MAX = 2**31 - 1
MAX_TOOLS = 128  # OpenAI's limit
MAX_STOP = 16
MAX_PROMPTS = 64
MAX_MESSAGES = 16384  # bounds the cost of a body of many tiny messages (they can render to nothing)
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

_PY = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
       "object": dict, "array": list}


@dataclass(frozen=True)
class Field:
    types: tuple[str, ...]  # JSON types accepted
    lo: float | None = None  # numbers: inclusive bounds (lo_open: exclusive lower bound)
    hi: float | None = None
    lo_open: bool = False
    enum: tuple[Any, ...] | None = None  # strings: the values accepted
    max_items: int | None = None  # arrays
    min_items: int | None = None
    items: "Field | None" = None  # arrays: every item
    props: Mapping[str, "Field"] | None = None  # objects whose keys are all known
    keys: Mapping[str, "Field"] | None = None  # objects: these keys' types (others pass on)
    use: str = "used"  # used | ignored | unsupported
    doc: str = ""
    schema: dict | None = None  # extra JSON schema (array items, object shapes) for /openapi.json

    def check(self, name: str, v: Any) -> None:
        if not any(_is(t, v) for t in self.types):
            raise bad_request(name, f"must be {_kinds(self.types)}, got {_json_kind(v)} "
                              f"{brief(v)}", "invalid_type")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            lo_bad = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
            if lo_bad or (self.hi is not None and v > self.hi):
                raise bad_request(name, f"must be in {self.range_text()}, got {brief(v)}")
        if self.enum is not None and isinstance(v, str) and v not in self.enum:
            raise bad_request(name, f"must be one of {', '.join(map(str, self.enum))}; got "
                              f"{brief(v)}")
        if isinstance(v, list):
            if self.max_items is not None and len(v) > self.max_items:
                raise bad_request(name, f"at most {self.max_items} items, got {len(v)}")
            if self.min_items is not None and len(v) < self.min_items:
                raise bad_request(name, f"at least {self.min_items} item(s), got {len(v)}")
            if self.items is not None and not self.items.takes_all(v):
                for i, x in enumerate(v):
                    self.items.check(f"{name}[{i}]", x)
        if self.keys is not None and isinstance(v, dict):
            for k, spec in self.keys.items():
                if v.get(k) is not None:
                    spec.check(f"{name}.{k}", v[k])
        if self.props is not None and isinstance(v, dict):
            for k, sub in v.items():
                spec = self.props.get(k)
                if spec is None:
                    raise unknown_field(f"{name}.{k}", self.props)
                if sub is not None:
                    spec.check(f"{name}.{k}", sub)

    def takes_all(self, items: list) -> bool:
        """A C-speed pass for long arrays of plain integers or strings (token-id prompts can
        hold a whole context): True when every item passes; False sends the caller through the
        items one by one, to name the first bad one."""
        if self.enum is not None:
            return False
        kinds = set(map(type, items))
        if "integer" in self.types and kinds <= {int}:
            return not items or ((self.lo is None or (min(items) > self.lo if self.lo_open
                                                      else min(items) >= self.lo))
                                 and (self.hi is None or max(items) <= self.hi))
        return "string" in self.types and kinds <= {str}

    def range_text(self) -> str:
        lo = "-inf" if self.lo is None else _num_text(self.lo)
        hi = "inf" if self.hi is None else _num_text(self.hi)
        return f"{'(' if self.lo_open else '['}{lo}, {hi}]"

    def json_schema(self, nullable: bool = True) -> dict[str, Any]:
        if self.use == "unsupported":
            return {"type": "null", "description": f"not supported: {self.doc}"}
        s: dict[str, Any] = {"type": [*self.types, "null"] if nullable else list(self.types)}
        if self.lo is not None:
            s["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            s["maximum"] = self.hi
        if self.enum is not None:
            s["enum"] = [*self.enum, None] if nullable else list(self.enum)
        if self.max_items is not None:
            s["maxItems"] = self.max_items
        if self.min_items is not None:
            s["minItems"] = self.min_items
        if self.items is not None:
            s["items"] = self.items.json_schema(nullable=False)
        if self.props is not None:
            s["properties"] = {k: f.json_schema() for k, f in self.props.items()}
            s["additionalProperties"] = False
        if self.keys is not None:
            s["properties"] = {k: f.json_schema() for k, f in self.keys.items()}
        if self.schema:
            s.update(self.schema)
        doc = self.doc or ("accepted, no effect on this server" if self.use == "ignored" else "")
        if doc:
            s["description"] = doc
        return s


def _is(t: str, v: Any) -> bool:
    if isinstance(v, bool):
        return t == "boolean"
    return isinstance(v, _PY[t])


def _json_kind(v: Any) -> str:
    for t in ("boolean", "integer", "number", "string", "array", "object"):
        if _is(t, v):
            return {"integer": "an integer", "number": "a number", "array": "an array",
                    "object": "an object"}.get(t, f"a {t}")
    return "null"


def _kinds(types: tuple[str, ...]) -> str:
    names = {"string": "a string", "integer": "an integer", "number": "a number",
             "boolean": "a boolean", "object": "an object", "array": "an array"}
    return " or ".join(names[t] for t in types)


def _num_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def unknown_field(name: str, known: Mapping[str, Field]):
    return bad_request(name, f"unrecognized request field (this endpoint takes "
                       f"{', '.join(sorted(known))})", "unknown_field")


@dataclass
class Endpoint:
    """The fields of one route and which of them must be present."""

    fields: dict[str, Field]
    required: tuple[str, ...] = ()
    examples: dict[str, Any] = field(default_factory=dict)
    first: Callable[[Mapping[str, Any]], None] | None = None  # cheap checks that make others moot

    def check(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`body` without its null fields, or a 400 naming the first bad field."""
        if self.first is not None:
            self.first(body)
        out = {}
        for k, v in body.items():
            spec = self.fields.get(k)
            if spec is None:
                raise unknown_field(k, self.fields)
            if v is None:
                continue
            spec.check(k, v)
            if spec.use == "unsupported":
                raise bad_request(k, f"not supported by this server ({spec.doc})", "unsupported")
            out[k] = v
        for k in self.required:
            if k not in out:
                raise bad_request(k, "is required", "missing_field")
        return out

    def json_schema(self) -> dict[str, Any]:
        return {"type": "object", "required": list(self.required), "additionalProperties": False,
                "properties": {k: f.json_schema() for k, f in self.fields.items()},
                **({"example": self.examples} if self.examples else {})}


def _common(service) -> dict[str, Field]:
    vocab, cap, max_n = service.engine.cfg.vocab_size, service.capacity, service.config.max_n
    ignored = "accepted, no effect on this server"
    return {
        "model": Field(("string",), doc="a name from GET /v1/models (default: the served model)"),
        "stream": Field(("boolean",)),
        "stream_options": Field(("object",), props={
            "include_usage": Field(("boolean",)),
            "continuous_usage_stats": Field(("boolean",), use="ignored", doc=ignored),
            "include_obfuscation": Field(("boolean",), use="ignored", doc=ignored)}),
        "n": Field(("integer",), 1, max_n),
        "max_tokens": Field(("integer",), 0, INT32_MAX,
                            doc=f"prompt + max_tokens must fit the context ({cap} tokens)"),
        "temperature": Field(("number",), 0, 2),
        "top_p": Field(("number",), 0, 1, lo_open=True),
        "stop": Field(("string", "array"), max_items=MAX_STOP, items=Field(("string",))),
        "frequency_penalty": Field(("number",), -2, 2),
        "presence_penalty": Field(("number",), -2, 2),
        "logit_bias": Field(("object",), schema={"additionalProperties": {
            "type": "number", "minimum": -100, "maximum": 100}}),
        "user": Field(("string",), use="ignored", doc=ignored),
        "top_k": Field(("integer",), -1, vocab, doc="0 or -1: off"),
        "min_p": Field(("number",), 0, 1),
        "repetition_penalty": Field(("number",), 0, 2, lo_open=True),
        "stop_token_ids": Field(("array",), max_items=256, items=Field(("integer",), 0, vocab - 1)),
        "ignore_eos": Field(("boolean",)),
    }


def _token_lists_fit(body: Mapping[str, Any], capacity: int) -> None:
    """A token-id prompt of `capacity` ids or more can never fit: refused before its ids are
    checked one by one (a 32 MiB body holds ten million of them)."""
    p = body.get("prompt")
    if not isinstance(p, list) or not p:
        return
    for ids in [p] if type(p[0]) is int else p:
        if isinstance(ids, list) and len(ids) >= capacity:
            mt = body.get("max_tokens")
            raise context_error("prompt", capacity, len(ids),
                                mt if type(mt) is int and 0 < mt <= INT32_MAX else 1)


def completions_endpoint(service) -> Endpoint:
    vocab, max_n, cap = service.engine.cfg.vocab_size, service.config.max_n, service.capacity
    token = Field(("integer",), 0, vocab - 1)
    f = _common(service)
    f.update({
        "prompt": Field(("string", "array"), min_items=1, items=Field(
            ("integer", "string", "array"), 0, vocab - 1, min_items=1, items=token),
            doc=f"text, token ids, or a list of up to {MAX_PROMPTS} of either"),
        "seed": Field(("integer",), *INT64),
        "logprobs": Field(("integer",), 0, 20),
        "echo": Field(("boolean",)),
        "best_of": Field(("integer",), 1, max_n, doc="equal to n (no server-side best-of)"),
        "suffix": Field(("string",), doc="not supported: only an empty suffix is accepted"),
    })
    return Endpoint(f, ("prompt",), {"model": service.model_name, "prompt": "Hello",
                                     "max_tokens": 16}, lambda body: _token_lists_fit(body, cap))


def chat_endpoint(service) -> Endpoint:
    obj = ("object",)
    f = _common(service)
    f.update({
        "messages": Field(("array",), min_items=1, max_items=MAX_MESSAGES, items=Field(obj, keys={
            "role": Field(("string",), enum=ROLES), "content": Field(("string", "array")),
            "name": Field(("string",)), "tool_call_id": Field(("string",)),
            "tool_calls": Field(("array",)), "reasoning_content": Field(("string",))},
            schema={"required": ["role"]})),
        "max_tokens": Field(("integer",), 1, INT32_MAX),
        "max_completion_tokens": Field(("integer",), 1, INT32_MAX),
        "seed": Field(("integer",), 0, INT64[1]),
        "logprobs": Field(("boolean",)),
        "top_logprobs": Field(("integer",), 0, 20),
        "tools": Field(("array",), max_items=MAX_TOOLS, items=Field(obj)),
        "tool_choice": Field(("string", "object"), schema={
            "description": '"auto", "none", "required" or {"type": "function", "function": '
                           '{"name": ...}}'}),
        "parallel_tool_calls": Field(("boolean",)),
        "response_format": Field(obj),
        "thinking": Field(("boolean", "object"),
                          doc='true/false or {"type": "enabled"|"disabled"}'),
        "chat_template_kwargs": Field(obj, doc='{"thinking": bool} / {"enable_thinking": bool}'),
        "reasoning_effort": Field(("string",), enum=("none", "minimal", "low", "medium", "high",
                                                     "xhigh", "max")),
        "thinking_budget": Field(("integer",), 0, INT32_MAX,
                                 doc="reasoning tokens at most (thinking mode; needs xgrammar)"),
        "thinking_token_budget": Field(("integer",), 0, INT32_MAX,
                                       doc="vLLM's spelling of thinking_budget"),
        "regex": Field(("string",)),
        "ebnf": Field(("string",)),
        "metadata": Field(obj, use="ignored"),
        "store": Field(("boolean",), use="ignored"),
        "service_tier": Field(("string",), use="ignored"),
        "prompt_cache_key": Field(("string",), use="ignored"),
        "safety_identifier": Field(("string",), use="ignored"),
        "modalities": Field(("array",), items=Field(("string",), enum=("text",)),
                            doc='only ["text"]'),
        "audio": Field(obj, use="unsupported", doc="text only"),
        "prediction": Field(obj, use="unsupported", doc="no predicted outputs"),
        "web_search_options": Field(obj, use="unsupported", doc="no web search"),
        "functions": Field(("array",), use="unsupported", doc="use `tools`"),
        "function_call": Field(("string", "object"), use="unsupported", doc="use `tool_choice`"),
        "verbosity": Field(("string",), use="unsupported", doc="the model has no such control"),
    })
    return Endpoint(f, ("messages",), {"model": service.model_name, "max_tokens": 16,
                                       "messages": [{"role": "user", "content": "Hello!"}]})
