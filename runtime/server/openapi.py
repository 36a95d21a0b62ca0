"""/openapi.json as the server really behaves: every status code and content type a route
returns, and the request bodies of the generation routes (from fields.py, the same table that
checks requests), so that a client generator or a schema-driven fuzzer (schemathesis) finds the
documented behaviour and nothing else.

FastAPI alone documents neither: the routes read the raw body (to bound its size and nesting
before parsing), so it sees no request model, and it declares a 422 that this server never
sends (validation errors are 400, as OpenAI's).
"""

from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi

ERROR = {"$ref": "#/components/schemas/Error"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "integer", "null"]}}}}}

_WHY = {400: "invalid request (the field is named in `param`)",
        401: "missing or wrong API key", 404: "unknown model", 413: "request body over 32 MiB",
        500: "server or engine failure (a request id, no internals; see the server log)",
        503: "overloaded (Retry-After), shutting down, or the engine loop stopped"}


def _error(status: int) -> dict[str, Any]:
    return {"description": _WHY[status], "content": {"application/json": {"schema": ERROR}}}


def _generated(what: str) -> dict[str, Any]:
    return {"description": f"the {what} (application/json), or with `stream: true` its chunks "
            "as server-sent events ending in `data: [DONE]`",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}}


def _ops(service) -> dict[tuple[str, str], dict[str, Any]]:
    """(path, method) -> the statuses and contents to declare."""
    from .fields import chat_endpoint, completions_endpoint

    auth = [401] if service.config.api_key else []
    gen = [400, *auth, 404, 413, 500, 503]
    return {
        ("/v1/completions", "post"): {"body": completions_endpoint(service),
                                      "200": _generated("completion"), "errors": gen},
        ("/v1/chat/completions", "post"): {"body": chat_endpoint(service),
                                           "200": _generated("chat completion"), "errors": gen},
        ("/v1/models", "get"): {"errors": [*auth, 500]},
        ("/v1/models/{model}", "get"): {"errors": [*auth, 404, 500]},
        ("/health", "get"): {"errors": [], "extra": {"503": {
            "description": "the engine loop has stopped, or other ranks are not up yet",
            "content": {"application/json": {"schema": {"type": "object"}}}}}},
        ("/metrics", "get"): {"errors": [], "200": {
            "description": "Prometheus text exposition format 0.0.4",
            "content": {"text/plain": {"schema": {"type": "string"}}}}},
    }


def build_openapi(app, service) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    ops = _ops(service)
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            resp = op.setdefault("responses", {})
            resp.pop("422", None)
            spec = ops.get((path, method))
            if spec is None:
                continue
            if "200" in spec:
                resp["200"] = spec["200"]
            for status in spec["errors"]:
                resp[str(status)] = _error(status)
            resp.update(spec.get("extra", {}))
            if "body" in spec:
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": spec["body"].json_schema()}}}
            if service.config.api_key and path.startswith("/v1"):
                op["security"] = [{"bearer": []}]
    comp = schema.setdefault("components", {})
    comp.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        comp["schemas"].pop(name, None)
    if service.config.api_key:
        comp["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema
