"""Structured output: request constraints -> xgrammar matchers a batch sampler can drive.

What is constrained (the `OutputConstraint` that `encoding.ChatPromptBuilder` derives):

* `response_format: {"type": "json_object"}` -> any JSON object;
  `{"type": "json_schema", "json_schema": {"schema": ...}}` -> that schema;
  `{"type": "regex", ...}` (deepseek-recipe's spelling) and SGLang's top-level `regex` / `ebnf`.
* Tool calls: `tool_choice: "required"` or a named function -> one DSML calls block whose invokes
  name only the allowed tool(s) and whose parameters follow each tool's JSON schema
  (`string="true"` raw text for string-typed parameters, JSON for the rest), built from xgrammar's
  structural-tag formats (the `deepseek_v4_1_xml` / `deepseek_xml` parameter styles). Without
  thinking the prompt already ends with the block opener, so the grammar starts inside the block.
  `tool_choice: "auto"` is constrained only when a tool says `strict: true` (free text, and a
  constrained block once the model opens one); a `response_format`/`regex`/`ebnf` together with
  auto tools allows "that format OR one calls block", so the model can still call a tool.
* Thinking mode: reasoning is never constrained. `ThinkingGrammarState` lets every token through
  until the end-of-thinking token id is accepted and constrains from the next token on (users of
  other servers report JSON landing inside the reasoning when the grammar starts at the first token).
  Its `reasoning_budget` bounds the reasoning: once that many reasoning tokens were accepted, the
  mask allows only `</think>` (SGLang's strict thinking and vLLM's `thinking_token_budget` do the
  same). `encoding.ChatPromptBuilder` sets it for forced tool calls and formats (so the forced part
  gets room within `max_tokens`) and from the request's `thinking_budget`; kind `text` is a budget
  with no format after the reasoning.

xgrammar is optional (the `grammar` extra): without it `GrammarFactory(...)` raises
`GrammarUnavailable`, `GrammarFactory.maybe_create(...)` returns None, and
`make_grammar_state(None, constraint)` raises `GrammarUnavailable` naming the request field
(`response_format`, `regex`, `ebnf`, `tool_choice`, `tools`), which the server answers with HTTP 400.
Constraints whose `required` is False (`tool_choice` required without thinking, where the prompt
already forces the block) decode unconstrained instead.

Scheduling (how a batch sampler should use `GrammarState`, keeping mask work off the critical path):

    step N:   sample tokens from logits[N] (masked with bitmask[N] where need_apply)
              state.accept(token) for every constrained request  (cheap, on the scheduler thread)
              launch the model forward for step N+1              (GPU, asynchronous)
              fut = mask_worker.submit(states, bitmask_cpu)      (CPU worker thread: fill rows for N+1)
    step N+1: logits[N+1] ready; fut.result() (usually already done); copy bitmask to the device
              (pinned + non_blocking) and apply it in place, only to rows whose need_apply is True;
              sample; accept; ...

The mask for step N+1 depends only on the tokens accepted up to step N, so it can be computed while
the forward pass of step N+1 runs. `MaskWorker` does this on one thread: the forward runs on the GPU
and the scheduler thread spends that time in a blocking CUDA wait (which releases the GIL), so the
worker's fills (~15 us per row for a JSON-schema matcher on the CPU dev machine) are hidden behind it.
Rows are independent. Speculative decoding: accept the draft tokens one by one, then `rollback(k)`
the rejected ones; rollback crosses the `</think>` boundary correctly.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Sequence

from .errors import ChatFormatError, GrammarUnavailable

__all__ = ["OutputConstraint", "GrammarFactory", "GrammarState", "ThinkingGrammarState",
           "UnconstrainedState", "MaskWorker", "make_grammar_state", "xgrammar_available"]


@dataclass(frozen=True)
class OutputConstraint:
    """A request's decoding constraint (hashable; its `key()` is the compile-cache key).

    kind: json_object | json_schema | regex | ebnf | tool_calls | text (no format: only the
        reasoning budget applies).
    field: the request field that asked for it (named in errors).
    thinking: reasoning comes first and stays unconstrained (wrap in ThinkingGrammarState).
    family: "v4.1" (spaced DSML tags) or "v4" (unspaced `tool_calls`/`invoke`/`parameter`).
    tools_json: OpenAI function tools as JSON; for kind tool_calls the callable tools, for the other
        kinds the auto tools that may be called instead of the format.
    tool_mode: "required" (a call block must come) or "auto" (free text or a call block).
    starts_in_tool_calls: the prompt already opened the calls block.
    required: False if decoding may go unconstrained when xgrammar is missing.
    reasoning_budget: at most this many reasoning tokens, then `</think>` is forced (thinking
        only; None: unbounded). Not part of `key()`: it does not change the compiled grammar.
    """

    kind: Literal["json_object", "json_schema", "regex", "ebnf", "tool_calls", "text"]
    field: str
    thinking: bool = False
    family: Literal["v4.1", "v4"] = "v4.1"
    schema_json: str | None = None
    pattern: str | None = None
    tools_json: str | None = None
    tool_mode: Literal["auto", "required"] = "auto"
    parallel_tool_calls: bool = True
    starts_in_tool_calls: bool = False
    required: bool = True
    reasoning_budget: int | None = None

    def key(self) -> str:
        return json.dumps([self.kind, self.family, self.schema_json, self.pattern, self.tools_json,
                           self.tool_mode, self.parallel_tool_calls, self.starts_in_tool_calls])


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _xgr(field: str | None = None):
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise GrammarUnavailable(field, str(e)) from None
    return xgr


# --------------------------------------------------------------------------------------- states
class GrammarState:
    """One request's matcher: `fill_mask` -> sample -> `accept`, plus rollback.

    `fill_mask(bitmask, index=0)` writes the allowed-token bits of the next token into
    `bitmask[index]` (int32, shape (batch, ceil(V/32)); a 1-D row is accepted too) and returns
    whether the mask must be applied (False: everything is allowed, skip the row).
    """

    def __init__(self, matcher, vocab_size: int, and_mask=None) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self._and = and_mask  # extra per-token restriction ANDed into every mask

    def fill_mask(self, bitmask, index: int = 0) -> bool:
        if bitmask.dim() == 1:
            bitmask, index = bitmask.unsqueeze(0), 0
        need = bool(self._m.fill_next_token_bitmask(bitmask, index))
        if self._and is not None:
            bitmask[index].bitwise_and_(self._and)
            need = True
        return need

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (state unchanged)."""
        ok = bool(self._m.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok

    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token (EOS): the request is done."""
        return bool(self._m.is_terminated())

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (EOS would be accepted)."""
        return bool(self._m.is_completed())

    def rollback(self, n: int = 1) -> None:
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} of {self.num_accepted} accepted tokens")
        if n:
            self._m.rollback(n)
            self.num_accepted -= n

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted = 0

    def jump_forward_string(self) -> str:
        """Text the grammar forces next (for jump-forward decoding; may be "")."""
        return self._m.find_jump_forward_string()


class UnconstrainedState:
    """Every token allowed: what follows the reasoning of a `text` constraint (a reasoning budget
    without a format). Counts tokens so that `ThinkingGrammarState.rollback` stays exact."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def fill_mask(self, bitmask, index: int = 0) -> bool:
        (bitmask if bitmask.dim() == 1 else bitmask[index]).fill_(-1)
        return False

    def accept(self, token_id: int) -> bool:
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False

    def is_completed(self) -> bool:
        return True

    def rollback(self, n: int = 1) -> None:
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} of {self.num_accepted} accepted tokens")
        self.num_accepted -= n

    def reset(self) -> None:
        self.num_accepted = 0

    def jump_forward_string(self) -> str:
        return ""


class ThinkingGrammarState:
    """Unconstrained until the end-of-thinking token, then `inner` (see the module docstring);
    with `reasoning_budget`, the end-of-thinking token is forced after that many reasoning tokens.

    The end-of-thinking token is matched by id (looked up from `</think>`): the model emits it as
    one special token, so there is no spelling to split.
    """

    def __init__(self, inner: GrammarState | UnconstrainedState, think_end_id: int,
                 reasoning_budget: int | None = None) -> None:
        if reasoning_budget is not None and reasoning_budget < 0:
            raise ValueError(f"reasoning_budget must be >= 0, got {reasoning_budget}")
        self.inner = inner
        self.think_end_id = int(think_end_id)
        self.vocab_size = inner.vocab_size
        self.reasoning_budget = reasoning_budget
        self._thinking_tokens = 0  # accepted while thinking, the end token included
        self._in_reasoning = True

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    @property
    def num_accepted(self) -> int:
        return self._thinking_tokens + self.inner.num_accepted

    @property
    def budget_spent(self) -> bool:
        """True while the next token must be `</think>` (the reasoning budget is used up)."""
        return (self._in_reasoning and self.reasoning_budget is not None
                and self._thinking_tokens >= self.reasoning_budget)

    def fill_mask(self, bitmask, index: int = 0) -> bool:
        if self._in_reasoning:
            row = bitmask if bitmask.dim() == 1 else bitmask[index]
            if not self.budget_spent:
                row.fill_(-1)
                return False
            row.zero_()
            bit = 1 << (self.think_end_id % 32)  # int32 words, bit i of word w = token 32w + i
            row[self.think_end_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
            return True
        return self.inner.fill_mask(bitmask, index)

    def accept(self, token_id: int) -> bool:
        if self._in_reasoning:
            is_end = int(token_id) == self.think_end_id
            if self.budget_spent and not is_end:
                return False
            self._thinking_tokens += 1
            if is_end:
                self._in_reasoning = False
            return True
        return self.inner.accept(token_id)

    def is_terminated(self) -> bool:
        return not self._in_reasoning and self.inner.is_terminated()

    def is_completed(self) -> bool:
        return not self._in_reasoning and self.inner.is_completed()

    def rollback(self, n: int = 1) -> None:
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} of {self.num_accepted} accepted tokens")
        k = min(n, self.inner.num_accepted)
        self.inner.rollback(k)
        n -= k
        if n:
            self._thinking_tokens -= n
            self._in_reasoning = True

    def reset(self) -> None:
        self.inner.reset()
        self._thinking_tokens = 0
        self._in_reasoning = True

    def jump_forward_string(self) -> str:
        return "" if self._in_reasoning else self.inner.jump_forward_string()


class MaskWorker:
    """Fills next-step bitmasks on a worker thread (see "Scheduling" in the module docstring)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def submit(self, states: Sequence[Any], bitmask) -> "Future[list[bool]]":
        """Row i of `bitmask` gets the mask of `states[i]` (None: row left as is, need_apply
        False). The future's result is the per-row need_apply flags."""
        states = list(states)

        def work() -> list[bool]:
            return [False if s is None else s.fill_mask(bitmask, i) for i, s in enumerate(states)]

        return self._pool.submit(work)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# --------------------------------------------------------------------------------------- factory
class GrammarFactory:
    """Compiles constraints for one tokenizer (cached) and makes per-request states.

    The xgrammar `TokenizerInfo` is built from our tokenizer's byte-level vocabulary (no network,
    no transformers object); `vocab_size` is the model's logits width (embedding rows, may exceed
    the tokenizer); EOS is the stop token.

    any_whitespace: let JSON contain free whitespace. Default False: xgrammar then uses the
    `", "` / `": "` separators (what the model writes for one-line JSON) and a model cannot loop on
    whitespace, a known failure mode of unconstrained-whitespace JSON grammars.
    """

    def __init__(self, tokenizer, *, vocab_size: int | None = None, any_whitespace: bool = False,
                 max_whitespace: int = 2, max_threads: int = 2, cache_size: int = 256) -> None:
        xgr = _xgr()
        self._xgr = xgr
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        self.any_whitespace = any_whitespace
        self.max_ws = max_whitespace
        self.think_end_id = tokenizer.special.think_end
        self.eos_id = tokenizer.special.eos
        vocab = tokenizer.encoded_vocab()
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                      stop_token_ids=[self.eos_id], add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def maybe_create(cls, tokenizer, **kw) -> "GrammarFactory | None":
        """The factory, or None when xgrammar is not installed (the constructor raises
        GrammarUnavailable then). Pass the result to `make_grammar_state`."""
        if not xgrammar_available():
            return None
        return cls(tokenizer, **kw)

    # ------------------------------------------------------------------ masks
    @cached_property
    def _no_control_chars(self):
        """Allowed-bits row without tokens that hold a raw control character.

        JSON never contains raw U+0000-U+001F (outside whitespace between tokens, which
        `any_whitespace=False` does not allow either), but xgrammar 0.2.9's JSON-schema grammar
        for a string with `minLength`/`maxLength` uses the class `[^"\\\r\n]` and lets e.g. a raw
        form feed through, which `json.loads` then rejects (found by the random-sampling test).
        ANDing this row into JSON masks closes that hole at no measurable cost.
        """
        import numpy as np
        import torch

        ws = {9, 10, 13} if self.any_whitespace else set()
        allowed = np.ones(self.bitmask_width * 32, dtype=np.uint8)
        for i in range(self.tokenizer.vocab_size):
            b = self.tokenizer.token_bytes(i)
            if any(x < 32 and x not in ws for x in b):
                allowed[i] = 0
        words = np.packbits(allowed.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(
            np.uint32).view(np.int32).reshape(-1)
        return torch.from_numpy(words.copy())

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def allocate_bitmask(self, batch: int):
        """An all-allowed int32 CPU bitmask of shape (batch, ceil(V/32))."""
        return self._xgr.allocate_token_bitmask(batch, self.vocab_size)

    def apply_bitmask(self, logits, bitmask, indices: list[int] | None = None) -> None:
        """Set disallowed logits to -inf in place (rows `indices`, default all)."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                              vocab_size=self.vocab_size, indices=indices)

    # ------------------------------------------------------------------ compile
    def compile(self, c: OutputConstraint):
        key = c.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(c)
        except ChatFormatError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/pydantic errors
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ChatFormatError(c.field, f"invalid {c.kind.replace('_', ' ')}: {msg}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: OutputConstraint):
        comp = self.compiler
        if c.kind == "tool_calls":
            tools = self._tools(c)
            if c.tool_mode == "required":
                fmt = self._calls_block(c, tools, opened=c.starts_in_tool_calls)
                return comp.compile_structural_tag(self._st(fmt))
            st = self._xgr.get_model_structural_tag(
                "deepseek_v4_1" if c.family == "v4.1" else "deepseek_v4",
                tools=tools, tool_choice="auto", reasoning="disabled",
                parallel_tool_calls=c.parallel_tool_calls, max_whitespace_cnt=self.max_ws)
            return comp.compile_structural_tag(st)
        if c.tools_json:  # the format, or a calls block instead
            sx = self._xgr.structural_tag
            fmt = sx.OrFormat(elements=[self._format(c), self._calls_block(c, self._tools(c),
                                                                           opened=False)])
            return comp.compile_structural_tag(self._st(fmt))
        if c.kind == "json_object":
            return comp.compile_json_schema({"type": "object"}, any_whitespace=self.any_whitespace)
        if c.kind == "json_schema":
            schema = json.loads(c.schema_json or "{}")
            if schema is True or schema == {}:
                return comp.compile_builtin_json_grammar()
            return comp.compile_json_schema(schema, any_whitespace=self.any_whitespace,
                                            strict_mode=True)
        if c.kind == "regex":
            return comp.compile_regex(c.pattern or "")
        if c.kind == "ebnf":
            return comp.compile_grammar(c.pattern or "")
        raise ChatFormatError(c.field, f"unknown constraint kind {c.kind!r}")

    def _st(self, fmt):
        return self._xgr.structural_tag.StructuralTag(format=fmt)

    def _format(self, c: OutputConstraint):
        """The non-tool format as a structural-tag element."""
        sx = self._xgr.structural_tag
        if c.kind == "json_object":
            return sx.JSONSchemaFormat(json_schema={"type": "object"})
        if c.kind == "json_schema":
            return sx.JSONSchemaFormat(json_schema=json.loads(c.schema_json or "true"))
        if c.kind == "regex":
            return sx.RegexFormat(pattern=c.pattern or "")
        return sx.GrammarFormat(grammar=c.pattern or "")

    @staticmethod
    def _tools(c: OutputConstraint) -> list[dict[str, Any]]:
        tools = json.loads(c.tools_json or "[]")
        if not tools:
            raise ChatFormatError(c.field, "no tools to constrain the output to")
        for t in tools:
            fn = t.get("function") or {}
            if fn.get("parameters") is None:
                fn["parameters"] = {"type": "object", "properties": {}}
        return tools

    def _calls_block(self, c: OutputConstraint, tools: list[dict[str, Any]], *, opened: bool):
        """One DSML calls block: invokes of the given tools, each parameter per its schema."""
        sx = self._xgr.structural_tag
        v41 = c.family == "v4.1"
        invoke = " invoke" if v41 else "invoke"
        calls = " calls" if v41 else "tool_calls"
        style = "deepseek_v4_1_xml" if v41 else "deepseek_xml"
        tags = [sx.TagFormat(begin=f'<｜DSML｜{invoke} name="{t["function"]["name"]}">\n',
                             content=sx.JSONSchemaFormat(json_schema=t["function"]["parameters"],
                                                         style=style,
                                                         max_whitespace_cnt=self.max_ws),
                             end=f"</｜DSML｜{invoke}>\n") for t in tools]
        body = sx.TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True,
                                          stop_after_first=not c.parallel_tool_calls)
        elements = [] if opened else [sx.ConstStringFormat(value=f"\n\n<｜DSML｜{calls}>\n")]
        elements += [body, sx.ConstStringFormat(value=f"</｜DSML｜{calls}>")]
        return sx.SequenceFormat(elements=elements)

    # ------------------------------------------------------------------ states
    def state_for(self, c: OutputConstraint) -> GrammarState | ThinkingGrammarState:
        """A fresh per-request state (thinking-wrapped when the constraint says so)."""
        if c.kind == "text":
            if not c.thinking:
                raise ChatFormatError(c.field, "a text constraint only bounds the reasoning")
            return ThinkingGrammarState(UnconstrainedState(self.vocab_size), self.think_end_id,
                                        c.reasoning_budget)
        json_only = c.kind in ("json_object", "json_schema") and not c.tools_json
        state = GrammarState(self._xgr.GrammarMatcher(self.compile(c)), self.vocab_size,
                             and_mask=self._no_control_chars if json_only else None)
        if c.thinking:
            return ThinkingGrammarState(state, self.think_end_id, c.reasoning_budget)
        return state


def make_grammar_state(factory: GrammarFactory | None, constraint: OutputConstraint | None):
    """The state a request decodes under, or None for unconstrained decoding.

    `factory` is None when the server runs without xgrammar: a required constraint then raises
    `GrammarUnavailable` naming the request field, an optional one decodes unconstrained.
    """
    if constraint is None:
        return None
    if factory is None:
        if constraint.required:
            raise GrammarUnavailable(constraint.field)
        return None
    return factory.state_for(constraint)
