"""helios-serve with a tensor-parallel core's ranks as processes: the real tritonserver, the
python stub as rank 0, a real helios-rank process as rank 1, the real gateway.

kill -9 of the rank process mid-generation: every open stream gets its one terminal error,
/health goes red, helios-serve restarts the server and the ranks together (counted as
tritonserver/rank_exited), /health turns green and requests are served again by a new rank.
Times are printed for the report, never asserted."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway_harness import wait_until
from tests.serve_process import ServeProcess, alive
from tests.test_rank_processes import free_port, tp_core  # noqa: F401 - fixture
from tests.test_serve_supervision import QUESTION, StreamReader, body

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def rank_pids(serve: ServeProcess) -> list[int]:
    """helios-serve's helios-rank children."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == serve.process.pid and b"helios_backend.cli.rank" in argv:
            found.append(int(entry.name))
    return found


def test_a_killed_rank_process_fails_open_requests_and_the_stack_restarts_the_ranks(tp_core: Path,  # noqa: F811
                                                                                    tmp_path: Path) -> None:
    # spec: OWN-15
    with ServeProcess(tp_core, tmp_path, "--executor", "numpy", "--rank-peers", "processes",
                      "--rank-store", f"127.0.0.1:{free_port()}", "--page-capacity", "128") as serve:
        serve.wait_gateway_healthy()
        [rank] = rank_pids(serve)
        readers = [StreamReader(serve.gateway_url, max_tokens=300) for _ in range(2)]
        for reader in readers:
            reader.start()
        assert all(reader.first_content.wait(120) for reader in readers)
        killed_at = time.monotonic()
        os.kill(rank, signal.SIGKILL)                        # rank 1 dies mid-generation
        for reader in readers:
            reader.join(120)
        print("terminal errors after", [f"{r.ended_at - killed_at:.2f}s" for r in readers])
        for reader in readers:
            errors = [json.loads(e) for e in reader.events if '"error"' in e]
            assert len(errors) == 1 and reader.events[-1] == json.dumps(errors[0], separators=(",", ":"))
            assert errors[0]["error"]["type"] == "server_error"
            assert "[DONE]" not in reader.events
        assert wait_until(lambda: httpx.get(serve.gateway_url + "/health", timeout=10).status_code == 503)
        print(f"/health red {time.monotonic() - killed_at:.2f}s after the kill")
        serve.wait_gateway_healthy()
        print(f"/health green again {time.monotonic() - killed_at:.1f}s after the kill")
        restarts = serve.gateway_metric("helios_serve_restarts_total", process="tritonserver", cause="rank_exited") + \
            serve.gateway_metric("helios_serve_restarts_total", process="tritonserver", cause="stub_died")
        assert restarts == 1
        [new_rank] = rank_pids(serve)
        assert new_rank != rank and not alive(rank)
        with httpx.Client(base_url=serve.gateway_url, timeout=120) as client:
            answer = client.post("/v1/chat/completions", json=body(QUESTION, 4))
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert serve.process.returncode == 0
    assert serve.leftovers() == []
