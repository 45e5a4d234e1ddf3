"""Spec rules of observation, response event queues, shutdown ownership and metrics: the real
EngineLoop, ResponseHub and Scheduler over the simulated executor, the real numpy executor through
ProgramRunner, the real Engine on the test core, and the gateway's presenters."""
from __future__ import annotations

import ast
import json
import pathlib
import threading
import time

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Emitted, Terminal
from helios_backend.engine.responses import ResponseHub, Stream
from helios_backend.exchange import OUT_EVENT, OUT_LOGPROBS, OUT_TIMESTAMPS, OUT_TOKENS, decode_event
from helios_backend.engine.loop import EngineLoop, SynchronousRunner
from tests.scheduler_sim import reference_tokens
from tests.test_rules_scheduler import VOCAB, make, prompt_of, spec

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Recorder:
    """A response sender that can be held (a paused reader / slow socket)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.sends: list[tuple[int, dict[str, np.ndarray], bool]] = []   # (monotonic ns at send, arrays, final)
        self.done = threading.Event()

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        if self.gate is not None:
            self.gate.wait(20)
        self.sends.append((time.monotonic_ns(), arrays, final))
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False

    def joined(self, name: str) -> list:
        return [v for _, arrays, _ in self.sends if name in arrays for v in arrays[name].tolist()]

    @property
    def finals(self) -> list[ep.ResponseEvent]:
        return [decode_event(a[OUT_EVENT]) for _, a, final in self.sends if final]


class Updates:
    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.lock = threading.Lock()

    def push(self, updates: list) -> None:
        with self.lock:
            self.items.extend(updates)


# ---- OBS-14: host timestamps, neither kernel completion nor delivery ------------------------

class TimedRunner:
    """The simulated executor; records when each round's results were ready ("kernel
    completion"), then holds the round a little before returning it to the worker."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine
        self.ready_ns: list[int] = []

    def run(self, plan):  # type: ignore[no-untyped-def]
        rows = self.engine.run(plan)
        self.ready_ns.append(time.monotonic_ns())
        time.sleep(0.004)
        return rows


def test_token_timestamps_mark_neither_kernel_completion_nor_delivery():
    # spec: OBS-14
    sched, engine = make()                       # clock origin 0: timestamps read as monotonic ns
    runner = TimedRunner(engine)
    gate = threading.Event()
    sender = Recorder(gate)
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Updates())
    worker = EngineLoop(sched, SynchronousRunner(runner.run), hub, Updates(), two_frames=False)
    hub.start()
    worker.start()
    hub.register(Stream(1, sender, timestamps=True))
    worker.enqueue(1, spec(prompt_of(2, 6), max_tokens=5, observe_timestamps=True))
    try:
        deadline = time.monotonic() + 10
        while sched.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)                         # the reader is still paused
        released = time.monotonic_ns()
        gate.set()
        assert sender.done.wait(10)
    finally:
        worker.stop()
        hub.stop()
    stamps = sender.joined(OUT_TIMESTAMPS)
    assert sender.joined(OUT_TOKENS) == reference_tokens(prompt_of(2, 6), 5, VOCAB)
    assert len(stamps) == 5 and len(runner.ready_ns) == 5
    for stamp, ready in zip(stamps, runner.ready_ns):
        assert stamp >= ready + 4_000_000        # taken at completion handling, after the hold
    assert stamps == sorted(stamps) and len(set(stamps)) == 5
    assert max(stamps) < released                # delivery happened later, to a paused reader
    assert all(at >= released for at, _, _ in sender.sends[1:])


# ---- HTTP-7, HTTP-8, HTTP-14: per-response event queues -----------------------------------

def test_event_queue_holds_the_whole_budget_and_grows_as_events_arrive():
    # spec: HTTP-7, HTTP-8, HTTP-14
    from helios_backend.engine.settings import StartupOptions, resolve

    settings = resolve(StartupOptions(pathlib.Path("/x.core"), event_capacity=16),
                       C.ServingContract(concurrency=4))
    assert settings.event_capacity == 16
    budget = 10 * settings.event_capacity        # far beyond event_capacity: a minimum, not a cap
    gate = threading.Event()
    sender = Recorder(gate)
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Updates())
    hub.start()
    stream = Stream(5, sender, timestamps=True, logprobs=True)
    hub.register(stream)
    assert stream.pending.tokens == [] and stream.pending.timestamps == []   # nothing allocated up front
    hub.deliver([Emitted(5, 0, 1000, -0.5, None, None)])
    deadline = time.monotonic() + 5
    while stream.pending.tokens and time.monotonic() < deadline:   # the response thread took token 0
        time.sleep(0.005)
    sizes = []
    for t in range(1, budget):
        hub.deliver([Emitted(5, t, 1000 + t, -0.5, None, None)])
        sizes.append(len(stream.pending.tokens))
    assert sizes == list(range(1, budget))       # one entry per event that arrived, no more
    hub.deliver([Terminal(5, ep.TerminalEvent(finished=ep.Finished(
        reason=ep.FINISH_REASON_LENGTH, usage=ep.Usage(completion_tokens=budget))))])
    gate.set()
    assert sender.done.wait(10)
    hub.stop()
    assert sender.joined(OUT_TOKENS) == list(range(budget))
    assert sender.joined(OUT_TIMESTAMPS) == [1000 + t for t in range(budget)]       # observations
    assert len(sender.joined(OUT_LOGPROBS)) == budget
    assert len(sender.finals) == 1 and sender.finals[0].terminal.finished.usage.completion_tokens == budget


# ---- OBS-30: one observation event per generated token on top of presentation ------------

@pytest.fixture(scope="module")
def served():
    from gateway.served_model import ServedModel
    from ignition.sources.gguf import GGUFModel, default_gguf_path
    from ignition.sources.tokenizer import tokenizer_json_from_gguf

    gguf = GGUFModel.open(default_gguf_path())
    assets = ep.FrontendAssets(
        version=ep.TRANSPORT_VERSION_1, served_id="test-model", tokenizer_json=tokenizer_json_from_gguf(gguf).encode(),
        chat_template=gguf.chat_template, eos_token_ids=[2], top_logprobs_capacity=0,
        limits=ep.ServingLimits(context_tokens=2048, queue_capacity=4, max_active=2, frontend_workers=1,
                                sampled_vocabulary=49152))
    return ServedModel.from_assets(assets)


def _sse_chunks(served, ids: list[int], **fields) -> list[dict]:  # type: ignore[no-untyped-def]
    from gateway.generation import ChoiceTranslator
    from gateway.output_pipeline import OutputPipeline, PlainTextParser
    from gateway.preparation import prepare_chat
    from gateway.presentation import ChatPresenter
    from gateway.schemas import ChatCompletionRequest
    from gateway.triton_client import TokenBatch

    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    prepared = prepare_chat(ChatCompletionRequest.model_validate(body), served, ingress_ns=10)
    presenter = ChatPresenter(prepared, served.served_id, served.tokenizer)
    pipeline = OutputPipeline(served.tokenizer, prepared.stop_matcher(), PlainTextParser(), served.eos_token_ids)
    translator = ChoiceTranslator(0, pipeline, "messages", prepared.ingress_ns, 20)
    out = b"".join(presenter.opening())
    for i, token in enumerate(ids):          # one backend batch per token: the finest event stream
        batch = TokenBatch(np.asarray([token], np.int32), np.asarray([100 + i], np.int64), None, None, None)
        out += b"".join(presenter.stream(translator.tokens(batch)))
    finished = ep.TerminalEvent(finished=ep.Finished(reason=ep.FINISH_REASON_EOS, usage=ep.Usage(
        prompt_tokens=9, completion_tokens=len(ids))))
    out += b"".join(presenter.stream(translator.terminal(finished)))
    frames = [f for f in out.decode().split("\n\n") if f and f != "data: [DONE]"]
    return [json.loads(f[len("data: "):]) for f in frames]


def test_observation_adds_one_event_per_generated_token(served):
    # spec: OBS-30
    ids = served.tokenizer.encode_untrusted("Paris is the capital of France.") + [2]
    plain = _sse_chunks(served, ids)
    observed = _sse_chunks(served, ids, return_token_ids=True)
    assert len(observed) == len(plain) + len(ids)
    metadata = [c for c in observed if c["choices"] and c["choices"][0].get("delta") == {}
                and c["choices"][0].get("token_ids")]
    assert [c["choices"][0]["token_ids"] for c in metadata] == [[i] for i in ids]
    presentation = [c for c in observed if c not in metadata]
    strip = lambda c: {k: v for k, v in c.items() if k not in ("prompt_token_ids",)}  # noqa: E731
    assert [strip(c)["choices"] for c in presentation] == [c["choices"] for c in plain]


# ---- OBS-31: observation changes no program, allocation or replay ABI ---------------------

class RecordingExecutor:
    def __init__(self, executor) -> None:  # type: ignore[no-untyped-def]
        self.executor = executor
        self.launches: list[tuple[str, bytes]] = []

    def launch(self, program: str, frame: int) -> None:
        self.launches.append((program, self.executor.staging(frame).tobytes()))
        self.executor.launch(program, frame)

    def wait(self, frame: int) -> np.ndarray:
        return self.executor.wait(frame)


def _serve_on_numpy(model, observe: bool) -> tuple[list[tuple[str, bytes]], list[int], int]:  # type: ignore[no-untyped-def]
    from helios_backend.packing import Packer
    from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
    from helios_backend.scheduler.variants import VariantTable
    from helios_backend.engine.runner import ProgramRunner

    contract, manifest = model.contract, model.execution_manifest
    vocab = contract.model.vocabulary
    frames = [model.executor.staging(f) for f in range(manifest.transport.frames)]
    for frame in frames:
        frame[:] = 0
    packer = Packer(model.graphs, manifest.transport, manifest.request_slots, frames)   # fresh page memory
    executor = RecordingExecutor(model.executor)
    runner = ProgramRunner(executor, packer, manifest.completion, vocab.sampled_tokens, vocab.histogram_bins,
                           (49151,), mask_words=vocab.mask_words,
                           submissions=model.submissions)   # the shared executor numbered earlier submissions
    config = SchedulerConfig(page_tokens=contract.model.cache.page_tokens, num_pages=model.manifests[0].cache_pages,
                             request_slots=manifest.request_slots, max_active=4, queue_capacity=8,
                             context_tokens=contract.context_tokens, max_pages_per_row=manifest.max_pages_per_row,
                             vocab_size=vocab.sampled_tokens, input_vocab_size=vocab.sampled_tokens,
                             eos_ids=(49151,), clock_origin_ns=time.monotonic_ns())
    sched = Scheduler(config, VariantTable.from_graphs(model.graphs))
    sched.add(0, RequestSpec((1, 9690, 253, 28, 17), 3, SamplingSettings(), observe_timestamps=observe))
    sched.add(1, RequestSpec((1, 9690, 253, 30), 3, SamplingSettings(temperature=0.7, seed=11),
                             observe_timestamps=observe))
    tokens, stamps = [], 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        sched.complete(plan, runner.run(plan))
        for ev in sched.take_events():
            if isinstance(ev, Emitted):
                tokens.append(ev.token)
                stamps += ev.timestamp_ns >= 0
    return executor.launches, tokens, stamps


def test_observation_changes_no_program_allocation_or_replay_abi(smollm2_model):
    # spec: OBS-31
    model = smollm2_model
    arena = model.executor.arena.memory.nbytes
    frames = [model.executor.staging(f) for f in range(model.execution_manifest.transport.frames)]
    saved = [f.copy() for f in frames]       # the shared model's packer remembers what these hold
    try:
        plain_launches, plain_tokens, plain_stamps = _serve_on_numpy(model, observe=False)
        observed_launches, observed_tokens, observed_stamps = _serve_on_numpy(model, observe=True)
    finally:
        for frame, bytes_ in zip(frames, saved):
            frame[:] = bytes_
    assert (plain_stamps, observed_stamps) == (0, 6)
    assert observed_tokens == plain_tokens and len(plain_tokens) == 6
    assert [p for p, _ in observed_launches] == [p for p, _ in plain_launches]      # the same programs
    assert [b for _, b in observed_launches] == [b for _, b in plain_launches]      # byte-identical staging
    assert model.executor.arena.memory.nbytes == arena                              # no allocation
    names = [d.name for d in model.execution_manifest.transport.destinations] + [b.name for b in model.execution_manifest.buffers]
    names += [f.name for f in model.execution_manifest.completion.row] + [f.name for f in model.execution_manifest.completion.header]
    assert not [n for n in names if "timestamp" in n or "observ" in n]               # nothing in the ABI


# ---- HTTP-16: CUDA ownership follows the stream-drain confirmation ------------------------

def _slow_first_round(runtime, seconds: float, mark_done: bool = False) -> list[tuple[str, bool]]:
    """Make the runtime's first round take `seconds` and record, with whether the worker was
    alive then, when that round started (and ended) and when the executor was released."""
    events: list[tuple[str, bool]] = []
    collect, close = runtime.runner.collect, runtime.model.executor.close

    def slow_collect(plan):  # type: ignore[no-untyped-def]
        if not events:
            events.append(("slow round", runtime.loop.alive))
            time.sleep(seconds)
            if mark_done:
                events.append(("round done", runtime.loop.alive))
        return collect(plan)

    def recording_close() -> None:
        events.append(("close", runtime.loop.alive))
        close()

    runtime.runner.collect = slow_collect  # type: ignore[method-assign]
    runtime.model.executor.close = recording_close  # type: ignore[method-assign]
    return events


def test_executor_ownership_follows_drain_confirmation_not_the_http_timeout(smollm2_core):
    # spec: HTTP-16, OWN-16
    from gateway.cli import SHUTDOWN_DRAIN_S
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from tests.engine_fixtures import ACCEPTANCE

    for path in sorted((ROOT / "helios_backend").rglob("*.py")):       # the backend knows no HTTP timeout
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.startswith(("gateway", "uvicorn")) for m in modules), path
    runtime = Engine.start(StartupOptions(smollm2_core, ACCEPTANCE))
    events = _slow_first_round(runtime, SHUTDOWN_DRAIN_S + 0.3)   # one round outlives the HTTP drain
    sender = Recorder()
    runtime.add_request(RequestSpec((1, 9690, 253, 7), 3, SamplingSettings()), Stream(1, sender))
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    runtime.stop(drain=True)
    assert time.monotonic() - started >= SHUTDOWN_DRAIN_S           # waited for the round, not the HTTP drain
    assert events == [("slow round", True), ("close", False)]         # released after the worker confirmed
    assert sender.finals[0].terminal.WhichOneof("outcome") == "finished" and len(sender.joined(OUT_TOKENS)) == 3


def test_a_stop_timeout_never_releases_the_executor_under_a_running_round(smollm2_core, caplog):
    # spec: OWN-16, HTTP-16
    # the round outlives stop's timeout: stop stops admitting and fails the queued work, but the
    # executor is released only once the worker left its round (docs/spec-gaps.md bug 3)
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from tests.engine_fixtures import ACCEPTANCE

    runtime = Engine.start(StartupOptions(smollm2_core, ACCEPTANCE))
    events = _slow_first_round(runtime, 2.0, mark_done=True)
    senders = [Recorder(), Recorder()]
    runtime.add_request(RequestSpec((1, 9690, 253, 7), 8, SamplingSettings()), Stream(1, senders[0]))
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    runtime.add_request(RequestSpec((1, 9690, 253, 8), 8, SamplingSettings()), Stream(2, senders[1]))
    started = time.monotonic()
    with caplog.at_level("ERROR", logger="helios.worker"):
        runtime.stop(drain=True, timeout=0.5)
    assert time.monotonic() - started >= 1.0                          # joined past the timeout
    assert events == [("slow round", True), ("round done", True), ("close", False)]
    assert not [r for r in caplog.records if "submission failed" in r.getMessage()]
    for sender in senders:                                            # queued work got its final
        assert len(sender.finals) == 1 and sender.finals[0].terminal.WhichOneof("outcome")


# ---- the worker's time by phase (flare_worker_seconds_total) ----------------------------------

def test_worker_time_is_split_by_phase_and_the_executor_wait_is_collect():
    # spec: MET-2
    sched, engine = make()
    runner = TimedRunner(engine)                 # every round is held >= 4 ms inside collect
    updates = Updates()
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Updates())
    worker = EngineLoop(sched, SynchronousRunner(runner.run), hub, updates, two_frames=False)
    sender = Recorder()
    started = time.perf_counter_ns()
    hub.start()
    worker.start()
    hub.register(Stream(1, sender))
    worker.enqueue(1, spec(prompt_of(2, 6), max_tokens=5))
    try:
        assert sender.done.wait(10)
    finally:
        worker.stop()
        hub.stop()
    elapsed_s = (time.perf_counter_ns() - started) / 1e9
    seconds: dict[str, float] = {}
    for name, labels, op, value in updates.items:
        if name == "flare_worker_seconds_total":
            assert op.value == "add" and value > 0
            phase = dict(labels)["phase"]
            seconds[phase] = seconds.get(phase, 0.0) + value
    assert set(seconds) == {"schedule", "launch", "collect", "complete", "deliver"}
    rounds = len(runner.ready_ns)
    assert rounds == worker.rounds >= 5
    assert seconds["collect"] >= rounds * 0.004          # the held rounds are the executor's wait
    assert sum(seconds.values()) <= elapsed_s            # phases partition the worker's busy time


# ---- MET-2: what /metrics covers -----------------------------------------------------------

def test_metrics_cover_lifecycle_launches_prefix_snapshots_and_capacity():
    # spec: MET-2
    sched, engine = make(num_pages=40, page_tokens=4, snapshots=1)
    updates = Updates()
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Updates())
    worker = EngineLoop(sched, engine, hub, updates, two_frames=False)
    hub.start()
    worker.start()
    senders = []
    shared = prompt_of(3, 8)
    jobs = [shared + [1, 2], shared + [5, 6, 7], prompt_of(4, 10), shared + [1, 2, 9], prompt_of(8, 40)]
    for serial, prompt in enumerate(jobs, start=1):          # one after another: snapshots take turns
        sender = Recorder()
        senders.append(sender)
        hub.register(Stream(serial, sender))
        worker.enqueue(serial, spec(prompt, max_tokens=4))
        assert sender.done.wait(10)
    worker.stop()
    hub.stop()
    totals: dict[tuple, float] = {}
    gauges: dict[tuple, float] = {}
    for name, labels, op, value in updates.items:
        key = (name, labels)
        if op.value == "add":
            totals[key] = totals.get(key, 0) + value
        elif op.value == "set":
            gauges[key] = value
    get = lambda name, **labels: totals.get((name, tuple(sorted(labels.items()))), 0)  # noqa: E731
    c = sched.counters
    # request lifecycle
    assert get("flare_requests_admitted_total") == 5 == c.admitted
    assert get("flare_requests_finished_total", reason="length") == 5
    assert ("flare_requests_running", ()) in gauges and ("flare_requests_waiting", ()) in gauges
    # graph launches by operation
    for op, label in ((C.OPERATION_PREFILL, "prefill"), (C.OPERATION_DECODE, "decode")):
        assert get("flare_graph_launches_total", operation=label) == c.launches[op] > 0
    # prefix reuse
    assert get("flare_prefix_reused_tokens_total") == c.reused_tokens > 0
    assert get("flare_prefix_lookup_tokens_total") == c.lookup_tokens
    assert get("flare_cache_pages_published_total") > 0
    # snapshot publication and eviction (one continuation row, several prompts ending mid-page)
    assert get("flare_snapshots_published_total") == sched.snapshots.counters.published >= 2
    assert get("flare_snapshots_evicted_total") == sched.snapshots.counters.evicted >= 1
    # resource capacity
    assert gauges[("flare_cache_pages_capacity", ())] == 40
    assert gauges[("flare_request_slots_capacity", ())] == 8
    assert gauges[("flare_snapshot_rows_capacity", ())] == 1
    assert {("flare_cache_pages", (("state", s),)) for s in ("free", "used", "cached")} <= set(gauges)


# ---- FE-42: distinct termination semantics, backend and gateway --------------------------

class FailOnce:
    def __init__(self, engine, serial: int) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.serial = engine, serial

    def run(self, plan):  # type: ignore[no-untyped-def]
        if any(lane.request.serial == self.serial and lane.request.output_len == 2 for lane in plan.main.lanes):
            raise RuntimeError("device fault")
        return self.engine.run(plan)


def _backend_terminals() -> dict[str, ep.TerminalEvent]:
    from helios_backend.scheduler.host_stops import HostStopCheck
    from helios_backend.scheduler.request import StopSettings
    from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
    from helios_backend.scheduler.variants import VariantTable
    from tests.scheduler_sim import SimulatedEngine, variants
    from tests.test_rules_scheduler import DigitDecoder

    prompts = {name: prompt_of(i, 6) for i, name in enumerate(("eos", "length", "string", "token", "cancel", "fail"))}
    refs = {name: reference_tokens(p, 40, VOCAB) for name, p in prompts.items()}
    eos = refs["eos"][2]
    assert all(eos not in refs[n][:12] for n in prompts if n != "eos")
    cfg = SchedulerConfig(page_tokens=4, num_pages=64, request_slots=8, max_active=8, queue_capacity=16,
                          context_tokens=256, max_pages_per_row=64, vocab_size=VOCAB, input_vocab_size=VOCAB,
                          eos_ids=(eos,))
    sched = Scheduler(cfg, VariantTable(variants()),
                      stop_factory=lambda s: HostStopCheck(s.stops, DigitDecoder() if s.stops.strings else None))
    engine = SimulatedEngine(sched)
    stops = {"string": StopSettings(strings=(f"<{refs['string'][3]}>",)),
             "token": StopSettings(token_ids=(refs["token"][4],))}
    serials = dict(enumerate(prompts))
    fail = [s for s, n in serials.items() if n == "fail"][0]
    for serial, name in serials.items():
        if serial != fail:                 # the failing request runs alone: a failed round fails its lanes
            sched.add(serial, spec(prompts[name], max_tokens=12 if name != "length" else 5,
                                   stops=stops.get(name, StopSettings())))
    runner = FailOnce(engine, serial=fail)
    out: dict[str, ep.TerminalEvent] = {}
    for _ in range(200):
        plan = sched.schedule()
        if plan is None:
            if fail in [s for s, n in serials.items() if n in out] or not len(out) == 5:
                break
            sched.add(fail, spec(prompts["fail"], max_tokens=12))
            continue
        try:
            rows = runner.run(plan)
        except RuntimeError as exc:
            sched.fail(plan, str(exc))
        else:
            sched.complete(plan, rows)
        for ev in sched.take_events():
            if isinstance(ev, Terminal):
                out[serials[ev.serial]] = ev.event
        cancel = [s for s, n in serials.items() if n == "cancel"][0]
        if (req := sched.request(cancel)) is not None and req.output_len == 3:
            sched.cancel(cancel)
    return out


def test_termination_kinds_keep_distinct_semantics(served):
    # spec: FE-42
    from gateway.errors import GatewayError
    from gateway.generation import ChoiceFailed, ChoiceFinished, ChoiceTranslator
    from gateway.output_pipeline import OutputPipeline, PlainTextParser
    from gateway.preparation import prepare_chat
    from gateway.schemas import ChatCompletionRequest

    terminals = _backend_terminals()
    assert set(terminals) == {"eos", "length", "string", "token", "cancel", "fail"}
    finished = {n: e.finished for n, e in terminals.items() if e.WhichOneof("outcome") == "finished"}
    assert {n: f.reason for n, f in finished.items()} == {
        "eos": ep.FINISH_REASON_EOS, "length": ep.FINISH_REASON_LENGTH, "string": ep.FINISH_REASON_STOP_STRING,
        "token": ep.FINISH_REASON_STOP_TOKEN, "cancel": ep.FINISH_REASON_CANCELLED}
    assert terminals["fail"].WhichOneof("outcome") == "failed"
    assert finished["eos"].usage.completion_tokens == 3 and finished["length"].usage.completion_tokens == 5
    assert finished["string"].stop.kind == ep.STOP_KIND_STRING and finished["token"].stop.kind == ep.STOP_KIND_TOKEN_ID
    assert not finished["eos"].HasField("stop") and not finished["length"].HasField("stop")
    # the gateway keeps them apart: EOS is not a user stop, a limit is not a stop, a backend
    # cancellation and an execution failure are errors of their own
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    prepared = prepare_chat(ChatCompletionRequest.model_validate(body), served, ingress_ns=10)
    seen = {}
    for name, event in terminals.items():
        pipeline = OutputPipeline(served.tokenizer, prepared.stop_matcher(), PlainTextParser(), served.eos_token_ids)
        result = ChoiceTranslator(0, pipeline, "messages", 10, 20).terminal(event)
        if isinstance(result, ChoiceFinished):
            seen[name] = ("finished", result.finish_reason, result.ended_by_eos)
        else:
            assert isinstance(result, ChoiceFailed) and isinstance(result.error, GatewayError)
            seen[name] = ("failed", result.error.status, result.error.code)
    assert seen["eos"] == ("finished", "stop", True)
    assert seen["string"] == seen["token"] == ("finished", "stop", False)
    assert seen["length"] == ("finished", "length", False)
    assert seen["cancel"][0] == seen["fail"][0] == "failed" and seen["cancel"] != seen["fail"]
    assert seen["fail"][1] == 500
