"""GenerationResponse's ASGI messages: what uvicorn turns into socket writes. A stream's last
chunk ends the body in its own message (one write with the chunked-encoding terminator), a
stream whose chunks never say so still ends, and the permit is returned either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.responses import Chunk, GenerationResponse


class _Permit:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def _run(chunks: list[Chunk]) -> tuple[list[dict], _Permit, list[bool]]:
    sent: list[dict] = []
    closed: list[bool] = []
    permit = _Permit()

    async def source() -> AsyncIterator[Chunk]:
        for chunk in chunks:
            yield chunk

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)          # the client stays connected
        return {"type": "http.disconnect"}

    response = GenerationResponse(permit, closed.append, chunks=source())   # type: ignore[arg-type]
    asyncio.run(response({"type": "http"}, receive, send))
    return sent, permit, closed


def _bodies(sent: list[dict]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]


# spec: HTTP-12
def test_the_last_chunk_ends_the_body_in_its_own_message() -> None:
    sent, permit, closed = _run([(b"data: role\n\n", False), (b"data: a\n\n", False),
                                 (b"data: b\n\ndata: [DONE]\n\n", True)])
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert _bodies(sent) == [(b"data: role\n\n", True), (b"data: a\n\n", True),
                             (b"data: b\n\ndata: [DONE]\n\n", False)]
    assert permit.released == 1 and closed == [False]


# spec: HTTP-12
def test_a_stream_not_marked_last_still_ends_with_an_empty_message() -> None:
    sent, permit, _ = _run([(b"data: a\n\n", False)])
    assert _bodies(sent) == [(b"data: a\n\n", True), (b"", False)]
    assert permit.released == 1


def test_an_empty_last_chunk_is_the_terminator_alone() -> None:
    sent, _, _ = _run([(b"data: a\n\n", False), (b"", True)])
    assert _bodies(sent) == [(b"data: a\n\n", True), (b"", False)]
