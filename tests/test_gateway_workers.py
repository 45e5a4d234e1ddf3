"""Several gateway worker processes, one admission budget: the shared permit file across real
processes, and `helios-gateway --workers 2` on a real tritonserver with the openai SDK."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.shared_permits import SharedPermits
from tests.engine_fixtures import smollm2_core  # noqa: F401  (session fixture: the test core)
from tests.gateway_harness import SERVED_ID, Stack, gateway_stack, wait_until

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
        yield s


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
