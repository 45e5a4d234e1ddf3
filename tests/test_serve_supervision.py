"""helios-serve fails loudly, recovers by itself and never hangs: a real tritonserver, the real
python stub and the real gateway under helios-serve (tests/serve_process.py).

* a tampered core: helios-serve exits non-zero on its own, naming the cause;
* a gateway that cannot start (its port taken): exits non-zero;
* kill -9 of the stub mid-generation: every open request gets its one terminal error,
  permits and streams are released, /health goes red, helios-serve restarts the server
  (counted), /health turns green and requests are served again; the stub's engine process
  ends by itself;
* kill -9 of the engine process mid-generation: the same, the stub ending itself (cause
  engine_failed);
* the same when a thread of the engine dies inside a live stub (injected crash): the stub
  answers every open request with its failure and exits, and is restarted (cause engine_failed);
* kill -9 of tritonserver mid-generation: the same, and its stub and engine process end
  within a bound (they watch their parent, triton/parent_watch.py);
* SIGTERM mid-stream: the stream ends with one `shutting_down` error event, everything
  exits, nothing is left in TMPDIR or /dev/shm;
* kill -9 of helios-serve mid-stream: every process of the instance ends within 5 s, and the
  next start removes the workdir and /dev/shm regions the dead one left, then serves.
Times are printed for the report, never asserted."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from helios_backend.engine.faults import ENVIRONMENT as FAULT_ENVIRONMENT, SITES
from helios_backend.triton.supervision import ExitCode
from tests.core_helpers import tampered_copy
from tests.gateway_harness import QUESTION, OpenRequests, StreamReader, body, wait_until
from tests.serve_process import ServeProcess, alive
from tests.server_fixtures import default_core  # noqa: F401 - fixture

pytestmark = [pytest.mark.triton, pytest.mark.slow]


# spec: FMT-22
def test_a_publisher_not_accepted_makes_helios_serve_exit_before_tritonserver(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(default_core, tmp_path, "--acceptance", "example.org/someone-else") as serve:
        code = serve.process.wait(300)
        print(f"publisher not accepted: exit {code} after {time.monotonic() - serve.started:.1f}s")
        log = serve.log()
    assert code == ExitCode.MODEL_FAILED, log[-3000:]
    assert "the core cannot be served (AuthorizationError)" in log and "example.org/someone-else" in log, log[-3000:]
    assert "tritonserver" not in log.split("cannot be served")[0].split("shared memory prefix")[-1], log[-3000:]
    assert serve.leftovers() == []


# spec: FMT-12, FMT-22
def test_a_tampered_core_makes_helios_serve_exit_non_zero(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(tampered_copy(default_core, tmp_path / "tampered.core"), tmp_path) as serve:
        code = serve.process.wait(300)
        print(f"tampered core: exit {code} after {time.monotonic() - serve.started:.1f}s")
        log = serve.log()
    assert code == ExitCode.MODEL_FAILED, log[-3000:]
    # refused before tritonserver starts: the cause names the resource's chunk
    assert "the core cannot be served (IntegrityError)" in log and "sha256 commitment" in log, log[-3000:]
    assert serve.leftovers() == []


def test_a_gateway_that_cannot_start_makes_helios_serve_exit_non_zero(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with ServeProcess(default_core, tmp_path) as serve:
        taken.bind(("0.0.0.0", serve.gateway_port))
        taken.listen()
        try:
            code = serve.process.wait(300)
        finally:
            taken.close()
        log = serve.log()
    assert code == ExitCode.GATEWAY_FAILED, log[-3000:]
    assert "the gateway exited with code" in log and "before it answered HTTP" in log
    assert serve.leftovers() == []


def assert_recovered(serve: ServeProcess, since: float, stub: int, cause: str) -> None:
    """Nothing held, /health red, then green on a new stub that serves; the restart counted."""
    assert serve.gateway_metric("helios_gateway_admission_permits_in_use") == 0
    assert serve.gateway_metric("helios_gateway_backend_streams_open") == 0
    serve.wait_gateway_healthy()
    print(f"/health green again {time.monotonic() - since:.1f}s after the failure")
    assert serve.gateway_metric("helios_serve_restarts_total", process="tritonserver", cause=cause) == 1
    with httpx.Client(base_url=serve.gateway_url, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body(QUESTION, 4))
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert serve.stub_pid() != stub


def wait_red(serve: ServeProcess, since: float) -> None:
    assert wait_until(lambda: httpx.get(serve.gateway_url + "/health", timeout=10).status_code == 503)
    print(f"/health red {time.monotonic() - since:.2f}s after the failure")


# spec: HTTP-23, HTTP-25, HTTP-27
def test_a_killed_stub_fails_open_requests_and_the_stack_recovers(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(default_core, tmp_path) as serve:
        serve.wait_gateway_healthy()
        requests = OpenRequests(serve.gateway_url)
        assert serve.gateway_metric("helios_gateway_backend_streams_open") == 4
        stub, triton, engine = serve.stub_pid(), serve.triton_pid(), serve.engine_pid()
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)                      # the backend dies mid-generation
        wait_red(serve, killed_at)
        requests.assert_each_failed_once(killed_at)
        assert not alive(triton)                           # the server with the dead stub was replaced
        assert_recovered(serve, killed_at, stub, "stub_died")
        assert wait_until(lambda: not alive(engine))       # the orphaned engine process let go of the device


# spec: HTTP-23, HTTP-25, HTTP-27
def test_a_killed_engine_process_fails_open_requests_and_the_stack_recovers(default_core: Path,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    with ServeProcess(default_core, tmp_path) as serve:
        serve.wait_gateway_healthy()
        requests = OpenRequests(serve.gateway_url)
        assert serve.gateway_metric("helios_gateway_backend_streams_open") == 4
        stub, engine = serve.stub_pid(), serve.engine_pid()
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)                    # the scheduler and executor die mid-generation
        wait_red(serve, killed_at)
        requests.assert_each_failed_once(killed_at)
        assert_recovered(serve, killed_at, stub, "engine_failed")
        assert not alive(stub) and serve.engine_pid() != engine
        log = serve.log()
    assert "the engine process ended unexpectedly (exit code -9)" in log, log[-3000:]


# spec: HTTP-23, HTTP-25, HTTP-27
@pytest.mark.parametrize("site", SITES)
def test_a_dead_engine_thread_ends_the_stub_and_the_stack_recovers(default_core: Path, tmp_path: Path,  # noqa: F811
                                                                   site: str) -> None:
    """A thread of the engine dies inside a live stub (the injected crash of faults.py): the open
    requests get their failure, the stub exits with STUB_EXIT_ENGINE_FAILED, helios-serve
    restarts the server (cause engine_failed)."""
    trigger = tmp_path / "fault"
    with ServeProcess(default_core, tmp_path, env={FAULT_ENVIRONMENT: str(trigger)}) as serve:
        serve.wait_gateway_healthy()
        requests = OpenRequests(serve.gateway_url)
        stub = serve.stub_pid()
        armed_at = time.monotonic()
        trigger.write_text(site)
        wait_red(serve, armed_at)
        requests.assert_each_failed_once(armed_at)
        assert_recovered(serve, armed_at, stub, "engine_failed")
        log = serve.log()
    assert f"injected fault in the {site} thread" in log and "helios engine failed, ending the stub" in log
    assert not trigger.exists()


# spec: HTTP-15
def test_sigterm_mid_stream_sends_shutting_down_and_leaves_nothing(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(default_core, tmp_path) as serve:
        serve.wait_gateway_healthy()
        reader = StreamReader(serve.gateway_url, max_tokens=2000)
        reader.start()
        assert reader.first_content.wait(120)
        pids = [serve.triton_pid(), serve.stub_pid()]
        signalled_at = time.monotonic()
        serve.process.send_signal(signal.SIGTERM)
        reader.join(60)
        code = serve.process.wait(60)
        print(f"SIGTERM: stream ended after {reader.ended_at - signalled_at:.2f}s, "
              f"helios-serve exited after {time.monotonic() - signalled_at:.2f}s")
        errors = [json.loads(e) for e in reader.events if '"error"' in e]
        assert [e["error"]["code"] for e in errors] == ["shutting_down"]
        assert reader.events[-1] == json.dumps(errors[0], separators=(",", ":")) and "[DONE]" not in reader.events
        assert code == 0, serve.log()[-3000:]
        assert not any(alive(pid) for pid in pids)
        assert serve.leftovers() == []


# spec: HTTP-23, HTTP-25, HTTP-27
def test_a_killed_tritonserver_ends_its_stub_and_engine_and_the_stack_recovers(default_core: Path,  # noqa: F811
                                                                              tmp_path: Path) -> None:
    with ServeProcess(default_core, tmp_path) as serve:
        serve.wait_gateway_healthy()
        requests = OpenRequests(serve.gateway_url)
        stub, triton, engine = serve.stub_pid(), serve.triton_pid(), serve.engine_pid()
        killed_at = time.monotonic()
        os.kill(triton, signal.SIGKILL)                    # the server dies mid-generation, its stub does not
        wait_red(serve, killed_at)
        requests.assert_each_failed_once(killed_at)
        # the orphaned stub and its engine process end by themselves (their parent watch)
        assert wait_until(lambda: not alive(stub) and not alive(engine), timeout_s=5), \
            f"stub {stub} alive: {alive(stub)}, engine {engine} alive: {alive(engine)}"
        print(f"the orphaned stub and engine process gone {time.monotonic() - killed_at:.2f}s after the kill")
        assert_recovered(serve, killed_at, stub, "exited_signal")


class _BrokenStreamReader(StreamReader):
    """A stream whose server is killed: its connection breaks, which is expected here."""

    def run(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            super().run()


# spec: HTTP-11
def test_a_killed_helios_serve_leaves_no_process_and_the_next_start_removes_its_state(
        default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(default_core, tmp_path) as serve:
        serve.wait_gateway_healthy()
        reader = _BrokenStreamReader(serve.gateway_url, max_tokens=2000)
        reader.start()
        assert reader.first_content.wait(120)
        processes = serve.descendants()
        names = sorted(processes.values())
        assert "tritonserver" in names and "triton_python_b" in names and len(names) >= 4, names  # + engine, gateway
        workdir, prefix, dead_pid = serve.workdir, serve.shm_prefix, serve.process.pid
        try:
            killed_at = time.monotonic()
            serve.process.kill()                           # an OOM kill: helios-serve runs no cleanup
            serve.process.wait(10)
            gone = wait_until(lambda: not any(alive(pid) for pid in processes), timeout_s=5)
            print(f"every process of the killed instance gone {time.monotonic() - killed_at:.2f}s after the kill")
            assert gone, {pid: name for pid, name in processes.items() if alive(pid)}
        finally:
            for pid in processes:                          # never leave one behind, even on failure
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        reader.join(30)
        # nothing removed the dead instance's state: its owner ran no cleanup
        assert workdir.is_dir() and list(Path("/dev/shm").glob(f"{prefix}*"))
    with ServeProcess(default_core, tmp_path) as second:
        second.wait_gateway_healthy()                       # its ports, regions and device were free
        assert not workdir.exists() and not list(Path("/dev/shm").glob(f"{prefix}*"))
        assert f"removed the state of a dead instance (pid {dead_pid})" in second.log()
        with httpx.Client(base_url=second.gateway_url, timeout=120) as client:
            answer = client.post("/v1/chat/completions", json=body(QUESTION, 4))
        assert answer.status_code == 200, answer.text
    assert second.leftovers() == []
