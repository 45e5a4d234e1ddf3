"""A clean start and stop of helios-serve on this CPU machine: liveness answers while the core
loads and readiness waits; the log holds no error-level line (tritonserver's GPU-probe lines
are replaced by one info line) and no `Exit timeout expired`; with nothing in flight
tritonserver is ended once its model unloaded, not after its exit poll. The stop's wait below
is a bound on a hung process, not a timing assertion."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from helios_backend.triton.server_log import EXPLANATION, GPU_PROBE_LINES, ServerLog
from tests.serve_process import ServeProcess
from tests.server_fixtures import default_core  # noqa: F401 - fixture

# glog's error lines (E1206 09:00:00.000 ...), Python's logging errors, tracebacks, Triton's stop timeout
ERROR_LINE = re.compile(r"^E\d{4} |\bERROR\b|Traceback|Exit timeout expired|CRITICAL")


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.triton
@pytest.mark.slow
def test_a_clean_start_and_stop_print_no_error_lines(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(default_core, tmp_path, "--executor", "cpu", "--host", "127.0.0.1") as serve:
        base = serve.gateway_url
        probes: list[tuple[int, int]] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and serve.process.poll() is None:
            probes.append((_status(base + "/livez"), _status(base + "/readyz")))
            if probes[-1][1] == 200:
                break
            time.sleep(0.3)
        assert probes and probes[-1] == (200, 200), serve.log()[-3000:]
        answer = httpx.post(base + "/v1/completions", timeout=120,
                            json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
        assert answer.status_code == 200
        assert serve.stop() == 0                       # SIGTERM, as an orchestrator stops a pod
        text = serve.log()
        assert serve.leftovers() == []
    # the gateway answered liveness while the model was still loading
    assert (200, 503) in probes, probes
    errors = [line for line in text.splitlines() if ERROR_LINE.search(line)]
    assert errors == [], "\n".join(errors)
    assert text.count(EXPLANATION.format(executor="cpu").strip()) == 1
    assert "the model unloaded; ending tritonserver" in text
    assert "stopped (" in text


def test_gpu_probe_lines_are_explained_once_without_a_gpu_and_kept_with_one() -> None:
    probe_lines = ['E1206 08:55:03.575638 13757 server.cc:241] "CudaDriverHelper has not been initialized."\n',
                   "Error: Failed to initialize NVML\n",
                   'W1206 08:57:33.985949 20248 metrics.cc:798] "DCGM unable to start: DCGM initialization error"\n']
    other = 'E1206 08:55:03.575638 13757 model_lifecycle.cc:1] "failed to load \'helios\'"\n'
    assert all(any(p.search(line) for p in GPU_PROBE_LINES) for line in probe_lines)
    cpu = ServerLog("cpu")
    out = [cpu.line(line) for line in probe_lines + [other]]
    assert out[0] == EXPLANATION.format(executor="cpu") and out[1:3] == [None, None]
    assert out[3] == other                                  # a real error passes unchanged
    cuda = ServerLog("cuda")
    assert [cuda.line(line) for line in probe_lines] == probe_lines
