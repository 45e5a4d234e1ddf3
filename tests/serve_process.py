"""`helios-serve` as a real process for tests: free ports, its own TMPDIR, captured log.

    with ServeProcess(core, tmp_path, "--max-active", "4") as serve:
        serve.wait_gateway_healthy()
    with serve_with_gateway(core, workdir) as base_url: openai.OpenAI(base_url=base_url + "/v1", ...)

It finds the processes it supervises (tritonserver, the python stub) through /proc, so
tests can kill them, and says what the stack left behind (TMPDIR entries, /dev/shm
regions of its prefix). Always stopped (and killed with its children if need be) on exit.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from helios_backend.triton.supervision import child_pids, process_alive as alive, stub_pids
from tests.triton_server import ends_with_this_process, free_ports, metric_value

SERVE = Path(sys.executable).parent / "helios-serve"


class ServeProcess:
    def __init__(self, core: Path, workdir: Path, *args: str, gateway: bool = True,
                 env: dict[str, str] | None = None, source: str = "--core") -> None:
        """`source`: the option `core` is given with (--core, or --model for a checkpoint folder)."""
        self.http, self.grpc, self.metrics_port, self.gateway_port = free_ports(4)
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        self.tmpdir = workdir / f"tmp-{self.grpc}"
        self.tmpdir.mkdir()
        self.log_path = workdir / f"serve-{self.grpc}.log"
        self._log = open(self.log_path, "wb")
        argv = [str(SERVE), source, str(core), "--http-port", str(self.http), "--grpc-port", str(self.grpc),
                "--metrics-port", str(self.metrics_port), "--gateway-port", str(self.gateway_port), *args]
        if not gateway:
            argv.append("--no-gateway")
        self.started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {}), "TMPDIR": str(self.tmpdir)},
                                        preexec_fn=ends_with_this_process())

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def shm_prefix(self) -> str:
        match = re.search(r"shared memory prefix (\S+)", self.log())
        assert match, self.log()[-2000:]
        return match.group(1)

    @property
    def workdir(self) -> Path:
        match = re.search(r"helios-serve: workdir (\S+),", self.log())
        assert match, self.log()[-2000:]
        return Path(match.group(1))

    def descendants(self) -> dict[int, str]:
        """Every process below helios-serve (pid -> command name), found through /proc."""
        found: dict[int, str] = {}
        parents = [self.process.pid]
        while parents:
            parent = parents.pop()
            for pid in child_pids(parent, ""):
                if pid not in found:
                    try:
                        found[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
                    except OSError:
                        found[pid] = "?"
                    parents.append(pid)
        return found

    def leftovers(self) -> list[str]:
        """What the stack left in its TMPDIR and /dev/shm (empty once it cleaned up)."""
        return sorted([p.name for p in self.tmpdir.iterdir()] +
                      [p.name for p in Path("/dev/shm").glob(f"{self.shm_prefix}*")])

    def triton_pid(self) -> int:
        [pid] = child_pids(self.process.pid, "tritonserver")
        return pid

    def stub_pid(self) -> int:
        [pid] = stub_pids(self.triton_pid())
        return pid

    def engine_pid(self) -> int:
        """The stub's engine process (helios_backend/engine/process_child.py)."""
        [pid] = child_pids(self.stub_pid(), "python")
        return pid

    def wait_gateway_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"helios-serve exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.gateway_url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"not healthy after {timeout_s}s:\n{self.log()[-4000:]}")

    def gateway_metric(self, name: str, **labels: str) -> float:
        return metric_value(httpx.get(self.gateway_url + "/metrics", timeout=10).text, name, **labels)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                for pid in child_pids(self.process.pid, ""):    # each child leads its own group
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


@contextlib.contextmanager
def serve_with_gateway(core: Path, workdir: Path, *extra: str, startup_s: float = 600) -> Iterator[str]:
    """helios-serve with its gateway, healthy; yields the gateway's base URL."""
    with ServeProcess(core, workdir, *extra) as serve:
        serve.wait_gateway_healthy(startup_s)
        yield serve.gateway_url
