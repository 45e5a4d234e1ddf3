"""The seam between a server and the engine: what the Triton adapter drives.

    runtime: Runtime = Engine.start(options, metrics, on_fatal)          # the engine in this process
    runtime: Runtime = ProcessEngine.start(options, metrics, on_fatal)   # the engine in a process of its own
    runtime.add_request(spec, stream, grammar)    # grammar: the request's ep.Grammar as it arrived

Both keep the response hub (the server's senders) on the caller's side; they differ only in
where the core, the scheduler and the executor run. A request's grammar crosses the seam as
the exchange message and is compiled where the scheduler lives (EngineParts.grammar_session):
in this process before the stream is registered (a grammar that does not compile raises
ExchangeError, and nothing was registered), or in the engine process, which ends the request
with the same InvalidRequest through its stream.
"""
from __future__ import annotations

from typing import Protocol

from helios_proto import exchange_pb2 as ep

from helios_backend.engine.faults import FaultTrigger
from helios_backend.engine.responses import ResponseHub, Stream
from helios_backend.scheduler.request import RequestSpec
from helios_backend.exchange import SpecDefaults


class Worker(Protocol):
    """The engine's worker as its server sees it (EngineLoop, or the engine process's)."""

    @property
    def alive(self) -> bool: ...

    @property
    def lost(self) -> str | None:
        """Why the executor can run nothing more (a rank process died), once it is lost."""


class Runtime(Protocol):
    @property
    def hub(self) -> ResponseHub: ...

    @property
    def loop(self) -> Worker: ...

    @property
    def spec_defaults(self) -> SpecDefaults: ...

    @property
    def fault(self) -> FaultTrigger | None:
        """The response thread's fault injection (faults.py); None when off."""

    @property
    def healthy(self) -> bool:
        """False once the worker stopped or its executor was lost: the model must be started again."""

    def assets(self) -> ep.FrontendAssets: ...

    def add_request(self, spec: RequestSpec, stream: Stream, grammar: ep.Grammar | None = None) -> None:
        """Register the stream and queue the request (ExchangeError: refused, nothing registered)."""

    def cancel(self, serial: int) -> None: ...

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Drain (or not), deliver every final response, release the engine."""
