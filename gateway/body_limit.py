"""Request bodies are bounded before they are parsed, rendered or tokenized.

A pure ASGI middleware: a declared Content-Length beyond the bound is answered 413 at once,
and a body streamed without one is counted as it arrives and refused at the first byte
beyond it, so an oversized request costs neither a JSON parse nor a tokenizer pass. The bound
comes from the served model (ServedModel.default_body_bytes, derived from its context) unless
`--max-body-bytes` sets it.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BodyTooLargeError, error_response


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self._limit()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        # FastAPI's body parsing wraps the error in its generic 400; the error handlers unwrap it
        try:
            await self.app(scope, counted, tracked)
        except BodyTooLargeError:
            if started:
                raise
            await self._refuse(scope, receive, send, limit)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        await error_response(_too_large(limit))(scope, receive, send)


def _too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"the request body exceeds {limit} bytes (the bound derived from the served "
                             "context; helios-gateway --max-body-bytes sets it)")
