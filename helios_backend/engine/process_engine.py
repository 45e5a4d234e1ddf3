"""The stub's side of the engine process: the runtime the Triton adapter drives when the
core, the scheduler and the executor run in a process of their own (process_child.py).

    runtime = ProcessEngine.start(options, metrics_backend, on_fatal)   # StartupError names the cause
    runtime.add_request(spec, stream, grammar)     # the Runtime protocol, as Engine (runtime.py)
    runtime.stop()

Why a process: the stub's execute() thread and its response thread (each send a round trip
through the stub's IPC, GIL held) shared one GIL with the worker, whose rounds then waited
for it; measured on the H200 at 64 clients, the worker held ~62 % of the GIL samples and the
rest went to sends and request parsing (bench/results/pyspy_stub_c64_h200_a4f984e.txt).

This side keeps what must live in the stub: the ResponseHub (the Triton senders), the
metrics thread (Triton's metric API) and the assets answer. A wire reader thread hands the
engine's events to the hub and its metric updates to the metrics thread, in order.

Failure: the engine process reports a dead worker (DEATH) or a lost executor (EXIT with the
cause); an engine process that ends without either (killed, crashed) is a death too. A death
fails every open request (FatalPath, as for a thread of Engine) and calls `on_fatal`, which
ends the stub so that supervision restarts both; a lost executor turns `healthy` false, and
the adapter ends the stub after its grace. The engine process ends by itself once the stub is
gone (the end of the wire).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from helios_proto import exchange_pb2 as ep

from helios_backend.engine.engine import FatalPath, ResponseSide, StartupError
from helios_backend.engine.faults import FaultTrigger
from helios_backend.engine.metrics import MetricBackend, MetricsThread, NullMetrics
from helios_backend.engine.process_wire import (
    CANCEL, DEATH, EVENTS, EXIT, FAILED, METRICS, READY, START, STOP, SUBMIT, Wire, WireClosed, unpack_events)
from helios_backend.engine.responses import ResponseHub, Stream, StreamInterval
from helios_backend.engine.settings import StartupOptions
from helios_backend.scheduler.events import Terminal
from helios_backend.scheduler.request import RequestSpec
from helios_backend.exchange import SpecDefaults

log = logging.getLogger("helios.process_engine")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
STOP_MARGIN_S = 30.0        # beyond the drain's own timeout, before a hung engine process is killed


def engine_python() -> str:
    """The interpreter of the engine process: this one, or inside Triton's stub (whose
    sys.executable is the stub binary) the `python3` on PATH, which is how the stub found its
    environment too."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python") and os.access(exe, os.X_OK):
        return exe
    found = shutil.which("python3")
    if found is None:
        raise StartupError("engine process: no python3 on PATH (start tritonserver with the "
                           "environment's bin first on PATH)")
    return found


class EngineWorker:
    """The engine process's worker as the stub sees it: the surface of EngineLoop that the
    adapter reads (alive, lost) and drives (enqueue, cancel, stop)."""

    def __init__(self, wire: Wire, process: subprocess.Popen, hub: ResponseHub) -> None:
        self._wire, self._process, self._hub = wire, process, hub
        self._ended = threading.Event()      # every event of the engine process reached the hub
        self.lost: str | None = None         # the engine's executor is lost (its EXIT said why)
        self.death: str | None = None        # the engine process died: why
        self.stopping = False

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()

    def enqueue(self, serial: int, spec: RequestSpec, grammar: ep.Grammar | None) -> None:
        if self.alive and not self.stopping:
            try:
                self._wire.send(SUBMIT, serial, spec, None if grammar is None else grammar.SerializeToString())
                return
            except WireClosed:
                pass
        self._hub.deliver([Terminal(serial, ep.TerminalEvent(rejected=ep.AdmissionRejection(
            reason=ep.REJECTION_REASON_SHUTTING_DOWN, message="the model stopped")))])

    def cancel(self, serial: int) -> None:
        try:
            self._wire.send(CANCEL, serial)
        except WireClosed:
            pass                             # the engine process is gone: its requests failed already

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Drain (or not) in the engine process; returns once it exited and its events are in
        the hub. A process that outlives the drain's timeout by STOP_MARGIN_S is killed."""
        self.stopping = True
        try:
            self._wire.send(STOP, drain, timeout)
        except WireClosed:
            pass
        bound = None if timeout is None else timeout + STOP_MARGIN_S
        if not self._ended.wait(bound):
            log.error("the engine process did not stop within %.0fs: killing it", bound)
            self._process.kill()
            self._ended.wait(STOP_MARGIN_S)
        try:
            self._process.wait(STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def read(self, metrics: MetricsThread | NullMetrics, fatal: FatalPath) -> None:
        """The wire reader thread: events to the hub, updates to metrics, in order."""
        try:
            while True:
                message = self._wire.receive()
                kind = message[0]
                if kind == EVENTS:
                    self._hub.deliver(unpack_events(message[1]))
                elif kind == METRICS:
                    metrics.push(message[1])
                elif kind == EXIT:
                    self.lost = message[1]
                elif kind == DEATH:
                    self.death = message[1]
        except WireClosed:
            pass
        finally:
            try:
                code = self._process.wait(STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                code = self._process.wait()
            self._wire.close()
            if self.death is None and self.lost is None and not self.stopping:
                self.death = f"the engine process ended unexpectedly (exit code {code})"
            self._ended.set()
        if self.death is not None:
            fatal(self.death)


class ProcessEngine:
    """The runtime surface of Engine (engine.py) over an engine process."""

    def __init__(self, worker: EngineWorker, hub: ResponseHub, metrics: MetricsThread | NullMetrics,
                 assets: ep.FrontendAssets, spec_defaults: SpecDefaults, process: subprocess.Popen) -> None:
        self.loop, self.hub, self.metrics = worker, hub, metrics
        self._assets, self.spec_defaults, self.process = assets, spec_defaults, process
        self.fault = FaultTrigger.from_environment()     # the response thread's site; the worker's is there

    @classmethod
    def start(cls, options: StartupOptions, metrics_backend: MetricBackend | None = None,
              on_fatal: Callable[[str], None] | None = None) -> "ProcessEngine":
        origin = time.monotonic_ns()   # one clock for both processes (CLOCK_MONOTONIC), OBS-15
        ours, theirs = socket.socketpair()
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), environment.get("PYTHONPATH", "")) if p)
        try:
            process = subprocess.Popen(
                [engine_python(), "-m", "helios_backend.engine.process_child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=environment, cwd=str(PROJECT_ROOT))
        except OSError as exc:
            ours.close()
            raise StartupError(f"engine process: cannot start it: {exc}") from exc
        finally:
            theirs.close()
        wire = Wire(ours)
        try:
            wire.send(START, options, origin)
            reply = wire.receive()
        except WireClosed:
            code = process.wait()
            raise StartupError(f"engine process: it exited during startup (exit code {code}); "
                               "its log is above") from None
        if reply[0] == FAILED:
            process.wait()
            raise StartupError(reply[1])
        if reply[0] != READY:
            process.kill()
            raise StartupError(f"engine process: unexpected first message {reply[0]!r}")
        _, assets_bytes, spec_defaults, description = reply
        side = ResponseSide(metrics_backend, on_fatal, StreamInterval(options.stream_interval))
        worker = EngineWorker(wire, process, side.hub)
        side.start(cancel=worker.cancel)
        threading.Thread(target=worker.read, args=(side.metrics, side.fatal), name="helios-engine-wire",
                         daemon=True).start()
        log.info("helios runtime ready in engine process %d: %s", process.pid, description)
        return cls(worker, side.hub, side.metrics, ep.FrontendAssets.FromString(assets_bytes), spec_defaults, process)

    @property
    def healthy(self) -> bool:
        return self.loop.lost is None and self.loop.alive

    def assets(self) -> ep.FrontendAssets:
        return self._assets

    def add_request(self, spec: RequestSpec, stream: Stream, grammar: ep.Grammar | None = None) -> None:
        """The grammar travels to the engine process, which compiles it; one that does not
        compile ends its request with an InvalidRequest naming `grammar` from there."""
        self.hub.register(stream)
        constrained = grammar is not None and grammar.kind != ep.GRAMMAR_KIND_UNSPECIFIED
        self.loop.enqueue(stream.serial, spec, grammar if constrained else None)

    def cancel(self, serial: int) -> None:
        self.loop.cancel(serial)

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Drain the engine process, deliver every final response, then end the threads."""
        start = time.monotonic()
        if isinstance(self.metrics, MetricsThread):
            self.metrics.discard()
        self.loop.stop(drain=drain, timeout=timeout)
        log.info("helios engine process stopped after %.2fs", time.monotonic() - start)
        self.hub.stop()
        if isinstance(self.metrics, MetricsThread):
            self.metrics.stop(discard=True, timeout=1.0)
        log.info("helios runtime stopped after %.2fs", time.monotonic() - start)
