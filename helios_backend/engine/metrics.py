"""flare_* metric families on Triton's metrics endpoint, updated off the hot path.

Each pb_utils metric update is an IPC round trip to the server process, so the worker
and the response thread only put small update tuples on a queue; one metrics thread
applies them. Labels are bounded enums (operation, reason, state): never request ids,
prompt text or token ids (MET-3..5).
"""
from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


FLUSH_S = 0.25   # coalescing period of metric updates (seconds)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Family:
    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...] = ()


FAMILIES: tuple[Family, ...] = (
    Family("flare_requests_admitted_total", Kind.COUNTER, "Requests accepted into the scheduler queue"),
    Family("flare_requests_rejected_total", Kind.COUNTER, "Requests refused at admission", ("reason",)),
    Family("flare_requests_invalid_total", Kind.COUNTER, "Malformed exchange requests"),
    Family("flare_requests_finished_total", Kind.COUNTER, "Requests that ended normally", ("reason",)),
    Family("flare_requests_failed_total", Kind.COUNTER, "Requests ended by an execution failure"),
    Family("flare_requests_waiting", Kind.GAUGE, "Requests queued for a slot"),
    Family("flare_requests_running", Kind.GAUGE, "Requests holding a slot"),
    Family("flare_preemptions_total", Kind.COUNTER, "Running requests preempted for pages"),
    Family("flare_readmissions_total", Kind.COUNTER, "Preempted requests admitted again"),
    Family("flare_graph_launches_total", Kind.COUNTER, "Program submissions", ("operation",)),
    Family("flare_second_frame_rounds_total", Kind.COUNTER,
           "Decode rounds launched on the second execution frame before the previous completion"),
    Family("flare_generated_tokens_total", Kind.COUNTER, "Validated sampled tokens"),
    Family("flare_prefix_lookup_tokens_total", Kind.COUNTER, "Tokens looked up in the prefix cache at admission"),
    Family("flare_prefix_reused_tokens_total", Kind.COUNTER, "Tokens served from cached pages or snapshots"),
    Family("flare_prefix_hit_pages_total", Kind.COUNTER, "Cached pages referenced by admitted requests"),
    Family("flare_cache_pages_published_total", Kind.COUNTER, "Complete pages published to the prefix cache"),
    Family("flare_cache_pages_evicted_total", Kind.COUNTER, "Cached pages evicted (LRU)"),
    Family("flare_snapshots_published_total", Kind.COUNTER, "Snapshots published at exact endpoints"),
    Family("flare_snapshots_evicted_total", Kind.COUNTER, "Snapshots evicted (LRU)"),
    Family("flare_snapshots_restored_total", Kind.COUNTER, "Snapshot continuations restored into private pages"),
    Family("flare_cache_pages", Kind.GAUGE, "Physical cache pages by state", ("state",)),
    Family("flare_cache_pages_capacity", Kind.GAUGE, "Physical cache pages"),
    Family("flare_request_slots_capacity", Kind.GAUGE, "Physical request slots"),
    Family("flare_snapshot_rows", Kind.GAUGE, "Snapshot continuation rows in use"),
    Family("flare_snapshot_rows_capacity", Kind.GAUGE, "Snapshot continuation rows"),
    Family("flare_mixed_grammar_decode_steps_total", Kind.COUNTER,
           "Successful decode submissions mixing constrained and unconstrained lanes"),
    Family("flare_constrained_max_inflight", Kind.GAUGE,
           "Maximum outstanding executor frames right after a constrained submission"),
    Family("flare_channel_responses_total", Kind.COUNTER, "Responses sent on channels (docs/exchange.md)"),
    Family("flare_channel_outputs_total", Kind.COUNTER,
           "Request outputs those responses carried (outputs / responses = requests per message)"),
    Family("flare_stream_interval_tokens", Kind.GAUGE,
           "Tokens a plain channel stream gathers before its output leaves (responses.StreamInterval)"),
    Family("flare_worker_seconds_total", Kind.COUNTER,
           "Scheduler worker time by phase: schedule, launch, collect (waiting for the executor), complete, deliver",
           ("phase",)),
    Family("flare_time_to_first_token_seconds", Kind.HISTOGRAM, "Backend receipt to first validated token"),
    Family("flare_e2e_request_latency_seconds", Kind.HISTOGRAM, "Backend receipt to the terminal event"),
    Family("flare_request_queue_time_seconds", Kind.HISTOGRAM,
           "Backend receipt to the first admission into a slot (the scheduler's queue)"),
    Family("flare_kv_cache_usage_ratio", Kind.GAUGE,
           "Cache pages held by requests or snapshots over all pages (0-1; cached free pages count as free)"),
    Family("flare_prefix_cache_hit_ratio", Kind.GAUGE,
           "Prompt tokens served from the prefix cache over prompt tokens looked up, since startup (0-1)"),
)
FAMILY = {f.name: f for f in FAMILIES}

# label values are enum names: bounded, never request data
OPERATION_LABEL = {v: cp.Operation.Name(v).removeprefix("OPERATION_").lower() for v in cp.Operation.values()}
FINISH_LABEL = {v: ep.FinishReason.Name(v).removeprefix("FINISH_REASON_").lower() for v in ep.FinishReason.values()}
REJECTION_LABEL = {v: ep.RejectionReason.Name(v).removeprefix("REJECTION_REASON_").lower()
                   for v in ep.RejectionReason.values()}
PAGE_STATES = ("free", "used", "snapshot", "cached")   # used: held by requests; snapshot: only by snapshots


class Op(enum.Enum):
    ADD = "add"        # counters
    SET = "set"        # gauges
    OBSERVE = "observe"  # histograms


# flare_worker_seconds_total's phases, in the worker's order (worker_clock.Phase)
WORKER_PHASES = ("schedule", "launch", "collect", "complete", "deliver")

Update = tuple[str, tuple[tuple[str, str], ...], Op, float]
MetricKey = tuple[str, tuple[tuple[str, str], ...]]          # (family name, label pairs)


def update(name: str, op: Op, value: float, **labels: str) -> Update:
    family = FAMILY[name]
    if set(labels) != set(family.labels):
        raise ValueError(f"{name} takes labels {family.labels}, got {sorted(labels)}")
    return (name, tuple(sorted(labels.items())), op, float(value))


class MetricsQueue(Protocol):
    """Where the worker and response threads push updates (MetricsThread, NullMetrics, tests)."""
    def push(self, updates: list[Update]) -> None: ...


class MetricBackend(Protocol):
    """Creates one metric handle; the Triton adapter implements it with pb_utils."""
    def create(self, family: Family, labels: dict[str, str]) -> Any: ...


def label_sets(family: Family) -> list[dict[str, str]]:
    """Every label combination a family can take (labels are bounded enums)."""
    if not family.labels:
        return [{}]
    (label,) = family.labels
    if label == "reason":
        reasons = FINISH_LABEL.items() if "finished" in family.name else REJECTION_LABEL.items()
        return [{label: v} for k, v in reasons if k]
    values = {"operation": [v for k, v in OPERATION_LABEL.items() if k], "state": list(PAGE_STATES),
              "phase": list(WORKER_PHASES)}
    return [{label: v} for v in values[label]]


class MetricsThread:
    """Applies queued updates. Every handle is created up front, on the thread that builds
    the MetricsThread (the stub's main thread in `initialize`): creating metrics from a
    background thread raced with model unload in Triton 2.51 and hung it."""

    def __init__(self, backend: MetricBackend, on_error: Callable[[str], None] = lambda m: None) -> None:
        self._backend = backend
        self._on_error = on_error
        self._queue: "queue.SimpleQueue[list[Update] | None]" = queue.SimpleQueue()
        self._handles: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._discard = threading.Event()
        self._wake = threading.Event()       # set by stop(): flush now and end
        for family in FAMILIES:
            for labels in label_sets(family):
                self._handles[(family.name, tuple(sorted(labels.items())))] = backend.create(family, labels)
        self._thread = threading.Thread(target=self._run, name="helios-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def push(self, updates: list[Update]) -> None:
        if updates:
            self._queue.put(updates)

    def discard(self) -> None:
        """From now on drop every update (model unload: no more IPC to the server)."""
        self._discard.set()

    def stop(self, discard: bool = False, timeout: float = 10.0) -> None:
        """End the thread; with `discard`, queued updates are dropped (model unload)."""
        if discard:
            self._discard.set()
        self._queue.put(None)
        self._wake.set()
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        # Updates are coalesced and applied every FLUSH_S: counters summed, gauges last value,
        # observations kept. Fewer IPC round trips, and fewer in flight when the server starts
        # unloading the model (an IPC then blocks the stub until the exit timeout). The thread
        # sleeps between flushes instead of waking on every push: a push is one C-level queue
        # append, and the serving threads do not hand the GIL to this one once per round.
        while True:
            stopping = self._wake.wait(FLUSH_S)
            counters: dict[MetricKey, float] = {}
            gauges: dict[MetricKey, float] = {}
            observed: list[tuple[str, tuple[tuple[str, str], ...], float]] = []
            while True:
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    break
                if batch is None:
                    stopping = True
                    continue
                for name, labels, op, value in batch:
                    key = (name, labels)
                    if op is Op.ADD:
                        counters[key] = counters.get(key, 0.0) + value
                    elif op is Op.SET:
                        gauges[key] = value
                    else:
                        observed.append((name, labels, value))
            if not self._discard.is_set():
                self._apply(counters, gauges, observed)
            if stopping:
                return

    def _apply(self, counters: dict[MetricKey, float], gauges: dict[MetricKey, float],
               observed: list[tuple[str, tuple[tuple[str, str], ...], float]]) -> None:
        work = ([(k, Op.ADD, v) for k, v in counters.items()] + [(k, Op.SET, v) for k, v in gauges.items()]
                + [((n, l), Op.OBSERVE, v) for n, l, v in observed])
        for (name, labels), op, value in work:
            if self._discard.is_set():
                return
            try:
                handle = self._handle(name, labels)
                if op is Op.ADD:
                    handle.increment(value)
                elif op is Op.SET:
                    handle.set(value)
                else:
                    handle.observe(value)
            except Exception as exc:  # a broken metric must never stop serving
                self._on_error(f"metric {name}: {type(exc).__name__}: {exc}")

    def _handle(self, name: str, labels: tuple[tuple[str, str], ...]) -> Any:
        key = (name, labels)
        handle = self._handles.get(key)
        if handle is None:
            handle = self._backend.create(FAMILY[name], dict(labels))
            self._handles[key] = handle
        return handle


class NullMetrics:
    """For runs outside Triton (bench, unit tests)."""

    def push(self, updates: list[Update]) -> None:
        pass
