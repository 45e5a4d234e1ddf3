"""The backend's flare_* families on the gateway's /metrics, and vLLM's names for them.

Triton serves the model's flare_* families (helios_backend/engine/metrics.py) on its metrics
port, which stays on the loopback and has no key. Each /metrics scrape of the gateway reads that
port once (BackendScrape) and exposes the flare_* families beside the gateway's own, so one
scrape target carries requests, queue, KV-cache and token families; every worker process reads
the same backend, so a multi-worker gateway's answer stays whole.

vLLM's dashboards and alerts read `vllm:*` families with a `model_name` label. The families
that exist in both systems are also exposed under vLLM's names and label sets (VLLM_ALIASES):
always, as aliases of the Helios families they copy, so a vLLM Grafana dashboard works
unchanged and nothing has to be chosen at start. vLLM's finish reasons are stop, length and
abort: Helios's eos, stop_string and stop_token are all `stop`, and cancelled is `abort`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

BACKEND_PREFIX = "flare_"
SCRAPE_TIMEOUT_S = 2.0      # a scrape answers without the backend's families rather than hang
MODEL_LABEL = "model_name"  # vLLM's label for the served model
# the labels Triton adds to a model's custom metrics: the Triton model's name ("helios", not the
# served model's) and version; vLLM's families carry model_name only
TRITON_LABELS = frozenset({"model", "version"})


@dataclass(frozen=True)
class Alias:
    """One vLLM family read from one Helios family (counters named without `_total`, as
    prometheus_client names families): its labels renamed, label values mapped, model_name added."""
    name: str
    source: str
    labels: Mapping[str, str] = field(default_factory=dict)
    values: Mapping[str, str] = field(default_factory=dict)


_FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "stop_token": "stop", "length": "length",
                   "cancelled": "abort"}
_MODEL = {"model": MODEL_LABEL}

# vLLM's production metrics (docs.vllm.ai, "Production Metrics") that Helios measures too
VLLM_ALIASES: tuple[Alias, ...] = (
    Alias("vllm:num_requests_running", "flare_requests_running"),
    Alias("vllm:num_requests_waiting", "flare_requests_waiting"),
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (V1); both are 0-1 ratios
    Alias("vllm:gpu_cache_usage_perc", "flare_kv_cache_usage_ratio"),
    Alias("vllm:kv_cache_usage_perc", "flare_kv_cache_usage_ratio"),
    Alias("vllm:prompt_tokens", "helios_gateway_prompt_tokens"),
    Alias("vllm:generation_tokens", "helios_gateway_output_tokens"),
    Alias("vllm:request_success", "flare_requests_finished", {"reason": "finished_reason"}, _FINISH_REASONS),
    Alias("vllm:time_to_first_token_seconds", "helios_gateway_time_to_first_token_seconds", _MODEL),
    # inter_token_latency_seconds is V1's name for V0's time_per_output_token_seconds
    Alias("vllm:inter_token_latency_seconds", "helios_gateway_inter_token_latency_seconds", _MODEL),
    Alias("vllm:time_per_output_token_seconds", "helios_gateway_inter_token_latency_seconds", _MODEL),
    Alias("vllm:e2e_request_latency_seconds", "helios_gateway_e2e_request_latency_seconds", _MODEL),
    Alias("vllm:request_queue_time_seconds", "helios_gateway_request_queue_time_seconds", _MODEL),
    Alias("vllm:request_prompt_tokens", "helios_gateway_request_prompt_tokens", _MODEL),
    Alias("vllm:request_generation_tokens", "helios_gateway_request_generation_tokens", _MODEL),
)


def vllm_aliases(families: Iterable[Metric], model_name: str) -> list[Metric]:
    """The VLLM_ALIASES families present in `families`, their samples copied under vLLM's names
    (samples that map to one label set, several finish reasons to `stop`, are summed)."""
    by_name = {family.name: family for family in families}
    out = []
    for alias in VLLM_ALIASES:
        source = by_name.get(alias.source)
        if source is None:
            continue
        values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample in source.samples:
            if sample.name.endswith("_created"):      # per-process creation stamps: vLLM exports none
                continue
            dropped = TRITON_LABELS if source.name.startswith(BACKEND_PREFIX) else frozenset()
            labels = {alias.labels.get(k, k): alias.values.get(v, v) if k in alias.labels else v
                      for k, v in sample.labels.items() if k not in dropped}
            labels.setdefault(MODEL_LABEL, model_name)
            key = (alias.name + sample.name[len(source.name):], tuple(sorted(labels.items())))
            values[key] = values.get(key, 0.0) + sample.value
        metric = Metric(alias.name, f"{source.documentation} (vLLM's name for {source.name})", source.type)
        for (name, pairs), value in values.items():
            metric.add_sample(name, dict(pairs), value)
        out.append(metric)
    return out


class BackendScrape:
    """Reads the flare_* families from Triton's metrics endpoint (`url`, None: not read)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._client: httpx.AsyncClient | None = None

    async def families(self) -> list[Metric]:
        """The backend's families, plus helios_gateway_backend_metrics_up (1 read, 0 not)."""
        if self.url is None:
            return []
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S)
        try:
            response = await self._client.get(self.url)
            response.raise_for_status()
            families = [f for f in text_string_to_metric_families(response.text) if f.name.startswith(BACKEND_PREFIX)]
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("backend metrics at %s not read: %s", self.url, exc)
            families = []
            up = 0.0
        else:
            up = 1.0
        families.append(GaugeMetricFamily("helios_gateway_backend_metrics_up",
                                          f"1 when this scrape read the backend's flare_* families ({self.url})",
                                          value=up))
        return families

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class Families:
    """Metric families already collected, in the shape generate_latest reads (a collector)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
