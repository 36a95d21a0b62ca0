"""The outermost layer of every HTTP request (pure ASGI, so streaming passes through untouched):
a request id, the API-key check on /v1, counting each request by how it ended, and the last
line of defence against an unhandled exception.

* Request id: the client's `X-Request-Id` when it is a short token, else a fresh `req-<hex>`;
  sent back in the `X-Request-Id` header of every response and named in every 500 body and in
  the server log lines about the request, so an operator can find what a client reports.
* Outcome (the `outcome` label of megagraph_requests_total): a stream's status line is sent
  before its first token, so the status alone calls a stream that failed or was cut "200". The
  routes record how it really ended in `RequestContext.outcome`: `error` (the engine failed
  it), `aborted` (client gone or server shutting down); otherwise it follows the status: `ok`
  for 2xx, `rejected` for 4xx, `error` for 5xx.
* A large body (memory.py): once it is answered, the freed memory goes back to the system.
* An exception no handler took is logged with its traceback and the request id, and the client
  gets a 500 with that id and no exception text (which can hold paths and internals). If the
  response has already started, an event stream gets an error event and `[DONE]` (clients stop
  reading cleanly); any other body is ended.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from dataclasses import dataclass

from .errors import APIError, error_body, internal_error
from .memory import LARGE_BODY_BYTES, release_freed_memory

log = logging.getLogger("megagraph.server")

CONTEXT_KEY = "megagraph.request"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
              "/v1/models": "models", "/health": "health", "/metrics": "metrics"}


@dataclass
class RequestContext:
    id: str
    outcome: str | None = None  # "error" or "aborted" when the route knows better than the status
    body_bytes: int = 0  # size of the body the route read

    def mark(self, outcome: str) -> None:
        """Record how the request ended; an error outranks an abort (the abort of the other
        choices of a request that failed is a consequence, not the cause)."""
        if self.outcome != "error":
            self.outcome = outcome


def request_context(request) -> RequestContext:
    """The context of a Starlette request (a fresh one outside the middleware, e.g. in tests)."""
    ctx = request.scope.get(CONTEXT_KEY)
    if ctx is None:
        ctx = request.scope[CONTEXT_KEY] = RequestContext(new_request_id())
    return ctx


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def endpoint_of(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "models"
    return _ENDPOINTS.get(path, "other")


def outcome_of(status: int, ctx: RequestContext) -> str:
    if ctx.outcome is not None:
        return ctx.outcome
    return "ok" if status < 400 else "rejected" if status < 500 else "error"


class ServerMiddleware:
    def __init__(self, app, service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        ctx = RequestContext(given if _CLIENT_ID.fullmatch(given) else new_request_id())
        scope[CONTEXT_KEY] = ctx
        path, m, key = scope["path"], self.service.metrics, self.service.config.api_key
        state = {"status": None, "sse": False}

        async def send_tagged(msg):
            if msg["type"] == "http.response.start":
                state["status"] = msg["status"]
                hs = list(msg.get("headers", ()))
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(
                    b"text/event-stream") for k, v in hs)
                if not any(k.lower() == b"x-request-id" for k, v in hs):
                    hs.append((b"x-request-id", ctx.id.encode()))
                msg = {**msg, "headers": hs}
            await send(msg)

        if key and path.startswith("/v1"):
            got = headers.get(b"authorization", b"").decode("latin-1")
            token = got[7:].strip() if got[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                m.request_done(endpoint_of(path), 401, "rejected")
                resp = APIError(401, "Incorrect API key provided (send it as 'Authorization: "
                                "Bearer KEY')", code="invalid_api_key").response()
                return await resp(scope, receive, send_tagged)
        with m.lock:
            m.http_active += 1
        try:
            await self.app(scope, receive, send_tagged)
        except Exception:  # noqa: BLE001 - the last line: logged with the id, answered 500
            log.exception("request %s (%s %s) failed with an unhandled exception", ctx.id,
                          scope.get("method"), path)
            ctx.mark("error")
            await self._fail(state, ctx, scope, receive, send_tagged)
        finally:
            with m.lock:
                m.http_active -= 1
            status = state["status"] or 500
            m.request_done(endpoint_of(path), status, outcome_of(status, ctx))
            if ctx.body_bytes >= LARGE_BODY_BYTES:
                await asyncio.to_thread(release_freed_memory)

    @staticmethod
    async def _fail(state, ctx: RequestContext, scope, receive, send) -> None:
        try:
            if state["status"] is None:
                e = internal_error(ctx.id)
                await e.response()(scope, receive, send)
            elif state["sse"]:
                body = error_body(500, internal_error(ctx.id).message, code="internal_error")
                data = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": data, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # noqa: BLE001 - the client is gone or the response is closed
            pass
