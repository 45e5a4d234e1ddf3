"""The response thread: one coalescing output buffer per request, sent off the worker.

The worker appends events (deliver) and never waits on a client. The response thread
sends each request's accumulated output as ONE response: when a reader (or the stub,
~0.25 ms per send) is behind, tokens coalesce instead of queueing sends, so a paused
reader loses nothing and never stalls scheduling (HTTP-9, HTTP-10). The terminal event
rides on the last data response with the FINAL flag (a flag-only FINAL is invisible to
the aio gRPC client). It also polls `is_cancelled()` and reports cancellations.

Invariant: every registered stream gets exactly one final response: from its terminal
event, or, if the backend stops first, a typed execution failure.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from helios_proto import transport_pb2 as tp

from helios_backend.scheduler.scheduler import Emitted, Event
from helios_backend.engine.metrics import MetricsQueue, Op, Update, update
from helios_backend.transport import OutputChunk

log = logging.getLogger("helios.responses")
CANCEL_POLL_S = 0.02


class Sender(Protocol):
    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None: ...
    def is_cancelled(self) -> bool: ...


@dataclass
class Stream:
    serial: int
    sender: Sender
    timestamps: bool = False
    logprobs: bool = False
    top_k: int = 0
    ingress_ns: int | None = None        # gateway stamps echoed into Performance
    enqueue_ns: int | None = None
    received_ns: int = field(default_factory=time.monotonic_ns)
    first_token_ns: int = 0
    pending: OutputChunk = field(default_factory=OutputChunk)
    final: bool = False                  # terminal event received (pending holds it)
    cancel_reported: bool = False
    sent_responses: int = 0


class ResponseHub:
    def __init__(self, on_cancel: Callable[[int], None], metrics: MetricsQueue) -> None:
        self._on_cancel = on_cancel
        self._metrics = metrics
        self._lock = threading.Condition()
        self._streams: dict[int, Stream] = {}
        self._dirty: set[int] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="helios-responses", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def register(self, stream: Stream) -> None:
        with self._lock:
            self._streams[stream.serial] = stream

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def deliver(self, events: list[Event]) -> None:
        """From the worker: append to buffers; never blocks on a client."""
        if not events:
            return
        now = time.monotonic_ns()
        updates: list[Update] = []
        with self._lock:
            for ev in events:
                stream = self._streams.get(ev.serial)
                if stream is None or stream.final:
                    continue
                chunk = stream.pending
                if isinstance(ev, Emitted):
                    chunk.tokens.append(ev.token)
                    if stream.timestamps:
                        chunk.timestamps.append(ev.timestamp_ns)
                    if stream.logprobs:
                        chunk.logprobs.append(ev.logprob)
                    if stream.top_k and ev.top_ids is not None and ev.top_logprobs is not None:
                        chunk.top_ids.append(ev.top_ids)
                        chunk.top_logprobs.append(ev.top_logprobs)
                    if not stream.first_token_ns:
                        stream.first_token_ns = now
                        updates.append(update("flare_time_to_first_token_seconds", Op.OBSERVE,
                                              (now - stream.received_ns) / 1e9))
                else:
                    terminal = ev.event
                    if terminal.HasField("finished") and terminal.finished.HasField("performance"):
                        perf = terminal.finished.performance
                        if stream.ingress_ns is not None:
                            perf.ingress_ns = stream.ingress_ns
                        if stream.enqueue_ns is not None:
                            perf.enqueue_ns = stream.enqueue_ns
                    chunk.event = tp.ResponseEvent(terminal=terminal)
                    stream.final = True
                    updates.append(update("flare_e2e_request_latency_seconds", Op.OBSERVE,
                                          (now - stream.received_ns) / 1e9))
                self._dirty.add(ev.serial)
            self._lock.notify()
        self._metrics.push(updates)

    def finish_now(self, serial: int, event: tp.ResponseEvent) -> None:
        """Answer a request that never reached the worker (assets, invalid, refused)."""
        with self._lock:
            stream = self._streams.get(serial)
            if stream is None or stream.final:
                return
            stream.pending.event = event
            stream.final = True
            self._dirty.add(serial)
            self._lock.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Flush, fail whatever never got a terminal event, and end the thread."""
        with self._lock:
            for stream in self._streams.values():
                if not stream.final:
                    stream.pending.event = tp.ResponseEvent(terminal=tp.TerminalEvent(
                        failed=tp.ExecutionFailure(message="the backend stopped")))
                    stream.final = True
                    self._dirty.add(stream.serial)
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    # ---- the response thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._dirty and not self._stopping:
                    self._lock.wait(CANCEL_POLL_S)
                batch = []
                for serial in self._dirty:
                    stream = self._streams[serial]
                    chunk, stream.pending = stream.pending, OutputChunk()
                    batch.append((stream, chunk, stream.final))
                    if stream.final:
                        del self._streams[serial]
                self._dirty.clear()
                done = self._stopping and not self._streams and not batch
                watch = [s for s in self._streams.values() if not s.final and not s.cancel_reported]
            for stream, chunk, final in batch:
                self._send(stream, chunk, final)
            for stream in watch:
                if self._cancelled(stream):
                    stream.cancel_reported = True
                    self._on_cancel(stream.serial)
            if done:
                return

    def _send(self, stream: Stream, chunk: OutputChunk, final: bool) -> None:
        try:
            stream.sender.send(chunk.arrays(stream.timestamps, stream.logprobs, stream.top_k), final)
            stream.sent_responses += 1
        except Exception as exc:   # a gone client must not stop the thread; the worker goes on
            log.warning("response to request %d not delivered: %s", stream.serial, exc)
            if not final and not stream.cancel_reported:
                stream.cancel_reported = True
                self._on_cancel(stream.serial)

    @staticmethod
    def _cancelled(stream: Stream) -> bool:
        try:
            return bool(stream.sender.is_cancelled())
        except Exception:
            return True
