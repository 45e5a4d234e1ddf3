"""Several gateway worker processes, one admission budget and one /metrics: the shared permit
file across real processes, and `helios-gateway --workers 2` on a real tritonserver with the
openai SDK."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.metrics import MULTIPROCESS_DIR
from gateway.shared_permits import SharedPermits
from helios_backend.triton.supervision import child_pids, process_alive
from tests.engine_fixtures import smollm2_core  # noqa: F401  (session fixture: the test core)
from tests.gateway_harness import SERVED_ID, Stack, gateway_stack, wait_until
from tests.triton_server import metric_value

STORY = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


def _take(path: str, count: int, limit: int, results: "multiprocessing.Queue[int]", hold: "multiprocessing.Event") -> None:
    permits = SharedPermits(Path(path))
    results.put(sum(permits.try_take(limit) for _ in range(count)))
    hold.wait(30)                        # keep the permits until the parent has counted


# spec: HTTP-1
def test_processes_share_one_budget_and_a_dead_process_frees_its_permits(tmp_path: Path) -> None:
    path = tmp_path / "permits"
    parent = SharedPermits.create(path)
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[int] = context.Queue()
    hold = context.Event()
    workers = [context.Process(target=_take, args=(str(path), 4, 5, results, hold)) for _ in range(2)]
    for w in workers:
        w.start()
    taken = sorted(results.get(timeout=30) for _ in workers)
    assert sum(taken) == 5 and parent.held() == 5        # 8 asked, the budget of 5 holds across both
    assert not parent.try_take(5)
    hold.set()
    for w in workers:
        w.join(30)
    assert parent.held() == 0                            # the exited processes' slots are reclaimed
    assert parent.try_take(5)
    parent.give_back()
    assert parent.held() == 0
    parent.close()


@pytest.fixture(scope="module")
def stack(smollm2_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: F811
    workdir = tmp_path_factory.mktemp("gateway-workers")
    with gateway_stack(smollm2_core, workdir, "--workers", "2", "--queue-capacity", "0", "--max-active", "2") as s:
        per_start = _metric_files(s.gateway.process.pid).parent     # the metric files and the permit file
        yield s
    assert not per_start.exists()                # the stopped gateway left nothing in /dev/shm


@pytest.mark.triton
@pytest.mark.slow
def test_two_workers_serve_chat(stack: Stack) -> None:  # spec: HTTP-1
    client = openai.OpenAI(base_url=stack.gateway.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=SERVED_ID, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens > 0
    # worker processes configure their own logging: the access log names the request
    rid = reply.id.removeprefix("chatcmpl-")
    assert wait_until(lambda: f"{rid} POST /v1/chat/completions 200" in stack.gateway.log(), 10)


@pytest.mark.triton
@pytest.mark.slow
def test_two_workers_admit_exactly_the_budget(stack: Stack) -> None:  # spec: HTTP-1, HTTP-12, HTTP-17
    # streams whose reader pauses keep their permits (HTTP-12); each new connection may land on
    # either worker, and every one beyond queue_capacity + max_active = 2 gets 429
    clients = [httpx.Client(base_url=stack.gateway.base_url, timeout=60) for _ in range(6)]
    streams, statuses = [], []
    try:
        for client in clients:
            cm = client.stream("POST", "/v1/chat/completions", json={
                "model": SERVED_ID, "messages": STORY, "max_tokens": 200, "temperature": 0, "stream": True})
            response = cm.__enter__()
            streams.append(cm)
            statuses.append(response.status_code)
        assert statuses.count(200) == 2 and statuses.count(429) == 4, statuses
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
        for client in clients:
            client.close()


GATEWAY_COUNTERS = ("helios_gateway_requests_total", "helios_gateway_output_tokens_total",
                    "helios_gateway_prompt_tokens_total", "helios_gateway_time_to_first_token_seconds_count",
                    "helios_gateway_request_generation_tokens_count")


def _metric_files(gateway_pid: int) -> Path:
    """The per-start directory of the workers' metric files (in their environment)."""
    for pid in child_pids(gateway_pid, ""):
        with contextlib.suppress(OSError):
            for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if entry.startswith(MULTIPROCESS_DIR.encode() + b"="):
                    return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError("no gateway worker has a metric-file directory")


def _by_process(files: Path, pattern: str, family: str, sample: str) -> dict[int, float]:
    """Each worker process's own value of one sample, read from its file alone."""
    values = {}
    for file in files.glob(pattern):
        merged = MultiProcessCollector.merge([str(file)], accumulate=True)
        values[int(file.stem.rsplit("_", 1)[1])] = sum(
            s.value for m in merged if m.name == family for s in m.samples if s.name == sample)
    return values


def _ttft_counts_by_process(files: Path) -> dict[int, float]:
    return _by_process(files, "histogram_*.db", "helios_gateway_time_to_first_token_seconds",
                       "helios_gateway_time_to_first_token_seconds_count")


def _scrape(base_url: str) -> dict[str, float]:
    # a new connection each time: a scrape may land on either worker
    with httpx.Client(base_url=base_url, timeout=30) as client:
        text = client.get("/metrics").text
    return {name: metric_value(text, name) for name in GATEWAY_COUNTERS} | {
        "chat_200": metric_value(text, "helios_gateway_requests_total", endpoint="chat", status="200")}


def _ask(stack: Stack) -> int:
    """One short chat request on a new connection; its completion tokens."""
    with openai.OpenAI(base_url=stack.gateway.base_url + "/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(model=SERVED_ID, max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "Count to ten."}])
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    return reply.usage.completion_tokens


def _assert_never_decreases(scrapes: list[dict[str, float]]) -> None:
    for earlier, later in zip(scrapes, scrapes[1:]):
        assert all(later[k] >= earlier[k] for k in earlier), (earlier, later)


@pytest.mark.triton
@pytest.mark.slow
def test_any_worker_answers_metrics_for_the_whole_gateway(stack: Stack) -> None:  # spec: MET-1, MET-2
    files = _metric_files(stack.gateway.process.pid)
    served_before = _ttft_counts_by_process(files)
    scrapes = [_scrape(stack.gateway.base_url)]
    sent, completion_tokens = 0, 0
    # requests on fresh connections until both workers have served some (the kernel hands each
    # accepted connection to either process); a bound, not a time
    while sent < 12 or len({pid for pid, n in _ttft_counts_by_process(files).items()
                            if n > served_before.get(pid, 0)}) < 2:
        assert sent < 200, f"every request reached one worker: {_ttft_counts_by_process(files)}"
        completion_tokens += _ask(stack)
        sent += 1
        scrapes.append(_scrape(stack.gateway.base_url))
    _assert_never_decreases(scrapes)
    first, last = scrapes[0], scrapes[-1]
    # one scrape, whichever worker answers it, counts every request of every worker
    assert last["chat_200"] - first["chat_200"] == sent
    assert last["helios_gateway_time_to_first_token_seconds_count"] - \
        first["helios_gateway_time_to_first_token_seconds_count"] == sent
    assert last["helios_gateway_request_generation_tokens_count"] - \
        first["helios_gateway_request_generation_tokens_count"] == sent
    assert last["helios_gateway_output_tokens_total"] - first["helios_gateway_output_tokens_total"] == \
        completion_tokens
    # nothing is open: the live-worker sum of open streams is back to zero
    with httpx.Client(base_url=stack.gateway.base_url, timeout=30) as client:
        assert metric_value(client.get("/metrics").text, "helios_gateway_backend_streams_open") == 0


@pytest.mark.triton
@pytest.mark.slow
def test_a_dead_workers_counts_stay(stack: Stack) -> None:  # spec: MET-1
    # last in this module: it kills a worker (uvicorn starts another in its place)
    # the worker streaming a long answer dies with its stream open: its counts stay, its open
    # stream leaves the live sum
    files = _metric_files(stack.gateway.process.pid)
    with httpx.Client(base_url=stack.gateway.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": SERVED_ID, "messages": STORY, "max_tokens": 400, "temperature": 0, "stream": True}) as response:
            lines = response.iter_lines()
            # generating (a bound: 400 tokens): text has arrived
            assert any('"content":"' in line and '"content":""' not in line for line in lines)
            streaming = {pid: n for pid, n in _by_process(
                files, "gauge_livesum_*.db", "helios_gateway_backend_streams_open",
                "helios_gateway_backend_streams_open").items() if n > 0}
            assert len(streaming) == 1, streaming
            before = _scrape(stack.gateway.base_url)
            [victim] = streaming
            os.kill(victim, signal.SIGKILL)
            assert wait_until(lambda: not process_alive(victim), 30)
            with pytest.raises(httpx.RemoteProtocolError):                 # the stream dies with its worker
                for _ in lines:
                    pass
    after = [_scrape(stack.gateway.base_url) for _ in range(6)]
    _assert_never_decreases([before, *after])
    assert after[-1]["helios_gateway_time_to_first_token_seconds_count"] == \
        before["helios_gateway_time_to_first_token_seconds_count"] > 0
    with httpx.Client(base_url=stack.gateway.base_url, timeout=30) as client:
        assert metric_value(client.get("/metrics").text, "helios_gateway_backend_streams_open") == 0
    _ask(stack)
    last = _scrape(stack.gateway.base_url)
    assert last["chat_200"] == before["chat_200"] + 1
