"""GET /v1/models: the served id and its aliases, as learned from the served model."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.schemas import ModelList
from gateway.service import GatewayService

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    service: GatewayService = request.app.state.service
    served = service.served
    cards = [{"id": model_id, "object": "model", "created": served.created, "owned_by": "helios",
              "max_model_len": served.limits.context_tokens}
             for model_id in (served.served_id, *served.aliases)]
    return ModelList.model_validate({"object": "list", "data": cards})
