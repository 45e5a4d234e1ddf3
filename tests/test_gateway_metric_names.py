"""vLLM's names for the families Helios has: names, label sets and values copied from the
Helios families (gateway/backend_metrics.py), Triton's own labels dropped, finish reasons mapped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.backend_metrics import VLLM_ALIASES, Families, vllm_aliases
from tests.triton_server import metric_value

BACKEND_TEXT = """# HELP flare_requests_running Requests holding a slot
# TYPE flare_requests_running gauge
flare_requests_running{model="helios",version="1"} 3
# HELP flare_kv_cache_usage_ratio Cache pages held
# TYPE flare_kv_cache_usage_ratio gauge
flare_kv_cache_usage_ratio{model="helios",version="1"} 0.25
# HELP flare_requests_finished_total Requests that ended normally
# TYPE flare_requests_finished_total counter
flare_requests_finished_total{model="helios",reason="eos",version="1"} 2
flare_requests_finished_total{model="helios",reason="stop_string",version="1"} 1
flare_requests_finished_total{model="helios",reason="length",version="1"} 4
flare_requests_finished_total{model="helios",reason="cancelled",version="1"} 5
"""


def _exposition(model: str = "m") -> str:
    registry = CollectorRegistry()
    Counter("helios_gateway_prompt_tokens", "prompt tokens", registry=registry).inc(7)
    ttft = Histogram("helios_gateway_time_to_first_token_seconds", "ttft", ["model"], buckets=(0.1, 1.0),
                     registry=registry)
    ttft.labels(model).observe(0.05)
    ttft.labels(model).observe(0.5)
    families = list(registry.collect()) + list(text_string_to_metric_families(BACKEND_TEXT))
    return generate_latest(Families(families + vllm_aliases(families, model))).decode()


def test_vllm_names_copy_the_helios_values_with_vllms_labels() -> None:
    # spec: MET-3, MET-4, MET-5
    text = _exposition()
    assert metric_value(text, "vllm:num_requests_running", model_name="m") == 3
    assert metric_value(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert metric_value(text, "vllm:gpu_cache_usage_perc", model_name="m") == 0.25
    assert metric_value(text, "vllm:prompt_tokens_total", model_name="m") == 7
    assert metric_value(text, "vllm:request_success_total", finished_reason="stop", model_name="m") == 3
    assert metric_value(text, "vllm:request_success_total", finished_reason="length", model_name="m") == 4
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort", model_name="m") == 5
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", model_name="m") == 2
    assert metric_value(text, "vllm:time_to_first_token_seconds_bucket", le="0.1", model_name="m") == 1
    vllm_lines = [line for line in text.splitlines() if line.startswith("vllm:")]
    assert vllm_lines and all('model_name="m"' in line for line in vllm_lines)
    assert not any('model="' in line or 'version="' in line or "_created" in line for line in vllm_lines)
    assert "# TYPE vllm:request_success_total counter" in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_an_absent_source_family_gives_no_alias() -> None:
    text = _exposition()
    present = {a.name for a in VLLM_ALIASES if f"# TYPE {a.name}" in text}
    assert "vllm:num_requests_waiting" not in present        # flare_requests_waiting is not in the sample
    assert "vllm:num_requests_running" in present


def test_repeated_observations_in_one_update_give_the_exposition_of_one_observe_each(tmp_path, monkeypatch) -> None:
    """observe_times (a coalesced batch's per-token gap) against observe() called that often,
    in one process and in the multi-process mode the gateway's workers use."""
    from gateway.metrics import observe_times

    def samples(text: str) -> dict[tuple, float]:
        return {(s.name, tuple(sorted(s.labels.items()))): round(s.value, 9)
                for family in text_string_to_metric_families(text) for s in family.samples
                if not s.name.endswith("_created")}

    def exposition(update) -> dict[tuple, float]:
        registry = CollectorRegistry()
        itl = Histogram("itl_seconds", "itl", ["model"], buckets=(0.001, 0.01, 0.1), registry=registry)
        update(itl.labels("m"))
        return samples(generate_latest(registry).decode())

    cases = [(0.0005, 7), (0.01, 3), (0.05, 1), (2.0, 5), (0.0, 0)]

    def repeated(h) -> None:
        for amount, times in cases:
            for _ in range(times):
                h.observe(amount)

    def at_once(h) -> None:
        for amount, times in cases:
            observe_times(h, amount, times)

    assert exposition(at_once) == exposition(repeated)
    assert exposition(at_once)[("itl_seconds_bucket", (("le", "0.001"), ("model", "m")))] == 7
    # multi-process: the values live in mmapped files (one directory per mode)
    from prometheus_client import multiprocess, values
    try:
        for name, update in (("repeated", repeated), ("at_once", at_once)):
            directory = tmp_path / name
            directory.mkdir()
            monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
            values.ValueClass = values.get_value_class()
            update(Histogram("itl_seconds", "itl", ["model"], buckets=(0.001, 0.01, 0.1),
                             registry=CollectorRegistry()).labels("m"))
    finally:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        values.ValueClass = values.get_value_class()
    texts: list[dict[tuple, float]] = []
    for name in ("repeated", "at_once"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(tmp_path / name))
        texts.append(samples(generate_latest(registry).decode()))
    assert texts[0] == texts[1] and texts[0][("itl_seconds_bucket", (("le", "0.001"), ("model", "m")))] == 7
