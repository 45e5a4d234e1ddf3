"""The exchange's channels against a real tritonserver (docs/exchange.md: channels): many
requests' output per message, per-request order, cancellation by tag, a paused reader."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.triton_client import ChannelGeneration, ChannelMux, Outbox, StreamFailure, StreamTerminal, TokenBatch, TritonBackend
from helios_proto import exchange_pb2 as ep
from tests import helios_client as hc
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.gateway_harness import wait_until
from tests.triton_server import TritonServer, metric_value, model_repository

pytestmark = [pytest.mark.triton, pytest.mark.slow]
PROMPTS = [[1, 9690, 253, 5, 17, 23, 8 + i] for i in range(6)]


@pytest.fixture(scope="module")
def server(default_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:  # noqa: F811
    work = tmp_path_factory.mktemp("channel")
    with TritonServer(model_repository(work, core_path=str(default_core)), work) as running:
        running.wait_ready("helios")
        yield running


async def _collect(generation, pause_s: float = 0.0) -> tuple[list[int], ep.TerminalEvent | None]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for event in generation.events():
        if isinstance(event, TokenBatch):
            tokens += event.token_ids.tolist()
            if pause_s:
                await asyncio.sleep(pause_s)      # a reader that falls behind, then catches up
                pause_s = 0.0
        elif isinstance(event, StreamTerminal):
            return tokens, event.event
        else:
            assert not isinstance(event, StreamFailure), event
    return tokens, None


def _metric(server: TritonServer, name: str, **labels: str) -> float:
    return metric_value(server.metrics(), name, **labels)


def test_many_requests_per_message_in_order(server: TritonServer) -> None:  # spec: HTTP-9, HTTP-10
    # the same greedy requests on their own streams are the reference for each one's order
    reference = [hc.run(hc.generate(server.grpc_url, p, hc.greedy(16))).tokens for p in PROMPTS]
    responses0 = _metric(server, "flare_channel_responses_total")
    outputs0 = _metric(server, "flare_channel_outputs_total")
    completed0 = _metric(server, "nv_inference_request_success", model="helios")

    async def scenario() -> list[tuple[list[int], ep.TerminalEvent | None]]:
        backend = TritonBackend(server.grpc_url)
        try:
            runs = [backend.generate(p, hc.greedy(16), f"r{i}") for i, p in enumerate(PROMPTS)]
            # one reader pauses after its first tokens: its output waits for it, nobody else does
            return await asyncio.gather(*(_collect(g, pause_s=1.0 if i == 0 else 0.0) for i, g in enumerate(runs)))
        finally:
            await backend.close()

    results = asyncio.run(scenario())
    for (tokens, terminal), expected in zip(results, reference):
        assert terminal is not None and terminal.HasField("finished")
        assert tokens == expected
        assert terminal.finished.usage.completion_tokens == len(expected)
    responses = _metric(server, "flare_channel_responses_total") - responses0
    outputs = _metric(server, "flare_channel_outputs_total") - outputs0
    assert outputs > responses > 0                 # messages carried several requests' output
    # the six generations, submitted together, went as one GenerateBatch: Triton saw one request
    # for them (and at most the channel's own), each completed by its flag-only FINAL (sent off
    # execute(), triton/finals.py)
    assert wait_until(lambda: _metric(server, "nv_inference_request_success", model="helios") - completed0 >= 1)
    assert _metric(server, "nv_inference_request_success", model="helios") - completed0 < len(PROMPTS)


def test_cancel_by_tag_ends_only_that_request(server: TritonServer) -> None:  # spec: HTTP-6, HTTP-11, HTTP-21
    cancelled0 = _metric(server, "flare_requests_finished_total", reason="cancelled")

    async def scenario() -> tuple[list[int], ep.TerminalEvent | None]:
        backend = TritonBackend(server.grpc_url)
        try:
            doomed = backend.generate(PROMPTS[0], hc.greedy(400), "doomed")
            kept = backend.generate(PROMPTS[1], hc.greedy(24), "kept")
            kept_task = asyncio.create_task(_collect(kept))
            async for event in doomed.events():
                assert isinstance(event, TokenBatch), event
                doomed.cancel()                      # the client went away after its first tokens
                break
            return await kept_task
        finally:
            await backend.close()

    tokens, terminal = asyncio.run(scenario())
    assert terminal is not None and terminal.HasField("finished") and tokens
    assert tokens == hc.run(hc.generate(server.grpc_url, PROMPTS[1], hc.greedy(24))).tokens
    # the backend retires the cancelled lane after its fence and frees its slot
    assert wait_until(lambda: _metric(server, "flare_requests_finished_total", reason="cancelled") == cancelled0 + 1
                      and _metric(server, "flare_requests_running") == 0)


def test_ids_only_and_logprob_outputs_share_the_channel(server: TritonServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # spec: HTTP-9
    # ids-only output travels in the batch's packed arrays, output with logprobs as messages;
    # both kinds on one channel keep each request's tokens and order
    reference = [hc.run(hc.generate(server.grpc_url, p, hc.greedy(16))).tokens for p in PROMPTS]
    packed: list[int] = []
    dispatch = ChannelMux._dispatch_plain

    def counted(mux: ChannelMux, batch: ep.ChannelBatch) -> None:
        packed.append(len(batch.plain_tags))
        dispatch(mux, batch)

    monkeypatch.setattr(ChannelMux, "_dispatch_plain", counted)

    async def scenario() -> list[tuple[list[int], list[float], ep.TerminalEvent | None]]:
        backend = TritonBackend(server.grpc_url)

        async def one(i: int, prompt: list[int]) -> tuple[list[int], list[float], ep.TerminalEvent | None]:
            rich = i % 2 == 1
            request = hc.greedy(16, logprobs=ep.LogprobOptions(logprobs=True)) if rich else hc.greedy(16)
            tokens: list[int] = []
            logprobs: list[float] = []
            async for event in backend.generate(prompt, request, f"m{i}").events():
                if isinstance(event, TokenBatch):
                    tokens += event.token_ids.tolist()
                    assert (event.logprobs is not None) == rich
                    if event.logprobs is not None:
                        logprobs += event.logprobs.tolist()
                elif isinstance(event, StreamTerminal):
                    return tokens, logprobs, event.event
                else:
                    raise AssertionError(event)
            return tokens, logprobs, None
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await backend.close()

    for i, ((tokens, logprobs, terminal), expected) in enumerate(zip(asyncio.run(scenario()), reference)):
        assert terminal is not None and terminal.HasField("finished")
        assert tokens == expected
        assert len(logprobs) == (len(expected) if i % 2 else 0)
        assert all(lp <= 0.0 for lp in logprobs)
    assert packed and max(packed) >= 2             # several ids-only requests in one batch's arrays


def test_a_batch_whose_prompt_lengths_do_not_fit_fails_only_its_requests(
        server: TritonServer, monkeypatch: pytest.MonkeyPatch) -> None:  # spec: HTTP-18, HTTP-21
    build = Outbox._batch

    def skewed(outbox: Outbox, generations: list[ChannelGeneration]):  # type: ignore[no-untyped-def]
        message = build(outbox, generations)
        params = ep.RequestParameters.FromString(message.raw_input_contents[0])
        if generations[0]._request_id.startswith("bad"):
            params.generate_batch.prompt_lengths[-1] += 1   # the lengths no longer add up to the tensor
            payload = params.SerializeToString()
            message.raw_input_contents[0] = payload
            del message.inputs[0].shape[:]
            message.inputs[0].shape.append(len(payload))
        return message

    monkeypatch.setattr(Outbox, "_batch", skewed)

    async def scenario() -> tuple[list, list, tuple]:  # type: ignore[type-arg]
        backend = TritonBackend(server.grpc_url)
        try:
            running = backend.generate(PROMPTS[0], hc.greedy(48), "running").events()
            first = await running.__anext__()        # its batch went alone and it is decoding
            assert isinstance(first, TokenBatch)
            bad = await asyncio.gather(*(_collect(backend.generate(p, hc.greedy(8), f"bad{i}"))
                                         for i, p in enumerate(PROMPTS[1:3])))
            rest = [event async for event in running]
            after = await _collect(backend.generate(PROMPTS[3], hc.greedy(8), "after"))
            return bad, [first, *rest], after
        finally:
            await backend.close()

    bad, running, after = asyncio.run(scenario())
    for tokens, terminal in bad:
        assert not tokens and terminal is not None and terminal.HasField("invalid")
        assert terminal.invalid.field == "generate_batch.prompt_lengths"
    # the request decoding beside them and the one after them are whole
    tokens = [t for e in running if isinstance(e, TokenBatch) for t in e.token_ids.tolist()]
    assert isinstance(running[-1], StreamTerminal) and running[-1].event.HasField("finished")
    assert tokens == hc.run(hc.generate(server.grpc_url, PROMPTS[0], hc.greedy(48))).tokens
    assert after[1] is not None and after[1].HasField("finished")
    assert after[0] == hc.run(hc.generate(server.grpc_url, PROMPTS[3], hc.greedy(8))).tokens


def test_a_wave_of_generations_travels_in_batches_in_order(server: TritonServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # spec: HTTP-9
    # more generations than one batch holds, submitted at once, with cancels between them:
    # each batch keeps its requests' order, a cancel ends exactly its own request
    from gateway import triton_client

    reference = {tuple(p): hc.run(hc.generate(server.grpc_url, p, hc.greedy(4))).tokens for p in PROMPTS}
    completed0 = _metric(server, "nv_inference_request_success", model="helios")
    monkeypatch.setattr(triton_client, "BATCH_LIMIT", 8)   # a wave within the backend's queue
    count = 20
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]

    async def scenario() -> list[tuple[list[int], ep.TerminalEvent | None]]:
        backend = TritonBackend(server.grpc_url)
        try:
            generations = [backend.generate(p, hc.greedy(4), f"w{i}") for i, p in enumerate(prompts)]
            tasks = [asyncio.create_task(_collect(g)) for g in generations]
            await asyncio.sleep(0)                   # every generation is submitted: all are queued
            generations[5].cancel()                  # a cancel behind its batch, before it runs
            tasks[5].cancel()                        # its reader went away (it gets no more events)
            return await asyncio.gather(*tasks[:5], *tasks[6:])
        finally:
            await backend.close()

    results = asyncio.run(scenario())
    for (tokens, terminal), prompt in zip(results, prompts[:5] + prompts[6:]):
        assert terminal is not None and terminal.HasField("finished"), terminal
        assert tokens == reference[tuple(prompt)]
    # 20 generations, 8 a batch at most: three batch requests (plus the cancel and the channel)
    assert wait_until(lambda: _metric(server, "nv_inference_request_success", model="helios") - completed0 >= 3)
    assert _metric(server, "nv_inference_request_success", model="helios") - completed0 <= 5


def test_a_lone_generate_request_on_a_channel_is_a_batch_of_one(
        server: TritonServer, monkeypatch: pytest.MonkeyPatch) -> None:  # spec: HTTP-18
    # a direct client may send one GenerateRequest naming the channel instead of a batch:
    # the same tokens come back, and one without a prompt gets InvalidRequest naming it
    from gateway import triton_client

    def lone(outbox: Outbox, generations: list[ChannelGeneration]):  # type: ignore[no-untyped-def]
        (generation,) = generations                  # the scenario submits one at a time
        request = ep.GenerateRequest()
        request.CopyFrom(generation._request)
        request.channel, request.tag = outbox._channel_id, generation.tag
        params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1, generate=request)
        prompt = None if generation._request_id == "no-prompt" else generation._prompt
        return triton_client._infer_request(outbox._model_name, f"lone-{generation.tag}", params, prompt)

    monkeypatch.setattr(Outbox, "_batch", lone)

    async def scenario() -> tuple[tuple, tuple]:  # type: ignore[type-arg]
        backend = TritonBackend(server.grpc_url)
        try:
            whole = await _collect(backend.generate(PROMPTS[2], hc.greedy(8), "whole"))
            missing = await _collect(backend.generate(PROMPTS[3], hc.greedy(8), "no-prompt"))
            return whole, missing
        finally:
            await backend.close()

    (tokens, terminal), (none, invalid) = asyncio.run(scenario())
    assert terminal is not None and terminal.HasField("finished")
    assert tokens == hc.run(hc.generate(server.grpc_url, PROMPTS[2], hc.greedy(8))).tokens
    assert not none and invalid is not None and invalid.invalid.field == "prompt_token_ids"


def test_one_batch_is_in_flight_and_arrivals_wait_to_leave_together() -> None:  # spec: HTTP-9
    # no server: the outbox alone. After a GenerateBatch leaves, the generations that arrive
    # leave as one batch when Triton acknowledges it (its empty FINAL), not one request each
    from gateway import triton_client

    async def scenario() -> tuple[list[list[int]], triton_client.Outbox]:
        outbox = Outbox("helios", "chan")
        sent: list[list[int]] = []
        received = asyncio.Event()

        async def consume() -> None:
            async for request in outbox.messages():
                params = ep.RequestParameters.FromString(request.raw_input_contents[0])
                assert request.parameters[triton_client.ACK_PARAMETER].bool_param
                sent.append([g.tag for g in params.generate_batch.requests])
                received.set()

        task = asyncio.create_task(consume())
        tags = iter(range(1, 100))

        def put() -> None:
            generation = ChannelGeneration(None, [1, 2], hc.greedy(4), "g")  # type: ignore[arg-type]
            generation.tag = next(tags)
            outbox.put(generation)

        put()
        await received.wait()                         # the first leaves at once (nothing in flight)
        received.clear()
        for _ in range(5):
            put()
        await asyncio.sleep(0.01)
        assert sent == [[1]]                          # held: batch-1-1 is not acknowledged
        outbox.acknowledge("batch-9-9")               # another id changes nothing
        await asyncio.sleep(0.01)
        assert sent == [[1]]
        outbox.acknowledge("batch-1-1")
        await received.wait()
        assert sent == [[1], [2, 3, 4, 5, 6]]         # the five arrivals left as one batch
        outbox.put(None)
        await task
        return sent, outbox

    sent, outbox = asyncio.run(scenario())
    assert outbox.acknowledged == 1 and outbox.waits_timed_out == 0


def test_a_triton_that_sends_no_acknowledgement_costs_one_wait(monkeypatch: pytest.MonkeyPatch) -> None:  # spec: HTTP-9
    from gateway import triton_client

    monkeypatch.setattr(triton_client, "ACK_WAIT_S", 0.02)

    async def scenario() -> tuple[list[float], triton_client.Outbox]:
        outbox = Outbox("helios", "chan")
        times: list[float] = []

        async def consume() -> None:
            async for _request in outbox.messages():
                times.append(asyncio.get_running_loop().time())

        task = asyncio.create_task(consume())
        start = asyncio.get_running_loop().time()
        for tag in range(1, 4):
            generation = ChannelGeneration(None, [1], hc.greedy(4), "g")  # type: ignore[arg-type]
            generation.tag = tag
            outbox.put(generation)
            await asyncio.sleep(0.03)                 # each arrives after the one before left
        outbox.put(None)
        await task
        return [t - start for t in times], outbox

    times, outbox = asyncio.run(scenario())
    assert len(times) == 3
    # the second waited for an acknowledgement that never came; after that none is awaited
    assert outbox.waits_timed_out == 1 and outbox.acknowledged == 0


def test_triton_acknowledges_each_batch_on_the_channel(server: TritonServer) -> None:  # spec: HTTP-9
    # the real tritonserver forwards each GenerateBatch's flag-only FINAL as an empty response
    # (triton_enable_empty_final_response): every batch is acknowledged, no wait times out
    async def scenario() -> tuple[list[tuple[list[int], ep.TerminalEvent | None]], int, int]:
        backend = TritonBackend(server.grpc_url)
        try:
            first = await _collect(backend.generate(PROMPTS[0], hc.greedy(4), "first"))
            wave = await asyncio.gather(*(_collect(backend.generate(p, hc.greedy(4), f"w{i}"))
                                          for i, p in enumerate(PROMPTS)))
            outbox = backend._mux._outbox
            assert outbox is not None
            for _ in range(200):                      # the acknowledgements come on this loop
                if outbox.acknowledged >= 2:
                    break
                await asyncio.sleep(0.05)
            return [first, *wave], outbox.acknowledged, outbox.waits_timed_out
        finally:
            await backend.close()

    results, acknowledged, timed_out = asyncio.run(scenario())
    for tokens, terminal in results:
        assert terminal is not None and terminal.HasField("finished") and len(tokens) == 4
    assert acknowledged >= 2 and timed_out == 0
