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
