"""Rank 0's front end for a data-parallel job (`runtime serve --nproc N`).

Every rank runs the same server core over its own `RankEngine` (its own requests, state slots and
scheduler; all ranks step together so the expert-parallel layers always have every rank). Ranks
1..N-1 listen on 127.0.0.1:PORT+rank; rank 0 listens on --host:--port, checks the API key and
sends each generation request to the rank with the fewest requests in flight (itself included).
Proxied responses stream through unchanged; a client that disconnects closes the upstream
request, so that rank aborts it and frees its state.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import Response, StreamingResponse

from .errors import APIError


class DPRouter:
    def __init__(self, world: int, base_port: int):
        self.urls = {r: f"http://127.0.0.1:{base_port + r}" for r in range(1, world)}
        self.load = [0] * world  # requests in flight per rank
        self._client = None
        self._up = False

    async def healthy(self) -> bool:
        """Every other rank answers /health (cached once true: rank 0 reports ready only when
        the whole job is up)."""
        if self._up:
            return True
        import httpx

        try:
            async with httpx.AsyncClient(timeout=2) as c:
                for url in self.urls.values():
                    if (await c.get(url + "/health")).status_code != 200:
                        return False
        except httpx.HTTPError:
            return False
        self._up = True
        return True

    def pick(self) -> int:
        return min(range(len(self.load)), key=lambda r: (self.load[r], r))

    async def route(self, request, path: str, body: bytes, local):
        """Run `local()` here or proxy the request (its raw `body`) to another rank."""
        r = self.pick()
        self.load[r] += 1
        done = True
        try:
            resp = await local() if r == 0 else await self._proxy(r, request, path, body)
            if isinstance(resp, StreamingResponse):
                resp.body_iterator = self._count(resp.body_iterator, r)
                done = False
            return resp
        finally:
            if done:
                self.load[r] -= 1

    async def _count(self, it, r: int):
        try:
            async for chunk in it:
                yield chunk
        finally:
            self.load[r] -= 1

    async def _proxy(self, r: int, request, path: str, body: bytes):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=64))
        req = self._client.build_request("POST", self.urls[r] + path, content=body,
                                         headers={"content-type": "application/json"})
        try:
            upstream = await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise APIError(503, f"rank {r} is not reachable ({type(e).__name__})",
                           code="rank_unavailable", headers={"Retry-After": "1"}) from None
        kind = upstream.headers.get("content-type", "application/json")
        keep = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
        if kind.startswith("text/event-stream"):
            return StreamingResponse(self._relay(upstream), status_code=upstream.status_code,
                                     media_type=kind, headers=keep)
        reading = asyncio.ensure_future(upstream.aread())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({reading, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not reading.done():
                reading.cancel()  # the client left: closing upstream aborts it on rank r
            await upstream.aclose()
        if reading.cancelled():
            return Response(status_code=499)
        return Response(reading.result(), status_code=upstream.status_code, media_type=kind,
                        headers=keep)

    async def _relay(self, upstream):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _disconnected(request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
