"""helios-serve: start tritonserver with the helios model (and the gateway) on a prepared core.

    helios-serve --model ./my-checkpoint [--executor auto|cpu|numpy|cuda] ...
    helios-serve --core var/cores/smollm2-135m-instruct.core [--executor auto|cpu|numpy|cuda]
                 [--gateway/--no-gateway] [--host ADDR] [--api-key KEY] [--tritonserver PATH]
                 [--concurrency N] [--page-capacity N] ...
                 [--rank-peers threads|processes] [--rank-store HOST:PORT] [--local-ranks all|none|1,2]

With --core it prepares nothing (`make core` / helios-prepare does). With --model DIR (a Hugging
Face checkpoint folder) it serves the core the prepared-core cache holds for the folder's content
(ignition/core_cache.py, under $HELIOS_CORE_CACHE), preparing it first when there is none: signed
with the local publisher key and accepted under the namespace it is signed with; GPU kernels are
compiled only when the executor is cuda (the cpu and numpy executors run none). It locates tritonserver (the
nvidia-pytriton wheel, else /opt/tritonserver), builds a backend directory with the python
backend and the stub for the running Python, writes a model repository whose config
carries the options, and starts tritonserver with this environment's bin first on PATH
(HTTP 8000, gRPC 8001, metrics 8002, bound to 127.0.0.1 unless --triton-host says otherwise),
and `helios-gateway` (port 9000 on --host) beside it: the gateway's liveness probe answers while
the model loads, its readiness once the model serves. tritonserver's output passes through
triton/server_log.py (GPU-probe lines explained once on a machine without a GPU). It supervises both
(triton/supervision.py): a model that cannot load or a gateway that cannot start exits non-zero
at once; a stub, server or gateway that dies is restarted after a backoff; SIGINT/SIGTERM stop
the gateway, then the server, within 10 s. The temporary workdir and the server's shared memory
are removed on exit; every process it starts ends with it however it ends (a SIGKILL
included: triton/parent_watch.py), and a start removes the workdir and shared memory an
instance killed that way left (triton/instances.py). With --rank-peers processes a
tensor-parallel core's ranks 1..N-1 run as helios-rank processes (started here for --local-ranks, supervised and restarted with the
server); rank 0 is the model's own process.

`--write-repository DIR` starts nothing: it writes the helios model into an existing model
repository for a tritonserver the operator runs (triton/operator_repository.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from helios_backend.triton.launcher import (
    LOOPBACK, Ports, TritonNotFound, cleanup_shm, locate_tritonserver, prepare_backend_directory, server_command,
    server_environment, gateway_command, write_model_repository)
from helios_backend.contract.errors import ContractError
from helios_backend.core import AuthorizationError, CoreError, IntegrityError, SignatureError, open_core
from helios_backend.engine.settings import BUILT_IN, DEFAULT_ACCEPTANCE, SWITCH_INTERVAL_US
from helios_backend.executors.factory import EXECUTOR_NAMES, HOST_CONCURRENCY, RANK_PEERS
from helios_backend.kernel_abi.activations import ACTIVATIONS
from helios_backend.ranks.rendezvous import parse_address
from helios_backend.triton.operator_repository import write_operator_layout
from helios_backend.triton.server_log import ServerLog
from helios_backend.triton.instances import WORKDIR_PREFIX, Claim, reap_dead
from helios_backend.triton.supervision import (
    Child, ExitCode, RestartLedger, Supervisor, SupervisorConfig)

# CLI flag -> config.pbtxt parameter (startup options; unset flags leave the core's default, then the
# built-in one: docs/triton-backend.md) and its help text
OPTION_PARAMETERS: dict[str, str] = {
    "concurrency": "decode rows served at once, 1..the core's captured rows (default: with the cuda executor "
                   f"all captured rows, else at most {HOST_CONCURRENCY})",
    "speculative_width": "tokens proposed per speculative step, at most the core's widest "
                         "(default: the widest captured; 1 turns speculation off)",
    "queue_capacity": "requests waiting for a slot before new ones are refused (default: the core's, else 64)",
    "max_active": "requests generating at once, in requests (default: the core's, else the concurrency)",
    "event_capacity": "buffered output events per request before it is failed as a slow reader "
                      "(default: the core's, else 256)",
    "page_capacity": "KV-cache pages to allocate, in pages of the core's page_tokens "
                     "(default: the core's, else sized from --cache-memory-share)",
    "snapshot_capacity": "prefix snapshot rows, at most the core's prepared rows (default: the prepared rows; "
                         "0 turns snapshots off)",
    "cache_memory_share": "share of free device memory the KV cache may take, in (0, 1] "
                          "(default: the core's, else 0.9)",
    "switch_interval_us": "the serving process's GIL switch interval, in microseconds "
                          f"(default: {SWITCH_INTERVAL_US})",
    "stream_interval": "tokens a streamed request gathers before they leave together, after its first token, "
                       "at most 25 ms (default: automatic, 1 below 64 open streams, then one more per 32, "
                       "at most 8; 1 streams every token as it is sampled)",
    "admission_burst": "waiting requests that make a round of prompts only, at least 2; fewer join the "
                       f"decode rounds one at a time (default: the core's, else {BUILT_IN.admission_burst})",
}

DEFAULT_RANK_PORT = 29400      # the rendezvous store of rank processes (--rank-store)

# Triton's own wait for the model to unload at shutdown (the gateway has cancelled its streams
# by then). The Python backend first waits 1 s for the stub's health answer, then sends it the
# finalize; on a loaded 2-core host that took past 3 s in about one stop of four, and tritonserver
# then logged "Exit timeout expired" for a clean stop. 5 s keeps a clean stop quiet there, and
# the supervision's deadline (9 s) still bounds the whole stack; the supervision ends
# tritonserver as soon as the stub is gone, so a quick unload does not wait for it.
EXIT_TIMEOUT_S = 5


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helios-serve", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--core", type=Path, help="the prepared core file to serve (this or --model, no default; `make core` writes var/cores/...)")
    source.add_argument("--model", type=Path, metavar="DIR",
                        help="a Hugging Face checkpoint folder to serve (this or --core): its core is prepared into "
                             "$HELIOS_CORE_CACHE (default ~/.cache/helios/cores) on first use, keyed by the folder's "
                             "content, and reused by later starts (this or --core, no default)")
    p.add_argument("--acceptance", default=None,
                   help="the publisher namespace you accept; the core's signature must name it (default: "
                        f"{DEFAULT_ACCEPTANCE} with --core; with --model the namespace the locally signed core names)")
    p.add_argument("--served-model-name", action="extend", nargs="+", default=None, metavar="NAME",
                   dest="served_model_names",
                   help="more model ids requests may name (repeatable, or several after one flag): "
                        "/v1/models lists them after the core's served id and its signed aliases; "
                        "answers still name the served id (default: none)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="--model: compile GPU kernel modules into the prepared core (default: when the executor "
                        "is cuda; the cpu and numpy executors run none, so a CPU-only host skips the compilation)")
    p.add_argument("--executor", choices=("auto",) + EXECUTOR_NAMES, default="auto",
                   help="auto: cuda where a GPU is usable, else cpu (compiled CPU kernels); numpy: the CPU oracle (default: %(default)s)")
    p.add_argument("--activations", choices=ACTIVATIONS, default=None,
                   help="cpu and numpy executors: the activations of products over block weights (Q8_0 / Q4_1): "
                        "f32, or q8 (quantized to 8 bits per 32-element block and multiplied with integer "
                        "instructions, as llama.cpp does; docs/cpu-executor.md) (default: the executor's: "
                        "q8 on cpu, f32 for a tensor-parallel core and on numpy)")
    p.add_argument("--gateway", action=argparse.BooleanOptionalAction, default=True,
                   help="also start helios-gateway once tritonserver runs (default: on when installed)")
    p.add_argument("--http-port", type=int, default=8000, help="tritonserver's HTTP port (default: %(default)s)")
    p.add_argument("--grpc-port", type=int, default=8001, help="tritonserver's gRPC port, which the gateway uses (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="tritonserver's Prometheus port (flare_*; the gateway's /metrics re-exports it) (default: %(default)s)")
    p.add_argument("--gateway-port", type=int, default=9000, help="the gateway's HTTP port (default: %(default)s)")
    p.add_argument("--gateway-workers", type=int, default=None,
                   help="gateway worker processes (one admission budget); each streamed token costs "
                        "gateway CPU, so rates beyond one core's need several (default: with the cuda "
                        "executor half the usable CPUs, at most 6; else 1)")
    p.add_argument("--host", default="0.0.0.0", help="address the gateway listens on (default: %(default)s)")
    p.add_argument("--triton-host", default=LOOPBACK,
                   help="address tritonserver's HTTP, gRPC and metrics ports bind to (they carry no "
                        "authentication: loopback unless asked otherwise) (default: %(default)s)")
    p.add_argument("--tritonserver", type=Path, default=None,
                   help="the tritonserver binary (default: the nvidia-pytriton wheel's, else /opt/tritonserver)")
    p.add_argument("--api-key", action="append", default=None,
                   help="gateway: require 'Authorization: Bearer KEY' (repeatable; default $HELIOS_API_KEY)")
    p.add_argument("--allowed-origins", default=None, help="gateway: CORS origins, a JSON list (default: the gateway's, [\"*\"])")
    p.add_argument("--workdir", type=Path, default=None,
                   help="model repository and backend dir (default: a temporary one, removed on exit)")
    p.add_argument("--history-drafting", action=argparse.BooleanOptionalAction, default=None,
                   help="speculative generation with drafts copied from each request's own prompt and "
                        "output (prompt lookup): up to 7 copied tokens verified per step, the width chosen "
                        "per request from observed acceptance, plain decode where copies are not accepted; "
                        "pays for code edits, quoting and rewriting at low batch (docs/speculative.md); "
                        "needs a core with SPECULATIVE programs (the shipped recipes record them) "
                        "(default: off)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the scheduler and the executor in a process of their own, outside the "
                        "Triton stub's GIL (default: on)")
    for name, text in OPTION_PARAMETERS.items():
        p.add_argument("--" + name.replace("_", "-"), type=float if name == "cache_memory_share" else int,
                       default=None, help=text)
    p.add_argument("--rank-peers", choices=RANK_PEERS, default="threads",
                   help="tensor-parallel cores: threads (every rank in the model's process) or processes "
                        "(rank 0 there, every other rank a helios-rank process; docs/rank-processes.md) "
                        "(default: %(default)s)")
    p.add_argument("--rank-store", default=f"{LOOPBACK}:{DEFAULT_RANK_PORT}",
                   help="processes: HOST:PORT rank 0's rendezvous store listens on, reachable by every rank "
                        "(default: %(default)s)")
    p.add_argument("--local-ranks", default="all",
                   help="processes: the peer ranks helios-serve starts here: all (default), none (each runs "
                        "helios-rank on its own host) or a comma-separated list of ranks")
    p.add_argument("--rank-timeout", type=float, default=None,
                   help="processes: seconds a rank may take to answer a step before every request fails (default: 30)")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for the model to load before giving up (exit 6) (default: %(default)s)")
    p.add_argument("--write-repository", type=Path, default=None, metavar="DIR",
                   help="start nothing: write the helios model into the model repository DIR (other models "
                        "there stay), the Python backend for this environment into DIR/../backends, and print "
                        "the script that starts tritonserver on them (docs/deployment.md) (default: serve)")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="one extra argument for helios-gateway, e.g. --gateway-arg=--access-log=false (repeatable; default: none)")
    return p


def _local_triton_host(args: argparse.Namespace) -> str:
    """Where this host reaches tritonserver (a wildcard bind is reached on the loopback)."""
    return LOOPBACK if args.triton_host in ("0.0.0.0", "::") else args.triton_host


def gateway_arguments(args: argparse.Namespace, ports: Ports) -> list[str]:
    """helios-gateway's command line (after its program name) for these options."""
    host = _local_triton_host(args)
    out = ["--triton", f"{host}:{ports.grpc}", "--triton-metrics", f"http://{host}:{ports.metrics}/metrics",
           "--host", args.host, "--port", str(args.gateway_port), "--workers", str(args.gateway_workers)]
    for key in args.api_key or ():
        out += ["--api-key", key]
    if args.allowed_origins is not None:
        out += ["--allowed-origins", args.allowed_origins]
    return out


# One gateway process streams about 21k tokens/s (~48 us of one core per token, H100 host, 2026-12-05);
# six served 78k at 128 clients and 101k at 256 there, and twelve were no faster than six
# (docs/gateway.md). The rest of the host's cores run the stub, the engine process and tritonserver.
MAX_AUTO_GATEWAY_WORKERS = 6


def resolve_gateway_workers(requested: int | None, executor: str, cpus: int) -> int:
    """--gateway-workers, or by default: several processes only where the executor can outrun
    one (cuda), half the usable CPUs up to MAX_AUTO_GATEWAY_WORKERS; the CPU and numpy
    executors serve far below one process's rate."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--gateway-workers must be at least 1, got {requested}")
        return requested
    if executor != "cuda":
        return 1
    return max(1, min(MAX_AUTO_GATEWAY_WORKERS, cpus // 2))


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_executor(name: str) -> str:
    """`auto`: the CUDA executor where cuda-bindings sees a device, else the CPU executor."""
    if name != "auto":
        return name
    from helios_backend.executors.cuda.driver import gpu_available

    return "cuda" if gpu_available() else "cpu"


def option_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The config.pbtxt parameters the options set (unset options leave the core's defaults)."""
    parameters: dict[str, str] = {}
    if args.rank_peers == "processes":
        parameters.update(rank_peers="processes", rank_store=args.rank_store,
                          rank_join_timeout=str(args.ready_timeout))
        if args.rank_timeout is not None:
            parameters["rank_timeout"] = str(args.rank_timeout)
    for name in OPTION_PARAMETERS:
        if getattr(args, name) is not None:
            parameters[name] = str(getattr(args, name))
    if args.served_model_names:
        parameters["served_model_names"] = json.dumps(args.served_model_names)
    if args.history_drafting is not None:
        parameters["history_drafting"] = str(args.history_drafting).lower()
    if args.engine_process is not None:
        parameters["engine_process"] = str(args.engine_process).lower()
    if args.activations is not None:
        parameters["activations"] = args.activations
    return parameters


def _fixed(argv: list[str]) -> Callable[[], list[str]]:
    return lambda: argv


def rank_children(args: argparse.Namespace, core: Path, executor: str, world_size: int) -> list[Child]:
    """The helios-rank processes to start on this host (--local-ranks of ranks 1..world_size-1)."""
    if args.rank_peers != "processes" or world_size < 2 or args.local_ranks == "none":
        return []
    ranks = range(1, world_size) if args.local_ranks == "all" else [int(r) for r in args.local_ranks.split(",")]
    host, port = parse_address(args.rank_store, "--rank-store")
    host = LOOPBACK if host in ("0.0.0.0", "::") else host
    children = []
    for rank in ranks:
        if not 1 <= rank < world_size:
            raise ValueError(f"--local-ranks: rank {rank} is outside 1..{world_size - 1}")
        argv = [sys.executable, "-m", "helios_backend.cli.rank", "--core", str(core), "--rank", str(rank),
                "--store", f"{host}:{port}", "--executor", executor, "--acceptance", args.acceptance,
                "--join-timeout", str(args.ready_timeout)]
        children.append(Child(f"rank{rank}", _fixed(argv)))
    return children


def prepared_model(args: argparse.Namespace, executor: str) -> Path:
    """--model: the folder's cached core (prepared now if the cache has none); sets args.acceptance
    to its namespace unless given. ModelFolderError when the folder cannot be prepared."""
    from ignition.core_cache import CoreCache

    kernels = executor == "cuda" if args.kernels is None else args.kernels
    entry = CoreCache().find_or_prepare(args.model, kernels, log=lambda line: print(
        f"helios-serve: {line}", file=sys.stderr, flush=True))
    if args.acceptance is None:
        args.acceptance = entry.namespace
    return entry.path


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.kernels is not None and args.model is None:
        print("helios-serve: --kernels/--no-kernels apply to --model only (a --core is already prepared)", file=sys.stderr)
        return int(ExitCode.USAGE)
    if args.model is not None:
        try:        # preparation is a package of its own, installed with the prepare extra
            from ignition.core_cache import ModelFolderError
        except ImportError as exc:
            print(f"helios-serve: --model needs preparation installed (the prepare extra): {exc}", file=sys.stderr)
            return int(ExitCode.USAGE)
        try:
            args.core = prepared_model(args, resolve_executor(args.executor))
        except ModelFolderError as exc:
            print(f"helios-serve: {exc}", file=sys.stderr)
            return int(ExitCode.USAGE)
    if args.acceptance is None:
        args.acceptance = DEFAULT_ACCEPTANCE
    core = args.core.resolve()
    if not core.is_file():
        print(f"helios-serve: no core at {core} (prepare one: make core, or helios-prepare)", file=sys.stderr)
        return int(ExitCode.USAGE)
    try:
        install = locate_tritonserver(args.tritonserver)
    except TritonNotFound as exc:
        print(f"helios-serve: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    for dead in reap_dead():
        print(f"helios-serve: removed the state of a dead instance (pid {dead.pid}): shared memory "
              f"{dead.shm_prefix}*, workdir {dead.workdir or '(its own --workdir, kept)'}"
              + (f"; ended its leftover processes {list(dead.killed)}" if dead.killed else ""), file=sys.stderr)
    owned_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX)) if owned_workdir else args.workdir
    shm_prefix = f"{WORKDIR_PREFIX}{uuid.uuid4().hex[:8]}-"
    claim = Claim.take(shm_prefix, workdir if owned_workdir else None)
    serving = args.write_repository is None
    if serving:
        print(f"helios-serve: workdir {workdir}, shared memory prefix {shm_prefix}", file=sys.stderr, flush=True)
    try:
        executor = resolve_executor(args.executor)
        try:
            args.gateway_workers = resolve_gateway_workers(args.gateway_workers, executor, usable_cpus())
        except ValueError as exc:
            print(f"helios-serve: {exc}", file=sys.stderr)
            return int(ExitCode.USAGE)
        if args.gateway and serving:
            print(f"helios-serve: {args.gateway_workers} gateway worker process(es)", file=sys.stderr, flush=True)
        parameters = {"core_path": str(core), "acceptance": args.acceptance, "executor": executor}
        try:
            with open_core(core) as opened:
                world_size = max(1, opened.manifest.world_size)
                # the model's own refusals, found here in about a second instead of after
                # tritonserver and the stub have started (seconds, more under load): a publisher
                # the operator does not accept, a tampered core, a contract that does not validate
                opened.authorize(args.acceptance)
                opened.verify_stored()
                opened.prepared_contract()
            ranks = rank_children(args, core, executor, world_size)
        except (AuthorizationError, IntegrityError, SignatureError, ContractError) as exc:
            print(f"helios-serve: the core cannot be served ({type(exc).__name__}): {exc}", file=sys.stderr)
            return int(ExitCode.MODEL_FAILED)
        except (ValueError, CoreError) as exc:
            print(f"helios-serve: {exc}", file=sys.stderr)
            return int(ExitCode.USAGE)
        parameters.update(option_parameters(args))
        if args.write_repository is not None:
            print(write_operator_layout(args.write_repository, install, parameters), end="", flush=True)
            return int(ExitCode.OK)
        repository = write_model_repository(workdir, parameters)
        backends = prepare_backend_directory(install, workdir / "triton")
        ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
        command = server_command(install, backends, repository, ports, shm_prefix=shm_prefix,
                                 exit_timeout_s=EXIT_TIMEOUT_S, address=args.triton_host)
        triton = Child("tritonserver", lambda: command, env=server_environment(install),
                       output=ServerLog(executor).copy)
        ledger = RestartLedger(workdir / "supervision.json")
        gateway = None
        gateway_url = None
        if args.gateway:
            binary = gateway_command()
            if binary is None:
                print("helios-serve: helios-gateway is not installed; serving Triton only", file=sys.stderr)
            else:
                gateway_argv = [*binary, *gateway_arguments(args, ports), "--supervision-state", str(ledger.path),
                                *args.gateway_arg]
                gateway = Child("gateway", lambda: gateway_argv)
                gateway_url = f"http://127.0.0.1:{args.gateway_port}/health"
        supervisor = Supervisor(SupervisorConfig(ports.http, gateway_url, args.ready_timeout,
                                                 host=_local_triton_host(args)), triton, gateway,
                                ledger, after_triton_stop=lambda: cleanup_shm(shm_prefix), ranks=ranks)
        signal.signal(signal.SIGINT, supervisor.request_stop)
        signal.signal(signal.SIGTERM, supervisor.request_stop)
        return supervisor.run()
    finally:
        cleanup_shm(shm_prefix)
        if owned_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        claim.release()


if __name__ == "__main__":
    sys.exit(main())
