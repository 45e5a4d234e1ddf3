"""helios-serve: start tritonserver with the helios model (and the gateway) on a prepared core.

    helios-serve --core var/cores/smollm2-135m-instruct.core [--executor auto|cpu|numpy|cuda]
                 [--gateway/--no-gateway] [--host ADDR] [--api-key KEY] [--tritonserver PATH]
                 [--concurrency N] [--page-capacity N] ...

It prepares nothing (`make core` / helios-prepare does). It locates tritonserver (the
nvidia-pytriton wheel, else /opt/tritonserver), builds a backend directory with the python
backend and the stub for the running Python, writes a model repository whose config
carries the options, and starts tritonserver with this environment's bin first on PATH
(HTTP 8000, gRPC 8001, metrics 8002, bound to 127.0.0.1 unless --triton-host says otherwise),
then `helios-gateway` (port 9000 on --host) once the model is ready. SIGINT/SIGTERM are forwarded: Triton drains its streams, the gateway its connections.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from helios_backend.triton.launcher import (
    LOOPBACK, Ports, TritonNotFound, cleanup_shm, locate_tritonserver, prepare_backend_directory, server_command,
    server_environment, gateway_command, write_model_repository)
from helios_backend.engine.settings import DEFAULT_ACCEPTANCE, EXECUTORS

# CLI flag -> config.pbtxt parameter (startup options; unset flags leave the core default)
OPTION_PARAMETERS = ("concurrency", "speculative_width", "queue_capacity", "max_active", "event_capacity",
                     "page_capacity", "snapshot_capacity", "cache_memory_share")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--core", required=True, type=Path, help="prepared core file")
    p.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE, help="publisher namespace you accept")
    p.add_argument("--executor", choices=("auto",) + EXECUTORS, default="auto",
                   help="auto (default): cuda where a GPU is usable, else cpu (compiled CPU kernels)")
    p.add_argument("--gateway", action=argparse.BooleanOptionalAction, default=True,
                   help="also start helios-gateway (default: on when installed)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--gateway-port", type=int, default=9000)
    p.add_argument("--gateway-workers", type=int, default=1,
                   help="gateway worker processes (one admission budget); each streamed token costs "
                        "gateway CPU, so rates beyond one core's need several")
    p.add_argument("--host", default="0.0.0.0", help="address the gateway listens on")
    p.add_argument("--triton-host", default=LOOPBACK,
                   help="address tritonserver's HTTP, gRPC and metrics ports bind to (they carry no "
                        "authentication: loopback unless asked otherwise)")
    p.add_argument("--tritonserver", type=Path, default=None,
                   help="the tritonserver binary (default: the nvidia-pytriton wheel's, else /opt/tritonserver)")
    p.add_argument("--api-key", action="append", default=None,
                   help="gateway: require 'Authorization: Bearer KEY' (repeatable; default $HELIOS_API_KEY)")
    p.add_argument("--allowed-origins", default=None, help="gateway: CORS origins, a JSON list")
    p.add_argument("--workdir", type=Path, default=None, help="model repository and backend dir (default: temp)")
    p.add_argument("--history-drafting", action=argparse.BooleanOptionalAction, default=None)
    for name in OPTION_PARAMETERS:
        p.add_argument("--" + name.replace("_", "-"), type=float if name == "cache_memory_share" else int,
                       default=None)
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for the model")
    return p


def _local_triton_host(args: argparse.Namespace) -> str:
    """Where this host reaches tritonserver (a wildcard bind is reached on the loopback)."""
    return LOOPBACK if args.triton_host in ("0.0.0.0", "::") else args.triton_host


def gateway_arguments(args: argparse.Namespace, ports: Ports) -> list[str]:
    """helios-gateway's command line (after its program name) for these options."""
    out = ["--triton", f"{_local_triton_host(args)}:{ports.grpc}", "--host", args.host, "--port", str(args.gateway_port),
           "--workers", str(args.gateway_workers)]
    for key in args.api_key or ():
        out += ["--api-key", key]
    if args.allowed_origins is not None:
        out += ["--allowed-origins", args.allowed_origins]
    return out


def resolve_executor(name: str) -> str:
    """`auto`: the CUDA executor where cuda-bindings sees a device, else the CPU executor."""
    if name != "auto":
        return name
    from helios_backend.executors.cuda.driver import gpu_available

    return "cuda" if gpu_available() else "cpu"


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    core = args.core.resolve()
    if not core.is_file():
        print(f"helios-serve: no core at {core} (prepare one: make core, or helios-prepare)", file=sys.stderr)
        return 2
    try:
        install = locate_tritonserver(args.tritonserver)
    except TritonNotFound as exc:
        print(f"helios-serve: {exc}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="helios-serve-"))
    parameters = {"core_path": str(core), "acceptance": args.acceptance, "executor": resolve_executor(args.executor)}
    for name in OPTION_PARAMETERS:
        if getattr(args, name) is not None:
            parameters[name] = str(getattr(args, name))
    if args.history_drafting is not None:
        parameters["history_drafting"] = str(args.history_drafting).lower()
    repository = write_model_repository(workdir, parameters)
    backends = prepare_backend_directory(install, workdir / "triton")
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    shm_prefix = f"helios-serve-{uuid.uuid4().hex[:8]}-"
    triton = subprocess.Popen(server_command(install, backends, repository, ports, shm_prefix=shm_prefix,
                                             address=args.triton_host),
                              env=server_environment(install))
    children: list[subprocess.Popen[bytes]] = [triton]
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGINT if child is triton else signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        if args.gateway:
            gateway = gateway_command()
            if gateway is None:
                print("helios-serve: helios-gateway is not installed; serving Triton only", file=sys.stderr)
            else:
                deadline = time.monotonic() + args.ready_timeout
                ready = f"http://{_local_triton_host(args)}:{ports.http}/v2/models/helios/ready"
                while not stopping and triton.poll() is None and time.monotonic() < deadline \
                        and _status(ready) != 200:
                    time.sleep(0.5)
                if not stopping and triton.poll() is None and _status(ready) == 200:
                    children.append(subprocess.Popen([*gateway, *gateway_arguments(args, ports)]))
                elif not stopping:
                    print("helios-serve: the helios model is not ready; see the tritonserver log above "
                          "(the gateway was not started)", file=sys.stderr)
        rc = triton.wait()
        for child in children[1:]:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
            child.wait()
        return rc
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        cleanup_shm(shm_prefix)


if __name__ == "__main__":
    sys.exit(main())
