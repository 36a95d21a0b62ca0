"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

400 names the request field (`param`), 401 a missing/wrong API key, 404 an unknown route or
model, 413 a request body too large, 500 an engine error, 503 an overloaded or stopping server.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param and not message.startswith(param)
                    else message, param, code or "invalid_value")
