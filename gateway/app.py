"""FastAPI application factory (and the one uvicorn's worker processes call)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from fastapi import FastAPI

from helios_backend.engine.settings import SWITCH_INTERVAL_US
from helios_backend.triton.parent_watch import watch_parent

from gateway.access import AccessMiddleware, configure_logging
from gateway.backend_metrics import BackendScrape
from gateway.body_limit import BodyLimit
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.model_wait import ModelWait
from gateway.routers import chat, completions, health, metrics, models, tokens
from gateway.security import SecuritySettings, install_security
from gateway.service import AdmissionOverrides, GatewayService, ParserFactory, syntax_parsers
from gateway.triton_client import MODEL_NAME, TritonBackend


def create_app(triton_url: str, overrides: AdmissionOverrides | None = None,
               parser_factory: ParserFactory = syntax_parsers, triton_model: str = MODEL_NAME,
               security: SecuritySettings | None = None, supervision_state: Path | None = None,
               max_body_bytes: int | None = None, triton_metrics: str | None = None) -> FastAPI:
    """The gateway for the Triton model ``triton_model`` at the gRPC endpoint ``triton_url`` (HOST:PORT);
    ``triton_metrics``: the URL of Triton's Prometheus endpoint /metrics re-exports (None: not read)."""
    gateway_metrics = GatewayMetrics()
    backend_metrics = BackendScrape(triton_metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = GatewayService(TritonBackend(triton_url, triton_model), overrides or AdmissionOverrides(),
                                 parser_factory, gateway_metrics)
        app.state.service = service
        if supervision_state is not None:
            service.metrics.export_supervision(supervision_state)
        service.start()
        # the stub's interval, for the same reason: CPython's 5 ms lets the busy streaming loop hold
        # back a preparation thread (template, tokenizer) by up to 5 ms per wake-up
        sys.setswitchinterval(SWITCH_INTERVAL_US / 1e6)
        restore = _start_shutdown_on_signals(service)
        try:
            yield
        finally:
            restore()
            await service.close()
            await backend_metrics.close()

    app = FastAPI(title="Helios gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible endpoints over Triton (docs/gateway.md)")
    app.state.backend_metrics = backend_metrics
    app.state.triton_model = triton_model
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=lambda: _body_bound(app, max_body_bytes))
    app.add_middleware(ModelWait)     # inside the key check: a refused key never waits
    for router in (chat.router, completions.router, models.router, health.router, metrics.router, tokens.router):
        app.include_router(router)
    # outermost first when a request arrives: access (ids, log, counts), CORS, then the key check
    install_security(app, security or SecuritySettings())
    app.add_middleware(AccessMiddleware, metrics=gateway_metrics)
    return app


WORKER_CONFIG = "HELIOS_GATEWAY_CONFIG"   # JSON of the settings below, set by helios-gateway --workers


def worker_config(triton_url: str, triton_model: str, overrides: AdmissionOverrides,
                  security: SecuritySettings | None = None, log_level: str = "info", access_log: bool = True,
                  supervision_state: Path | None = None, max_body_bytes: int | None = None,
                  triton_metrics: str | None = None) -> str:
    return json.dumps({"triton_url": triton_url, "triton_model": triton_model,
                       "overrides": dataclasses.asdict(overrides),
                       "security": dataclasses.asdict(security or SecuritySettings()),
                       "log_level": log_level, "access_log": access_log,
                       "supervision_state": str(supervision_state) if supervision_state else None,
                       "max_body_bytes": max_body_bytes, "triton_metrics": triton_metrics})


def app_from_environment() -> FastAPI:
    """The gateway of one worker process: every worker serves the same Triton model and
    shares the parent's admission budget (overrides.shared_budget)."""
    config = json.loads(os.environ[WORKER_CONFIG])
    watch_parent()          # a worker ends with the gateway process, whatever ends it
    configure_logging(config["log_level"], config["access_log"])  # a spawned process: nothing inherited
    security = SecuritySettings.from_json(config["security"])
    state = config.get("supervision_state")
    return create_app(config["triton_url"], AdmissionOverrides(**config["overrides"]),
                      triton_model=config["triton_model"], security=security,
                      supervision_state=Path(state) if state else None, max_body_bytes=config.get("max_body_bytes"),
                      triton_metrics=config.get("triton_metrics"))


# HTTP-15 gives connections five seconds to drain (helios-gateway's timeout_graceful_shutdown);
# responses still open this long into it get their terminal `shutting_down` error, so no
# stream is cut without one when the drain ends
TERMINAL_EVENT_AT_S = 4.5


def _start_shutdown_on_signals(service: GatewayService) -> Callable[[], None]:
    """Chain onto the SIGINT/SIGTERM handlers uvicorn installed (in this process, whether it
    is the only one or one of --workers): the first signal also starts the service's
    shutdown, then uvicorn's own handler begins the connection drain. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(sig: int, frame: FrameType | None) -> None:
        service.begin_shutdown(TERMINAL_EVENT_AT_S)
        chained = previous[sig]
        if callable(chained):
            chained(sig, frame)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, chained in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, chained)
    return restore


# before the model is known every generation request is refused (503) anyway
_BODY_BOUND_UNTIL_SERVED = 1 << 20


def _body_bound(app: FastAPI, configured: int | None) -> int:
    if configured is not None:
        return configured
    service = getattr(app.state, "service", None)
    served = service.served_or_none if service is not None else None
    return served.default_body_bytes if served is not None else _BODY_BOUND_UNTIL_SERVED
