"""End to end, each with its own tritonserver: preemption under a small cache, startup
failures that leave the model not ready, and a clean drain when the server stops."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from helios_backend.frontend.tokenizer import FrontendTokenizer
from tests import helios_client as hc
from tests.core_helpers import tampered_copy
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.triton_server import TritonServer, metric_value, model_repository, wait_for_metric

pytestmark = pytest.mark.triton


def counting(tokenizer: FrontendTokenizer, start: int) -> list[int]:
    return tokenizer.encode_untrusted(", ".join(str(start + i) for i in range(8)) + ",")


def tokenizer_of(server: TritonServer) -> FrontendTokenizer:
    return FrontendTokenizer.from_json(hc.run(hc.assets(server.grpc_url)).tokenizer_json.decode())


def test_small_cache_preempts_and_every_request_completes(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: HTTP-20, CACHE-24, CACHE-9
    # 10 pages of 16 tokens; each request needs 5 alone (~30 prompt + 40 output), four need 20
    with TritonServer(model_repository(tmp_path, core_path=default_core, page_capacity=10)) as server:
        server.wait_ready()
        tok = tokenizer_of(server)
        prompts = [counting(tok, start) for start in (1, 20, 300, 4000)]
        alone = [hc.run(hc.generate(server.grpc_url, p, hc.greedy(40))) for p in prompts]
        together = hc.run(hc.generate_many(server.grpc_url, [(p, hc.greedy(40)) for p in prompts]))
        assert wait_for_metric(server, "flare_preemptions_total", lambda v: v > 0) > 0
    for a, b in zip(alone, together):
        assert a.outcome == b.outcome == "finished"
        assert len(a.tokens) == 40 and b.tokens == a.tokens


def test_wrong_acceptance_namespace_leaves_the_model_not_ready(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: FMT-21, OWN-20
    with TritonServer(model_repository(tmp_path, core_path=default_core, acceptance="helios.local/other")) as server:
        server.wait_live()
        server.wait_load_attempt()
        assert not server.model_ready()
        log = server.log()
    assert "helios startup failed: Bootstrap.load failed: AuthorizationError" in log
    assert "helios.local/other" in log or "namespace" in log


def test_tampered_core_leaves_the_model_not_ready(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: FMT-12, FMT-22
    tampered = tampered_copy(default_core, tmp_path / "tampered.core")
    with TritonServer(model_repository(tmp_path, core_path=tampered)) as server:
        server.wait_live()
        server.wait_load_attempt()
        assert not server.model_ready()
        log = server.log()
    assert "helios startup failed: Bootstrap.load failed:" in log
    assert "IntegrityError" in log or "FrameError" in log or "SignatureError" in log


def test_unknown_startup_option_value_fails_startup(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: SRV-7
    # more rows than any shipped core captures (load may only reduce the captured rows)
    with TritonServer(model_repository(tmp_path, core_path=default_core, concurrency=4096)) as server:
        server.wait_live()
        server.wait_load_attempt()
        assert not server.model_ready()
        log = server.log()
    assert re.search(r"helios startup failed: engine setup: startup option concurrency: 4096 outside 1\.\.\d+ captured", log)


def test_stopping_the_server_mid_stream_drains_cleanly(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: OWN-16, HTTP-15
    server = TritonServer(model_repository(tmp_path, core_path=default_core)).start()
    try:
        server.wait_ready()
        tok = tokenizer_of(server)
        prompts = [counting(tok, start) for start in (5, 50, 500)]

        async def run() -> list[hc.StreamResult]:
            signalled = asyncio.Event()

            async def signal_once() -> None:
                if not signalled.is_set():
                    signalled.set()
                    server.signal()          # SIGINT while every stream is mid-generation

            async with hc.grpcclient.InferenceServerClient(server.grpc_url) as client:
                return list(await asyncio.gather(*(
                    hc.stream(client, hc.generate_arrays(p, hc.greedy(30)), pause_after_first=signal_once,
                              request_id=f"d{i}") for i, p in enumerate(prompts))))

        results = hc.run(run())
        rc = server.stop()
    finally:
        server.stop()
    for r in results:
        assert r.outcome == "finished" and len(r.tokens) == 30, r.error
    assert rc == 0
    assert "successfully unloaded 'helios'" in server.log()


def test_snapshot_restores_a_partial_page_at_the_exact_endpoint(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: CACHE-19, CACHE-21, CACHE-22, OBS-18
    with TritonServer(model_repository(tmp_path / "a", core_path=default_core)) as server:
        server.wait_ready()
        tok = tokenizer_of(server)
        turn1 = tok.encode_untrusted("You are a helpful assistant. The user asks about the weather in Paris "
                                     "today and later this week and")
        assert len(turn1) % 16, "the first turn must end inside a page"
        turn2 = turn1 + tok.encode_untrusted(" tomorrow, please answer")
        first = hc.run(hc.generate(server.grpc_url, turn1, hc.greedy(4)))
        restored = hc.run(hc.generate(server.grpc_url, turn2, hc.greedy(6)))
        assert wait_for_metric(server, "flare_snapshots_restored_total", lambda v: v >= 1) == 1
        metrics = server.metrics()
    with TritonServer(model_repository(tmp_path / "b", core_path=default_core, snapshot_capacity=0)) as cold_server:
        cold_server.wait_ready()
        cold = hc.run(hc.generate(cold_server.grpc_url, turn2, hc.greedy(6)))
    assert first.outcome == "finished"
    assert restored.terminal.finished.usage.reused_prompt_tokens == len(turn1)   # the exact endpoint
    assert metric_value(metrics, "flare_snapshots_restored_total") == 1
    assert metric_value(metrics, "flare_graph_launches_total", operation="restoration") == 1
    assert restored.tokens == cold.tokens
