"""Hostile requests for the serving benchmark: what a fuzzer, a broken client or an attacker
sends. Each must get a 4xx (or, for a disconnect, nothing: the server must just clean up), never
a 5xx, and must not disturb the well-formed requests running beside it.

Kinds: an empty prompt (the one kind that may also succeed: with a BOS token it is a prompt of
one token, which OpenAI's API accepts too), a lone surrogate (invalid UTF-8 once encoded), out-of-range sampling
values, an unknown field, a body nested deeper than any parser should follow, a prompt far over
the context, a malformed JSON body, and a streaming request whose client disconnects after its
first chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

KINDS = ("empty_prompt", "lone_surrogate", "bad_temperature", "bad_max_tokens", "unknown_field",
         "deep_nesting", "over_context", "bad_json", "disconnect")


@dataclass
class HostileOutcome:
    kind: str
    status: int | None = None  # HTTP status (None: disconnected by us, or no answer)
    ok: bool = False  # a 4xx (or a clean disconnect)
    detail: str = ""


def make_hostile(n: int, seed: int, model: str) -> list[tuple[str, bytes]]:
    """`n` (kind, raw JSON body) pairs, kinds in turn from a seeded shuffle."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    out = []
    for k in kinds:
        body: object = {"model": model, "prompt": "graph state token", "max_tokens": 8}
        if k == "empty_prompt":
            body["prompt"] = ""
        elif k == "lone_surrogate":
            raw = json.dumps(body).replace("graph", "gr\\ud800aph")  # valid JSON, not UTF-8 text
            out.append((k, raw.encode()))
            continue
        elif k == "bad_temperature":
            body["temperature"] = rng.choice([-1.0, 7.5, "hot"])
        elif k == "bad_max_tokens":
            body["max_tokens"] = rng.choice([0, -5, 10**9, 2.5])
        elif k == "unknown_field":
            body["frobnicate"] = True
        elif k == "deep_nesting":
            raw = '{"model": "%s", "prompt": ' % model + "[" * 100_000 + "]" * 100_000 + "}"
            out.append((k, raw.encode()))
            continue
        elif k == "over_context":
            body["prompt"] = "token " * 200_000
        elif k == "bad_json":
            out.append((k, b'{"model": "x", "prompt": "unterminated'))
            continue
        elif k == "disconnect":
            body.update(stream=True, max_tokens=64, ignore_eos=True)
        out.append((k, json.dumps(body).encode()))
    return out


async def send_hostile(client, kind: str, raw: bytes, timeout: float) -> HostileOutcome:
    """POST one hostile body to /v1/completions with an `httpx.AsyncClient`."""
    o = HostileOutcome(kind)
    headers = {"Content-Type": "application/json"}
    try:
        if kind == "disconnect":
            async with client.stream("POST", "/v1/completions", content=raw, headers=headers,
                                     timeout=timeout) as r:
                o.status = r.status_code
                async for _ in r.aiter_bytes():
                    break  # the first chunk, then hang up
            o.ok = o.status == 200
            return o
        r = await client.post("/v1/completions", content=raw, headers=headers, timeout=timeout)
        o.status = r.status_code
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
            "application/json") else {}
        o.ok = 400 <= r.status_code < 500 and bool(err.get("message")) \
            or kind == "empty_prompt" and r.status_code == 200
        o.detail = str(err.get("message", r.text[:120]))[:160]
    except Exception as e:  # noqa: BLE001 - a dropped connection is a failure of the server
        o.detail = f"{type(e).__name__}: {e}"
    return o


async def run_hostile(base_url: str, bodies: list[tuple[str, bytes]], timeout: float,
                      api_key: str | None = None) -> list[HostileOutcome]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as c:
        return list(await asyncio.gather(*(send_hostile(c, k, b, timeout) for k, b in bodies)))


def summarize_hostile(outs: list[HostileOutcome]) -> dict:
    by: dict[str, dict] = {}
    for o in outs:
        d = by.setdefault(o.kind, {"sent": 0, "ok": 0, "statuses": {}})
        d["sent"] += 1
        d["ok"] += o.ok
        d["statuses"][str(o.status)] = d["statuses"].get(str(o.status), 0) + 1
    return {"sent": len(outs), "ok": sum(o.ok for o in outs),
            "5xx": sum(1 for o in outs if o.status is not None and o.status >= 500),
            "no_answer": sum(1 for o in outs if o.status is None),
            "by_kind": by, "failures": [f"{o.kind}: {o.status} {o.detail}"
                                        for o in outs if not o.ok][:8]}
