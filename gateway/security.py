"""API keys and CORS at the HTTP edge (vLLM's options and behaviour).

`--api-key KEY` (repeatable; or HELIOS_API_KEY): every request needs `Authorization: Bearer
KEY`, else 401 in OpenAI's error shape, except the paths in `--public-path` (default /health
and /metrics, so probes and scrapers need no secret) and CORS preflights. Keys are compared in
constant time. CORS (Starlette's middleware) runs outside the key check, so a browser's
preflight is answered 200 with the allowed headers instead of 401 or 405.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

DEFAULT_PUBLIC_PATHS = ("/health", "/livez", "/readyz", "/metrics")   # probes and scrapes carry no key


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    api_keys: tuple[str, ...] = ()
    public_paths: tuple[str, ...] = DEFAULT_PUBLIC_PATHS
    allowed_origins: tuple[str, ...] = ("*",)  # vLLM's default
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @classmethod
    def from_json(cls, value: dict[str, object]) -> "SecuritySettings":
        """The settings from their JSON form (dataclasses.asdict: tuples became lists)."""
        def strings(name: str) -> tuple[str, ...]:
            items = value.get(name, ())
            return tuple(str(v) for v in items) if isinstance(items, (list, tuple)) else ()
        return cls(api_keys=strings("api_keys"), public_paths=strings("public_paths"),
                   allowed_origins=strings("allowed_origins"), allowed_methods=strings("allowed_methods"),
                   allowed_headers=strings("allowed_headers"), allow_credentials=bool(value.get("allow_credentials")))


_UNAUTHORIZED = json.dumps({"error": {"message": "a valid API key is required (Authorization: Bearer KEY)",
                                      "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    """401 unless the request carries one of the keys (pure ASGI: streams pass untouched)."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], public_paths: Sequence[str]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.public = frozenset(public_paths)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    token = token.strip()
                    # every key compared: the time does not tell which key was close
                    return any([hmac.compare_digest(token, key) for key in self.keys])
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public or scope["method"] == "OPTIONS" \
                or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


def install_security(app: FastAPI, settings: SecuritySettings) -> None:
    """Add the key check, then CORS (the last added middleware runs first)."""
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys, public_paths=settings.public_paths)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials)
