"""Spec rules of the scheduler and worker, on the real Scheduler and EngineLoop driven by the
simulated paged executor (tests/scheduler_sim.py): completion validation before retiring
(CACHE-16..18), the host-stop barrier (STOP-16..18), what a host stop keeps and discards
(STOP-23, 24, 32..34), observation that changes nothing (OBS-9, 13, 16) and bounded
retained output (HTTP-13)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler import scheduler as scheduler_module
from helios_backend.scheduler.completion import CompletionFormat, parse_and_validate
from helios_backend.scheduler.errors import CompletionMismatch
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.plan import PENDING_TOKEN, RoundPlan, Submission
from helios_backend.scheduler.request import RequestSpec, SamplingSettings, StopSettings
from helios_backend.scheduler.scheduler import Emitted, Scheduler, SchedulerConfig, Terminal
from helios_backend.scheduler.variants import VariantTable
from helios_backend.engine.responses import ResponseHub, Stream
from helios_backend.engine.loop import EngineLoop
from tests.scheduler_sim import HEADER_FIELDS, ROW_FIELDS, SimulatedEngine, completion_layout, reference_tokens, variants

VOCAB = 1000
MAIN_OPS = (cp.OPERATION_DECODE, cp.OPERATION_PREFILL, cp.OPERATION_MIXED)


class DigitDecoder:
    """A text decoder for string stops: token t decodes to '<t>' (distinct, printable)."""

    def feed_one(self, token_id: int) -> str:
        return f"<{token_id}>"


class TamperingEngine(SimulatedEngine):
    """The simulated executor; `tamper(sub, words)` rewrites the next main completion."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.tamper: Callable[[Submission, np.ndarray], None] | None = None

    def _execute(self, sub: Submission) -> np.ndarray:
        words = super()._execute(sub)
        if self.tamper is not None and sub.operation in MAIN_OPS:
            self.tamper(sub, words)
            self.tamper = None
        return words


def make(num_pages: int = 64, page_tokens: int = 4, slots: int = 8, context: int = 256,
         snapshots: int = 0, **variant_kw: object) -> tuple[Scheduler, TamperingEngine]:
    cfg = SchedulerConfig(page_tokens=page_tokens, num_pages=num_pages, request_slots=slots,
                          max_active=slots, queue_capacity=64, context_tokens=context,
                          max_pages_per_row=context // page_tokens, vocab_size=VOCAB,
                          input_vocab_size=VOCAB, eos_ids=(), snapshot_capacity=snapshots)
    sched = Scheduler(cfg, VariantTable(variants(**variant_kw)),  # type: ignore[arg-type]
                      stop_factory=lambda s: HostStopCheck(s.stops, DigitDecoder() if s.stops.strings else None))
    return sched, TamperingEngine(sched)


def spec(prompt: list[int], max_tokens: int = 8, **kw: object) -> RequestSpec:
    return RequestSpec(tuple(prompt), max_tokens, SamplingSettings(), **kw)  # type: ignore[arg-type]


def prompt_of(i: int, n: int = 10) -> list[int]:
    return [(i * 37 + j * 11) % VOCAB for j in range(n)]


def collect(sched: Scheduler, events: dict[int, list[object]]) -> None:
    for ev in sched.take_events():
        events.setdefault(ev.serial, []).append(ev)


def run_all(sched: Scheduler, engine: SimulatedEngine, events: dict[int, list[object]] | None = None,
            limit: int = 10_000) -> dict[int, list[object]]:
    events = {} if events is None else events
    for _ in range(limit):
        busy = engine.step()
        collect(sched, events)
        if not busy and not sched.has_work():
            return events
    raise AssertionError("scheduler did not go idle")


def tokens_of(evs: list[object]) -> list[int]:
    return [e.token for e in evs if isinstance(e, Emitted)]


def terminal(evs: list[object]) -> ep.TerminalEvent:
    ts = [e for e in evs if isinstance(e, Terminal)]
    assert len(ts) == 1
    return ts[0].event


def _row(words: np.ndarray, i: int) -> slice:
    start = len(HEADER_FIELDS) + i * len(ROW_FIELDS)
    return slice(start, start + len(ROW_FIELDS))


def _field(name: str) -> int:
    return ROW_FIELDS.index(name)


# ---- CACHE-16..18: validated before any lane retires ----------------------------------------

def _two_lanes_then_tamper(tamper: Callable[[Submission, np.ndarray], None]) -> tuple[Scheduler, dict]:
    """Two requests decode together; the tampered round is request 0's LAST round, so a
    scheduler that retired lanes before validating would finish it normally."""
    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 5), max_tokens=3))
    sched.add(1, spec(prompt_of(1, 5), max_tokens=6))
    events: dict[int, list[object]] = {}
    for _ in range(2):                     # prefill (token 1), decode (token 2)
        engine.step()
        collect(sched, events)
    assert len(tokens_of(events[0])) == 2 and 0 not in [ev.serial for ev in events[0] if isinstance(ev, Terminal)]
    published = sched.pool.counters.published
    engine.tamper = tamper
    engine.step()                          # request 0's third and last token: tampered
    collect(sched, events)
    assert sched.pool.counters.published == published          # nothing of the round published
    run_all(sched, engine, events)
    return sched, events


def _assert_round_failed(sched: Scheduler, events: dict) -> None:
    for serial in (0, 1):
        assert terminal(events[serial]).WhichOneof("outcome") == "failed", serial
        assert len(tokens_of(events[serial])) == 2, serial       # the tampered round emitted nothing
    assert sched.pool.used_pages == 0


def test_rows_out_of_submission_order_fail_the_round_before_retiring():
    # spec: CACHE-16
    def swap(sub: Submission, words: np.ndarray) -> None:
        assert len(sub.lanes) == 2
        a, b = words[_row(words, 0)].copy(), words[_row(words, 1)].copy()
        words[_row(words, 0)], words[_row(words, 1)] = b, a

    _assert_round_failed(*_two_lanes_then_tamper(swap))


@pytest.mark.parametrize("header_field, delta", [("sequence", -1), ("frame", 1)])
def test_stale_sequence_or_frame_fails_the_round_before_retiring(header_field, delta):
    # spec: CACHE-16
    def stale(sub: Submission, words: np.ndarray) -> None:
        i = HEADER_FIELDS.index(header_field)
        words[i] = (words[i] + delta) if header_field == "sequence" else (words[i] ^ 1)

    _assert_round_failed(*_two_lanes_then_tamper(stale))


@pytest.mark.parametrize("name, value", [("accepted", 1), ("emitted", 0), ("emitted", 2)])
def test_wrong_accepted_or_emitted_count_fails_the_round_before_retiring(name, value):
    # spec: CACHE-17
    def count(sub: Submission, words: np.ndarray) -> None:
        words[_row(words, 0).start + _field(name)] = value

    _assert_round_failed(*_two_lanes_then_tamper(count))


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_consumed_endpoint_fails_the_round_before_retiring(delta):
    # spec: CACHE-18
    def endpoint(sub: Submission, words: np.ndarray) -> None:
        words[_row(words, 1).start + _field("consumed")] += delta

    _assert_round_failed(*_two_lanes_then_tamper(endpoint))


def test_parse_and_validate_checks_order_counts_and_endpoints_directly():
    # spec: CACHE-16, CACHE-17, CACHE-18
    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 5)))
    sched.add(1, spec(prompt_of(1, 5)))
    plan = sched.schedule()
    assert plan is not None
    sub = plan.main
    sub.sequence, sub.frame = 41, 1
    words = engine._execute(sub)
    fmt = CompletionFormat.from_layout(completion_layout(64))
    rows = parse_and_validate(fmt, words, sub, vocab_size=VOCAB)
    assert rows.consumed.tolist() == [lane.end for lane in sub.lanes]
    for mutate, what in ((lambda w: w.__setitem__(0, 40), "sequence"),
                         (lambda w: w.__setitem__(_row(w, 0).start + _field("slot"), sub.lanes[1].slot), "slot"),
                         (lambda w: w.__setitem__(_row(w, 1).start + _field("accepted"), 3), "accepted"),
                         (lambda w: w.__setitem__(_row(w, 0).start + _field("consumed"), 0), "consumed")):
        bad = words.copy()
        mutate(bad)
        with pytest.raises(CompletionMismatch):
            parse_and_validate(fmt, bad, sub, vocab_size=VOCAB)


# ---- STOP-16..18: the host-stop barrier ----------------------------------------------------

def _decode_round(sched: Scheduler, engine: SimulatedEngine) -> RoundPlan:
    """Step until the next plan is a plain DECODE round; return it unexecuted."""
    for _ in range(50):
        plan = sched.schedule()
        assert plan is not None
        if plan.main.operation == cp.OPERATION_DECODE and not plan.initialization and not plan.restoration:
            return plan
        sched.complete(plan, engine.run(plan))
    raise AssertionError("no decode round")


def test_string_stop_request_forces_width_one_and_no_second_frame():
    # spec: STOP-16, STOP-17
    # control: the same decode round pipelines onto the second frame without a host stop
    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 6), max_tokens=20))
    plan = _decode_round(sched, engine)
    assert not sched.host_stop_barrier
    assert sched.pipeline_next(plan) is not None

    sched, engine = make()
    sched.add(0, spec(prompt_of(0, 6), max_tokens=20))
    sched.add(1, spec(prompt_of(1, 6), max_tokens=20, stops=StopSettings(strings=("never-generated",))))
    assert sched.host_stop_barrier
    plan = _decode_round(sched, engine)
    assert [lane.tokens for lane in plan.main.lanes] == [[PENDING_TOKEN], [PENDING_TOKEN]]   # width one
    assert sched.pipeline_next(plan) is None                 # at most one round outstanding
    sched.complete(plan, engine.run(plan))
    sched.cancel(1)
    run_all(sched, engine)
    assert not sched.host_stop_barrier                         # lifted once the request is gone


class TwoFrameRunner:
    """The simulated executor behind the worker's two-frame interface; records how many
    rounds were outstanding and which rounds carried which request."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self.outstanding = 0
        self.max_outstanding: dict[bool, int] = {False: 0, True: 0}   # barrier on? -> max rounds
        self.rounds_of: dict[int, int] = {}
        self.lock = threading.Lock()

    def launch(self, plan: RoundPlan, frame: int) -> None:
        with self.lock:
            self.outstanding += 1
            barrier = self.engine.scheduler.host_stop_barrier
            self.max_outstanding[barrier] = max(self.max_outstanding[barrier], self.outstanding)
            for lane in plan.main.lanes:
                self.rounds_of[lane.request.serial] = self.rounds_of.get(lane.request.serial, 0) + 1

    def collect(self, plan: RoundPlan):  # type: ignore[no-untyped-def]
        rows = self.engine.run(plan)
        with self.lock:
            self.outstanding -= 1
        return rows

    def run(self, plan: RoundPlan):  # type: ignore[no-untyped-def]
        raise AssertionError("the worker uses submit/collect")


class Sender:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finals: list[object] = []
        self.done = threading.Event()

    def send(self, arrays, final):  # type: ignore[no-untyped-def]
        from helios_backend.exchange import OUT_EVENT, OUT_TOKENS, decode_event
        self.tokens.extend(arrays[OUT_TOKENS].tolist())
        if final:
            self.finals.append(decode_event(arrays[OUT_EVENT]))
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class NullMetrics:
    def push(self, updates):  # type: ignore[no-untyped-def]
        pass


def _serve(jobs: list[tuple[int, RequestSpec]]) -> tuple[TwoFrameRunner, dict[int, Sender]]:
    sched, engine = make()
    runner = TwoFrameRunner(engine)
    hub = ResponseHub(on_cancel=lambda s: None, metrics=NullMetrics())
    worker = EngineLoop(sched, runner, hub, NullMetrics(), two_frames=True)
    hub.start()
    worker.start()
    senders = {}
    for serial, request_spec in jobs:
        senders[serial] = Sender()
        hub.register(Stream(serial, senders[serial]))
        worker.enqueue(serial, request_spec)
    try:
        for sender in senders.values():
            assert sender.done.wait(30)
    finally:
        worker.stop()
        hub.stop()
    return runner, senders


def test_worker_keeps_one_round_outstanding_and_decides_the_stop_before_the_next_round():
    # spec: STOP-17, STOP-18
    prompt = prompt_of(3, 6)
    ref = reference_tokens(prompt, 30, VOCAB)
    # control: without a stop the worker does use the second frame for plain decode rounds
    runner, senders = _serve([(1, spec(prompt, max_tokens=30))])
    assert senders[1].tokens == ref
    assert runner.max_outstanding[False] == 2
    # with a string stop that completes on the 6th generated token
    stop = "".join(f"<{t}>" for t in ref[4:6])
    runner, senders = _serve([(1, spec(prompt, max_tokens=30, stops=StopSettings(strings=(stop,))))])
    assert senders[1].tokens == ref[:6]
    fin = senders[1].finals[0].terminal.finished
    assert fin.reason == ep.FINISH_REASON_STOP_STRING and fin.usage.completion_tokens == 6
    assert runner.max_outstanding[True] == 1
    # one prefill round and one decode round per further token: no round after the match
    assert runner.rounds_of[1] == 6


# ---- STOP-23, 24, 32..34: what a host stop keeps and discards -------------------------------

def _stop_request(prompt: list[int], stop_at: int, **kw: object) -> tuple[RequestSpec, list[int]]:
    ref = reference_tokens(prompt, 40, VOCAB)
    return spec(prompt, max_tokens=40, stops=StopSettings(token_ids=(ref[stop_at],)), **kw), ref


def test_host_stop_releases_its_private_candidate_only_after_the_fence():
    # spec: STOP-23, STOP-32, STOP-34
    prompt = prompt_of(7, 9)                      # page_tokens 4: 2 complete pages + 1
    request, ref = _stop_request(prompt, stop_at=4)
    assert ref[4] not in ref[:4]
    sched, engine = make()
    sched.add(0, request)
    events: dict[int, list[object]] = {}
    while True:
        plan = sched.schedule()
        assert plan is not None
        req = plan.main.lanes[0].request
        if req.output_len == 4:                   # this round samples the stop token
            break
        sched.complete(plan, engine.run(plan))
        collect(sched, events)
    pages = list(req.pages)
    private = pages[req.published_pages:]
    assert private and all(not sched.pool.is_published(p) for p in private)
    rows = engine.run(plan)                        # the round is in flight: nothing freed yet
    assert sched.pool.used_pages == len(pages)
    sched.complete(plan, rows)                     # its fence: the stop is decided now
    collect(sched, events)
    fin = terminal(events[0]).finished
    assert fin.reason == ep.FINISH_REASON_STOP_TOKEN and tokens_of(events[0]) == ref[:5]
    assert sched.pool.used_pages == 0
    # the private partial page (the publication candidate) was discarded, not published
    assert all(not sched.pool.is_published(p) for p in private)
    assert sched.has_work() is False


def test_host_stop_keeps_published_history_unchanged():
    # spec: STOP-24, STOP-33
    prompt = prompt_of(8, 12)                     # 3 complete pages of 4
    request, ref = _stop_request(prompt, stop_at=6)
    assert ref[6] not in ref[:6]
    sched, engine = make()
    sched.add(0, request)
    events = run_all(sched, engine)
    assert terminal(events[0]).finished.reason == ep.FINISH_REASON_STOP_TOKEN
    published_before = {p: engine.cache[p].copy() for p in range(sched.config.num_pages) if sched.pool.is_published(p)}
    assert len(published_before) >= 4             # the prompt's 3 pages and the first output page
    # the consumed history (prompt + 6 consumed outputs; the stop token was never consumed)
    # is reused as it was: a continuation of it matches every complete page, including
    # the one holding generated tokens, and generates what an unpaged run generates
    history = prompt + ref[:6]
    sched.add(1, spec(history + [5], max_tokens=5))
    events = run_all(sched, engine)
    reused = terminal(events[1]).finished.usage.reused_prompt_tokens
    assert reused == (len(history) // 4) * 4 == 16
    assert tokens_of(events[1]) == reference_tokens(history + [5], 5, VOCAB)
    for page, content in published_before.items():
        assert np.array_equal(engine.cache[page], content), page   # immutable, never rewritten
    assert engine.writes_to_shared == []


# ---- OBS-9, OBS-13, OBS-16: observation changes nothing ----------------------------------

def _workload(observe: bool) -> tuple[list[str], dict[int, list[int]], dict[int, tuple], list[int]]:
    sched, engine = make(num_pages=14, page_tokens=4, slots=4, snapshots=0)
    shared = prompt_of(1, 12)
    jobs = [spec(shared + [1, 2], max_tokens=12, observe_timestamps=observe),
            spec(shared + [3], max_tokens=9, observe_timestamps=observe),
            spec(prompt_of(5, 7), max_tokens=30, observe_timestamps=observe),
            spec(prompt_of(6, 3), max_tokens=4, observe_timestamps=observe,
                 stops=StopSettings(token_ids=(reference_tokens(prompt_of(6, 3), 4, VOCAB)[2],)))]
    events: dict[int, list[object]] = {}
    for serial, job in enumerate(jobs):
        sched.add(serial, job)
        engine.step()
        collect(sched, events)
    run_all(sched, engine, events)
    outcomes = {}
    for serial, evs in events.items():
        fin = terminal(evs).finished
        outcomes[serial] = (fin.reason, fin.usage.completion_tokens, fin.usage.reused_prompt_tokens)
    stamps = [e.timestamp_ns for evs in events.values() for e in evs if isinstance(e, Emitted)]
    return engine.launched, {s: tokens_of(e) for s, e in events.items()}, outcomes, stamps


def test_observation_changes_no_termination_lookup_limit_or_schedule():
    # spec: OBS-9
    launched_plain, tokens_plain, outcomes_plain, stamps_plain = _workload(observe=False)
    launched_obs, tokens_obs, outcomes_obs, stamps_obs = _workload(observe=True)
    assert launched_obs == launched_plain                      # the same rounds, programs, order
    assert tokens_obs == tokens_plain
    assert outcomes_obs == outcomes_plain                      # finish reasons, limits, prefix reuse
    assert any(o[2] > 0 for o in outcomes_plain.values())      # prefix lookup was exercised
    assert sum(o[0] == ep.FINISH_REASON_LENGTH for o in outcomes_plain.values()) >= 2
    assert set(stamps_plain) == {-1} and min(stamps_obs) >= 0   # and observation did happen


class CountingClock:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return time.perf_counter_ns()


def test_unobserved_requests_read_no_per_token_clock(monkeypatch):
    # spec: OBS-16
    clock = CountingClock()
    monkeypatch.setattr(scheduler_module.time, "monotonic_ns", clock)
    for observe, expect_reads in ((False, False), (True, True)):
        sched, engine = make()
        sched.add(0, spec(prompt_of(0, 5), max_tokens=6, observe_timestamps=observe))
        sched.add(1, spec(prompt_of(1, 5), max_tokens=6, observe_timestamps=observe))
        clock.calls = 0
        events = run_all(sched, engine)
        stamps = [e.timestamp_ns for evs in events.values() for e in evs if isinstance(e, Emitted)]
        assert len(stamps) == 12
        if expect_reads:
            assert clock.calls >= 1 and all(s >= 0 for s in stamps)
        else:
            assert clock.calls == 0 and stamps == [-1] * 12


class SlowGrammar:
    """Records when consume() started, then takes a while: a timestamp taken after
    grammar advancement would be later than the recorded start."""

    def __init__(self, origin: int) -> None:
        self.origin = origin
        self.started: list[int] = []

    def fill_mask(self, out_words: np.ndarray) -> None:
        out_words[:] = -1

    def consume(self, token: int) -> bool:
        self.started.append(time.monotonic_ns() - self.origin)
        time.sleep(0.002)
        return True


class SlowStop(HostStopCheck):
    def __init__(self, origin: int) -> None:
        super().__init__(StopSettings(token_ids=(VOCAB + 1,)), None)
        self.origin = origin
        self.started: list[int] = []

    def observe(self, token: int):  # type: ignore[no-untyped-def]
        self.started.append(time.monotonic_ns() - self.origin)
        time.sleep(0.002)
        return super().observe(token)


def test_token_timestamps_precede_grammar_advancement_and_stop_handling():
    # spec: OBS-13
    origin = time.monotonic_ns()
    cfg = SchedulerConfig(page_tokens=4, num_pages=64, request_slots=4, max_active=4, queue_capacity=8,
                          context_tokens=128, max_pages_per_row=32, vocab_size=VOCAB, input_vocab_size=VOCAB + 2,
                          eos_ids=(), clock_origin_ns=origin)
    stops: list[SlowStop] = []

    def factory(s: RequestSpec) -> SlowStop:
        stops.append(SlowStop(origin))
        return stops[-1]

    sched = Scheduler(cfg, VariantTable(variants()), stop_factory=factory)
    engine = SimulatedEngine(sched)
    grammar = SlowGrammar(origin)
    sched.add(0, spec(prompt_of(0, 5), max_tokens=5, observe_timestamps=True, constrained=True), grammar)
    sched.add(1, spec(prompt_of(1, 5), max_tokens=5, observe_timestamps=True,
                      stops=StopSettings(token_ids=(VOCAB + 1,))))
    events = run_all(sched, engine)
    stamps0 = [e.timestamp_ns for e in events[0] if isinstance(e, Emitted)]
    stamps1 = [e.timestamp_ns for e in events[1] if isinstance(e, Emitted)]
    assert len(stamps0) == len(grammar.started) == 5 and len(stamps1) == len(stops[0].started) == 5
    assert all(t <= g for t, g in zip(stamps0, grammar.started))
    assert all(t <= s for t, s in zip(stamps1, stops[0].started))


# ---- HTTP-13: retained output is bounded by prompt and output limits -----------------------

def test_retained_output_is_bounded_by_admitted_limits():
    # spec: HTTP-13
    sched, engine = make(context=32)
    sched.add(0, spec(prompt_of(0, 20), max_tokens=10_000))      # clipped to the context
    sched.add(1, spec(prompt_of(1, 5), max_tokens=7))
    events = run_all(sched, engine)
    assert len(tokens_of(events[0])) == 32 - 20                 # prompt + output fit the context
    assert len(tokens_of(events[1])) == 7
    for evs in events.values():
        assert sum(isinstance(e, Terminal) for e in evs) == 1
