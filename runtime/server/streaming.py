"""Driving one request's events from a route: SSE framing, per-choice timing (TTFT, inter-token
latency), client-disconnect detection (disconnect -> abort -> the scheduler frees the slots), the
usage block, and how the request ended (for the request metrics and the log).

An engine failure reaches the client as a 500 (or an error event in a stream) carrying the
request id and a short message; the failure's own text can hold internals (paths, kernel
arguments), so it goes to the server log with the request id and the sequence ids the
scheduler's own log lines name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from .errors import error_body, internal_error
from .middleware import request_context
from .service import RequestStream

log = logging.getLogger("megagraph.server")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestRun:
    """Iterates a RequestStream, keeping timing, usage and disconnect watching in one place."""

    def __init__(self, service, stream: RequestStream, request, endpoint: str):
        self.service, self.stream, self.request, self.endpoint = service, stream, request, endpoint
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last: dict[int, float] = {}
        self.itls: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens: dict[int, int] = {}  # per choice: prompt tokens from the cache
        self.completion_tokens: dict[int, int] = {}
        self.error: str | None = None  # set on an engine error (or by a route, on shutdown)
        self.failed = False  # the engine failed this request
        self.aborted = False  # client gone, or aborted by the server (shutdown)
        self.ctx = request_context(request)
        self._watch: asyncio.Task | None = None

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice, event) pairs; aborts the request if the consumer stops early."""
        self._watch = asyncio.create_task(self._watch_disconnect())
        try:
            async for i, ev in self.stream.events():
                now = time.monotonic()
                if ev.token_ids:
                    if self.first is None:
                        self.first = now
                    if i in self.last:
                        self.itls.append(now - self.last[i])
                    self.last[i] = now
                    self.service.metrics.tokens(len(ev.token_ids))
                self.prompt_tokens = ev.num_prompt_tokens or self.prompt_tokens
                self.completion_tokens[i] = ev.num_output_tokens
                if ev.token_ids:
                    self.cached_tokens[i] = ev.num_cached_tokens
                if ev.finish_reason == "error" and not self.failed:
                    self._engine_failed(ev.error)
                elif ev.finish_reason == "abort":
                    self._abort_seen()
                yield i, ev
        finally:
            self._watch.cancel()
            if not self.stream.finished:
                self._abort_seen()
                self.stream.abort()
            self._record()

    def _engine_failed(self, why: str | None) -> None:
        self.failed, self.error = True, why or "engine error"
        self.ctx.mark("error")
        log.error("request %s (%s, sequences %s): the engine failed it: %s", self.ctx.id,
                  self.endpoint, self.stream.seq_ids, self.error)

    def _abort_seen(self) -> None:
        self.aborted = True
        self.ctx.mark("aborted")

    async def _watch_disconnect(self) -> None:
        """Wait for the client to go away; then abort (frees the sequences' state)."""
        try:
            while True:
                msg = await self.request.receive()
                if msg["type"] == "http.disconnect":
                    if not self.stream.finished:
                        self._abort_seen()
                        self.stream.abort()
                    return
        except (asyncio.CancelledError, RuntimeError):
            return

    def _record(self) -> None:
        m = self.service.metrics
        m.latency(None if self.first is None else self.first - self.t0, self.itls,
                  time.monotonic() - self.t0)
        if self.aborted:
            with m.lock:
                m.aborted += 1

    def usage(self) -> dict:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens this
        request did not prefill (the first choice's: the others resume from its prompt)."""
        c = sum(self.completion_tokens.values())
        cached = min(self.cached_tokens.values(), default=0)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": c,
                "total_tokens": self.prompt_tokens + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def raise_if_failed(self) -> None:
        if self.failed:
            e = internal_error(self.ctx.id, "the engine failed while running this request")
            e.code = "engine_error"
            raise e

    def ends_in_error(self, ev) -> bool:
        """Whether event `ev` ends the stream in an engine error or an abort (the stream then
        sends error_event() and [DONE]); an abort records its message as the run's error."""
        if ev.finish_reason not in ("error", "abort"):
            return False
        if ev.finish_reason == "abort":
            self.error = "the request was aborted (server shutting down)"
        return True

    def error_event(self) -> str:
        """The stream's last event before `[DONE]`: the engine failure, or the abort."""
        if self.failed:
            msg = internal_error(self.ctx.id, "the engine failed while running this request")
            return sse(error_body(500, msg.message, code="engine_error"))
        return sse(error_body(503, f"the request was aborted (server shutting down; request "
                               f"id {self.ctx.id})", code="aborted"))
