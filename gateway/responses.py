"""The ASGI response that runs a generation while holding its admission permit.

Why a custom response: (1) the permit must outlive the route handler, until the reader
has the last byte or is gone (HTTP-12); (2) the client's disconnect must cancel the
backend request even while nothing is being written (HTTP-6), and uvicorn's ``send``
silently drops writes after a disconnect, so the response watches ``receive`` itself;
(3) for non-streaming requests the status is only known once the backend's terminal
event arrives, so the status line is sent from inside the response; (4) a stream's last chunk
ends the body in the same ASGI message (uvicorn writes it and the chunked-encoding terminator
as one socket write), not in an empty message after it: one write fewer per request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.admission import Permit
from gateway.errors import GatewayError

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]


# a stream's chunks: each SSE payload and whether it is the stream's last (nothing follows it)
Chunk = tuple[bytes, bool]


class GenerationResponse(Response):
    """Streams SSE chunks (``chunks``) or sends one JSON body (``body_once``)."""

    def __init__(self, permit: Permit, on_close: Callable[[bool], None], *,
                 chunks: AsyncIterator[Chunk] | None = None,
                 body_once: Callable[[], Awaitable[tuple[int, dict]]] | None = None) -> None:
        super().__init__()
        self._permit = permit
        self._on_close = on_close  # called once with disconnected=True/False; cancels the run
        self._chunks = chunks
        self._body_once = body_once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._respond(send))
        watcher = asyncio.ensure_future(self._wait_for_disconnect(receive))
        disconnected = False
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done and not work.done():
                disconnected = True
                work.cancel()
            if work in done:
                work.result()  # re-raise a failure of the response itself
        finally:
            for task in (work, watcher):
                task.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)
            self._on_close(disconnected)
            self._permit.release()

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _respond(self, send: Send) -> None:
        if self._chunks is not None:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            last = False
            async for chunk, last in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        assert self._body_once is not None  # constructor contract: exactly one body source
        try:
            status, payload = await self._body_once()
            headers = JSON_HEADERS
        except GatewayError as error:
            status, payload = error.status, error.body()
            headers = JSON_HEADERS + [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
