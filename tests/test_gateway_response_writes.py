"""GenerationResponse's ASGI messages: what uvicorn turns into socket writes. A stream's last
chunk ends the body in its own message (one write with the chunked-encoding terminator), a
stream whose chunks never say so still ends, and the permit is returned either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.admission import AdmissionPermits, AdmissionSettings
from gateway.responses import Chunk, GenerationResponse


def _run(chunks: list[Chunk]) -> tuple[list[dict], AdmissionPermits, list[bool]]:
    sent: list[dict] = []
    closed: list[bool] = []
    permits = AdmissionPermits(AdmissionSettings(queue_capacity=0, max_active=1, frontend_workers=1))
    permit = permits.admit()

    async def source() -> AsyncIterator[Chunk]:
        for chunk in chunks:
            yield chunk

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)          # the client stays connected
        return {"type": "http.disconnect"}

    response = GenerationResponse(permit, closed.append, chunks=source())
    asyncio.run(response({"type": "http"}, receive, send))   # type: ignore[arg-type]
    permits.close()
    return sent, permits, closed


def _bodies(sent: list[dict]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]


# spec: HTTP-12
def test_the_last_chunk_ends_the_body_in_its_own_message() -> None:
    sent, permits, closed = _run([(b"data: role\n\n", False), (b"data: a\n\n", False),
                                 (b"data: b\n\ndata: [DONE]\n\n", True)])
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert _bodies(sent) == [(b"data: role\n\n", True), (b"data: a\n\n", True),
                             (b"data: b\n\ndata: [DONE]\n\n", False)]
    assert permits.in_use == 0 and closed == [False]


# spec: HTTP-12
def test_a_stream_not_marked_last_still_ends_with_an_empty_message() -> None:
    sent, permits, _ = _run([(b"data: a\n\n", False)])
    assert _bodies(sent) == [(b"data: a\n\n", True), (b"", False)]
    assert permits.in_use == 0


def test_an_empty_last_chunk_is_the_terminator_alone() -> None:
    sent, _, _ = _run([(b"data: a\n\n", False), (b"", True)])
    assert _bodies(sent) == [(b"data: a\n\n", True), (b"", False)]
