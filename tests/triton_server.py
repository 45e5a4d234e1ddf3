"""A real tritonserver for tests: free ports, model readiness, captured log, clean stop.

    with TritonServer(model_repository(tmp, core_path=core)) as server:
        server.wait_ready("helios")
        client = grpcclient.InferenceServerClient(server.grpc_url)

Shared by the backend and gateway tests. It never leaves a server running: stop()
(also on __exit__) sends SIGINT, then SIGKILL after a grace period, and removes the
server's python-backend shared-memory regions.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

from helios_backend.triton.parent_watch import parent_death_signal
from helios_backend.triton.launcher import (
    Ports, cleanup_shm, locate_tritonserver, prepare_backend_directory, server_command, server_environment,
    write_model_repository)


def ends_with_this_process() -> "Callable[[], None] | None":
    """The preexec_fn for a server a test starts: SIGKILL when the test process dies, so a
    killed pytest (a CI timeout, ^C twice) leaves no tritonserver, gateway or helios-serve behind;
    their own children follow through the product's parent watches. PDEATHSIG follows the forking
    *thread*, so a server started from another thread (which may end first) gets none."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return parent_death_signal(os.getpid())


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def model_repository(workdir: Path, **parameters: str | int | float | bool | Path) -> Path:
    """A copy of model_repository/helios with some config parameters replaced."""
    return write_model_repository(workdir, {k: str(v).lower() if isinstance(v, bool) else str(v)
                                            for k, v in parameters.items()})


class TritonServer:
    def __init__(self, repository: Path, workdir: Path | None = None, exit_timeout_s: int = 30,
                 python_bin: Path | None = None) -> None:
        self.repository = repository
        self.python_bin = python_bin          # the stub's Python environment (default: this one's)
        self.workdir = workdir or repository.parent
        self.ports = Ports(*free_ports(3))
        self.log_path = self.workdir / f"tritonserver-{self.ports.grpc}.log"
        self.shm_prefix = f"helios-test-{uuid.uuid4().hex[:8]}-"
        self.exit_timeout_s = exit_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._restarts = 0

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    def start(self) -> "TritonServer":
        install = locate_tritonserver()
        backends = prepare_backend_directory(install, self.workdir / "triton")
        cmd = server_command(install, backends, self.repository, self.ports, shm_prefix=self.shm_prefix,
                             exit_timeout_s=self.exit_timeout_s)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=server_environment(install, python_bin=self.python_bin),
                                        cwd=self.workdir, preexec_fn=ends_with_this_process())
        return self

    def _restart_if_port_taken(self) -> bool:
        """free_ports() releases its sockets before tritonserver binds them; on a shared
        machine another process may take one first. Then start again on new ports."""
        if self.process is None or self.process.poll() is None or self._restarts >= 3:
            return False
        if "already in use" not in self.log() and "Address in use" not in self.log():
            return False
        self._log.close()
        cleanup_shm(self.shm_prefix)
        self._restarts += 1
        self.ports = Ports(*free_ports(3))
        self.log_path = self.workdir / f"tritonserver-{self.ports.grpc}.log"
        self.start()
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def wait_live(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._restart_if_port_taken():
                continue
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            if self._get("/v2/health/live") == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver not live after {timeout}s:\n{self.log()[-4000:]}")

    def model_ready(self, model: str = "helios") -> bool:
        return self._get(f"/v2/models/{model}/ready") == 200

    def wait_ready(self, model: str = "helios", timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._restart_if_port_taken():
                continue
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            if self.model_ready(model):
                return
            if f"failed to load '{model}'" in self.log():
                raise RuntimeError(f"model {model} failed to load:\n{self.log()[-4000:]}")
            time.sleep(0.3)
        raise TimeoutError(f"model {model} not ready after {timeout}s:\n{self.log()[-4000:]}")

    def wait_load_attempt(self, model: str = "helios", timeout: float = 300) -> None:
        """Until the model loaded or failed to load (for startup-failure tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            if f"failed to load '{model}'" in text or self.model_ready(model):
                return
            if self.process is not None and self.process.poll() is not None:
                return
            time.sleep(0.3)
        raise TimeoutError(f"no load outcome for {model} after {timeout}s:\n{self.log()[-4000:]}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def signal(self, sig: int = signal.SIGINT) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, grace_s: float = 60) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        kill_stubs(self.shm_prefix)          # a server killed by a test leaves its stub behind
        cleanup_shm(self.shm_prefix)
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kill_stubs(shm_prefix: str) -> None:
    """SIGKILL every Python backend stub of one server (its command line names the server's
    shared-memory region): Triton 2.51's stub outlives a tritonserver that was killed."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmd and shm_prefix.encode() in cmd:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def wait_for_metric(server: "TritonServer", name: str, predicate, timeout: float = 30, **labels: str) -> float:  # type: ignore[no-untyped-def]
    """Poll a metric until predicate(value) holds (metrics are applied every ~0.25 s);
    returns the last value. A bound on waiting, not a timing assertion."""
    deadline = time.monotonic() + timeout
    value = metric_value(server.metrics(), name, **labels)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = metric_value(server.metrics(), name, **labels)
    return value


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels` (0 when absent)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
            found = True
    return total if found else 0.0


os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
