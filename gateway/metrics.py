"""The gateway's own Prometheus metrics (the backend's flare_* families live on Triton's
metrics endpoint). Labels are bounded: endpoint, status and the served model id only, never
request ids, prompt contents or token ids. The latency and length histograms are vLLM's set
(TTFT, inter-token latency, end-to-end latency, queue time, prompt and output lengths) under
a `model` label, so one dashboard (docs/grafana/helios.json) serves several models.

With `helios-gateway --workers N` every worker process records into files of one per-start
directory (prometheus_client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR set by the parent
before the workers start) and any worker's /metrics answers for the whole gateway: counters
and histograms summed over every process since the start (an exited worker's files stay, so
nothing goes backwards), open streams summed over live workers, the permit gauges read from
the shared permit file. Per-process figures (process_*) are not summable: that mode drops them."""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_left
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from helios_backend.triton.supervision import process_alive

# prometheus_client picks its value store when it is first imported, from this variable: the
# parent sets it before spawning the workers (gateway/cli.py), so it is in their environment
# from their first instruction
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def observe_times(histogram: Histogram, amount: float, times: int) -> None:
    """`times` observations of one amount (a coalesced batch's inter-token gap, one per token)
    in one update of the sum and of one bucket, where the library's child keeps them as
    prometheus_client has since 0.1 (`_sum`, `_buckets`, `_upper_bounds`); otherwise one
    observe() each. In a multi-process gateway every observe() writes the shared files."""
    buckets, bounds, total = (getattr(histogram, name, None) for name in ("_buckets", "_upper_bounds", "_sum"))
    if buckets is None or bounds is None or total is None or times < 2:
        for _ in range(times):
            histogram.observe(amount)
        return
    total.inc(amount * times)
    buckets[bisect_left(bounds, amount)].inc(times)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()          # what /metrics exposes
        shared = os.environ.get(MULTIPROCESS_DIR)
        if shared:
            # the families below live in this process's files; the registry reads every worker's
            self.registry.register(WorkerFilesCollector(Path(shared)))
            r: CollectorRegistry | None = None
        else:
            r = self.registry
            # process_cpu_seconds_total & co: bench/serve.py divides the gateway's CPU by its tokens
            ProcessCollector(registry=r)
        self._admission = AdmissionCollector()
        self.registry.register(self._admission)
        self.requests = Counter("helios_gateway_requests", "HTTP responses by endpoint and final status "
                                "(gateway/access.py: 400s, 404s and SSE error events included)",
                                ["endpoint", "status"], registry=r)
        self.ingress_full = Counter("helios_gateway_ingress_full", "requests refused with 429", registry=r)
        self.disconnects = Counter("helios_gateway_client_disconnects",
                                   "requests whose client left before the end (their backend request "
                                   "was cancelled)", registry=r)
        self.backend_lost = Counter("helios_gateway_backend_lost",
                                    "times the backend watch found the model refusing while requests were "
                                    "open, and ended them (a stub that died under a standalone gateway)",
                                    registry=r)
        self.open_streams = Gauge("helios_gateway_backend_streams_open",
                                  "Triton gRPC streams currently open (one per backend request; the sum over "
                                  "live worker processes)", multiprocess_mode="livesum", registry=r)
        self.ttft = Histogram("helios_gateway_time_to_first_token_seconds",
                              "ingress to first generated token", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("helios_gateway_inter_token_latency_seconds",
                             "gap between a choice's token arrivals, spread over the tokens that arrived "
                             "together", ["model"], buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("helios_gateway_e2e_request_latency_seconds", "ingress to the response's end",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("helios_gateway_request_queue_time_seconds",
                                    "ingress to the backend submission: permit, preparation slot, rendering "
                                    "(the scheduler's own wait is flare_request_queue_time_seconds)",
                                    ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_length = Histogram("helios_gateway_request_prompt_tokens", "prompt tokens per prompt",
                                       ["model"], buckets=_LENGTH_BUCKETS, registry=r)
        self.output_length = Histogram("helios_gateway_request_generation_tokens", "generated tokens per choice",
                                       ["model"], buckets=_LENGTH_BUCKETS, registry=r)
        self.duration = Histogram("helios_gateway_request_duration_seconds", "ingress to terminal event",
                                  ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.unknown_fields = Counter("helios_gateway_unknown_fields",
                                      "request fields neither implemented, declared unused nor refused "
                                      "(their names are logged, never labels)", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("helios_gateway_prompt_tokens",
                                     "prompt tokens submitted (each prompt once, whatever n)", registry=r)
        self.output_tokens = Counter("helios_gateway_output_tokens", "generated tokens received", registry=r)

    def track_permits(self, in_use: Callable[[], int], total: int) -> None:
        self._admission.in_use, self._admission.total = in_use, total

    def export_supervision(self, state: Path) -> None:
        self.registry.register(SupervisionCollector(state))


class AdmissionCollector:
    """The permit gauges, read at scrape time: the admission's count, which with several
    workers is the shared permit file's (every live process's permits), so any worker
    answers for the gateway."""

    def __init__(self) -> None:
        self.in_use: Callable[[], int] = lambda: 0
        self.total = 0

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("helios_gateway_admission_permits_in_use",
                                "admitted HTTP requests (preparation, generation, delivery), "
                                "over every worker process", value=self.in_use())
        yield GaugeMetricFamily("helios_gateway_admission_permits", "queue_capacity + max_active",
                                value=self.total)


_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


class WorkerFilesCollector:
    """Every worker process's metric files, merged. A live gauge (open streams) counts live
    processes only: prometheus_client leaves forgetting a dead process's gauge file to its
    owner (its mark_process_dead) and uvicorn, which starts and restarts the workers, does
    not, so each scrape first forgets the live-gauge files of processes that are gone."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._merged = MultiProcessCollector(None, str(path))

    def collect(self) -> Iterator[Metric]:
        for file in self._path.glob("gauge_live*.db"):
            match = _LIVE_GAUGE_FILE.fullmatch(file.name)
            if match and not process_alive(int(match.group(1))):
                file.unlink(missing_ok=True)     # another worker's scrape may forget it first
        try:
            return iter(self._merged.collect())
        except FileNotFoundError:
            # a concurrent scrape forgot a dead process's file between our listing and reading;
            # files only ever go that way, so listing again converges
            return iter(self._merged.collect())


class SupervisionCollector:
    """helios-serve's restarts, read at scrape time from the ledger it rewrites after each
    restart (helios_backend/triton/supervision.py), so the counts survive a restart of the gateway itself."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def collect(self) -> Iterator[Metric]:
        try:
            state = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return
        restarts = CounterMetricFamily("helios_serve_restarts", "processes helios-serve restarted after they "
                                       "died, by cause (stub_died, engine_failed, exited_code, exited_signal)",
                                       labels=["process", "cause"])
        for row in state.get("restarts", ()):
            restarts.add_metric([row["process"], row["cause"]], row["count"])
        yield restarts
        yield GaugeMetricFamily("helios_serve_restart_backoff_seconds", "the delay before the latest restart",
                                value=state.get("backoff_seconds", 0.0))
