"""The FastAPI app: routes, OpenAI-shaped errors, lifespan.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{model},
GET /health, GET /metrics, POST /flush_cache (and /openapi.json). With an API key, every /v1
route needs `Authorization: Bearer KEY` (401 otherwise); /health, /metrics and /flush_cache stay
open for probes, scrapers and routers (flushing costs speed, never an answer). The request id,
the key check, request counting and the last-resort 500 are middleware.py's; what a generation
body must look like is body.py's and fields.py's.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .body import MAX_BODY_BYTES, decode_json, read_body
from .chat import chat_completions
from .completions import completions
from .errors import APIError, error_body
from .fields import chat_endpoint, completions_endpoint
from .middleware import ServerMiddleware, request_context
from .openapi import build_openapi
from ..scheduler import Overloaded

__all__ = ["create_app", "MAX_BODY_BYTES"]


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
    specs = {"/v1/completions": completions_endpoint(service),
             "/v1/chat/completions": chat_endpoint(service)}

    app.add_middleware(ServerMiddleware, service=service)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        detail = {404: "no such route", 405: f"method {request.method} is not allowed on "
                  f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, detail), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(400, "invalid request"), status_code=400)

    def model_names() -> tuple[str, ...]:
        return service.chat.config.model_names() if service.chat else (service.model_name,)

    def parse(raw: bytes, path: str) -> dict:
        body = specs[path].check(decode_json(raw))
        model = body.get("model")
        if model is not None and model not in model_names():
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                           f"{', '.join(model_names())})", "model", "model_not_found")
        if path == "/v1/chat/completions" and service.bound is not None:
            service.bound.check_chat(body, service.capacity)
        return body

    async def generation(request: Request, path: str, handler):
        if not service.healthy:
            raise APIError(503, "the engine loop has stopped; see the server log", code="dead")
        raw = await read_body(request)
        request_context(request).body_bytes = len(raw)
        body = await asyncio.to_thread(parse, raw, path)
        if router is None:
            return await handler(service, request, body)
        return await router.route(request, path, raw, lambda: handler(service, request, body))

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await generation(request, "/v1/chat/completions", chat_completions)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await generation(request, "/v1/completions", completions)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "megagraph",
                "max_model_len": service.capacity, "root": service.engine.cfg.name}

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [model_card(service.model_name)]}

    @app.get("/v1/models/{model:path}")
    async def _model(model: str):
        if model not in model_names():
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                           f"{', '.join(model_names())})", "model", "model_not_found")
        return model_card(model)

    @app.get("/health")
    async def _health():
        if not service.healthy:
            return JSONResponse({"status": "dead"}, status_code=503)
        if router is not None and not await router.healthy():
            return JSONResponse({"status": "starting (waiting for the other ranks)"},
                                status_code=503)
        return {"status": "ok"}

    @app.post("/flush_cache")
    async def _flush_cache():
        """Drop every cached prefix no running request holds (SGLang's and SMG's route)."""
        try:
            out = await asyncio.to_thread(service.scheduler.flush_cache)
        except Overloaded as e:
            raise APIError(503, str(e), None, "unavailable") from None
        return {"flushed_nodes": out["nodes"], "flushed_bytes": out["bytes"],
                "kept_nodes": out["kept"], "enabled": out.get("enabled", True)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def _metrics():
        return PlainTextResponse(service.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, service)
        return app.openapi_schema

    app.openapi = openapi
    return app
