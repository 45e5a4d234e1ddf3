"""POST /v1/completions (JSON and SSE)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.preparation import prepare_completion
from gateway.presentation import CompletionPresenter
from gateway.routers.chat import ERROR_RESPONSES
from gateway.schemas import Completion, CompletionRequest
from gateway.access import access_record
from gateway.service import GatewayService

router = APIRouter()


@router.post("/v1/completions", response_model=None,
             responses={200: {"model": Completion, "content": {"text/event-stream": {}}}, **ERROR_RESPONSES})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    service: GatewayService = request.app.state.service
    record = access_record(request)
    return await service.handle(body, lambda served, ingress_ns: prepare_completion(body, served, ingress_ns, record.request_id),
                                CompletionPresenter, "completions", prompt_param="prompt", record=record)
