"""Request ids, the access log and the count of every response by status (pure ASGI).

Each HTTP request gets an id: the client's `X-Request-Id` when it is a short token
([A-Za-z0-9._:-], at most 128 characters), else a fresh one. It is sent back in the
`X-Request-Id` header, names the completion (`chatcmpl-<id>`, `cmpl-<id>`) and its backend
requests (`<id>-<choice>` in the backend's logs), and starts the access-log line written when
the response is over (logger `helios.access`: id, method, path, status, seconds).

The status counted (`helios_gateway_requests_total{endpoint, status}`) is the response's
final outcome: the status line, except where a generation ended otherwise after a 200 SSE
header (the error event's status) or the client left (499); the generation path reports that
through the request's AccessRecord.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics

access_log = logging.getLogger("helios.access")

_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_SCOPE_KEY = "helios.access"
# route -> the bounded endpoint label; other paths count as "other"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models",
             "/tokenize": "tokenize", "/detokenize": "detokenize", "/version": "version",
             "/health": "health", "/metrics": "metrics"}


def configure_logging(level: str, access_log: bool) -> None:
    """The gateway process's logging (each uvicorn worker process calls it too): `level` for
    everything, and the access log at info unless turned off."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("helios.access").setLevel(logging.INFO if access_log else logging.CRITICAL)
    # httpx logs every request at info: /metrics reads the backend's port once per scrape, and the
    # scrape's own access-log line already says so
    logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    status: int = 0  # the status line sent
    outcome: int | None = None  # a generation's final outcome when it differs (SSE error, 499)


def access_record(request: Request) -> AccessRecord:
    """The record of this request (a fresh one when the middleware is not installed)."""
    record = request.scope.get(_SCOPE_KEY)
    if record is None:
        record = request.scope[_SCOPE_KEY] = AccessRecord(uuid.uuid4().hex)
    return record


class AccessMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        record = AccessRecord(given.decode() if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex)
        scope[_SCOPE_KEY] = record
        started = time.monotonic()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", record.request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            status = record.outcome if record.outcome is not None else (record.status or 500)
            endpoint = ENDPOINTS.get(scope["path"], "other")
            self.metrics.requests.labels(endpoint, str(status)).inc()
            access_log.info("%s %s %s %d %.3f", record.request_id, scope["method"], scope["path"], status,
                            time.monotonic() - started)
