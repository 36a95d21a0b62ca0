"""Errors the chat-format layer raises for bad requests.

Why one small type: the server turns every request problem found while rendering the prompt,
choosing a grammar or parsing options into the same OpenAI-shaped HTTP 400, and OpenAI clients
show `error.param` to users, so every error names the request field it is about
(`"tool_choice"`, `"response_format.json_schema.schema"`, `"messages[2].role"`, ...).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChatFormatError", "GrammarUnavailable"]


class ChatFormatError(ValueError):
    """A request the chat-format layer cannot serve.

    `field` is the request field at fault (dotted/indexed path, or None when the request as a
    whole is bad); `status` is the HTTP status the server should answer with (400 unless a
    deepseek-recipe conversion error carried another one).
    """

    def __init__(self, field: str | None, message: str, *, status: int = 400,
                 code: str = "invalid_request_error") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message
        self.status = status
        self.code = code

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": "invalid_request_error",
                          "param": self.field, "code": self.code}}


class GrammarUnavailable(ChatFormatError):
    """The request needs constrained decoding but xgrammar is not installed.

    Raised (not an ImportError) so that the server answers 400 naming the field that asked for a
    grammar, instead of failing the whole process; install the `grammar` extra to serve it.
    """

    def __init__(self, field: str | None, reason: str = "") -> None:
        msg = ("constrained decoding is not available on this server (the optional dependency "
               "xgrammar is not installed: pip install 'megagraph[grammar]')")
        if reason:
            msg += f": {reason}"
        super().__init__(field, msg, code="grammar_unavailable")
