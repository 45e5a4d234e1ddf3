"""GET /metrics: the gateway's own Prometheus metrics (the backend's are on Triton's port)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.service import GatewayService

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    service: GatewayService = request.app.state.service
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
