"""End to end: a real tritonserver, tritonclient gRPC streaming, the embedded default core
on the numpy executor. No mocks. One server per engine placement (starting one costs
seconds): the engine in its own process (the default) and in the stub (engine_process=false);
every test runs against both."""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Iterator

import pytest

from helios_proto import exchange_pb2 as ep

from helios_backend.frontend.tokenizer import FrontendTokenizer
from helios_backend.engine.metrics import FAMILY, FLUSH_S, label_sets
from tests import helios_client as hc
from tests.greedy_agreement import first_divergence
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.triton_server import TritonServer, metric_value, model_repository, wait_for_metric

pytestmark = pytest.mark.triton
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"                  # greedy continues it for a long time
TOP = 4                                                     # alternatives compared at a difference


@pytest.fixture(scope="module", params=["engine-process", "engine-in-stub"])
def server(default_core: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
           request: pytest.FixtureRequest) -> Iterator[TritonServer]:
    work = tmp_path_factory.mktemp("triton-serving")
    placement = {} if request.param == "engine-process" else {"engine_process": "false"}
    with TritonServer(model_repository(work, core_path=default_core, **placement)) as s:
        s.wait_ready()
        assert ("helios runtime ready in engine process" in s.log()) == (request.param == "engine-process")
        yield s


@pytest.fixture(scope="module")
def tokenizer(server: TritonServer) -> FrontendTokenizer:
    assets = hc.run(hc.assets(server.grpc_url))
    return FrontendTokenizer.from_json(assets.tokenizer_json.decode())


def settled_metrics(server: TritonServer) -> str:
    """Metrics once earlier updates were applied (the backend flushes them every 0.25 s)."""
    time.sleep(3 * FLUSH_S)
    return server.metrics()


def wait_metric(server: TritonServer, name: str, value: float, timeout: float = 30, **labels: str) -> float:
    """Poll until the metric reaches `value` (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    current = metric_value(server.metrics(), name, **labels)
    while current != value and time.monotonic() < deadline:
        time.sleep(0.1)
        current = metric_value(server.metrics(), name, **labels)
    return current


def test_assets_describe_the_served_model(server: TritonServer) -> None:  # spec: FE-43, FE-44, SRV-1
    assets = hc.run(hc.assets(server.grpc_url))
    assert assets.served_id == "smollm2-135m-instruct"
    assert b'"model"' in assets.tokenizer_json and "<|im_start|>" in assets.chat_template
    assert list(assets.eos_token_ids) == [2, 0]
    assert abs(assets.sampling_defaults.temperature - 0.2) < 1e-6
    assert assets.limits.context_tokens == 2048 and assets.limits.max_prompt_tokens == 2047
    assert assets.clock.origin_monotonic_ns > 0


def test_a_probe_answers_with_the_served_model_and_clock_only(server: TritonServer) -> None:  # spec: FE-43
    # the gateway's backend watch probes twice a second per process: its answer names the model
    # and the clock (a restarted backend shows a new origin) without the megabytes of tokenizer
    from gateway.triton_client import TritonBackend

    async def both() -> tuple[ep.FrontendAssets, ep.FrontendAssets]:
        backend = TritonBackend(server.grpc_url)
        try:
            return await backend.fetch_assets(10.0), await backend.fetch_assets(10.0, probe=True)
        finally:
            await backend.close()

    full, probe = asyncio.run(both())
    assert probe.served_id == full.served_id == "smollm2-135m-instruct"
    assert list(probe.aliases) == list(full.aliases) and probe.version == full.version
    assert probe.clock.origin_monotonic_ns == full.clock.origin_monotonic_ns > 0
    assert not probe.tokenizer_json and not probe.chat_template and full.tokenizer_json
    assert probe.ByteSize() < 1024 < full.ByteSize()


def test_32_concurrent_streams_match_one_at_a_time(server: TritonServer, tokenizer: FrontendTokenizer) -> None:
    # alone, each prompt's step runs the fused kernels; packed together, the product path: the
    # same tokens up to near-ties of the two paths' last bits (tests/greedy_agreement.py)
    prompts = [tokenizer.encode_untrusted(f"Once upon a time, in village number {i}, there lived") for i in range(32)]
    request = hc.greedy(6, logprobs=ep.LogprobOptions(logprobs=True, top_logprobs=TOP))
    alone = [hc.run(hc.generate(server.grpc_url, p, request, top=True)) for p in prompts]
    together = hc.run(hc.generate_many(server.grpc_url, [(p, request) for p in prompts], top=True))
    parted = 0
    for a, b in zip(alone, together):
        assert a.outcome == b.outcome == "finished"
        assert len(a.top_ids) == len(a.tokens) and len(b.top_ids) == len(b.tokens)
        divergence = first_divergence(a.tokens, b.tokens, a.top_ids, a.top_logprobs, b.top_ids, b.top_logprobs)
        if divergence is None:
            assert a.terminal.finished.reason == b.terminal.finished.reason
        parted += divergence is not None
        assert b.terminal.finished.usage.completion_tokens == len(b.tokens)
    assert parted <= 3, f"{parted} of 32 prompts parted at near-ties: more than rounding explains"
    assert sum(len(a.tokens) for a in alone) > 3 * 32           # real generations, not bare EOS
    assert len({tuple(a.tokens) for a in alone}) > 1          # distinct prompts, distinct answers
    assert wait_metric(server, "flare_requests_running", 0) == 0
    assert wait_for_metric(server, "flare_second_frame_rounds_total", lambda v: v > 0) > 0   # both frames used
    # the worker's time by phase reaches Triton's endpoint: the executor's wait, the completions
    assert wait_for_metric(server, "flare_worker_seconds_total", lambda v: v > 0, phase="collect") > 0
    assert wait_for_metric(server, "flare_worker_seconds_total", lambda v: v > 0, phase="complete") > 0


def test_shared_prefix_is_reused_and_reported(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: CACHE-9, OBS-18
    shared = tokenizer.encode_untrusted("You are a terse assistant that answers in one word. " * 4)
    assert len(shared) >= 40                                   # > two complete 16-token pages
    before = metric_value(settled_metrics(server), "flare_prefix_reused_tokens_total")
    first = hc.run(hc.generate(server.grpc_url, shared + tokenizer.encode_untrusted(" Sky color?"), hc.greedy(4)))
    again = hc.run(hc.generate(server.grpc_url, shared + tokenizer.encode_untrusted(" Sky color?"), hc.greedy(4)))
    other = hc.run(hc.generate(server.grpc_url, shared + tokenizer.encode_untrusted(" Grass?"), hc.greedy(4)))
    assert first.terminal.finished.usage.reused_prompt_tokens == 0
    reused = again.terminal.finished.usage.reused_prompt_tokens
    assert reused > 0 and reused % 16 == 0                     # whole pages only
    assert again.tokens == first.tokens                        # a hit changes nothing
    assert other.terminal.finished.usage.reused_prompt_tokens >= (len(shared) // 16) * 16 - 16
    after = wait_metric(server, "flare_prefix_reused_tokens_total",
                        before + reused + other.terminal.finished.usage.reused_prompt_tokens)
    assert after == before + reused + other.terminal.finished.usage.reused_prompt_tokens


def test_cancel_mid_stream_frees_pages(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: CACHE-23, HTTP-6
    cancelled_before = metric_value(settled_metrics(server), "flare_requests_finished_total", reason="cancelled")
    prompt = tokenizer.encode_untrusted(COUNTING)
    result = hc.run(hc.generate(server.grpc_url, prompt, hc.greedy(1500), cancel_after=3))
    assert len(result.tokens) >= 3 and result.event is None   # the client went away mid-stream
    assert wait_metric(server, "flare_requests_finished_total", cancelled_before + 1, reason="cancelled") \
        == cancelled_before + 1
    assert wait_metric(server, "flare_requests_running", 0) == 0
    assert wait_metric(server, "flare_cache_pages", 0, state="used") == 0


def test_prompt_beyond_capacity_is_rejected_while_others_continue(server: TritonServer,
                                                                  tokenizer: FrontendTokenizer) -> None:  # spec: OWN-21, HTTP-21, HTTP-22, HTTP-26
    ok_prompt = tokenizer.encode_untrusted(COUNTING)
    too_long = [42] * 2100                                     # context extent is 2048

    async def both() -> list[hc.StreamResult]:
        running = asyncio.create_task(hc.generate(server.grpc_url, ok_prompt, hc.greedy(12)))
        await asyncio.sleep(0.3)
        rejected = await hc.generate(server.grpc_url, too_long, hc.greedy(4))
        return [await running, rejected]

    ok, rejected = hc.run(both())
    assert rejected.outcome == "rejected"
    rejection = rejected.terminal.rejected
    assert rejection.reason == ep.REJECTION_REASON_PROMPT_BEYOND_CAPACITY
    assert (rejection.limit, rejection.requested) == (2047, 2100)
    assert ok.outcome == "finished" and len(ok.tokens) == 12
    assert server.model_ready()
    assert wait_for_metric(server, "flare_requests_rejected_total", lambda v: v >= 1,
                           reason="prompt_beyond_capacity") >= 1


def test_invalid_request_gets_a_typed_event(server: TritonServer) -> None:  # spec: HTTP-18, OBS-10
    request = hc.greedy(2)
    request.observation.return_token_timestamps = True          # without return_token_ids
    result = hc.run(hc.generate(server.grpc_url, [1, 2, 3], request))
    assert result.outcome == "invalid" and result.terminal.invalid.field == "observation"


def test_token_timestamps_are_aligned_and_ordered(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: OBS-11, OBS-12, OBS-15, OBS-20
    request = hc.greedy(5)
    request.observation.return_token_ids = True
    request.observation.return_token_timestamps = True
    request.ingress_ns = 5
    request.enqueue_ns = 7
    result = hc.run(hc.generate(server.grpc_url, tokenizer.encode_untrusted("Hello"), request))
    assert len(result.timestamps) == len(result.tokens) == 5
    assert result.timestamps == sorted(result.timestamps) and result.timestamps[0] > 0
    perf = result.terminal.finished.performance
    assert (perf.ingress_ns, perf.enqueue_ns) == (5, 7) and 0 < perf.admitted_ns <= result.timestamps[0]


def test_stop_token_ends_with_its_match(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: STOP-19, STOP-29, STOP-31
    prompt = tokenizer.encode_untrusted("List the days of the week:")
    free = hc.run(hc.generate(server.grpc_url, prompt, hc.greedy(10)))
    request = hc.greedy(10)
    request.stops.token_ids.append(free.tokens[4])
    stopped = hc.run(hc.generate(server.grpc_url, prompt, request))
    first = free.tokens.index(free.tokens[4])
    assert stopped.tokens == free.tokens[:first + 1]
    fin = stopped.terminal.finished
    assert fin.reason == ep.FINISH_REASON_STOP_TOKEN and fin.stop.presented_tokens == first


def test_paused_reader_loses_nothing_and_does_not_stall(server: TritonServer,
                                                        tokenizer: FrontendTokenizer) -> None:  # spec: HTTP-9, HTTP-10
    prompt = tokenizer.encode_untrusted(COUNTING)
    fast = hc.run(hc.generate(server.grpc_url, prompt, hc.greedy(16)))
    finished = metric_value(settled_metrics(server), "flare_requests_finished_total")

    async def until_generation_finished() -> None:
        # the reader stops after its first response; the request must still run to its end
        reached = await asyncio.to_thread(wait_metric, server, "flare_requests_finished_total", finished + 1, 120)
        assert reached == finished + 1

    slow = hc.run(hc.generate(server.grpc_url, prompt, hc.greedy(16), pause_after_first=until_generation_finished))
    assert slow.tokens == fast.tokens and slow.outcome == "finished"


def test_metric_labels_carry_no_request_data(server: TritonServer) -> None:  # spec: MET-3, MET-4, MET-5
    # Every flare_ sample's labels, beyond Triton's model/version and a histogram's le, must be one of
    # the bounded enumerations its family declares: a request id, prompt text or token id cannot be.
    text = server.metrics()
    sample = re.compile(r'^(flare_\w+)\{([^}]*)\}')
    seen = 0
    for line in text.splitlines():
        match = sample.match(line)
        if not match:
            continue
        name = re.sub(r"_(bucket|count|sum)$", "", match.group(1))
        family = FAMILY.get(name) or FAMILY[match.group(1)]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        assert labels.pop("model") == "helios", line
        for triton_label in ("version", "le"):
            labels.pop(triton_label, None)
        assert labels in label_sets(family), line
        seen += 1
    assert seen > 0
    for family in ("flare_graph_launches_total", "flare_cache_pages_capacity", "flare_snapshots_published_total",
                   "flare_mixed_grammar_decode_steps_total", "flare_constrained_max_inflight",
                   "flare_time_to_first_token_seconds_count", "flare_e2e_request_latency_seconds_count"):
        assert family in text, family


def test_grammar_constrains_the_output(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: FE-41, MET-8, MET-9, MET-10
    request = hc.greedy(10)
    request.grammar.kind = ep.GRAMMAR_KIND_LARK
    request.grammar.text = 'start: "yes" | "no"'
    prompt = tokenizer.encode_untrusted("Is the sky green? Reply with a short story:")
    result = hc.run(hc.generate(server.grpc_url, prompt, request))
    assert result.outcome == "finished", result.terminal
    assert result.terminal.finished.reason == ep.FINISH_REASON_EOS
    assert tokenizer.decode(result.tokens[:-1]) in ("yes", "no") and result.tokens[-1] in (0, 2)
    assert wait_metric(server, "flare_constrained_max_inflight", 1) == 1


def test_constrained_and_free_lanes_decode_together(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: MET-6, MET-11
    before = metric_value(settled_metrics(server), "flare_mixed_grammar_decode_steps_total")
    constrained = hc.greedy(12)
    constrained.grammar.kind = ep.GRAMMAR_KIND_LARK
    constrained.grammar.text = r'start: /[0-9]+(, [0-9]+)*/'
    prompt = tokenizer.encode_untrusted(COUNTING)
    results = hc.run(hc.generate_many(server.grpc_url, [(prompt, constrained), (prompt, hc.greedy(12))]))
    assert all(r.outcome == "finished" for r in results)
    tokens = results[0].tokens
    if results[0].terminal.finished.reason == ep.FINISH_REASON_EOS:
        tokens = tokens[:-1]
    # the output is a prefix of the grammar's language (LENGTH may cut it after ", ")
    assert re.fullmatch(r"[0-9]+(, [0-9]+)*(, ?)?", tokenizer.decode(tokens)), tokenizer.decode(tokens)
    assert wait_for_metric(server, "flare_mixed_grammar_decode_steps_total", lambda v: v > before) > before
    assert wait_for_metric(server, "flare_constrained_max_inflight", lambda v: v == 1) == 1


def test_bad_grammar_is_an_invalid_request(server: TritonServer) -> None:
    request = hc.greedy(4)
    request.grammar.kind = ep.GRAMMAR_KIND_LARK
    request.grammar.text = "start: ((("
    result = hc.run(hc.generate(server.grpc_url, [1, 2, 3], request))
    assert result.outcome == "invalid" and result.terminal.invalid.field == "grammar"


def test_string_stop_is_decided_by_the_backend(server: TritonServer, tokenizer: FrontendTokenizer) -> None:  # spec: STOP-11, STOP-19, STOP-21, STOP-22
    prompt = tokenizer.encode_untrusted(COUNTING)
    free = hc.run(hc.generate(server.grpc_url, prompt, hc.greedy(16)))
    text = tokenizer.decode(free.tokens)
    stop = "13,"                                              # inside the continuation " 11, 12, 13, 14,"
    assert stop in text, text
    request = hc.greedy(16)
    request.stops.strings.append(stop)
    stopped = hc.run(hc.generate(server.grpc_url, prompt, request))
    fin = stopped.terminal.finished
    assert fin.reason == ep.FINISH_REASON_STOP_STRING and fin.stop.matched_text == stop
    visible = text.encode()[:fin.stop.visible_text_bytes].decode()
    assert visible == text[:text.index(stop)]                  # the stop and its suffix removed
    assert tokenizer.decode(stopped.tokens).startswith(visible + stop)   # the crossing token is counted
    assert fin.usage.completion_tokens == len(stopped.tokens) < len(free.tokens)
    assert stopped.tokens == free.tokens[:len(stopped.tokens)]
