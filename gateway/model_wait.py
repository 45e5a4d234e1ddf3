"""An API request that arrives before its gateway process has learned the model waits for it.

Each gateway process learns the model (the assets request) on its own. Probes and /metrics pass
straight through: liveness must answer while the model loads and readiness says what it sees.
Every other request waits up to GatewayService.LOAD_WAIT_S, having woken the loader, and then
goes on to its route, which answers 503 if the model is still not there.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.routers.health import LIVENESS_PATH, READINESS_PATHS

UNWAITED_PATHS = frozenset((LIVENESS_PATH, *READINESS_PATHS, "/metrics"))


class ModelWait:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNWAITED_PATHS:
            service = getattr(scope["app"].state, "service", None)
            if service is not None and service.served_or_none is None:
                await service.wait_learned()
        await self.app(scope, receive, send)
