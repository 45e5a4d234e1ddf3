"""The scheduler worker thread: the only thread that touches the scheduler and executor.

    inbox (submit / cancel / stop)  ->  admit  ->  schedule -> run -> complete  ->  events
                                                                                   |
                                                            ResponseHub.deliver <--+

Rounds use completion feedback, except plain decode rounds (device-owned pending tokens,
no grammar, no host stops, nobody waiting): then round N+1 is packed and launched on the
other frame before round N's completion is read (Scheduler.pipeline_next).
A failing round ends its own lanes with a typed execution failure and the worker keeps
serving the others; an unexpected error outside a round fails every request it knows, and
so does a lost executor (ExecutorLostError: a rank process died or stopped answering),
after which the worker stops (Engine.healthy turns false).
When the thread exits, whatever is left gets a terminal event, so every request always
receives exactly one final response. A thread that died (rather than stopped) then reports it
through `on_death`: the engine's owner decides how the process recovers.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from helios_proto import exchange_pb2 as ep

from helios_backend.executors.base import ExecutorLostError
from helios_backend.scheduler.errors import AdmissionRejected, InvalidSpecError
from helios_backend.scheduler.plan import RoundPlan
from helios_backend.scheduler.request import Grammar, RequestSpec
from helios_backend.scheduler.scheduler import Scheduler, Terminal, WorkerEvent
from helios_backend.scheduler.completion import CompletionRows
from helios_backend.engine.metrics import REJECTION_LABEL, MetricsQueue, Op, Update, update
from helios_backend.engine.round_metrics import RoundMetrics
from helios_backend.engine.worker_clock import Phase, WorkerClock

log = logging.getLogger("helios.worker")
IDLE_WAIT_S = 0.05
ROUND_METRICS_S = 0.05         # round counters and gauges are collected at most this often while busy


class RoundRunner(Protocol):
    """launch() packs and starts a round on a frame; collect() waits for it and returns its
    validated rows. With two frames the loop launches round N+1 before collecting round N."""
    def launch(self, plan: RoundPlan, frame: int) -> None: ...
    def collect(self, plan: RoundPlan) -> CompletionRows: ...


class SynchronousRunner:
    """A RoundRunner over a run(plan) callable: the round runs inside collect()."""

    def __init__(self, run: Callable[[RoundPlan], CompletionRows]) -> None:
        self._run = run

    def launch(self, plan: RoundPlan, frame: int) -> None:
        pass

    def collect(self, plan: RoundPlan) -> CompletionRows:
        return self._run(plan)


class EventSink(Protocol):
    def deliver(self, events: Sequence[WorkerEvent]) -> None: ...


@dataclass(frozen=True)
class _Submit:
    serial: int
    spec: RequestSpec
    grammar: Grammar | None = None


@dataclass(frozen=True)
class _Cancel:
    serial: int


@dataclass(frozen=True)
class _Stop:
    drain: bool


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: RoundRunner, sink: EventSink,
                 metrics: MetricsQueue, two_frames: bool = True, ingress_capacity: int | None = None,
                 on_death: Callable[[str], None] = lambda reason: None) -> None:
        self._scheduler = scheduler
        self._on_death = on_death
        # The ingress channel holds at most queue_capacity submissions that will have to queue
        # (HTTP-4): a submission beyond it is rejected at once, even while a long round keeps the
        # worker busy. Submissions the free active places take at the next round pass on top
        # (`_ingress_free`, published by the worker), so the channel agrees with HTTP admission
        # (queue_capacity + max_active) and a burst into free slots is never refused.
        self._ingress_capacity = ingress_capacity if ingress_capacity is not None else scheduler.config.queue_capacity
        self._ingress_pending = 0
        self._ingress_free = scheduler.free_active
        self._ingress_cancels = 0           # cancels not yet applied: HTTP released their permits already
        self._ingress_lock = threading.Lock()
        self._runner = runner
        self._sink = sink
        self._metrics = metrics
        self._round_metrics = RoundMetrics(scheduler)
        self._clock = WorkerClock()        # the worker's time by phase (worker_clock.py)
        self._next_metrics = 0.0
        self._inbox: "queue.SimpleQueue[_Submit | _Cancel | _Stop]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="helios-worker", daemon=True)
        self._stopping: _Stop | None = None
        self._two_frames = two_frames
        self._frame = 0
        self._closed = False                # the worker exits: set under the ingress lock
        self._stop_reason = "the scheduler worker stopped"
        self.lost: str | None = None      # why the executor can run nothing more (set once, by the worker)
        self.rounds = 0

    # ---- any thread ------------------------------------------------------------------
    def start(self) -> None:
        self._metrics.push(self._round_metrics.capacity() + self._round_metrics.collect())
        self._thread.start()

    def enqueue(self, serial: int, spec: RequestSpec, grammar: Grammar | None = None) -> None:
        if not self._thread.is_alive() and self._thread.ident is not None:
            # the worker is gone (stopped, or died): nothing would ever answer this request
            self._reject(serial, AdmissionRejected(ep.REJECTION_REASON_SHUTTING_DOWN, "the model stopped"))
            return
        with self._ingress_lock:
            closed = self._closed
            bound = self._ingress_capacity + self._ingress_free + self._ingress_cancels
            full = not closed and self._ingress_pending >= bound
            if not full and not closed:
                self._ingress_pending += 1
        if closed:
            self._reject(serial, AdmissionRejected(ep.REJECTION_REASON_SHUTTING_DOWN, "the model stopped"))
            return
        if full:
            self._reject(serial, AdmissionRejected(
                ep.REJECTION_REASON_QUEUE_FULL, f"the ingress channel holds {self._ingress_capacity} queued "
                f"requests and {bound - self._ingress_capacity} for free places", limit=bound, requested=bound + 1))
            return
        self._inbox.put(_Submit(serial, spec, grammar))

    def cancel(self, serial: int) -> None:
        with self._ingress_lock:
            self._ingress_cancels += 1     # its place is free at the next pass over the inbox
        self._inbox.put(_Cancel(serial))

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Drain: finish admitted requests first. Either way every request gets its final.

        `timeout` bounds the drain, never the executor's ownership (OWN-16, HTTP-16): when it
        passes, the worker stops admitting and fails what is left (as drain=False), and stop
        still returns only once the thread exited, after the fence of its in-flight rounds."""
        self._inbox.put(_Stop(drain))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("drain did not finish within %.1fs: failing the remaining requests, "
                        "waiting for the round in flight", timeout)
            self._inbox.put(_Stop(False))
            self._thread.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker thread to end (after a stop, a lost executor or its death)."""
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the worker thread -------------------------------------------------------------
    def _main(self) -> None:
        death: str | None = None
        try:
            self._loop()
        except ExecutorLostError as exc:
            if self.lost is None:
                self._lost(f"{type(exc).__name__}: {exc}")
        except BaseException as exc:
            log.exception("scheduler worker stopped by an unexpected error")
            death = f"the scheduler worker died: {type(exc).__name__}: {exc}"
        finally:
            with self._ingress_lock:
                self._closed = True           # enqueue refuses from now on: nothing lands in a dead inbox
            self._refuse_inbox()
            self._sink.deliver(self._scheduler.fail_all(death or self._stop_reason))
            self._metrics.push(self._collect_metrics())
        if death is not None:
            self._on_death(death)

    def _loop(self) -> None:
        s = self._scheduler
        clock = self._clock
        inflight: deque[RoundPlan] = deque()     # submitted rounds, oldest first (at most two)
        while True:
            self._take_inbox(block=not s.has_work() and not inflight)
            clock.start()
            if not inflight:
                if self._stopping is not None and (not self._stopping.drain or not s.has_work()):
                    return
                try:
                    plan = s.schedule()
                    clock.lap(Phase.SCHEDULE)
                except Exception as exc:
                    log.exception("scheduling failed; failing every request")
                    self._sink.deliver([*s.take_worker_events(), *s.fail_all(f"scheduling failed: {exc}")])
                    continue
                if plan is None:
                    self._sink.deliver(s.take_worker_events())
                    clock.lap(Phase.DELIVER)
                    self._metrics.push(self._collect_metrics())
                    self._take_inbox(block=True, timeout=IDLE_WAIT_S)
                    continue
                submitted = self._submit(plan)
                clock.lap(Phase.LAUNCH)
                if submitted:
                    inflight.append(plan)
                else:
                    continue
            if self._two_frames and len(inflight) == 1 and self._stopping is None:
                # the second execution frame: the same decode lanes, before round N completes
                nxt = s.pipeline_next(inflight[0])
                clock.lap(Phase.SCHEDULE)
                if nxt is not None:
                    if self._submit(nxt):
                        inflight.append(nxt)
                    clock.lap(Phase.LAUNCH)
            plan = inflight.popleft()
            try:
                rows = self._collect(plan)
                clock.lap(Phase.COLLECT)
                s.complete(plan, rows)
                clock.lap(Phase.COMPLETE)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                log.error("round failed (%s lanes): %s", len(plan.main.lanes), message)
                if isinstance(exc, ExecutorLostError):
                    self._lost(message)           # before any failure is delivered: health is red first
                s.fail(plan, message)
                while inflight:                   # a round pipelined on a failed one is not trusted
                    later = inflight.popleft()
                    try:
                        self._collect(later)
                    except Exception:
                        pass
                    s.fail(later, message)
                if isinstance(exc, ExecutorLostError):
                    return                        # _main's finally fails every other request
            self.rounds += 1
            self._sink.deliver(s.take_worker_events())
            clock.lap(Phase.DELIVER)
            now = time.monotonic()
            if now >= self._next_metrics:
                # the metrics thread applies updates every FLUSH_S: a collection per round
                # (~30 counter and gauge reads) would be work nobody sees; idle always collects
                self._next_metrics = now + ROUND_METRICS_S
                self._metrics.push(self._collect_metrics())

    def _collect_metrics(self) -> list[Update]:
        return self._round_metrics.collect() + self._clock.updates()

    def _submit(self, plan: RoundPlan) -> bool:
        """Launch a round (on the next frame); a failure fails its lanes at once."""
        self._stamp_admissions()
        try:
            self._runner.launch(plan, self._frame)
            if self._two_frames:
                self._frame ^= 1
            return True
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.error("submission failed (%s lanes): %s", len(plan.main.lanes), message)
            if isinstance(exc, ExecutorLostError):
                self._lost(message)           # before any failure is delivered: health is red first
            self._scheduler.fail(plan, message)
            self._sink.deliver(self._scheduler.take_worker_events())
            if isinstance(exc, ExecutorLostError):
                raise
            return False

    def _stamp_admissions(self) -> None:
        """The queue waits of the requests this round admits, read now: once per admitting
        round (building a round reads no clock; Scheduler.add stamped each receipt), not at
        the metrics' next collection."""
        counters = self._scheduler.counters
        if counters.first_admission_receipts_ns:
            now = time.monotonic_ns()
            counters.first_admission_waits_ns.extend(max(now - receipt, 0)
                                                     for receipt in counters.first_admission_receipts_ns if receipt)
            counters.first_admission_receipts_ns.clear()

    def _lost(self, message: str) -> None:
        """The executor can run nothing more: every request ends now, with the cause."""
        log.error("the executor is lost (%s): failing every request; the model must be restarted", message)
        self._stop_reason = self.lost = f"the executor is lost: {message}"

    def _collect(self, plan: RoundPlan) -> CompletionRows:
        return self._runner.collect(plan)

    def _take_inbox(self, block: bool, timeout: float = IDLE_WAIT_S) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            self._publish_free()
            return
        while True:
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self._publish_free()
                return

    def _publish_free(self) -> None:
        with self._ingress_lock:
            self._ingress_free = self._scheduler.free_active

    def _apply(self, item: "_Submit | _Cancel | _Stop") -> None:
        if isinstance(item, (_Submit, _Cancel)):
            with self._ingress_lock:
                if isinstance(item, _Submit):
                    self._ingress_pending -= 1
                else:
                    self._ingress_cancels -= 1
        if isinstance(item, _Stop):
            self._stopping = item
        elif isinstance(item, _Cancel):
            self._scheduler.cancel(item.serial)
        elif self._stopping is not None:
            self._reject(item.serial, AdmissionRejected(ep.REJECTION_REASON_SHUTTING_DOWN, "the model is draining"))
        else:
            try:
                self._scheduler.add(item.serial, item.spec, item.grammar)
            except AdmissionRejected as exc:
                self._reject(item.serial, exc)
            except InvalidSpecError as exc:
                self._sink.deliver([Terminal(item.serial, ep.TerminalEvent(
                    invalid=ep.InvalidRequest(field=exc.field, message=exc.message)))])
                self._metrics.push([update("flare_requests_invalid_total", Op.ADD, 1)])

    def _reject(self, serial: int, exc: AdmissionRejected) -> None:
        event = ep.TerminalEvent(rejected=ep.AdmissionRejection(
            reason=exc.reason, message=str(exc), limit=exc.limit, requested=exc.requested))
        self._sink.deliver([Terminal(serial, event)])
        self._metrics.push([update("flare_requests_rejected_total", Op.ADD, 1, reason=REJECTION_LABEL[exc.reason])])

    def _refuse_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submit):
                self._reject(item.serial, AdmissionRejected(ep.REJECTION_REASON_SHUTTING_DOWN,
                                                            "the model stopped"))
