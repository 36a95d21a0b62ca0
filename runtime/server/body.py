"""Request bodies, read and decoded so that no body can reach code that is not ready for it.

Each check exists because of a failure it prevents:

* size: the body is read in chunks and refused (413) as soon as it passes the cap, so a client
  cannot make the server buffer more than the cap (Content-Length is checked before reading).
* strict UTF-8: `json.loads(bytes)` would guess UTF-16/32 and decode with `surrogatepass`.
* nesting depth: CPython's parser, and every recursive walk after it (copying, the chat layer,
  the recipe's serde, which stops at 128), raise RecursionError on deep input; the depth is
  measured on the raw bytes before parsing, with C-speed passes only.
* NaN / Infinity / numbers that overflow to infinity: not JSON, and they poison sampling.
* lone surrogates (`"\\ud800"`): valid JSON escapes, but not text: the tokenizer raises
  TypeError on them and the JSON encoder of an error message fails too. Refused naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from .errors import APIError

MAX_BODY_BYTES = 32 * 2**20
MAX_DEPTH = 64  # objects/arrays inside each other, the body itself being depth 1

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_CHUNK = 1 << 22


def _step_table() -> np.ndarray:
    t = np.zeros(256, dtype=np.int8)
    t[list(b"[{")], t[list(b"]}")] = 1, -1
    return t


_STEP = _step_table()


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, never more than `limit` bytes held (413 past it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, "the Content-Length header is not a number", None,
                           "invalid_request")
        if int(declared) > limit:
            raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit} bytes ({limit // 2**20} MiB)", None,
                    "too_large")


def nesting_depth_exceeds(raw: bytes, limit: int) -> bool:
    """True when the JSON text `raw` nests objects/arrays more than `limit` deep.

    Strings are blanked first (brackets inside them do not count; `"` and `\\` never occur
    inside a multi-byte UTF-8 sequence, so this works on bytes), every other byte but brackets
    is dropped, and the running depth is a cumulative sum, in chunks so that the scratch memory
    stays small. Mismatched brackets are the parser's to report.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:  # depth <= the opening brackets: done
        return False
    s = np.frombuffer(_STRING.sub(b'""', raw).translate(None, _NOT_BRACKET), dtype=np.uint8)
    depth = 0
    for i in range(0, len(s), _CHUNK):
        steps = np.cumsum(_STEP[s[i:i + _CHUNK]], dtype=np.int64)
        if depth + int(steps.max()) > limit:
            return True
        depth += int(steps[-1])
    return False


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def decode_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an OpenAI-shaped 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: "
                       f"{e.reason})", None, "invalid_encoding") from None
    if nesting_depth_exceeds(raw, MAX_DEPTH):
        raise too_deep()
    try:
        body = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:  # the depth check makes this unreachable; a second line only
        raise too_deep() from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, "
                       f"column {e.colno})", None, "invalid_json") from None
    except ValueError as e:  # non-finite numbers, integers over Python's digit limit
        why = "a number has too many digits" if "digits" in str(e) else str(e)
        raise APIError(400, f"the request body is not valid JSON: {why}", None,
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        where = surrogate_path(body)
        if where is not None:
            raise APIError(400, f"{where or 'the request body'}: a lone UTF-16 surrogate "
                           "(an unpaired \\ud800-\\udfff escape) is not text", where or None,
                           "invalid_encoding")
    return body


def too_deep() -> APIError:
    return APIError(400, f"the request body nests objects/arrays more than {MAX_DEPTH} deep",
                    None, "invalid_json")


def _bad_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def surrogate_path(value: Any, path: str = "") -> str | None:
    """Path (`messages[0].content`) of the first string or key holding a lone surrogate."""
    if isinstance(value, str):
        return path if _bad_text(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            here = f"{path}.{k}" if path else k
            if _bad_text(k):
                return path or here
            found = surrogate_path(v, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = surrogate_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None
