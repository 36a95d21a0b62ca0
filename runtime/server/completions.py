"""POST /v1/completions: raw prompts (text, token ids, or a list of either), `n` choices each.

Choice `k` of prompt `p` has index `p * n + k` (OpenAI's order). Text prompts get BOS + the
tokenizer's ids; token-id prompts are used as given.

`echo: true` puts the prompt in front of each choice's text; with `logprobs: k` the logprobs
object then starts with the prompt's tokens (the first has no logprob, `null`, as OpenAI and
vLLM answer), each the model's log-probability of that prompt token and its top k, which is
what evaluation harnesses' loglikelihood requests (`echo`, `logprobs`, `max_tokens` 0 or 1) read.
`max_tokens: 0` is taken with `echo` only: the prompt alone comes back (one token is computed
and dropped; usage counts none).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from ..scheduler import Overloaded
from ..sequence import TokenLogprob
from .errors import APIError, bad_request
from .middleware import request_context
from .protocol import (_num, completion_logprobs, context_error, parse_logit_bias, parse_n,
                       parse_seed, parse_stop, sampling_params)
from .service import ChoiceSpec
from .streaming import SSE_DONE, RequestRun, new_id, sse


def _prompts(service, body) -> list[list[int]]:
    p = body.get("prompt")
    vocab = service.engine.cfg.vocab_size
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p or len(p) > 64:
        raise bad_request("prompt", "must be a string, a list of token ids, or a list of up to "
                          "64 of either")
    out = []
    for x in p:
        if isinstance(x, str):
            if service.tokenizer is None:
                raise bad_request("prompt", "this model has no tokenizer: pass token ids")
            service.bound.check_prompt(x, service.capacity, "prompt", extra_tokens=1)  # + BOS
            out.append([service.tokenizer.special.bos, *service.tokenizer.encode(x)])
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                               and 0 <= t < vocab for t in x):
            out.append(list(x))
        else:
            raise bad_request("prompt", f"token-id prompts must be non-empty lists of ids in "
                              f"0..{vocab - 1}")
    return out


def _check_unsupported(body) -> None:
    if body.get("suffix"):
        raise bad_request("suffix", "suffix is not supported")
    bo = body.get("best_of")
    if bo is not None and bo != body.get("n", 1):
        raise bad_request("best_of", "best_of is not supported (leave it unset or equal to n)")


async def completions(service, request, body: dict[str, Any]):
    _check_unsupported(body)
    cap, vocab = service.capacity, service.engine.cfg.vocab_size
    n = parse_n(body, service.config.max_n)
    prompts = await asyncio.to_thread(_prompts, service, body)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad_request("echo", "must be a boolean")
    max_tokens = _num(body, "max_tokens", 0 if echo else 1, cap, None, integer=True)
    drop = max_tokens == 0  # echo of the prompt alone
    temperature = _num(body, "temperature", 0, 2, 1.0)
    top_p = _num(body, "top_p", 0, 1, 1.0, lo_open=True)
    lp = _num(body, "logprobs", 0, 20, None, integer=True)
    stream_flag = body.get("stream", False)
    if not isinstance(stream_flag, bool):
        raise bad_request("stream", "must be a boolean")
    so = body.get("stream_options") or {}
    include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
    specs = []
    for p in prompts:
        want = 16 if max_tokens is None else max(max_tokens, 1)
        if len(p) + want > cap:
            if max_tokens is not None or len(p) >= cap:
                raise context_error("prompt", cap, len(p), want)
            want = cap - len(p)
        params = sampling_params(body, max_tokens=want, temperature=temperature, top_p=top_p,
                                 seed=parse_seed(body), stop=parse_stop(body), vocab=vocab)
        specs.append(params)
    bias = parse_logit_bias(body, vocab)
    plp = lp if echo and lp is not None else None
    runs = []
    try:
        for p, params in zip(prompts, specs):
            stream = service.submit(p, [ChoiceSpec(params, k, None, lp, bias, prompt_logprobs=plp)
                                        for k in range(n)],
                                    request_id=request_context(request).id)
            runs.append(RequestRun(service, stream, request, "completions"))
    except (Overloaded, APIError) as e:
        for r in runs:
            r.stream.abort()
        if isinstance(e, APIError):
            raise
        raise APIError(503, str(e), code="overloaded", headers={"Retry-After": "1"}) from None
    raw = body.get("prompt")
    texts = [raw] if isinstance(raw, str) else list(raw) if isinstance(raw, list) else []
    echoes = [Echo(service, ids, texts[i] if i < len(texts) and isinstance(texts[i], str)
                   else None, drop) if echo else None for i, ids in enumerate(prompts)]
    meta = {"id": new_id("cmpl"), "created": int(time.time()), "model": service.model_name}
    if stream_flag:
        return StreamingResponse(_stream(runs, n, lp, meta, include_usage, echoes),
                                 media_type="text/event-stream")
    return JSONResponse(await _collect(runs, n, lp, meta, echoes))


class Echo:
    """The prompt's part of an echoed choice: its text, and its logprobs object once the
    first token's event brings the prompt logprobs."""

    def __init__(self, service, ids: list[int], text: str | None, drop: bool):
        self.service, self.ids, self.drop = service, ids, drop
        skip = service._skip or ()
        self.text = text if text is not None else "".join(
            service.token_text(t)[0] for t in ids if t not in skip)

    def logprobs(self, plps) -> dict[str, Any]:
        """`plps`: one per prompt token, None for the first (nothing predicts it)."""
        entries = [lp or TokenLogprob(t, 0.0) for t, lp in zip(self.ids, plps)]
        out = completion_logprobs(self.service, entries, 0)
        out["token_logprobs"][0] = out["top_logprobs"][0] = None
        return out

    def join(self, prompt_part: dict[str, Any], gen: dict[str, Any] | None) -> dict[str, Any]:
        if gen is None or self.drop:
            return prompt_part
        return {k: prompt_part[k] + gen[k] for k in prompt_part}


def _usage(runs, echoes=None) -> dict:
    u = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for r, e in zip(runs, echoes or [None] * len(runs)):
        got = r.usage()
        cached += got.pop("prompt_tokens_details")["cached_tokens"]
        if e is not None and e.drop:  # max_tokens 0: the computed token is not an output
            got = {**got, "completion_tokens": 0, "total_tokens": got["prompt_tokens"]}
        for k, v in got.items():
            u[k] += v
    return {**u, "prompt_tokens_details": {"cached_tokens": cached}}


async def _collect(runs, n: int, lp, meta: dict, echoes) -> dict[str, Any]:
    async def one(pi: int, run: RequestRun):
        texts, lps, fin = [""] * n, [[] for _ in range(n)], [None] * n
        plps = [None] * n
        async for i, ev in run.events():
            texts[i] += ev.text
            lps[i] += ev.logprobs or []
            plps[i] = ev.prompt_logprobs or plps[i]
            fin[i] = ev.finish_reason or fin[i]
        run.raise_if_failed()
        if run.aborted or "abort" in fin:
            raise APIError(503, "the request was aborted (server shutting down or client gone)",
                           code="aborted")
        e = echoes[pi]
        out = []
        for i in range(n):
            text = texts[i] if e is None or not e.drop else ""
            obj = None
            if lp is not None:
                obj = completion_logprobs(run.service, lps[i], len(e.text) if e else 0)
                if e is not None:
                    obj = e.join(e.logprobs(plps[i] or [None] * len(e.ids)), obj)
            out.append({"index": pi * n + i, "text": (e.text if e else "") + text,
                        "logprobs": obj, "finish_reason": fin[i]})
        return out

    try:
        per = await asyncio.gather(*(one(i, r) for i, r in enumerate(runs)))
    finally:
        for r in runs:
            r.stream.abort()
    return {**meta, "object": "text_completion", "choices": [c for cs in per for c in cs],
            "usage": _usage(runs, echoes)}


async def _stream(runs, n: int, lp, meta: dict, include_usage: bool, echoes):
    q: asyncio.Queue = asyncio.Queue()
    offsets: dict[int, int] = {}

    async def pump(pi: int, run: RequestRun):
        try:
            async for i, ev in run.events():
                await q.put((pi * n + i, run, ev))
        finally:
            await q.put(None)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        open_ = len(tasks)
        while open_:
            item = await q.get()
            if item is None:
                open_ -= 1
                continue
            idx, run, ev = item
            if run.ends_in_error(ev):
                yield run.error_event()
                yield SSE_DONE
                return
            e = echoes[idx // n]
            first = idx not in offsets
            text = ev.text if e is None or not e.drop else ""
            logprobs = None
            if lp is not None:
                logprobs = completion_logprobs(run.service, ev.logprobs if text or not e else [],
                                               offsets.get(idx, len(e.text) if e else 0))
            if e is not None and first:  # the prompt goes out with the first chunk
                text = e.text + text
                if lp is not None:
                    logprobs = e.join(e.logprobs(ev.prompt_logprobs or [None] * len(e.ids)),
                                      logprobs)
            offsets[idx] = offsets.get(idx, 0) + len(text)
            c = {**meta, "object": "text_completion",
                 "choices": [{"index": idx, "text": text, "logprobs": logprobs,
                              "finish_reason": ev.finish_reason}]}
            if ev.finish_reason and not include_usage and all(r.stream.finished for r in runs):
                c["usage"] = _usage(runs, echoes)
            yield sse(c)
        if include_usage:
            yield sse({**meta, "object": "text_completion", "choices": [],
                       "usage": _usage(runs, echoes)})
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            r.stream.abort()
