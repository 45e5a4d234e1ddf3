"""The engine process: the core, the scheduler and the executor, outside the stub's GIL.

    python -m helios_backend.engine.process_child FD     # started by ProcessEngine.start

The stub process runs Triton's execute() and the response thread; under one GIL they took
about 40 % of it away from the worker while decoding (bench/results/pyspy_stub_*), and the
worker's rounds stretched by as much. Here the worker holds a GIL of its own. It reads
submissions, cancellations and the stop from the wire (one reader thread), and its events
and metric updates go back over the wire instead of to a ResponseHub (`WireSink`).

The process ends when the worker ends: after a STOP (the drain, then EXIT), after the
executor is lost (EXIT with the cause), after the worker died (DEATH with the cause, exit
code 1), or when the stub is gone (end of the wire: nothing can read the answers, so the
worker stops at once and the process exits within EOF_GRACE_S even if a round hangs; and
within a second of the stub's death by the parent watch, triton/parent_watch.py).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence

from helios_backend.engine.engine import EngineParts, StartupError, freeze_startup_objects
from helios_backend.engine.loop import EngineLoop
from helios_backend.engine.metrics import Update
from helios_backend.engine.process_wire import (
    CANCEL, DEATH, EVENTS, EXIT, FAILED, METRICS, READY, START, STOP, SUBMIT, Wire, WireClosed, pack_events)
from helios_backend.engine.settings import SWITCH_INTERVAL_US, SettingsError, StartupOptions
from helios_backend.scheduler.events import Terminal, WorkerEvent
from helios_backend.exchange import ExchangeError
from helios_backend.triton.parent_watch import watch_parent
from helios_proto import exchange_pb2 as ep

log = logging.getLogger("helios.engine_process")
EOF_GRACE_S = 10.0          # the stub is gone: the worker's own stop gets this long, then the process exits
EXIT_DIED = 1               # the worker died: the stub fails every request and ends itself


class WireSink:
    """The worker's EventSink and MetricsQueue: each delivery is one message to the stub. A
    closed wire drops them: the stub that would read them is gone."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire

    def deliver(self, events: Sequence[WorkerEvent]) -> None:
        if events:
            self._send(EVENTS, pack_events(events))

    def push(self, updates: list[Update]) -> None:
        if updates:
            self._send(METRICS, updates)

    def _send(self, kind: str, payload: object) -> None:
        try:
            self._wire.send(kind, payload)
        except WireClosed:
            pass


def _read(wire: Wire, parts: EngineParts, loop: EngineLoop, sink: WireSink) -> None:
    """The reader thread: one message at a time into the worker's inbox."""
    while True:
        try:
            message = wire.receive()
        except WireClosed:
            log.warning("the stub closed the wire: stopping the worker")
            threading.Thread(target=loop.stop, kwargs={"drain": False}, daemon=True).start()
            time.sleep(EOF_GRACE_S)
            log.error("the worker did not stop within %.0fs of the stub's exit; exiting", EOF_GRACE_S)
            os._exit(EXIT_DIED)
        kind = message[0]
        if kind == SUBMIT:
            _, serial, spec, grammar_bytes = message
            grammar = None
            if grammar_bytes is not None:
                try:
                    grammar = parts.grammar_session(ep.Grammar.FromString(grammar_bytes))
                except ExchangeError as exc:
                    sink.deliver([Terminal(serial, exc.event())])
                    continue
            loop.enqueue(serial, spec, grammar)
        elif kind == CANCEL:
            loop.cancel(message[1])
        elif kind == STOP:
            # the drain runs on its own thread: cancellations keep arriving while it lasts
            _, drain, timeout = message
            threading.Thread(target=loop.stop, kwargs={"drain": drain, "timeout": timeout},
                             name="helios-drain", daemon=True).start()
        else:
            log.error("unknown message %r from the stub", kind)


def serve(wire: Wire) -> int:
    kind, options, origin = wire.receive()
    if kind != START or not isinstance(options, StartupOptions):
        raise SystemExit(f"the engine process expected {START!r}, got {kind!r}")
    sys.setswitchinterval((options.switch_interval_us or SWITCH_INTERVAL_US) / 1e6)
    try:
        parts = EngineParts.build(options, origin)
    except (StartupError, SettingsError) as exc:
        wire.send(FAILED, str(exc))
        return 0
    sink = WireSink(wire)
    died: list[str] = []
    loop = parts.loop(sink, sink, on_death=died.append)
    wire.send(READY, parts.assets().SerializeToString(), parts.spec_defaults, parts.describe())
    freeze_startup_objects()
    loop.start()
    threading.Thread(target=_read, args=(wire, parts, loop, sink), name="helios-wire", daemon=True).start()
    loop.join()
    try:
        if died:
            wire.send(DEATH, died[0])
        else:
            wire.send(EXIT, loop.lost)
    except WireClosed:
        pass
    parts.close()
    return EXIT_DIED if died else 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s helios-engine %(levelname)s %(name)s: %(message)s")
    wire = Wire.from_fd(int(args[0]))
    watch_parent()              # the stub is gone: exit at once, whatever the worker is doing
    try:
        return serve(wire)
    except WireClosed:
        return EXIT_DIED                 # the stub went away during startup
    finally:
        logging.shutdown()


if __name__ == "__main__":
    sys.exit(main())
