"""Several gateway processes behind one port become ready one by one: each learns the model on its
own. A client that saw /readyz answer 200 from one of them must not get a 503 from a sibling that
has not asked the backend yet (it would otherwise sleep up to a second in its retry delay): a
request that finds its process still waiting wakes that process's loader and waits for it."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ServeProcess
from tests.server_fixtures import default_core  # noqa: F401 - fixture

WORKERS = 4


def _status(url: str) -> int:
    try:
        with httpx.Client(timeout=10) as client:         # a new connection: any worker may take it
            return client.get(url).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.triton
@pytest.mark.slow
def test_every_gateway_process_answers_once_one_reports_ready(default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    with ServeProcess(default_core, tmp_path, "--executor", "cpu", "--host", "127.0.0.1",
                      "--gateway-workers", str(WORKERS)) as serve:
        base = serve.gateway_url
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and serve.process.poll() is None and _status(base + "/readyz") != 200:
            time.sleep(0.05)
        statuses = [_status(base + "/v1/models") for _ in range(8 * WORKERS)]
        assert statuses == [200] * len(statuses), (statuses, serve.log()[-3000:])
        assert serve.stop() == 0
