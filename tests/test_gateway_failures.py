"""End to end, disruptive: full ingress (429), shutdown drain, and a backend that dies mid-request
(500 / SSE error event, then 503), also when only its Python stub dies under a standalone gateway
(no helios-serve: the gateway's backend watch ends the open requests and reconnects once the
model is back). Real tritonserver, real gateway processes, the test core."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine_fixtures import smollm2_core  # noqa: F401  (session fixture: the test core)
from tests.server_fixtures import default_core  # noqa: F401  (the served default core)
from tests.gateway_harness import QUESTION, STORY, SERVED_ID, GatewayProcess, OpenRequests, body, wait_until
from tests.triton_server import TritonServer, metric_value, model_repository
from helios_backend.triton.supervision import stub_pids

pytestmark = [pytest.mark.triton, pytest.mark.slow]

@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-failures")


@pytest.fixture(scope="module")
def server(smollm2_core: Path, workdir: Path) -> Iterator[TritonServer]:  # noqa: F811
    with TritonServer(model_repository(workdir, core_path=str(smollm2_core)), workdir) as running:
        running.wait_ready("helios")
        yield running


@pytest.fixture
def one_permit_gateway(server: TritonServer, workdir: Path) -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(server.grpc_url, workdir / "gateway-one-permit.log",
                             "--queue-capacity", "0", "--max-active", "1")
    try:
        gateway.wait_healthy()
        yield gateway
    finally:
        gateway.stop()


def backend_requests(server: TritonServer) -> float:
    text = server.metrics()
    return metric_value(text, "flare_requests_running") + metric_value(text, "flare_requests_waiting")


def first_content(response: httpx.Response) -> Iterator[str]:
    """Iterate SSE lines, having consumed the stream up to the first text delta."""
    lines = response.iter_lines()
    for line in lines:
        if '"content":"' in line and '"content":""' not in line:
            break
    return lines


# spec: HTTP-1, HTTP-2, HTTP-12, HTTP-17, HTTP-21
def test_full_ingress_answers_429_with_retry_after(one_permit_gateway: GatewayProcess) -> None:
    gateway = one_permit_gateway
    sdk = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0)
    with httpx.Client(base_url=gateway.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body(STORY, 300, stream=True)) as held:
            lines = first_content(held)
            assert gateway.metric("helios_gateway_admission_permits_in_use") == 1
            refused = client.post("/v1/chat/completions", json=body(QUESTION, 2))
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=2)
            # the refusals did not disturb the admitted stream
            assert '"content"' in next(line for line in lines if '"content":"' in line)
        assert wait_until(lambda: gateway.metric("helios_gateway_admission_permits_in_use") == 0)
        assert client.post("/v1/chat/completions", json=body(QUESTION, 2)).status_code == 200
    assert gateway.metric("helios_gateway_ingress_full_total") == 2


# spec: HTTP-15
def test_shutdown_drains_in_flight_stream(server: TritonServer, workdir: Path) -> None:
    gateway = GatewayProcess(server.grpc_url, workdir / "gateway-drain.log")
    try:
        gateway.wait_healthy()
        with httpx.Client(base_url=gateway.base_url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=body(QUESTION, 6, stream=True)) as response:
                lines = first_content(response)
                gateway.process.send_signal(signal.SIGINT)  # shutdown begins mid-stream
                rest = list(lines)
        assert "data: [DONE]" in rest  # the response completed within the drain window
        assert gateway.process.wait(30) == 0
    finally:
        gateway.stop()


# spec: HTTP-23, HTTP-25, HTTP-27
def test_backend_death_mid_request_is_500_then_503(server: TritonServer, workdir: Path) -> None:
    gateway = GatewayProcess(server.grpc_url, workdir / "gateway-kill.log")
    try:
        gateway.wait_healthy()
        json_result: dict[str, Any] = {}

        def non_stream() -> None:
            with httpx.Client(base_url=gateway.base_url, timeout=120) as client:
                response = client.post("/v1/chat/completions", json=body(STORY, 300))
                json_result.update(status=response.status_code, body=response.json())

        with httpx.Client(base_url=gateway.base_url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=body(STORY, 300, stream=True)) as response:
                lines = first_content(response)
                worker = threading.Thread(target=non_stream)
                worker.start()
                assert wait_until(lambda: gateway.metric("helios_gateway_backend_streams_open") == 2)
                # both requests reached the backend (otherwise the second is merely unsendable: 503)
                assert wait_until(lambda: backend_requests(server) == 2)
                server.process.kill()  # type: ignore[union-attr]  # the backend dies mid-generation
                rest = [line for line in lines if line.startswith("data: ")]
            worker.join(120)
            errors = [json.loads(line[6:]) for line in rest if '"error"' in line]
            assert len(errors) == 1 and rest[-1] == "data: " + json.dumps(errors[0], separators=(",", ":"))
            assert errors[0]["error"]["type"] == "server_error"
            assert "data: [DONE]" not in rest
            assert json_result["status"] == 500
            assert json_result["body"]["error"]["type"] == "server_error"
            # with the backend gone: not healthy, and new work is refused as unavailable
            assert client.get("/health").status_code == 503
            assert client.post("/v1/chat/completions", json=body(QUESTION, 2)).status_code == 503
    finally:
        gateway.stop()


# spec: HTTP-1, HTTP-4, HTTP-5, HTTP-17
def test_a_burst_of_every_permit_is_served_without_503(smollm2_core: Path, tmp_path: Path) -> None:  # noqa: F811
    import asyncio

    from tests.gateway_harness import gateway_stack

    with gateway_stack(smollm2_core, tmp_path, queue_capacity="2", max_active="4") as stack:
        permits = int(stack.gateway.metric("helios_gateway_admission_permits"))
        assert permits == 6

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=stack.gateway.base_url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/chat/completions", json=body(QUESTION, 12))
                                              for _ in range(permits + 2)))

        responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 503 not in statuses, [r.text for r in responses if r.status_code == 503]
    assert statuses.count(200) >= permits
    assert all(int(r.headers["retry-after"]) >= 1 for r in responses if r.status_code == 429)


# spec: HTTP-23, HTTP-25, HTTP-27
def test_a_dead_stub_under_a_standalone_gateway_ends_open_requests_and_reconnects(
        default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    """Triton keeps the model READY and the channel's stream open after kill -9 of the stub;
    the gateway's watch sees the model refuse, ends every open request with its terminal error,
    turns /health red, and serves again once tritonserver is back on the same address."""
    server = TritonServer(model_repository(tmp_path, core_path=str(default_core)), tmp_path, exit_timeout_s=3)
    with server:
        server.wait_ready("helios")
        gateway = GatewayProcess(server.grpc_url, tmp_path / "gateway-standalone.log")
        try:
            gateway.wait_healthy()
            requests = OpenRequests(gateway.base_url)
            assert gateway.metric("helios_gateway_backend_streams_open") == 4
            [stub] = stub_pids(server.process.pid)  # type: ignore[union-attr]
            killed_at = time.monotonic()
            os.kill(stub, signal.SIGKILL)
            requests.assert_each_failed_once(killed_at)
            assert server.model_ready("helios")            # Triton itself never noticed
            assert gateway.metric("helios_gateway_backend_lost_total") == 1
            assert gateway.metric("helios_gateway_admission_permits_in_use") == 0
            assert gateway.metric("helios_gateway_backend_streams_open") == 0
            with httpx.Client(base_url=gateway.base_url, timeout=120) as client:
                assert client.get("/health").status_code == 503
                refused = client.post("/v1/chat/completions", json=body(QUESTION, 2))
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "backend_unavailable"
                assert int(refused.headers["retry-after"]) >= 1
            server.stop()                                  # an operator (or an orchestrator) restarts it
            server.start()
            server.wait_ready("helios")
            gateway.wait_healthy()
            print(f"/health green again {time.monotonic() - killed_at:.1f}s after the kill")
            with httpx.Client(base_url=gateway.base_url, timeout=120) as client:
                answer = client.post("/v1/chat/completions", json=body(QUESTION, 4))
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        finally:
            gateway.stop()
