"""GET /v1/models and /v1/models/{id}: the served id and its aliases, as learned from the served model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.errors import ModelNotFoundError
from gateway.schemas import ModelCard, ModelList
from gateway.service import GatewayService

router = APIRouter()


def _cards(request: Request) -> list[dict[str, Any]]:
    service: GatewayService = request.app.state.service
    served = service.served
    return [{"id": model_id, "object": "model", "created": served.created, "owned_by": "helios",
             "max_model_len": served.limits.context_tokens}
            for model_id in (served.served_id, *served.aliases)]


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList.model_validate({"object": "list", "data": _cards(request)})


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """One model (the openai SDK's models.retrieve); an id that is not served is OpenAI's 404."""
    for card in _cards(request):
        if card["id"] == model_id:
            return ModelCard.model_validate(card)
    raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model")
