"""Server plumbing without Triton: response coalescing, exactly one final, worker failure
isolation, drain, startup option precedence, metrics updates. The scheduler is real; the
executor is the simulated paged one (tests/scheduler_sim.py)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.scheduler import Emitted, Terminal
from helios_backend.engine.faults import FaultTrigger, FaultyRunner, FaultySink
from helios_backend.engine.metrics import FAMILY, MetricsThread, Op, update
from helios_backend.engine.responses import Channel, ResponseHub, Stream, StreamInterval
from helios_backend.engine.settings import SettingsError, StartupOptions, resolve
from helios_backend.executors.factory import EXECUTOR_NAMES, HOST_CONCURRENCY
from helios_backend.exchange import OUT_EVENT, OUT_LOGPROBS, OUT_TIMESTAMPS, OUT_TOKENS, decode_event
from helios_backend.engine.loop import EngineLoop, SynchronousRunner
from tests.scheduler_sim import reference_tokens
from tests.test_scheduler_loop import VOCAB, make, prompt_of, spec


class RecordingSender:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.sends: list[tuple[dict[str, np.ndarray], bool]] = []
        self.block = block
        self.cancelled = False
        self.done = threading.Event()

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        if self.block is not None:
            self.block.wait(10)
        self.sends.append((arrays, final))
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    @property
    def tokens(self) -> list[int]:
        return [t for arrays, _ in self.sends for t in arrays[OUT_TOKENS].tolist()]

    @property
    def finals(self) -> list[ep.ResponseEvent]:
        return [decode_event(a[OUT_EVENT]) for a, final in self.sends if final]


class Metrics:
    def __init__(self) -> None:
        self.updates: list[object] = []

    def push(self, updates: list[object]) -> None:
        self.updates.extend(updates)


def finished_event(serial: int) -> Terminal:
    return Terminal(serial, ep.TerminalEvent(finished=ep.Finished(reason=ep.FINISH_REASON_LENGTH)))


def test_tokens_coalesce_while_a_send_is_slow_and_nothing_is_lost() -> None:  # spec: HTTP-9, HTTP-10
    gate = threading.Event()
    sender = RecordingSender(block=gate)
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics())
    hub.start()
    hub.register(Stream(1, sender))
    hub.deliver([Emitted(1, 0, -1, 0.0, None, None)])
    time.sleep(0.05)                                 # the response thread is now stuck in send
    for t in range(1, 100):
        hub.deliver([Emitted(1, t, -1, 0.0, None, None)])   # never blocks the worker
    hub.deliver([finished_event(1)])
    gate.set()
    assert sender.done.wait(5)
    hub.stop()
    assert sender.tokens == list(range(100))
    assert len(sender.sends) <= 3                    # first token, then the rest coalesced with the final
    assert [f for _, f in sender.sends].count(True) == 1 and sender.sends[-1][1]


class RecordingChannel:
    """A channel sink that keeps every ChannelBatch, decoded."""

    def __init__(self) -> None:
        self.batches: list[ep.ChannelBatch] = []
        self.lock = threading.Lock()

    def send_batch(self, payload: bytes) -> None:
        with self.lock:
            self.batches.append(ep.ChannelBatch.FromString(payload))

    def close(self) -> None:
        pass

    def is_cancelled(self) -> bool:
        return False

    def plain_groups(self, tag: int) -> list[list[int]]:
        """The ids-only output of `tag`, one list per message that carried some."""
        groups = []
        with self.lock:
            for batch in self.batches:
                start = 0
                for t, count in zip(batch.plain_tags, batch.plain_counts):
                    if t == tag:
                        groups.append(list(batch.plain_token_ids[start:start + count]))
                    start += count
        return groups

    def output_tokens(self, tag: int) -> list[int]:
        """`tag`'s tokens that travelled as output messages (its terminal, records)."""
        with self.lock:
            return [t for b in self.batches for out in b.outputs if out.tag == tag for t in out.token_ids]


def _channel_hub(interval: StreamInterval) -> tuple[ResponseHub, RecordingChannel, Channel]:
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics(), interval=interval)
    hub.start()
    sink = RecordingChannel()
    channel = hub.open_channel("c", sink)
    return hub, sink, channel


def _wait_for(condition, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return bool(condition())


def test_a_plain_stream_sends_its_first_token_alone_then_gathers_its_interval() -> None:  # spec: HTTP-9
    # interval 4 and a hold longer than the test: after the first token every message carries
    # exactly four of the stream's tokens, however the rounds arrive; the terminal takes the rest
    hub, sink, channel = _channel_hub(StreamInterval(4, hold_s=60.0))
    hub.register(Stream(1, None, channel=channel, tag=5))
    hub.deliver([Emitted(1, 100, -1, 0.0, None, None)])
    assert _wait_for(lambda: sink.plain_groups(5) == [[100]])      # the first token leaves at once
    for t in range(101, 111):
        hub.deliver([Emitted(1, t, -1, 0.0, None, None)])
        time.sleep(0.002)
    assert _wait_for(lambda: len(sink.plain_groups(5)) == 3)
    time.sleep(0.05)
    assert sink.plain_groups(5) == [[100], [101, 102, 103, 104], [105, 106, 107, 108]]   # 109, 110 held
    hub.deliver([finished_event(1)])
    assert _wait_for(lambda: sink.output_tokens(5) == [109, 110])
    hub.stop()


def test_held_tokens_leave_when_their_hold_ends_without_more_rounds() -> None:  # spec: HTTP-9
    # a stream whose interval does not fill (a slow step, or the last tokens before a long
    # prompt round) is not held past hold_s: its tokens leave on the response thread's own clock
    hub, sink, channel = _channel_hub(StreamInterval(8, hold_s=0.05))
    hub.register(Stream(1, None, channel=channel, tag=2))
    hub.deliver([Emitted(1, 7, -1, 0.0, None, None)])
    assert _wait_for(lambda: sink.plain_groups(2) == [[7]])
    hub.deliver([Emitted(1, 8, -1, 0.0, None, None)])
    hub.deliver([Emitted(1, 9, -1, 0.0, None, None)])
    assert _wait_for(lambda: sink.plain_groups(2) == [[7], [8, 9]], timeout=2.0)
    hub.deliver([finished_event(1)])
    hub.stop()


def test_a_due_stream_takes_the_held_streams_of_its_channel_along() -> None:  # spec: HTTP-9
    # interval 4: stream 2 starts two rounds after stream 1; its first token makes the channel's
    # message leave, and stream 1's two held tokens go with it. From then on the two streams are
    # in step: one message per four rounds carries both, never one message per stream
    hub, sink, channel = _channel_hub(StreamInterval(4, hold_s=60.0))
    hub.register(Stream(1, None, channel=channel, tag=1))
    hub.register(Stream(2, None, channel=channel, tag=2))

    def round_(*serials_tokens: tuple[int, int]) -> None:
        before = len(sink.batches)
        hub.deliver([Emitted(serial, token, -1, 0.0, None, None) for serial, token in serials_tokens])
        time.sleep(0.03)                               # the pass that follows, if any
        assert len(sink.batches) in (before, before + 1)

    round_((1, 10))                                    # stream 1's first token: at once
    round_((1, 11))
    round_((1, 12))
    round_((1, 13), (2, 20))                           # stream 2's first token takes 11-13 along
    assert _wait_for(lambda: sink.plain_groups(2) == [[20]])
    assert sink.plain_groups(1) == [[10], [11, 12, 13]]
    messages = len(sink.batches)
    for k in range(8):                                 # two intervals in step
        round_((1, 14 + k), (2, 21 + k))
    assert _wait_for(lambda: len(sink.batches) == messages + 2)
    time.sleep(0.05)
    assert len(sink.batches) == messages + 2
    assert sink.plain_groups(1)[2:] == [[14, 15, 16, 17], [18, 19, 20, 21]]
    assert sink.plain_groups(2)[1:] == [[21, 22, 23, 24], [25, 26, 27, 28]]
    hub.deliver([finished_event(1), finished_event(2)])
    hub.stop()


def test_streams_with_records_and_an_interval_of_one_are_never_held() -> None:  # spec: HTTP-9
    # a stream that asked for logprobs travels as its own output message, every round; so does
    # every stream at interval 1 (what --stream-interval 1 asks for)
    for interval, logprobs in ((StreamInterval(8, hold_s=60.0), True), (StreamInterval(1, hold_s=60.0), False)):
        hub, sink, channel = _channel_hub(interval)
        hub.register(Stream(1, None, channel=channel, tag=3, logprobs=logprobs))
        for t in range(5):
            hub.deliver([Emitted(1, t, -1, -0.5, None, None)])
            count = t + 1
            assert _wait_for(lambda: sum(len(g) for g in sink.plain_groups(3)) + len(sink.output_tokens(3))
                             == count)
        hub.deliver([finished_event(1)])
        hub.stop()


def test_the_automatic_interval_grows_with_the_open_streams() -> None:
    auto = StreamInterval()
    assert [auto.at(n) for n in (0, 1, 16, 63, 64, 95, 96, 128, 200, 256, 1024)] == [1, 1, 1, 1, 2, 2, 3, 4, 6, 8, 8]
    assert StreamInterval(3).at(256) == 3
    with pytest.raises(ValueError, match="at least one token"):
        StreamInterval(0)
    # the hub applies it to its open streams and says so on its gauge
    metrics = Metrics()
    hub = ResponseHub(on_cancel=lambda s: None, metrics=metrics)
    hub.start()
    channel = hub.open_channel("c", RecordingChannel())
    for serial in range(1, 97):
        hub.register(Stream(serial, None, channel=channel, tag=serial))
    hub.deliver([Emitted(1, 4, -1, 0.0, None, None)])
    assert _wait_for(lambda: update("flare_stream_interval_tokens", Op.SET, 3) in metrics.updates)
    hub.stop()


def test_stop_gives_unfinished_streams_exactly_one_failure() -> None:
    sender = RecordingSender()
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics())
    hub.start()
    hub.register(Stream(7, sender))
    hub.deliver([Emitted(7, 5, -1, 0.0, None, None)])
    hub.stop()
    hub.deliver([finished_event(7)])                 # late events are ignored
    assert sender.tokens == [5]
    assert len(sender.finals) == 1 and sender.finals[0].terminal.WhichOneof("outcome") == "failed"


def test_cancelled_sender_is_reported_once() -> None:
    cancels: list[int] = []
    sender = RecordingSender()
    hub = ResponseHub(on_cancel=cancels.append, metrics=Metrics())
    hub.start()
    hub.register(Stream(3, sender))
    sender.cancelled = True
    deadline = time.monotonic() + 5
    while not cancels and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    hub.stop()
    assert cancels == [3]


class FailingRunner:
    """The simulated engine, failing the round that carries `poison`'s first decode."""

    def __init__(self, engine, poison: int) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.poison = engine, poison

    def run(self, plan):  # type: ignore[no-untyped-def]
        if any(l.request.serial == self.poison and l.request.output_len == 1 for l in plan.main.lanes):
            raise RuntimeError("device fault")
        return self.engine.run(plan)


def _serve(worker_scheduler_engine, jobs, runner=None):  # type: ignore[no-untyped-def]
    sched, engine = worker_scheduler_engine
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics())
    worker = EngineLoop(sched, SynchronousRunner(runner.run) if runner is not None else engine, hub, Metrics())
    hub.start()
    worker.start()
    senders = {}
    for serial, request_spec in jobs:
        senders[serial] = RecordingSender()
        hub.register(Stream(serial, senders[serial]))
        worker.enqueue(serial, request_spec)
    return worker, hub, senders


def test_a_failing_round_fails_its_lanes_and_the_worker_goes_on() -> None:  # spec: HTTP-23, CACHE-25
    sched, engine = make()
    worker, hub, senders = _serve((sched, engine), [(1, spec(prompt_of(1, 6), max_tokens=5))],
                                  runner=FailingRunner(engine, poison=1))
    assert senders[1].done.wait(10)
    worker.enqueue(2, spec(prompt_of(2, 6), max_tokens=5))
    senders[2] = RecordingSender()
    hub.register(Stream(2, senders[2]))
    assert senders[2].done.wait(10)
    worker.stop()
    hub.stop()
    failed = senders[1].finals
    assert len(failed) == 1 and failed[0].terminal.failed.message == "RuntimeError: device fault"
    assert senders[2].tokens == reference_tokens(prompt_of(2, 6), 5, VOCAB)
    assert sched.pool.used_pages == 0


def test_drain_finishes_admitted_requests_then_refuses() -> None:  # spec: OWN-16
    sched, engine = make()
    jobs = [(i, spec(prompt_of(i, 6), max_tokens=8)) for i in range(1, 6)]
    worker, hub, senders = _serve((sched, engine), jobs)
    worker.stop(drain=True, timeout=30)
    late = RecordingSender()
    hub.register(Stream(99, late))
    worker.enqueue(99, spec(prompt_of(9, 6)))
    hub.stop()
    for serial, request_spec in jobs:
        assert senders[serial].tokens == reference_tokens(list(request_spec.prompt), 8, VOCAB)
        assert senders[serial].finals[0].terminal.finished.reason == ep.FINISH_REASON_LENGTH
    assert len(late.finals) == 1                      # never left hanging


def test_stop_without_drain_fails_everything_exactly_once() -> None:
    sched, engine = make()
    jobs = [(i, spec(prompt_of(i, 6), max_tokens=200)) for i in range(1, 4)]
    worker, hub, senders = _serve((sched, engine), jobs)
    worker.stop(drain=False, timeout=30)
    hub.stop()
    for serial, _ in jobs:
        assert len(senders[serial].finals) == 1


def test_rejection_is_its_own_event() -> None:  # spec: HTTP-26
    sched, engine = make(context=32)
    worker, hub, senders = _serve((sched, engine), [(1, spec(prompt_of(1, 40)))])
    assert senders[1].done.wait(10)
    worker.stop()
    hub.stop()
    rejected = senders[1].finals[0].terminal
    assert rejected.WhichOneof("outcome") == "rejected"
    assert rejected.rejected.reason == ep.REJECTION_REASON_PROMPT_BEYOND_CAPACITY


def _contract(concurrency: int = 8, **defaults: object) -> cp.ServingContract:
    contract = cp.ServingContract(concurrency=concurrency, speculative_widths=[])
    for key, value in defaults.items():
        setattr(contract.defaults, key, value)
    return contract


def test_option_precedence_explicit_core_builtin() -> None:  # spec: SRV-15, SRV-16
    core = Path("/x.core")
    s = resolve(StartupOptions(core, queue_capacity=5), _contract(queue_capacity=9, max_active=3))
    assert (s.queue_capacity, s.max_active, s.event_capacity) == (5, 3, 256)
    s = resolve(StartupOptions(core), _contract())
    assert (s.queue_capacity, s.max_active, s.concurrency, s.snapshot_capacity) == (64, 8, 8, 0)
    prepared = _contract()
    prepared.prepared_snapshots = 6
    assert resolve(StartupOptions(core), prepared).snapshot_capacity == 6            # prepared rows
    assert resolve(StartupOptions(core, snapshot_capacity=2), prepared).snapshot_capacity == 2
    assert resolve(StartupOptions(core, snapshot_capacity=9), prepared).snapshot_capacity == 6  # rows exist
    with pytest.raises(SettingsError, match="concurrency"):
        resolve(StartupOptions(core, concurrency=9), _contract())     # load may only reduce it
    with pytest.raises(SettingsError, match="history_drafting"):
        resolve(StartupOptions(core, history_drafting=True), _contract())  # spec: SRV-12


def test_the_default_concurrency_is_the_executors_and_every_served_row_generates() -> None:  # spec: SRV-7, SRV-15
    """A core of a GPU server's 256 rows: CUDA serves them all, the host executors the 32 rows
    they served before the shipped cores recorded more; max_active follows the concurrency."""
    core, wide = Path("/x.core"), _contract(256)
    served = {executor: resolve(StartupOptions(core, executor=executor), wide) for executor in EXECUTOR_NAMES}
    assert {e: (s.concurrency, s.max_active) for e, s in served.items()} == {
        "cpu": (32, 32), "numpy": (32, 32), "cuda": (256, 256)}
    assert HOST_CONCURRENCY == 32
    # a core of fewer rows serves them all on every executor
    assert {resolve(StartupOptions(core, executor=e), _contract()).concurrency for e in EXECUTOR_NAMES} == {8}
    # options and the core's default still win: more rows on the CPU where asked, fewer generating
    s = resolve(StartupOptions(core, executor="cpu", concurrency=64), wide)
    assert (s.concurrency, s.max_active) == (64, 64)
    s = resolve(StartupOptions(core, executor="cuda"), _contract(256, max_active=100))
    assert (s.concurrency, s.max_active) == (256, 100)
    s = resolve(StartupOptions(core, executor="cuda", max_active=300), wide)
    assert s.max_active == 256                                     # never more than the rows served


def test_options_parse_from_config_parameters(tmp_path: Path) -> None:
    options = StartupOptions.from_parameters({"core_path": "var/c.core", "page_capacity": "12",
                                              "history_drafting": "", "executor": "numpy"}, tmp_path)
    assert options.core_path == tmp_path / "var/c.core" and options.page_capacity == 12
    assert options.history_drafting is None
    with pytest.raises(SettingsError, match="page_capacity"):
        StartupOptions.from_parameters({"page_capacity": "twelve"}, tmp_path)
    with pytest.raises(SettingsError, match="surprise"):
        StartupOptions.from_parameters({"surprise": "1"}, tmp_path)
    with pytest.raises(SettingsError, match="executor"):
        StartupOptions.from_parameters({"executor": "tpu"}, tmp_path)
    assert StartupOptions.from_parameters({"switch_interval_us": "500"}, tmp_path).switch_interval_us == 500
    assert StartupOptions.from_parameters({"stream_interval": "4"}, tmp_path).stream_interval == 4
    assert StartupOptions.from_parameters({"stream_interval": ""}, tmp_path).stream_interval is None
    with pytest.raises(SettingsError, match="stream_interval"):
        StartupOptions.from_parameters({"stream_interval": "0"}, tmp_path)
    with pytest.raises(SettingsError, match="switch_interval_us"):
        StartupOptions.from_parameters({"switch_interval_us": "0"}, tmp_path)
    assert StartupOptions.from_parameters({"admission_burst": "8"}, tmp_path).admission_burst == 8
    for bad in ("1", "many"):
        with pytest.raises(SettingsError, match="admission_burst"):
            StartupOptions.from_parameters({"admission_burst": bad}, tmp_path)


def test_startup_model_names_follow_the_core_aliases_once_each(tmp_path: Path) -> None:  # spec: SRV-1
    options = StartupOptions.from_parameters({"served_model_names": '["gpt-4o", "mine", "sample"]'}, tmp_path)
    assert options.served_model_names == ("gpt-4o", "mine", "sample")
    contract = _contract()
    contract.served_id = "sample-model"
    contract.aliases.append("sample")
    assert resolve(options, contract).aliases == ("sample", "gpt-4o", "mine")
    assert resolve(StartupOptions(Path("/x.core"), served_model_names=("sample-model",)), contract).aliases == ("sample",)
    assert resolve(StartupOptions(Path("/x.core")), contract).aliases == ("sample",)
    for bad in ('"gpt-4o"', "[1]", "gpt-4o", '[""]', '[" padded"]'):
        with pytest.raises(SettingsError, match="served_model_names"):
            StartupOptions.from_parameters({"served_model_names": bad}, tmp_path)


def test_metrics_thread_applies_updates_and_checks_labels() -> None:  # spec: MET-1
    applied: list[tuple[str, dict[str, str], str, float]] = []

    class Handle:
        def __init__(self, name: str, labels: dict[str, str]) -> None:
            self.name, self.labels = name, labels

        def increment(self, v: float) -> None:
            applied.append((self.name, self.labels, "add", v))

        def set(self, v: float) -> None:
            applied.append((self.name, self.labels, "set", v))

        def observe(self, v: float) -> None:
            applied.append((self.name, self.labels, "observe", v))

    class Backend:
        def create(self, family, labels):  # type: ignore[no-untyped-def]
            return Handle(family.name, labels)

    thread = MetricsThread(Backend())
    thread.start()
    thread.push([update("flare_graph_launches_total", Op.ADD, 2, operation="decode"),
                 update("flare_requests_running", Op.SET, 3)])
    thread.stop()
    assert applied == [("flare_graph_launches_total", {"operation": "decode"}, "add", 2.0),
                       ("flare_requests_running", {}, "set", 3.0)]
    with pytest.raises(ValueError):
        update("flare_graph_launches_total", Op.ADD, 1, request_id="x")
    assert all(not {"request_id", "prompt", "token"} & set(f.labels) for f in FAMILY.values())


@pytest.mark.parametrize("wanted, top, packed", [(False, 0, -1), (True, 0, 0), (True, 5, 5)])
def test_the_packed_sampling_vector_says_whether_a_request_wants_logprob_records(wanted, top, packed):
    """sampling.logprobs.v2 skips rows whose word 7 is negative: only requests that asked for
    logprobs pay for the records."""
    from helios_backend.exchange import SpecDefaults, request_spec
    gen = ep.GenerateRequest()
    gen.logprobs.logprobs = wanted
    gen.logprobs.top_logprobs = top
    spec = request_spec(gen, np.array([1, 2, 3]), SpecDefaults(cp.SamplingDefaults(top_p=1.0), 16, 100))
    assert spec.sampling.vector()[7] == packed


@pytest.mark.parametrize("entries, capacity, message", [
    ({7: 100.0}, 0, "re-prepare"), ({7: 1.0, 8: 1.0, 9: 1.0}, 2, "limit of 2"), ({100: 1.0}, 300, "vocabulary"),
    ({7: 100.5}, 300, "[-100, 100]"), ({7: float("nan")}, 300, "[-100, 100]"),
])
def test_the_backend_checks_logit_bias_again(entries, capacity, message):
    # spec: BND-9
    from helios_backend.exchange import SpecDefaults, ExchangeError, request_spec
    gen = ep.GenerateRequest()
    gen.logit_bias.update(entries)
    with pytest.raises(ExchangeError) as refused:
        request_spec(gen, np.array([1, 2, 3]), SpecDefaults(cp.SamplingDefaults(top_p=1.0), 16, 100, capacity))
    assert refused.value.field == "logit_bias" and message in refused.value.message


def test_a_valid_logit_bias_travels_as_arrays_of_distinct_ids():
    # spec: BND-9
    from helios_backend.exchange import SpecDefaults, request_spec
    gen = ep.GenerateRequest()
    gen.logit_bias.update({7: 100.0, 99: -100.0, 0: 0.5})
    spec = request_spec(gen, np.array([1, 2, 3]), SpecDefaults(cp.SamplingDefaults(top_p=1.0), 16, 100, 300))
    assert spec.logit_bias is not None
    assert dict(zip(spec.logit_bias.ids.tolist(), spec.logit_bias.values.tolist())) == {7: 100.0, 99: -100.0, 0: 0.5}
    assert spec.logit_bias.ids.dtype == np.int32 and spec.logit_bias.values.dtype == np.float32
    assert request_spec(ep.GenerateRequest(), np.array([1]), SpecDefaults(cp.SamplingDefaults(top_p=1.0), 16, 100,
                                                                          300)).logit_bias is None


def _dying(tmp_path: Path, site: str) -> tuple[FaultTrigger, list[str], threading.Event]:
    """An armed fault trigger, and what the death callback records."""
    trigger = FaultTrigger(tmp_path / "fault")
    trigger.path.write_text(site)
    deaths: list[str] = []
    died = threading.Event()
    return trigger, deaths, died


def test_a_dead_worker_fails_every_request_once_and_reports_its_death(tmp_path: Path) -> None:  # spec: HTTP-23
    sched, engine = make()
    trigger, deaths, died = _dying(tmp_path, "worker")
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics())
    worker = EngineLoop(sched, FaultyRunner(engine, trigger), hub, Metrics(),
                        on_death=lambda reason: (deaths.append(reason), died.set()))
    hub.start()
    senders = {}
    for serial in (1, 2, 3):
        senders[serial] = RecordingSender()
        hub.register(Stream(serial, senders[serial]))
        worker.enqueue(serial, spec(prompt_of(serial, 6), max_tokens=50))
    worker.start()
    assert died.wait(10) and all(s.done.wait(10) for s in senders.values())
    worker.stop(timeout=10)                         # returns once the dead thread is gone
    late = RecordingSender()
    hub.register(Stream(9, late))
    worker.enqueue(9, spec(prompt_of(9, 6)))        # refused at once: nobody would answer it
    hub.stop()
    assert deaths == ["the scheduler worker died: InjectedFault: injected fault in the worker thread"]
    for sender in senders.values():
        [final] = sender.finals
        assert final.terminal.failed.message == deaths[0]
    [refused] = late.finals
    assert refused.terminal.rejected.reason == ep.REJECTION_REASON_SHUTTING_DOWN
    assert not worker.alive and not trigger.path.exists()


def test_a_dead_response_thread_ends_every_stream_once_and_reports_its_death(tmp_path: Path) -> None:  # spec: HTTP-23
    sched, engine = make()
    trigger, deaths, died = _dying(tmp_path, "responses")
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics(),
                      on_death=lambda reason: (deaths.append(reason), died.set()))
    worker = EngineLoop(sched, engine, hub, Metrics())
    hub.start()
    worker.start()
    senders = {}
    for serial in (1, 2, 3):
        senders[serial] = RecordingSender()
        hub.register(Stream(serial, FaultySink(senders[serial], trigger)))
        worker.enqueue(serial, spec(prompt_of(serial, 6), max_tokens=200))
    assert died.wait(10)
    worker.stop(drain=False, timeout=30)
    assert deaths == ["the response thread died: InjectedFault: injected fault in the responses thread"]
    assert not hub.alive
    for sender in senders.values():
        assert len(sender.finals) == 1              # its outcome, or the thread's death


def test_every_startup_option_is_declared_in_the_model_config() -> None:
    # helios-serve writes options into config.pbtxt's declared parameters: one left out there is
    # an option that cannot be set (a KeyError at startup)
    import dataclasses
    import re
    config = (Path(__file__).resolve().parents[1] / "model_repository" / "helios" / "config.pbtxt").read_text()
    declared = set(re.findall(r'key: "([a-z_]+)"', config))
    missing = [f.name for f in dataclasses.fields(StartupOptions) if f.name not in declared]
    assert missing == []


def test_a_token_block_is_delivered_as_its_events_one_by_one() -> None:  # spec: HTTP-9
    # the hub reads a round's TokenBlock as arrays; what each stream receives (tokens, stamps,
    # logprobs, first-token time, the terminal after) equals the same events delivered one by one
    from helios_backend.scheduler.events import TokenBlock

    rng = np.random.default_rng(5)
    block = TokenBlock(np.array([3, 1, 9, 2, 7], np.int64), rng.integers(0, 500, 5).astype(np.int32),
                       np.array([11, 12, -1, 14, 15], np.int64), rng.random(5).astype(np.float32))
    bare = TokenBlock(np.array([1, 2], np.int64), np.array([8, 9], np.int32), None, None)
    received = {}
    for mode in ("block", "events"):
        senders = {serial: RecordingSender() for serial in (1, 2, 3, 7)}    # 9 is not registered
        hub = ResponseHub(on_cancel=lambda s: None, metrics=Metrics())
        hub.start()
        for serial, sender in senders.items():
            hub.register(Stream(serial, sender, timestamps=serial in (1, 3), logprobs=serial in (1, 2)))
        hub.deliver([finished_event(7)])                # 7 ends first: its block token is dropped
        for b in (block, bare):
            hub.deliver([b] if mode == "block" else b.emitted())
        hub.deliver([finished_event(s) for s in (1, 2, 3)])
        for sender in senders.values():
            assert sender.done.wait(5)
        hub.stop()
        # what a stream received, joined over its sends (how the sends split depends on timing)
        received[mode] = {serial: ({key: [x for arrays, _ in sender.sends if key in arrays for x in arrays[key].tolist()]
                                    for key in sorted({k for arrays, _ in sender.sends for k in arrays} - {OUT_EVENT})},
                                   [f.terminal.WhichOneof("outcome") for f in sender.finals])
                          for serial, sender in senders.items()}
    assert received["block"] == received["events"]
    # and what each stream asked for, in absolute terms: serial 1 (stamps and logprobs) got
    # block index 1 then the bare block's token (-1 and 0.0: absent), serial 3 (stamps only) index 0
    one, three = received["block"][1][0], received["block"][3][0]
    assert one[OUT_TOKENS] == [int(block.tokens[1]), 8]
    assert one[OUT_TIMESTAMPS] == [12, -1]
    assert one[OUT_LOGPROBS] == pytest.approx([float(block.logprobs[1]), 0.0])
    assert three[OUT_TIMESTAMPS] == [11] and OUT_LOGPROBS not in three
    assert received["block"][2][0][OUT_LOGPROBS] == pytest.approx([float(block.logprobs[3]), 0.0])
    assert received["block"][7][0].get(OUT_TOKENS, []) == []
