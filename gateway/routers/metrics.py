"""GET /metrics: the gateway's own Prometheus metrics (every worker's, merged), the backend's
flare_* families read from Triton's metrics port at each scrape, and vLLM's names for the
families both have (gateway/backend_metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.backend_metrics import BackendScrape, Families, vllm_aliases
from gateway.service import GatewayService

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    service: GatewayService = request.app.state.service
    scrape: BackendScrape = request.app.state.backend_metrics
    families = list(service.metrics.registry.collect()) + await scrape.families()
    served = service.served_or_none
    families += vllm_aliases(families, served.served_id if served is not None else request.app.state.triton_model)
    return Response(generate_latest(Families(families)), media_type=CONTENT_TYPE_LATEST)
