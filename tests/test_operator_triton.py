"""An operator's own tritonserver: `helios-serve --write-repository DIR` writes the helios model
into a repository that already holds another model, and the script it prints starts the
nvidia-pytriton wheel's tritonserver on it, as docs/deployment.md shows (not through
helios-serve). The gateway runs alone against it (`helios-gateway --triton HOST:PORT`), started
before tritonserver: liveness answers through the load while readiness waits; under load from
the OpenAI SDK its /metrics carries the backend's flare_* families and vLLM's names and label
sets, whose values move; when tritonserver stops, readiness turns false and liveness stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from gateway.backend_metrics import VLLM_ALIASES
from helios_backend.triton.launcher import cleanup_shm
from tests.gateway_harness import SERVED_ID, STORY, GatewayProcess, wait_until
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.triton_server import free_ports, kill_stubs, metric_value

pytestmark = [pytest.mark.triton, pytest.mark.slow]

# another model of the operator's repository: a Python model that echoes its input
ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                             .as_numpy())]) for r in requests]
"""
ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 6
MAX_TOKENS = 48


@dataclass
class Operated:
    http: int
    grpc: int
    gateway: GatewayProcess
    triton: subprocess.Popen[bytes]
    work: Path
    probes: list[tuple[int, int]] = field(default_factory=list)   # (/livez, /readyz) while tritonserver loaded


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _index(http: int) -> dict[str, str]:
    try:
        rows = httpx.post(f"http://127.0.0.1:{http}/v2/repository/index", json={}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {row["name"]: row.get("state", "") for row in rows}


@pytest.fixture(scope="module")
def operated(default_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operated]:  # noqa: F811
    work = tmp_path_factory.mktemp("operator")
    models = work / "models"
    (models / "echo" / "1").mkdir(parents=True)
    (models / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (models / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    written = subprocess.run([sys.executable, "-m", "helios_backend.cli.serve", "--core", str(default_core),
                              "--write-repository", str(models)], capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    script = work / "start-tritonserver.sh"
    script.write_text(written.stdout)
    http, grpc, metrics = free_ports(3)
    shm_prefix = f"helios-operator-{uuid.uuid4().hex[:8]}-"
    # the gateway first, as a pod whose tritonserver is still starting
    gateway = GatewayProcess(f"127.0.0.1:{grpc}", work / "gateway.log",
                             "--triton-metrics", f"http://127.0.0.1:{metrics}/metrics", "--log-level", "info")
    triton_log = open(work / "tritonserver.log", "wb")
    triton = None
    try:
        assert wait_until(lambda: _status(gateway.base_url + "/livez") == 200, 60), gateway.log()[-3000:]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        triton = subprocess.Popen(
            ["sh", str(script), f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
             "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
             "--allow-gpu-metrics=false", "--exit-timeout-secs=10", f"--backend-config=python,shm-region-prefix-name={shm_prefix}"],
            stdout=triton_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        operated = Operated(http, grpc, gateway, triton, work)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and triton.poll() is None:
            live, ready = _status(gateway.base_url + "/livez"), _status(gateway.base_url + "/readyz")
            operated.probes.append((live, ready))
            if ready == 200:
                break
            time.sleep(0.3)
        assert operated.probes and operated.probes[-1][1] == 200, (
            (work / "tritonserver.log").read_text(errors="replace")[-3000:] + gateway.log()[-2000:])
        yield operated
    finally:
        gateway.stop()
        if triton is not None and triton.poll() is None:
            triton.send_signal(signal.SIGINT)
            try:
                triton.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(triton.pid, signal.SIGKILL)
                triton.wait()
        triton_log.close()
        kill_stubs(shm_prefix)          # a stub tritonserver left behind at its exit timeout
        cleanup_shm(shm_prefix)


def test_the_helios_model_loads_beside_the_repositorys_other_model(operated: Operated) -> None:
    assert _index(operated.http) == {"echo": "READY", "helios": "READY"}
    answer = httpx.post(f"http://127.0.0.1:{operated.http}/v2/models/echo/infer", timeout=30, json={
        "inputs": [{"name": "IN", "datatype": "INT32", "shape": [3], "data": [7, 8, 9]}]}).json()
    assert answer["outputs"][0]["data"] == [7, 8, 9]


def test_liveness_answers_through_the_load_while_readiness_waits(operated: Operated) -> None:
    lives = {live for live, _ in operated.probes}
    readies = [ready for _, ready in operated.probes]
    assert lives == {200}, operated.probes
    assert 503 in readies and readies[-1] == 200, operated.probes       # not ready while loading, then ready
    assert readies.index(200) > readies.index(503)


def _scrape(base_url: str) -> str:
    return httpx.get(base_url + "/metrics", timeout=30).text


def test_metrics_carry_the_backend_and_vllm_families_and_move_under_load(operated: Operated) -> None:
    # spec: MET-1, MET-2, MET-3
    base = operated.gateway.base_url
    before = _scrape(base)
    during: list[str] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(httpx.HTTPError):
                during.append(_scrape(base))
            time.sleep(0.1)

    usage: list[tuple[int, int]] = []

    def chat() -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(model=SERVED_ID, messages=STORY, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=chat) for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(300)
    done.set()
    sampler.join(60)
    assert len(usage) == CLIENTS
    # counters are applied by the backend's metrics thread every ~0.25 s: wait for the last ones
    assert wait_until(lambda: metric_value(_scrape(base), "vllm:request_success_total", finished_reason="length")
                      - metric_value(before, "vllm:request_success_total", finished_reason="length") >= CLIENTS, 30)
    after = _scrape(base)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    model = {"model_name": SERVED_ID}
    assert metric_value(after, "helios_gateway_backend_metrics_up") == 1
    assert delta("flare_generated_tokens_total") >= sum(c for _, c in usage)       # the backend's own family
    assert delta("flare_requests_admitted_total") == CLIENTS
    assert delta("vllm:request_success_total", finished_reason="length", **model) == CLIENTS
    assert delta("vllm:prompt_tokens_total", **model) == sum(p for p, _ in usage)
    assert delta("vllm:generation_tokens_total", **model) == sum(c for _, c in usage)
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert delta(histogram + "_count", **model) == CLIENTS, histogram
        assert delta(histogram + "_sum", **model) > 0, histogram
    for histogram in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert delta(histogram + "_count", **model) > 0, histogram
    # the gauges moved while the requests ran, and are back at rest after
    running = [metric_value(text, "vllm:num_requests_running", **model) for text in during]
    usage_ratio = [metric_value(text, "vllm:kv_cache_usage_perc", **model) for text in during]
    assert max(running) > 0 and max(usage_ratio) > 0, (running, usage_ratio)
    assert [metric_value(t, "vllm:gpu_cache_usage_perc", **model) for t in during] == usage_ratio
    assert wait_until(lambda: metric_value(_scrape(base), "vllm:num_requests_running", **model) == 0, 30)
    # vLLM's label sets: model_name on every family, finished_reason on request_success, nothing of Triton's
    names = {alias.name for alias in VLLM_ALIASES}
    for line in after.splitlines():
        if line.startswith("vllm:"):
            head = line.rpartition(" ")[0]
            family, _, labels = head.partition("{")
            assert any(family.startswith(name) for name in names), line
            assert f'model_name="{SERVED_ID}"' in labels, line
            assert 'model="' not in labels and 'version="' not in labels, line
            if family.startswith("vllm:request_success"):
                assert any(f'finished_reason="{r}"' in labels for r in ("stop", "length", "abort")), line
    for alias in VLLM_ALIASES:
        assert f"# TYPE {alias.name}" in after, alias.name
    # the Grafana dashboard reads this one endpoint
    dashboard = json.loads((ROOT / "docs" / "grafana" / "helios.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    read = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs
            for m in re.findall(r"\b((?:helios_gateway|flare)_[a-z0-9_]+|vllm:[a-z0-9_]+)", e)}
    assert sum(name.startswith("vllm:") for name in read) >= 10
    for name in read:
        assert re.search(rf"^{name}(_bucket|_count|_total)?[{{ ]", after, re.M), name


def test_readiness_turns_false_when_tritonserver_stops_and_liveness_stays(operated: Operated) -> None:
    # the module's last test: it stops the operator's tritonserver; one request first opens the channel
    answer = httpx.post(operated.gateway.base_url + "/v1/completions", timeout=120,
                        json={"model": SERVED_ID, "prompt": "Hello", "max_tokens": 2})
    assert answer.status_code == 200
    operated.triton.send_signal(signal.SIGINT)
    assert wait_until(lambda: _status(operated.gateway.base_url + "/readyz") == 503, 30)
    # the gateway lets go of its idle channel, so that the model can unload
    assert wait_until(lambda: "closed the idle channel" in operated.gateway.log(), 30)
    assert _status(operated.gateway.base_url + "/livez") == 200
    assert _status(operated.gateway.base_url + "/health") == 503       # vLLM's name, readiness here
