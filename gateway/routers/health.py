"""The probes: liveness GET /livez, readiness GET /readyz (Kubernetes' pair), and GET /health.

/livez answers 200 whenever the gateway's event loop answers, also while the model loads and
while the backend restarts: a liveness failure means the process is stuck, so the orchestrator
restarts it. /readyz (and /health, vLLM's name, kept with the meaning it always had here)
answers 200 only when Triton and the model are ready and answer a tiny inference, and 503 while
the model loads, while the backend restarts or refuses, and from the first shutdown signal on
(on a connection still open: uvicorn stops accepting new ones then): a readiness failure only
takes the instance out of the load balancer. docs/deployment.md shows probe settings.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.service import GatewayService

router = APIRouter()

LIVENESS_PATH = "/livez"
READINESS_PATHS = ("/readyz", "/health")


@router.get(LIVENESS_PATH)
async def live() -> JSONResponse:
    return JSONResponse({"status": "alive"})


async def ready(request: Request) -> JSONResponse:
    service: GatewayService = request.app.state.service
    if await service.healthy():
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


for _path in READINESS_PATHS:
    router.add_api_route(_path, ready, methods=["GET"],
                         responses={503: {"description": "loading, restarting, refusing or shutting down"}})
