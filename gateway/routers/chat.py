"""POST /v1/chat/completions (JSON and SSE)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.preparation import prepare_chat
from gateway.presentation import ChatPresenter
from gateway.schemas import ChatCompletion, ChatCompletionRequest, ErrorResponse
from gateway.access import access_record
from gateway.service import GatewayService

router = APIRouter()

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 429, 500, 503)}   # FastAPI's `responses` type


@router.post("/v1/chat/completions", response_model=None,
             responses={200: {"model": ChatCompletion, "content": {"text/event-stream": {}}}, **ERROR_RESPONSES})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    service: GatewayService = request.app.state.service
    record = access_record(request)
    return await service.handle(body, lambda served, ingress_ns: prepare_chat(body, served, ingress_ns, record.request_id),
                                ChatPresenter, "chat", prompt_param="messages", record=record)
