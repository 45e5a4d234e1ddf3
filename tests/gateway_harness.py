"""A real gateway process on a real tritonserver serving the test core, for end-to-end tests.

    with gateway_stack(core, workdir) as stack:
        client = openai.OpenAI(base_url=stack.gateway.base_url + "/v1", api_key="unused")

The gateway runs as `python -m gateway.cli` (the `helios-gateway` console script) on a free
port; tritonserver comes from tests/triton_server.py. Both are always stopped on exit.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.triton_server import TritonServer, ends_with_this_process, free_ports, metric_value, model_repository

ROOT = Path(__file__).resolve().parent.parent
SERVED_ID = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class GatewayProcess:
    def __init__(self, triton_url: str, log_path: Path, *extra_args: str) -> None:
        self.port = free_ports(1)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "--triton", triton_url, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=ends_with_this_process())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"gateway not healthy after {timeout_s}s:\n{self.log()[-4000:]}")

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics(), name, **labels)

    def stop(self, grace_s: float = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


@dataclass
class Stack:
    server: TritonServer
    gateway: GatewayProcess

    def backend_metric(self, name: str, **labels: str) -> float:
        return metric_value(self.server.metrics(), name, **labels)


@contextlib.contextmanager
def gateway_stack(core: Path, workdir: Path, *gateway_args: str, **model_parameters: str) -> Iterator[Stack]:
    repo = model_repository(workdir, core_path=str(core), **model_parameters)
    with TritonServer(repo, workdir) as server:
        server.wait_ready("helios")
        gateway = GatewayProcess(server.grpc_url, workdir / f"gateway-{server.ports.grpc}.log",
                                 "--triton-metrics", server.metrics_url, *gateway_args)
        try:
            gateway.wait_healthy()
            yield Stack(server, gateway)
        finally:
            gateway.stop()


def wait_until(predicate, timeout_s: float = 60, interval_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    """Poll a condition; a bound on waiting, never an assertion about time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def body(messages: list[dict[str, Any]], max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": SERVED_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}


def sse_events(lines: list[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


class StreamReader(threading.Thread):
    """Reads one SSE response to its end; `first_content` is set once a text delta arrived."""

    def __init__(self, url: str, max_tokens: int = 400) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first_content = threading.Event()
        self.events: list[str] = []
        self.ended_at = 0.0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions",
                               json=body(STORY, self.max_tokens, stream=True)) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if '"content":"' in line and '"content":""' not in line:
                            self.first_content.set()
        self.ended_at = time.monotonic()


class OpenRequests:
    """Three streams and one non-streamed request, all generating."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.readers = [StreamReader(url) for _ in range(3)]
        self.json_result: dict[str, Any] = {}
        self.plain = threading.Thread(target=self._non_stream, daemon=True)
        for reader in self.readers:
            reader.start()
        self.plain.start()
        assert all(reader.first_content.wait(120) for reader in self.readers)

    def _non_stream(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            response = client.post("/v1/chat/completions", json=body(STORY, 400))
            self.json_result.update(status=response.status_code, body=response.json(), at=time.monotonic())

    def assert_each_failed_once(self, since: float) -> None:
        """Every request ended with its one terminal error: an SSE error event without [DONE],
        a JSON 500."""
        for reader in self.readers:
            reader.join(120)
        self.plain.join(120)
        print("terminal errors after", [f"{r.ended_at - since:.2f}s" for r in self.readers],
              f"json {self.json_result['at'] - since:.2f}s")
        for reader in self.readers:
            errors = [json.loads(e) for e in reader.events if '"error"' in e]
            assert len(errors) == 1 and reader.events[-1] == json.dumps(errors[0], separators=(",", ":"))
            assert errors[0]["error"]["type"] == "server_error" and errors[0]["error"]["code"]
            assert "[DONE]" not in reader.events
        print("the error:", errors[0]["error"]["message"][:160])
        assert self.json_result["status"] == 500 and self.json_result["body"]["error"]["code"] == "execution_failed"
