"""Driving one request's events from a route: SSE framing, per-choice timing (TTFT, inter-token
latency), client-disconnect detection (disconnect -> abort -> the scheduler frees the slots) and
the usage block.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from .errors import APIError, error_body
from .service import RequestStream


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
        self.completion_tokens: dict[int, int] = {}
        self.error: str | None = None
        self.aborted = False
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
                if ev.finish_reason == "error" and self.error is None:
                    self.error = ev.error or "engine error"
                yield i, ev
        finally:
            self._watch.cancel()
            if not self.stream.finished:
                self.aborted = True
                self.stream.abort()
            self._record()

    async def _watch_disconnect(self) -> None:
        """Wait for the client to go away; then abort (frees the sequences' state)."""
        try:
            while True:
                msg = await self.request.receive()
                if msg["type"] == "http.disconnect":
                    if not self.stream.finished:
                        self.aborted = True
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

    def usage(self) -> dict[str, int]:
        c = sum(self.completion_tokens.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": c,
                "total_tokens": self.prompt_tokens + c}

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise APIError(500, self.error, code="engine_error")

    def error_event(self) -> str:
        return sse(error_body(500, self.error or "engine error", code="engine_error"))
