"""The gateway's own Prometheus metrics (the backend's flare_* families live on Triton's
metrics endpoint). Labels are bounded: endpoint and status class only, never request ids,
prompt contents or token ids."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total & co: bench/serve.py divides the gateway's CPU by its tokens
        ProcessCollector(registry=r)
        self.requests = Counter("helios_gateway_requests", "HTTP generation requests by final status",
                                ["endpoint", "status"], registry=r)
        self.ingress_full = Counter("helios_gateway_ingress_full", "requests refused with 429", registry=r)
        self.disconnects = Counter("helios_gateway_client_disconnects",
                                   "requests whose client left before the end (their backend request "
                                   "was cancelled)", registry=r)
        self.permits_in_use = Gauge("helios_gateway_admission_permits_in_use",
                                    "admitted HTTP requests (preparation, generation, delivery)", registry=r)
        self.permits_total = Gauge("helios_gateway_admission_permits",
                                   "queue_capacity + max_active", registry=r)
        self.open_streams = Gauge("helios_gateway_backend_streams_open",
                                  "Triton gRPC streams currently open (one per backend request)", registry=r)
        self.ttft = Histogram("helios_gateway_time_to_first_token_seconds",
                              "ingress to first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("helios_gateway_request_duration_seconds", "ingress to terminal event",
                                  ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("helios_gateway_prompt_tokens", "prompt tokens submitted", registry=r)
        self.output_tokens = Counter("helios_gateway_output_tokens", "generated tokens received", registry=r)

    def track_permits(self, in_use: Callable[[], int], total: int) -> None:
        self.permits_in_use.set_function(in_use)
        self.permits_total.set(total)
