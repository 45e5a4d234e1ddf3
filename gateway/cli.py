"""`helios-gateway --triton HOST:PORT --port 9000`: the OpenAI-compatible gateway alone."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import uvicorn

from gateway.access import configure_logging
from gateway.app import WORKER_CONFIG, create_app, worker_config
from gateway.metrics import MULTIPROCESS_DIR
from gateway.security import DEFAULT_PUBLIC_PATHS, SecuritySettings
from gateway.service import AdmissionOverrides
from gateway.shared_permits import SharedPermits
from gateway.triton_client import MODEL_NAME

SHUTDOWN_DRAIN_S = 5  # HTTP-15: connections get five seconds to drain, then are dropped
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helios-gateway", description=__doc__)
    parser.add_argument("--triton", default="127.0.0.1:8001", help="Triton gRPC address HOST:PORT (default: %(default)s)")
    parser.add_argument("--triton-metrics", default=None, metavar="URL",
                        help="Triton's Prometheus endpoint, whose flare_* families /metrics re-exports; 'none': "
                             "not read (default: http://HOST:8002/metrics, HOST from --triton)")
    parser.add_argument("--triton-model", default=MODEL_NAME, help="name of the Triton model serving the core (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--queue-capacity", type=int, default=None,
                        help="requests waiting for a slot; HTTP permits = this + max_active "
                             "(default: the served model's queue_capacity)")
    parser.add_argument("--max-active", type=int, default=None, help="requests generating at once (default: the served model's max_active)")
    parser.add_argument("--frontend-workers", type=int, default=None,
                        help="requests rendered and tokenized at once (default: the served model's frontend_workers)")
    parser.add_argument("--workers", type=int, default=1,
                        help="gateway worker processes sharing one admission budget (for rates one "
                             "process cannot carry: each streamed token costs the gateway CPU) (default: %(default)s)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="require 'Authorization: Bearer KEY' (repeatable; default: $HELIOS_API_KEY)")
    parser.add_argument("--public-path", action="append", default=None,
                        help="a path served without a key (repeatable; default: the probes /health, /livez, /readyz and "
                             "/metrics; "
                             "'none' protects every path)")
    parser.add_argument("--allowed-origins", default='["*"]', help="CORS origins, a JSON list; '[]': no CORS (default: %(default)s)")
    parser.add_argument("--allowed-methods", default='["*"]', help="CORS methods, a JSON list (default: %(default)s)")
    parser.add_argument("--allowed-headers", default='["*"]', help="CORS headers, a JSON list (default: %(default)s)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: off)")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="one line per request on the helios.access logger (default: on)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="request body bound, in bytes (default: derived from the served context)")
    parser.add_argument("--supervision-state", type=Path, default=None,
                        help="helios-serve's restart ledger, exported on /metrics (default: none; helios-serve sets it)")
    parser.add_argument("--log-level", default="info",
                        help="the gateway's and uvicorn's log level: critical, error, warning, info, debug, trace "
                             "(default: %(default)s)")
    return parser


def _json_list(parser: argparse.ArgumentParser, flag: str, text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        parser.error(f"{flag} must be a JSON list of strings, got {text!r}")
    return tuple(value)


def security_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SecuritySettings:
    keys = tuple(args.api_key or ([os.environ["HELIOS_API_KEY"]] if os.environ.get("HELIOS_API_KEY") else []))
    if any(not key for key in keys):
        parser.error("--api-key cannot be empty")
    public = DEFAULT_PUBLIC_PATHS if args.public_path is None else tuple(p for p in args.public_path if p != "none")
    return SecuritySettings(
        api_keys=keys, public_paths=public,
        allowed_origins=_json_list(parser, "--allowed-origins", args.allowed_origins),
        allowed_methods=_json_list(parser, "--allowed-methods", args.allowed_methods),
        allowed_headers=_json_list(parser, "--allowed-headers", args.allowed_headers),
        allow_credentials=args.allow_credentials)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    security = security_settings(parser, args)
    configure_logging(args.log_level, args.access_log)
    overrides = AdmissionOverrides(args.queue_capacity, args.max_active, args.frontend_workers)
    triton_metrics = triton_metrics_url(args.triton, args.triton_metrics)
    if args.workers < 1:
        raise SystemExit("helios-gateway: --workers must be at least 1")
    if args.workers == 1:
        app = create_app(args.triton, overrides, triton_model=args.triton_model, security=security,
                         supervision_state=args.supervision_state, max_body_bytes=args.max_body_bytes,
                         triton_metrics=triton_metrics)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=SHUTDOWN_DRAIN_S, access_log=False)
        return
    with tempfile.TemporaryDirectory(prefix="helios-gateway-", dir=_budget_dir()) as tmp:
        budget = Path(tmp) / "permits"
        SharedPermits.create(budget).close()
        overrides = dataclasses.replace(overrides, shared_budget=str(budget))
        # every worker's metric files, so each /metrics answers for the whole gateway (gateway/metrics.py)
        metric_files = Path(tmp) / "metrics"
        metric_files.mkdir()
        os.environ[MULTIPROCESS_DIR] = str(metric_files)
        os.environ[WORKER_CONFIG] = worker_config(args.triton, args.triton_model, overrides, security,
                                                   args.log_level, args.access_log,
                                                   args.supervision_state, args.max_body_bytes, triton_metrics)
        uvicorn.run("gateway.app:app_from_environment", factory=True, workers=args.workers, host=args.host,
                    port=args.port, log_level=args.log_level, timeout_graceful_shutdown=SHUTDOWN_DRAIN_S,
                    access_log=False)


TRITON_METRICS_PORT = 8002   # tritonserver's default --metrics-port


def triton_metrics_url(triton: str, explicit: str | None) -> str | None:
    """--triton-metrics, 'none' for None, or by default Triton's metrics port on --triton's host."""
    if explicit is not None:
        return None if explicit == "none" else explicit
    host = triton.rsplit(":", 1)[0]
    return f"http://{host}:{TRITON_METRICS_PORT}/metrics"


def _budget_dir() -> str | None:
    """/dev/shm when present: the permit file is touched on every admission."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


if __name__ == "__main__":
    main()
