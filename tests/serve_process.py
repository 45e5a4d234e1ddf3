"""`helios-serve` with its gateway as one process, for tests that talk to it with the openai SDK.

    with serve_with_gateway(core, workdir) as base_url: openai.OpenAI(base_url=base_url + "/v1", ...)

Ports are free ones; the process is stopped with SIGINT (its drain path) and killed if it does
not exit, so no server outlives the test module.
"""
from __future__ import annotations

import contextlib
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from tests.triton_server import free_ports


@contextlib.contextmanager
def serve_with_gateway(core: pathlib.Path, workdir: pathlib.Path, *extra: str,
                       startup_s: float = 600) -> Iterator[str]:
    http, grpc, metrics, gateway = free_ports(4)
    serve = pathlib.Path(sys.executable).parent / "helios-serve"
    log_path = workdir / "serve.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(serve), "--core", str(core), "--workdir", str(workdir), "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--gateway-port", str(gateway),
                             *extra], stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{gateway}"
    try:
        deadline = time.monotonic() + startup_s
        ready = False
        while not ready and proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(base_url + "/v1/models", timeout=2) as response:
                    ready = response.status == 200
            except OSError:
                time.sleep(0.5)
        assert ready, log_path.read_text(errors="replace")[-3000:]
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
