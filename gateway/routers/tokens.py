"""POST /tokenize, POST /detokenize (vLLM's shapes) and GET /version.

/tokenize encodes what a generation request would send: a `prompt` as /v1/completions
encodes it, or `messages` rendered through the chat template as /v1/chat/completions does
(same preparation code, so the counts agree with `usage.prompt_tokens`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.preparation import chat_prompt, completion_prompts
from gateway.schemas import ChatMessage, TokenId
from gateway.served_model import ServedModel
from gateway.service import GatewayService

router = APIRouter()
_CONFIG = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool | None = None


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


def _served(request: Request, model: str | None) -> ServedModel:
    service: GatewayService = request.app.state.service
    served = service.served
    if model is not None and not served.serves(model):
        raise ModelNotFoundError(f"the model {model!r} is not served here; use {served.served_id!r}", param="model")
    return served


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    served = _served(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("exactly one of prompt and messages is required", param="prompt")
    if body.prompt is not None:
        ids: Sequence[int] = completion_prompts(body.prompt, served)[0]
    else:
        ids = chat_prompt(body.messages or [], served, None, body.add_generation_prompt,
                          body.continue_final_message, body.chat_template_kwargs).ids
    out: dict[str, Any] = {"count": len(ids), "max_model_len": served.limits.context_tokens, "tokens": list(ids)}
    out["token_strs"] = [served.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    served = _served(request, body.model)
    size = served.tokenizer.vocab_size
    if any(t >= size for t in body.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {size})", param="tokens")
    return {"prompt": served.tokenizer.decode(body.tokens)}


@router.get("/version")
async def server_version() -> dict[str, str]:
    try:
        return {"version": version("helios")}
    except PackageNotFoundError:  # a source tree that was never installed
        return {"version": "unknown"}
