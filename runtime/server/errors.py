"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

400 names the request field (`param`), 401 a missing/wrong API key, 404 an unknown route or
model, 405 a method a known path does not take, 413 a request body too large, 500 an engine or
server failure (a request id and a short message: the details are in the server log, never in
the body), 503 an overloaded or stopping server.

Messages may quote what the client sent, so `error_body` makes them safe to encode (a lone
surrogate would make the JSON encoder itself fail, turning a 400 into a 500) and short (a quoted
multi-MiB value would make the error as large as the request), and drops the source locations
C++ libraries put in front of theirs (xgrammar: `[21:34:05] /project/cpp/regex_converter.cc:94: `),
which tell a client about the server's build, not about its request.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}

MAX_MESSAGE_CHARS = 2000
_SOURCE_LOCATION = re.compile(r"(?:\[\d\d:\d\d:\d\d\] )?[\w./-]{1,200}\.(?:cc|cpp|cxx|h|hpp):\d+: ")

_brief = reprlib.Repr()
_brief.maxstring = 60
_brief.maxother = 60
_brief.maxlist = _brief.maxdict = _brief.maxtuple = 6
_brief.maxlevel = 3


def brief(value: Any) -> str:
    """A short repr of a client-supplied value, for error messages."""
    return _brief.repr(value)


def safe_text(s: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`s` cut to `limit` characters, lone surrogates written as `\\udXXX` escapes, without
    source locations."""
    if len(s) > limit:
        s = s[:limit] + "..."
    s = _SOURCE_LOCATION.sub("", s)
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


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
    return {"error": {"message": safe_text(message),
                      "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else safe_text(param, 200),
                      "code": code if code is not None else status}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param and not message.startswith(param)
                    else message, param, code or "invalid_value")


def internal_error(request_id: str, what: str = "internal error") -> APIError:
    """The 500 a client sees: what failed, in a few words, and the id to find it in the log."""
    return APIError(500, f"{what} (request id {request_id}; the server log has the details)",
                    code="internal_error", headers={"X-Request-Id": request_id})
