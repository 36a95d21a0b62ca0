"""POST /v1/chat/completions: the chat-format layer (runtime/chat) on top of the scheduler.

Prompt rendering, thinking mode, tools and structured-output constraints come from
`ChatPromptBuilder`; each of the `n` choices gets its own grammar state (masks filled by the
scheduler for step N+1 while step N runs) and its own `ChatOutputParser`, which splits the
streamed text into `reasoning_content`, `content` and `tool_calls` (each sent whole once complete).
Streaming and non-streaming answers come from the same parser calls, so an output cut short
(`length`, a stop string) ends the same way in both: no markup, no half call (parser.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import ChatFormatError, ChatOutputParser
from ..scheduler import Overloaded
from .errors import APIError
from .middleware import request_context
from .protocol import chat_logprobs, parse_logit_bias, parse_n, sampling_params
from .service import ChoiceSpec
from .streaming import SSE_DONE, RequestRun, new_id, sse


def chat_error(e: ChatFormatError) -> APIError:
    if "maximum context length" in e.message:
        return APIError(400, e.message, "messages", "context_length_exceeded")
    named = re.match(r"Invalid (\w+) value", e.message)
    if e.field is None and named:  # deepseek-recipe's range errors name the field this way
        e.field = named.group(1)
    elif e.field is None and "json schema" in e.message.lower():
        e.field = "response_format.json_schema"
    return APIError(e.status, f"{e.field}: {e.message}" if e.field else e.message, e.field,
                    e.code)


async def chat_completions(service, request, body: dict[str, Any]):
    if service.chat is None:
        raise APIError(400, f"this server cannot render chats ({service.chat_note}): use "
                       "/v1/completions", "model")
    vocab = service.engine.cfg.vocab_size
    n = parse_n(body, service.config.max_n)
    rest = {k: v for k, v in body.items() if k != "n"}
    try:
        prep = await asyncio.to_thread(service.chat.build, rest)
    except ChatFormatError as e:
        raise chat_error(e) from None
    s = prep.sampling
    params = sampling_params(body, max_tokens=s.max_tokens, temperature=s.temperature,
                             top_p=s.top_p, seed=s.seed, stop=s.stop, vocab=vocab)
    logprobs = (s.top_logprobs or 0) if s.logprobs else None
    bias = parse_logit_bias(body, vocab)
    choices = []
    for i in range(n):
        try:
            grammar = service.make_grammar(prep.constraint)
        except ChatFormatError as e:
            raise chat_error(e) from None
        choices.append(ChoiceSpec(params, i, grammar, logprobs, bias))
    try:
        stream = service.submit(prep.prompt_ids, choices, request_id=request_context(request).id)
    except Overloaded as e:
        raise APIError(503, str(e), code="overloaded", headers={"Retry-After": "1"}) from None
    run = RequestRun(service, stream, request, "chat")
    meta = {"id": new_id("chatcmpl"), "created": int(time.time()), "model": prep.model}
    if prep.stream:
        return StreamingResponse(_stream(run, prep, n, meta), media_type="text/event-stream")
    return JSONResponse(await _collect(run, prep, n, meta))


async def _collect(run: RequestRun, prep, n: int, meta: dict) -> dict[str, Any]:
    parsers = [ChatOutputParser(prep.parser_options) for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    shutdown = False
    async for i, ev in run.events():
        if ev.text:
            parsers[i].feed(ev.text)
        lps[i] += ev.logprobs or []
        if ev.finish_reason in ("stop", "length"):
            parsers[i].finish(ev.finish_reason)
        shutdown |= ev.finish_reason == "abort"
    run.raise_if_failed()
    if shutdown or run.aborted:
        raise APIError(503, "the request was aborted (server shutting down or client gone)",
                       code="aborted")
    choices = []
    for i, p in enumerate(parsers):
        msg = p.result()
        choices.append({"index": i, "message": msg.to_openai(),
                        "logprobs": {"content": chat_logprobs(run.service, lps[i])}
                        if prep.sampling.logprobs else None,
                        "finish_reason": msg.finish_reason})
    return {**meta, "object": "chat.completion", "choices": choices, "usage": run.usage()}


async def _stream(run: RequestRun, prep, n: int, meta: dict):
    parsers = [ChatOutputParser(prep.parser_options) for _ in range(n)]

    def chunk(i, delta, finish=None, logprobs=None, usage=None) -> str:
        c = {**meta, "object": "chat.completion.chunk",
             "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}]}
        if usage is not None:
            c["usage"] = usage
        return sse(c)

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, ev in run.events():
        if run.ends_in_error(ev):
            yield run.error_event()
            yield SSE_DONE
            return
        deltas = parsers[i].feed(ev.text) if ev.text else []
        lp = {"content": chat_logprobs(run.service, ev.logprobs)} if ev.logprobs else None
        if ev.finish_reason:
            deltas += parsers[i].finish(ev.finish_reason)
        if not deltas and lp:
            yield chunk(i, {}, None, lp)
        for k, d in enumerate(deltas):
            last = d.finish_reason is not None and run.stream.finished
            usage = run.usage() if last and not prep.include_usage else None
            yield chunk(i, d.to_openai(), d.finish_reason, lp if k == 0 else None, usage)
    if prep.include_usage:
        yield sse({**meta, "object": "chat.completion.chunk", "choices": [],
                   "usage": run.usage()})
    yield SSE_DONE
