"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, request counting, lifespan.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. With an API key, every /v1 route needs `Authorization: Bearer KEY` (401
otherwise); /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import chat_completions
from .completions import completions
from .errors import APIError, error_body

MAX_BODY_BYTES = 32 * 2**20


def create_app(service, *, close_on_shutdown: bool = True, router=None) -> FastAPI:
    """An app over a started `ServingEngine`; its lifespan closes the service on shutdown
    (uvicorn has drained the in-flight requests by then). `router` (rank 0 of a data-parallel
    job, dp_router.py) spreads generation requests over the ranks."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if router is not None:
            await router.close()
        if close_on_shutdown:
            await asyncio.to_thread(service.close, timeout=service.config.drain_timeout)

    app = FastAPI(title="megagraph", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    created = int(time.time())

    app.add_middleware(AuthAndCount, service=service)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"),
                            status_code=500)

    async def body_of(request: Request) -> dict:
        if not service.healthy:
            raise APIError(503, "the engine loop has stopped; see the server log", code="dead")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes", code="too_large")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None,
                           "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        names = service.chat.config.model_names() if service.chat else (service.model_name,)
        if model is not None and model not in names:
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                           f"{', '.join(names)})", "model", "model_not_found")
        return body

    async def generation(request: Request, path: str, handler):
        body = await body_of(request)
        if router is None:
            return await handler(service, request, body)
        return await router.route(request, path, lambda: handler(service, request, body))

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await generation(request, "/v1/chat/completions", chat_completions)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await generation(request, "/v1/completions", completions)

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [{
            "id": service.model_name, "object": "model", "created": created,
            "owned_by": "megagraph", "max_model_len": service.capacity,
            "root": service.engine.cfg.name}]}

    @app.get("/health")
    async def _health():
        if not service.healthy:
            return JSONResponse({"status": "dead"}, status_code=503)
        if router is not None and not await router.healthy():
            return JSONResponse({"status": "starting (waiting for the other ranks)"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def _metrics():
        return PlainTextResponse(service.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class AuthAndCount:
    """Pure ASGI middleware (streaming-safe): API key on /v1, requests counted by status."""

    def __init__(self, app, service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, m, key = scope["path"], self.service.metrics, self.service.config.api_key
        if key and path.startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = got[7:].strip() if got[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                m.request_done(_endpoint(path), 401)
                resp = APIError(401, "Incorrect API key provided (send it as 'Authorization: "
                                "Bearer KEY')", code="invalid_api_key").response()
                return await resp(scope, receive, send)
        status = [500]

        async def send_and_count(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        with m.lock:
            m.http_active += 1
        try:
            await self.app(scope, receive, send_and_count)
        finally:
            with m.lock:
                m.http_active -= 1
            m.request_done(_endpoint(path), status[0])


def _endpoint(path: str) -> str:
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions",
            "/v1/models": "models", "/health": "health", "/metrics": "metrics"}.get(path, "other")
