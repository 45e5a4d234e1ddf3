"""Serving with numpy 2 in the Python backend stub's environment (Triton 2.51's stub misreads
numpy 2 arrays; docs/exchange.md says how the adapter avoids that), against a real
tritonserver: the own-stream path and the gateway's channel path give the same tokens as a
stub running numpy 1."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway.triton_client import StreamTerminal, TokenBatch, TritonBackend
from tests import helios_client as hc
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.triton_server import TritonServer, model_repository

pytestmark = [pytest.mark.triton, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
NUMPY_2 = "numpy==2.2.6"


@pytest.fixture(scope="module")
def numpy2_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv whose own site-packages holds numpy 2 ahead of this environment's packages."""
    env = tmp_path_factory.mktemp("numpy2") / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(env)],
                   check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = env / "lib" / version / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), NUMPY_2],
                   check=True)
    (site / "zz-helios.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{ROOT}\n")
    probe = subprocess.run([str(env / "bin" / "python"), "-c", "import numpy, helios_backend; print(numpy.__version__)"],
                           check=True, capture_output=True, text=True)
    assert probe.stdout.startswith("2."), probe.stdout
    return env / "bin"


@pytest.fixture(scope="module")
def servers(default_core: Path, numpy2_bin: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
            ) -> Iterator[dict[int, TritonServer]]:
    made: dict[int, TritonServer] = {}
    try:
        for major, python_bin in ((1, None), (2, numpy2_bin)):
            work = tmp_path_factory.mktemp(f"numpy{major}-server")
            server = TritonServer(model_repository(work, core_path=str(default_core)), work, python_bin=python_bin)
            made[major] = server.start()
        for server in made.values():
            server.wait_ready("helios")
        yield made
    finally:
        for server in made.values():
            server.stop()


async def _channel_tokens(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    backend = TritonBackend(url)
    tokens: list[int] = []
    try:
        async for event in backend.generate(prompt, hc.greedy(max_tokens), "numpy2").events():
            if isinstance(event, TokenBatch):
                tokens += event.token_ids.tolist()
            else:
                assert isinstance(event, StreamTerminal), event
    finally:
        await backend.close()
    return tokens


def test_numpy2_stub_serves_the_same_tokens(servers: dict[int, TritonServer]) -> None:  # spec: OWN-13
    assert "numpy 2." in servers[2].log() and "tensors through DLPack" in servers[2].log()
    assert f"numpy {np.__version__}" in servers[1].log()
    prompt = [1, 9690, 253, 5, 17, 23, 8]
    own = {m: hc.run(hc.generate(s.grpc_url, prompt, hc.greedy(12))) for m, s in servers.items()}
    assert own[1].outcome == own[2].outcome == "finished"
    assert own[1].tokens == own[2].tokens and own[2].tokens
    channel = {m: asyncio.run(_channel_tokens(s.grpc_url, prompt, 12)) for m, s in servers.items()}
    assert channel[1] == channel[2] == own[1].tokens
    assets = hc.run(hc.assets(servers[2].grpc_url))
    assert assets.served_id == hc.run(hc.assets(servers[1].grpc_url)).served_id
    assert "PyCapsule" not in servers[2].log() and "Traceback" not in servers[2].log()
