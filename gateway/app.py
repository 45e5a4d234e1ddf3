"""FastAPI application factory (and the one uvicorn's worker processes call)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.access import AccessMiddleware, configure_logging
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.routers import chat, completions, health, metrics, models, tokens
from gateway.security import SecuritySettings, install_security
from gateway.service import AdmissionOverrides, GatewayService, ParserFactory, syntax_parsers
from gateway.triton_client import MODEL_NAME, TritonBackend


def create_app(triton_url: str, overrides: AdmissionOverrides | None = None,
               parser_factory: ParserFactory = syntax_parsers, triton_model: str = MODEL_NAME,
               security: SecuritySettings | None = None) -> FastAPI:
    """The gateway for the Triton model ``triton_model`` at the gRPC endpoint ``triton_url`` (HOST:PORT)."""
    gateway_metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = GatewayService(TritonBackend(triton_url, triton_model), overrides or AdmissionOverrides(),
                                 parser_factory, gateway_metrics)
        app.state.service = service
        service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="Helios gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible endpoints over Triton (docs/gateway.md)")
    install_error_handlers(app)
    for router in (chat.router, completions.router, models.router, health.router, metrics.router, tokens.router):
        app.include_router(router)
    # outermost first when a request arrives: access (ids, log, counts), CORS, then the key check
    install_security(app, security or SecuritySettings())
    app.add_middleware(AccessMiddleware, metrics=gateway_metrics)
    return app


WORKER_CONFIG = "HELIOS_GATEWAY_CONFIG"   # JSON of the settings below, set by helios-gateway --workers


def worker_config(triton_url: str, triton_model: str, overrides: AdmissionOverrides,
                  security: SecuritySettings | None = None, log_level: str = "info", access_log: bool = True) -> str:
    return json.dumps({"triton_url": triton_url, "triton_model": triton_model,
                       "overrides": dataclasses.asdict(overrides),
                       "security": dataclasses.asdict(security or SecuritySettings()),
                       "log_level": log_level, "access_log": access_log})


def app_from_environment() -> FastAPI:
    """The gateway of one worker process: every worker serves the same Triton model and
    shares the parent's admission budget (overrides.shared_budget)."""
    config = json.loads(os.environ[WORKER_CONFIG])
    configure_logging(config["log_level"], config["access_log"])  # a spawned process: nothing inherited
    security = SecuritySettings.from_json(config["security"])
    return create_app(config["triton_url"], AdmissionOverrides(**config["overrides"]),
                      triton_model=config["triton_model"], security=security)
