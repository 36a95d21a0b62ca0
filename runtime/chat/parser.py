"""Incremental parser: decoded model text in, OpenAI chat deltas out.

The model writes `reasoning</think>content` followed, optionally, by one DSML tool-call block:

    \\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

(V4.1 spells the tag names with a leading space; V4 wrote `<｜DSML｜tool_calls>`, `<｜DSML｜invoke ...>`,
`<｜DSML｜parameter ...>`. Both spellings are accepted everywhere.) `ChatOutputParser.feed(text)` takes
text chunks cut anywhere (single characters included) and returns `ChatDelta`s: `reasoning_content`,
`content`, and `tool_calls` deltas (one per call: its id, name and whole JSON `arguments`).

Why our own parser and not deepseek-recipe's `StreamProcessor`: the recipe processor is incremental
and agrees with this one on well-formed output (tests/runtime/chat/test_parser.py checks the final
reasoning/content/calls against it), but on anything else it loses or corrupts text, which is what
users of SGLang/vLLM complain about (anchors.md §4): an unknown `<｜DSML｜ x>` tag or a bad attribute
silently drops the rest of the answer, `string="false"` values that are not JSON (and a missing
`string` attribute) produce invalid `arguments` JSON, an unterminated block becomes a call with
truncated arguments, text after the block is dropped, and a DSML spelling inside the reasoning cuts
the reasoning and loses the answer. Its only inputs are whole protocol chunk generators (it emits
serialized ChatCompletion chunks with random ids), so wrapping it would still mean re-parsing its
JSON. This parser follows the recipe's whitespace conventions so both agree on well-formed text:
leading newlines of the reasoning and of the content are dropped, newlines right before
`</think>` and right before the calls block are dropped, and a stray `</think>` in the content is
dropped.

Guarantees:

* No partial markup in `content` or `reasoning_content`, in deltas or in the final message, at any
  finish reason: text that could be the start of a marker (a prefix of `</think>` or of a calls
  block opener, and the newlines that would belong to it; any unfinished `<｜DSML｜...` tag) is held
  back until it is decided, so the stream lags by at most one partial marker; `finish()` drops what
  is still undecided (see "At the end" below). A whole DSML tag outside a block (the model wrote
  one in its reasoning, or without the block opener) is text, as in deepseek-recipe.
* A tool call is reported only when its invoke is closed (`</｜DSML｜ invoke>`): one delta with its
  id, name and whole `arguments`, a valid JSON object. A call cut by the end of the output is never
  reported, streaming or not, so a client never sees a half call as if it were complete (SGLang's
  DSML detector does the same; a stream cannot take back fragments it already sent).
* Malformed markup (unknown tag, bad or missing attribute, text where a tag must be) never
  raises: the raw text of the broken invoke (with the block opener if no call of the block was
  complete yet) goes to `content`, the complete calls before it stay, and everything after is
  plain content. `notes` records what happened.
* `string="true"` values become JSON strings; `string="false"` values are emitted verbatim if they
  are valid JSON, otherwise as a JSON string (noted).

At the end (`finish(engine_finish_reason)`), the same for streaming and non-streaming:

* A held-back partial marker is dropped, with the newlines right before it.
* Held-back trailing newlines alone are text when the model ended the output itself (`stop`, as
  deepseek-recipe keeps them) and dropped when the output was cut (`length`, or any other reason).
* Inside an unfinished calls block: the calls already closed are kept; the open invoke's text
  (arguments cut mid-value included) is dropped and noted, not turned into `content` (raw DSML
  there would be shown to users, and sent back to the model as the assistant's text next turn).
* Inside unterminated reasoning: the reasoning so far stays `reasoning_content`; `content` is "".
* Finish reason: the engine's reason passes through unless it is `stop`; after `stop` it is
  `tool_calls` when a complete call was reported, else `stop`. So a call cut by `max_tokens` gives
  `length` and no call for it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ParserOptions", "ToolCallDelta", "ChatDelta", "ParsedToolCall", "ParsedMessage",
           "ChatOutputParser", "parse_completion"]

_THINK_END = "</think>"
_DSML = "｜DSML｜"
_OPEN = "<" + _DSML
_CLOSE = "</" + _DSML
_BLOCK_OPENERS = tuple(_OPEN + sp + name + ">" for sp in (" ", "") for name in ("calls", "tool_calls"))
_CONTENT_TRIGGERS = _BLOCK_OPENERS + (_THINK_END,)
_PARAM_CLOSERS = (_CLOSE + " parameter>", _CLOSE + "parameter>")
_TAG_RE = re.compile(r'<(/?)' + _DSML + r' ?([A-Za-z_]+)((?:\s+[^\s="<>/]+="[^"<>]*")*)\s*>')
_ATTR_RE = re.compile(r'([^\s="<>/]+)="([^"<>]*)"')
_MAX_TAG = 2048  # a DSML tag longer than this (no '>' yet) is malformed

_REASONING, _CONTENT, _BLOCK, _INVOKE, _VALUE, _RAW = range(6)


@dataclass(frozen=True)
class ParserOptions:
    """How the output starts.

    thinking: the output begins inside the reasoning (prompt ended with `<think>`).
    strip_leading_newlines: drop newlines at the very start (a new turn; False for a prefix
        continuation, as deepseek-recipe's `*Continuation` stages).
    starts_in_tool_calls: the prompt already opened the calls block (`tool_choice` required/named
        without thinking: the prompt ends with `</think>\\n\\n<｜DSML｜ calls>\\n`).
    parse_tool_calls: recognise DSML at all (False when the request declared no tools: then the
        markup is ordinary content, as in deepseek-recipe).
    """

    thinking: bool = True
    strip_leading_newlines: bool = True
    starts_in_tool_calls: bool = False
    parse_tool_calls: bool = True

    @classmethod
    def from_recipe(cls, parsing_options) -> "ParserOptions":
        """From a `deepseek_recipe.ParsingOptions` (the converted request's `.parsing_options`)."""
        import deepseek_recipe as dr

        stage = parsing_options.thinking_initial_stage
        cont = stage is not None and stage != dr.ThinkingInitialStage.ReasoningStart
        return cls(thinking=stage is not None and stage.starts_in_reasoning(),
                   strip_leading_newlines=not cont,
                   starts_in_tool_calls=bool(parsing_options.starts_in_tool_calls),
                   parse_tool_calls=bool(parsing_options.parse_tool_calls))


@dataclass
class ToolCallDelta:
    """One tool call as a stream delta. The parser sends each call once, whole (`id`, `name` and
    all of `arguments`); the OpenAI shape also allows later fragments without `id`/`name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        d["function"] = fn
        return d


@dataclass
class ChatDelta:
    """One OpenAI `choices[0].delta` (exactly one of the three parts is set), plus the finish
    reason on the last delta that `finish()` returns."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    finish_reason: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The `delta` object (without `role`, which the server adds to the first chunk)."""
        d: dict[str, Any] = {}
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return d


@dataclass
class ParsedToolCall:
    """A reported call: always complete (its invoke was closed), `arguments` a JSON object."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int) -> dict[str, Any]:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """Everything a parser emitted, accumulated (the non-streaming response)."""

    reasoning_content: str | None
    content: str
    tool_calls: list[ParsedToolCall]
    finish_reason: str | None
    notes: list[str]

    def to_openai(self) -> dict[str, Any]:
        """The `choices[0].message` object."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai(i) for i, c in enumerate(self.tool_calls)]
        return msg


def _default_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _first_of(buf: str, triggers) -> tuple[int, str]:
    """(index, trigger) of the trigger that starts earliest in buf (the first listed on a tie),
    (-1, "") where none occurs."""
    best, which = -1, ""
    for t in triggers:
        i = buf.find(t)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, t
    return best, which


def _partial_len(buf: str, patterns: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `patterns`."""
    n = min(len(buf), max(len(p) for p in patterns) - 1)
    for k in range(n, 0, -1):
        tail = buf[-k:]
        if any(p.startswith(tail) and len(p) > k for p in patterns):
            return k
    return 0


def _open_tag_len(buf: str) -> int:
    """Length of the suffix of `buf` that may be an unfinished DSML tag written outside a block
    (in reasoning, in content, after a broken block): from its last `<`, no `>` yet, and a prefix
    of `<｜DSML｜` / `</｜DSML｜` or longer. Held back so that a cut never leaves half a tag."""
    i = buf.rfind("<")
    if i < 0:
        return 0
    tail = buf[i:]
    if ">" in tail or len(tail) > _MAX_TAG:
        return 0
    if any(tail.startswith(t) or t.startswith(tail) for t in (_OPEN, _CLOSE)):
        return len(tail)
    return 0


def _reject_constant(name: str):
    raise ValueError(name)


def _json_value(raw: str) -> str | None:
    """`raw` stripped if it is one valid JSON value (NaN/Infinity are not), else None."""
    v = raw.strip()
    if not v:
        return None
    try:
        json.loads(v, parse_constant=_reject_constant)
    except ValueError:
        return None
    return v


class ChatOutputParser:
    """Streaming parser for one choice. `feed()` per decoded chunk, `finish()` once at the end,
    then `result()` for the accumulated message."""

    def __init__(self, options: ParserOptions = ParserOptions(), *,
                 id_factory: Callable[[int], str] = _default_id) -> None:
        self.options = options
        self._new_id = id_factory
        self._buf = ""
        self._out: list[ChatDelta] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ParsedToolCall] = []
        self.notes: list[str] = []
        self._finished = False
        self._finish_reason: str | None = None
        self._pending_nl = ""  # trailing newlines held back (dropped before </think> / a block)
        self._strip_nl = options.strip_leading_newlines
        self._strip_ws = False  # after a calls block: drop whitespace
        self._raw = ""  # raw text of the open invoke (+ the block opener before the first call)
        self._block_calls = 0  # calls of the open block already reported
        self._call: dict[str, Any] | None = None  # the invoke being parsed
        self._param: dict[str, Any] | None = None  # the parameter being parsed
        if options.parse_tool_calls and options.starts_in_tool_calls:
            self._mode = _BLOCK
            self._strip_nl = False
        elif options.thinking:
            self._mode = _REASONING
        else:
            self._mode = _CONTENT

    # ------------------------------------------------------------------ public
    def feed(self, text: str) -> list[ChatDelta]:
        if self._finished:
            raise RuntimeError("parser already finished")
        if text:
            self._buf += text
            while self._step():
                pass
        return self._take()

    def finish(self, engine_finish_reason: str = "stop") -> list[ChatDelta]:
        """End of generation: resolve what is held back and return the remaining deltas, the last
        one with the finish reason. `engine_finish_reason` is `stop` when the model ended the
        output itself (EOS, a stop token or string, the grammar's end), else why it was cut
        (`length`, `content_filter`, `abort`, `error`); see the module docstring."""
        if self._finished:
            return []
        while self._step():
            pass
        cut = engine_finish_reason != "stop"
        if self._mode in (_BLOCK, _INVOKE, _VALUE):
            self._drop_open_block(engine_finish_reason)
        else:  # _REASONING, _CONTENT, _RAW: the buffer holds at most a partial marker
            kind = "reasoning" if self._mode == _REASONING else "content"
            if self._buf:
                self.notes.append(f"dropped {self._buf!r} at the end of the {kind}: the start of "
                                  f"a marker that the output ({engine_finish_reason}) never "
                                  f"finished")
            elif self._pending_nl and not cut:
                self._emit(kind, self._pending_nl)
        self._buf = self._pending_nl = ""
        self._finished = True
        if engine_finish_reason == "stop":
            reason = "tool_calls" if self._calls else "stop"
        else:
            reason = engine_finish_reason
        self._finish_reason = reason
        out = self._take()
        if out:
            out[-1].finish_reason = reason
        else:
            out = [ChatDelta(finish_reason=reason)]
        return out

    def result(self) -> ParsedMessage:
        return ParsedMessage(
            reasoning_content="".join(self._reasoning) if self.options.thinking else None,
            content="".join(self._content), tool_calls=list(self._calls),
            finish_reason=self._finish_reason, notes=list(self.notes))

    @property
    def tool_calls_emitted(self) -> int:
        return len(self._calls)

    # ------------------------------------------------------------------ emission
    def _take(self) -> list[ChatDelta]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if kind == "reasoning":
            self._reasoning.append(text)
            if last is not None and last.reasoning_content is not None:
                last.reasoning_content += text
            else:
                self._out.append(ChatDelta(reasoning_content=text))
        else:
            self._content.append(text)
            if last is not None and last.content is not None:
                last.content += text
            else:
                self._out.append(ChatDelta(content=text))

    def _emit_call(self) -> None:
        """The open invoke closed: report it whole."""
        call = self._call
        assert call is not None
        args = "{}" if call["nparams"] == 0 else call["args"] + "}"
        index = len(self._calls)
        parsed = ParsedToolCall(id=self._new_id(index), name=call["name"], arguments=args)
        self._calls.append(parsed)
        self._block_calls += 1
        self._out.append(ChatDelta(tool_calls=[ToolCallDelta(index, parsed.id, parsed.name,
                                                             args)]))

    def _emit_text(self, kind: str, text: str) -> None:
        """Reasoning or content text, holding back trailing newlines (they may belong to the next
        marker) and dropping leading ones at the start of a part."""
        if self._strip_nl:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_nl = False
        text = self._pending_nl + text
        body = text.rstrip("\n")
        self._pending_nl = text[len(body):]
        self._emit(kind, body)

    # ------------------------------------------------------------------ state machine
    def _step(self) -> bool:
        """Consume what can be decided from the buffer; True if progress was made and the loop
        should run again."""
        if not self._buf:
            return False
        mode = self._mode
        if mode == _REASONING:
            return self._step_reasoning()
        if mode == _CONTENT:
            return self._step_content()
        if mode == _RAW:
            text = self._consume(len(self._buf) - _open_tag_len(self._buf))
            self._emit("content", self._pending_nl + text)
            self._pending_nl = ""
            return False
        if mode == _VALUE:
            return self._step_value()
        return self._step_tags()

    def _consume(self, n: int) -> str:
        s, self._buf = self._buf[:n], self._buf[n:]
        return s

    def _consume_raw(self, n: int) -> str:
        """Consume block markup, remembering it in case the invoke breaks."""
        s = self._consume(n)
        self._raw += s
        return s

    def _step_reasoning(self) -> bool:
        buf = self._buf
        i = buf.find(_THINK_END)
        if i >= 0:
            self._emit_text("reasoning", buf[:i])
            self._consume(i + len(_THINK_END))
            self._pending_nl = ""  # newlines before </think> are dropped
            self._mode = _CONTENT
            self._strip_nl = True
            return True
        hold = max(_partial_len(buf, (_THINK_END,)), _open_tag_len(buf))
        self._emit_text("reasoning", self._consume(len(buf) - hold))
        return False

    def _step_content(self) -> bool:
        if self._strip_ws:
            stripped = self._buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            self._buf = stripped
            self._strip_ws = False
        buf = self._buf
        triggers = _CONTENT_TRIGGERS if self.options.parse_tool_calls else (_THINK_END,)
        best, which = _first_of(buf, triggers)
        if best < 0:
            hold = max(_partial_len(buf, triggers), _open_tag_len(buf))
            self._emit_text("content", self._consume(len(buf) - hold))
            return False
        self._emit_text("content", self._consume(best))
        self._consume(len(which))
        if which == _THINK_END:
            self.notes.append("dropped a stray </think> in the content")
            return True
        # a calls block opens: the newlines before it belong to its markup
        self._raw = self._pending_nl + which
        self._pending_nl = ""
        self._strip_nl = False
        self._block_calls = 0
        self._mode = _BLOCK
        return True

    def _step_tags(self) -> bool:
        """_BLOCK (between invokes) and _INVOKE (between parameters): whitespace, then a tag."""
        buf = self._buf
        stripped = buf.lstrip()
        if len(stripped) != len(buf):
            self._consume_raw(len(buf) - len(stripped))
            buf = self._buf
            if not buf:
                return False
        if not (buf.startswith(_OPEN) or buf.startswith(_CLOSE)):
            if _OPEN.startswith(buf) or _CLOSE.startswith(buf):
                return False  # could still become a tag
            self._malformed(f"unexpected text {buf[:20]!r} inside the tool-call block")
            return True
        j = buf.find(">")
        if j < 0:
            if len(buf) > _MAX_TAG:
                self._malformed("unterminated DSML tag")
                return True
            return False
        tag = buf[:j + 1]
        m = _TAG_RE.fullmatch(tag)
        if m is None:
            self._malformed(f"bad DSML tag {tag[:80]!r}")
            return True
        closing, name, attr_text = m.group(1) == "/", m.group(2), m.group(3)
        attrs = dict(_ATTR_RE.findall(attr_text))
        if self._mode == _BLOCK:
            if closing and name in ("calls", "tool_calls"):
                self._consume(j + 1)
                self._end_block()
                return True
            if not closing and name == "invoke" and attrs.get("name"):
                self._note_extra_attrs(attrs, ("name",), tag)
                self._consume_raw(j + 1)
                self._call = {"name": attrs["name"], "args": "", "nparams": 0}
                self._mode = _INVOKE
                return True
            self._malformed(f"expected an invoke tag, got {tag[:80]!r}")
            return True
        # _INVOKE
        if closing and name == "invoke":
            self._consume(j + 1)
            self._emit_call()
            self._call = None
            self._raw = ""
            self._mode = _BLOCK
            return True
        if (not closing and name == "parameter" and attrs.get("name")
                and attrs.get("string") in ("true", "false")):
            self._note_extra_attrs(attrs, ("name", "string"), tag)
            self._consume_raw(j + 1)
            call = self._call
            assert call is not None
            call["args"] += (("{" if call["nparams"] == 0 else ", ")
                             + json.dumps(attrs["name"], ensure_ascii=False) + ": ")
            call["nparams"] += 1
            self._param = {"name": attrs["name"], "string": attrs["string"] == "true",
                           "value": ""}
            self._mode = _VALUE
            return True
        self._malformed(f"expected a parameter tag or </{_DSML} invoke>, got {tag[:80]!r}")
        return True

    def _step_value(self) -> bool:
        buf = self._buf
        param, call = self._param, self._call
        assert param is not None and call is not None
        best, which = _first_of(buf, _PARAM_CLOSERS)
        if best < 0:
            hold = _partial_len(buf, _PARAM_CLOSERS)
            param["value"] += self._consume_raw(len(buf) - hold)
            return False
        raw = param["value"] + self._consume_raw(best)
        self._consume_raw(len(which))
        if param["string"]:
            call["args"] += json.dumps(raw, ensure_ascii=False)
        else:
            value = _json_value(raw)
            if value is None:
                self.notes.append(f"tool call {len(self._calls)} ({call['name']}): parameter "
                                  f"{param['name']!r} has string=\"false\" but is not valid "
                                  f"JSON; passed as a string")
                value = json.dumps(raw, ensure_ascii=False)
            call["args"] += value
        self._param = None
        self._mode = _INVOKE
        return True

    def _note_extra_attrs(self, attrs: dict[str, str], known: tuple[str, ...], tag: str) -> None:
        extra = sorted(set(attrs) - set(known))
        if extra:
            self.notes.append(f"ignored unknown attribute(s) {extra} in {tag[:80]!r}")

    def _end_block(self) -> None:
        self._call = None
        self._raw = ""
        self._mode = _CONTENT
        self._strip_ws = True

    def _malformed(self, why: str) -> None:
        """Give up on the current block: the open invoke's raw text (and the opener if no call of
        the block was complete) and the rest become content; see the module docstring."""
        where = "after complete calls" if self._block_calls else "in the tool-call block"
        self.notes.append(f"malformed tool-call markup {where} ({why}); returned as content")
        text = self._raw + self._buf
        self._buf = self._raw = ""
        self._call = self._param = None
        self._mode = _RAW
        self._emit("content", text)

    def _drop_open_block(self, reason: str) -> None:
        """The output ended inside a calls block: keep the closed calls, drop the rest."""
        call = self._call
        what = (f"inside tool call {len(self._calls)} ({call['name']})" if call is not None
                else "inside the tool-call block")
        if call is not None or self._raw.strip() or self._buf.strip():
            self.notes.append(f"the output ({reason}) ended {what}; its partial text was "
                              f"dropped")
        self._buf = self._raw = ""
        self._call = self._param = None


def parse_completion(text: str, options: ParserOptions = ParserOptions(), *,
                     engine_finish_reason: str = "stop",
                     id_factory: Callable[[int], str] = _default_id) -> ParsedMessage:
    """One-shot parse of a whole completion (the non-streaming path)."""
    p = ChatOutputParser(options, id_factory=id_factory)
    p.feed(text)
    p.finish(engine_finish_reason)
    return p.result()
