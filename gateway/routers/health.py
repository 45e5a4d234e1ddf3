"""GET /health: 200 only when Triton and the model are ready and answer an inference."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.service import GatewayService

router = APIRouter()


@router.get("/health", responses={503: {"description": "Triton or the model is not ready"}})
async def health(request: Request) -> JSONResponse:
    service: GatewayService = request.app.state.service
    if await service.healthy():
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)
