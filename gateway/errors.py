"""Typed gateway errors and the one place that maps them to HTTP status and OpenAI error JSON.

Every failure the gateway reports is one of these classes; the status code comes from the
class (and for backend outcomes from the typed terminal event that produced it), never from
message text (HTTP-27). Routers raise; the handlers installed by ``install_error_handlers``
answer ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base: subclasses fix ``status``, ``error_type`` and a default ``code``."""

    status = 500
    error_type = "server_error"
    code: str | None = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequestError(GatewayError):
    """The request cannot be prepared (HTTP-18); ``param`` names the offending field."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFoundError(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class RetryLaterError(GatewayError):
    """A refusal that may succeed later: the answer carries Retry-After (seconds)."""

    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class IngressFullError(RetryLaterError):
    """queue_capacity + max_active requests are already admitted (HTTP-17)."""

    status = 429
    error_type = "rate_limit_error"
    code = "ingress_full"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionRejectedError(RetryLaterError):
    """The backend scheduler refused admission (typed AdmissionRejection event, HTTP-19)."""

    status = 503
    error_type = "service_unavailable_error"
    code = "admission_rejected"


class BackendUnavailableError(RetryLaterError):
    """Triton or the model is not reachable or not ready (before any generation began)."""

    status = 503
    error_type = "service_unavailable_error"
    code = "backend_unavailable"


class ShuttingDownError(RetryLaterError):
    """The gateway is stopping: new requests are refused, and responses still open when the
    drain window closes end with this as their one terminal error."""

    status = 503
    error_type = "service_unavailable_error"
    code = "shutting_down"


class BodyTooLargeError(GatewayError):
    """The request body exceeds the gateway's bound (checked before parsing or tokenizing)."""

    status = 413
    error_type = "invalid_request_error"
    code = "body_too_large"


class ExecutionFailedError(GatewayError):
    """Model execution, device or output error (typed ExecutionFailure or a lost stream, HTTP-23)."""

    status = 500
    error_type = "server_error"
    code = "execution_failed"


class BackendInvalidRequestError(GatewayError):
    """The backend reported the exchange request malformed (typed InvalidRequest)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def _validation_param(exc: RequestValidationError) -> tuple[str | None, str]:
    """First pydantic error -> (dotted field path without 'body', message)."""
    errors = exc.errors()
    if not errors:
        return None, "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return None, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}"
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # pydantic puts union member names (e.g. 'str', 'list[str]') in the location; drop them
    loc = [part for part in loc if not any(c in part for c in "[]") and part not in _TYPE_NAMES]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    return param, f"{param}: {message}" if param else message


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after",
                         "function-before", "function-wrap", "literal", "union"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI clients expect 400 with the field named.
        param, message = _validation_param(exc)
        return error_response(InvalidRequestError(message, param=param))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # a bug, not a client error: OpenAI's shape, logged with its traceback
        log.error("unhandled error", exc_info=exc)
        return error_response(GatewayError("internal error in the gateway"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # routing errors (404 unknown path, 405 wrong method) and body decoding in OpenAI's shape
        if isinstance(exc.__cause__, GatewayError):        # raised while FastAPI read the body
            return error_response(exc.__cause__)
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message, code = str(exc.detail), _HTTP_CODES.get(exc.status_code, "http_error")
        if isinstance(exc.__cause__, UnicodeDecodeError):   # FastAPI's generic "error parsing the body"
            message, code = f"the request body is not valid UTF-8: {exc.__cause__}", "invalid_json"
        body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
               415: "unsupported_media_type"}
