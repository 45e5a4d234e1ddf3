"""The columnar decode steady state (scheduler/decode_block.py) against the per-lane path.

Two schedulers, one with `columnar_decode` (plain decode lanes behind a round in flight held
as a DecodeBlock) and one without (a Lane per lane), run the worker's two-frame loop over the
same random workload (arrivals with shared prefixes, EOS, ignore_eos, output limits, cancels,
page shortages that preempt, snapshots, requests with host values or host stops) on the
simulated engine; every round's plans (each submission's program and lanes, field by field)
and events must be identical, and the columnar run must actually have used blocks.
"""
from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from helios_proto import exchange_pb2 as ep

from helios_backend.engine.process_wire import pack_events, unpack_events
from helios_backend.scheduler.decode_block import DecodeBlock, lane_columns, lane_requests
from helios_backend.scheduler.events import Emitted, Terminal, TokenBlock, expand
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan
from helios_backend.scheduler.request import LogitBias, Request, RequestSpec, SamplingSettings, StopSettings
from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import SimulatedEngine, variants

VOCAB = 64
EOS = (5, 9)


def _spec(rng: random.Random, bases: list[list[int]]) -> RequestSpec:
    prompt = list(rng.choice(bases)[:rng.randrange(0, 24)]) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    kw: dict[str, object] = {}
    roll = rng.random()
    if roll < 0.03:
        kw["min_tokens"] = rng.randrange(1, 6)                 # host values while below it
    elif roll < 0.06:
        kw["logit_bias"] = LogitBias(np.array([3, 7], np.int32), np.array([1.5, -2.0], np.float32))
    elif roll < 0.075:
        kw["stops"] = StopSettings(token_ids=(rng.randrange(VOCAB),))   # host stops: feedback rounds
    return RequestSpec(tuple(prompt), rng.randrange(1, 40), SamplingSettings(), ignore_eos=rng.random() < 0.3,
                       observe_timestamps=rng.random() < 0.3, priority=rng.choice((0, 0, 0, 1)),
                       **kw)  # type: ignore[arg-type]


def _lane_record(lane: Lane) -> tuple:
    restore = None if lane.restore is None else (lane.restore.source_row, lane.restore.page,
                                                 lane.restore.page_index, lane.restore.tokens)
    return (lane.request.serial, lane.slot, lane.generation, lane.start, list(lane.tokens), lane.sample,
            lane.output_limit, lane.snapshot_row, restore, lane.initialize)


def _plan_record(plan: RoundPlan) -> list:
    return [(sub.variant.program, [_lane_record(lane) for lane in sub.lanes]) for sub in plan.submissions()] \
        + [sorted(req.serial for req in plan.preempted)]


def _event_record(ev: Emitted | Terminal) -> tuple:
    if isinstance(ev, Emitted):
        return ("token", ev.serial, ev.token, ev.timestamp_ns >= 0, ev.logprob, ev.top_ids, ev.top_logprobs)
    event = ep.TerminalEvent()
    event.CopyFrom(ev.event)
    if event.HasField("finished"):
        event.finished.ClearField("performance")          # clock readings differ between the runs
    return ("terminal", ev.serial, event.SerializeToString(deterministic=True))


def _trace(columnar: bool, seed: int, steps: int = 400, failures: bool = False) -> tuple[list, int, dict]:
    rng = random.Random(seed)
    cfg = SchedulerConfig(page_tokens=4, num_pages=rng.choice((48, 96, 400)), request_slots=16, max_active=16,
                          queue_capacity=256, context_tokens=96, max_pages_per_row=24, vocab_size=VOCAB,
                          input_vocab_size=VOCAB, eos_ids=EOS, snapshot_capacity=4, columnar_decode=columnar)
    table = VariantTable(variants(rows=(1, 2, 4, 8, 16), tokens=(16, 64), initialization=rng.random() < 0.5))
    sched = Scheduler(cfg, table, stop_factory=lambda spec: HostStopCheck(spec.stops, None))
    engine = SimulatedEngine(sched)
    bases = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
    trace: list = []
    blocks = serial = 0
    inflight: list[RoundPlan] = []

    def launch(plan: RoundPlan, frame: int) -> None:
        nonlocal blocks
        if isinstance(plan.main.lanes, DecodeBlock):   # its page counts are its requests' pages (packing reads them)
            blocks += 1
            assert plan.main.lanes.page_counts.tolist() == [len(req.pages) for req in plan.main.lanes.requests]
        trace.append(("plan", _plan_record(plan)))
        engine.launch(plan, frame)

    for step in range(steps + 5000):
        if step >= steps and not inflight and not sched.has_work():
            break
        # the same inputs in both runs: drawn from the seed whatever the scheduler did
        arrivals = rng.choice((0, 0, 0, 0, 0, 0, 0, 1, 1, 4)) if step < steps else 0
        cancel = rng.randrange(serial + 1) if step < steps and rng.random() < 0.03 else -1
        for _ in range(arrivals):
            sched.add(serial, _spec(rng, bases))
            serial += 1
        if cancel >= 0:
            sched.cancel(cancel)
        if not inflight:
            plan = sched.schedule()
            if plan is None:
                trace.append(("idle", step))
                continue
            launch(plan, 0)
            inflight.append(plan)
        if len(inflight) == 1:
            nxt = sched.pipeline_next(inflight[0])
            if nxt is not None:
                launch(nxt, 1)
                inflight.append(nxt)
        plan = inflight.pop(0)
        rows = engine.collect(plan)
        if failures and rng.random() < 0.05:        # a failed round, and the one pipelined behind it
            sched.fail(plan, "failed")
            for later in inflight:
                engine.collect(later)
                sched.fail(later, "failed")
            inflight.clear()
        else:
            sched.complete(plan, rows)
        events = sched.take_worker_events()
        trace.append(("events", [_event_record(ev) for ev in expand(events)]))
        # the fence: each request's rounds in flight (a block round may hold it for the next one)
        trace.append(("fence", sorted((req.serial, req.inflight) for req in sched._by_serial.values())))
        pool = sched.pool                             # published pages, their keys and the LRU order
        trace.append(("pool", sorted(pool._key_of.items()), list(pool._lru), pool.free_pages))
    state = {"used_pages": sched.pool.used_pages, "writes_to_shared": list(engine.writes_to_shared),
             "finished": dict(sched.counters.finished), "generated": sched.counters.generated_tokens,
             "pipelined": sched.counters.pipelined, "preemptions": sched.counters.preemptions}
    return trace, blocks, state


@pytest.mark.parametrize("seed", range(8))
def test_columnar_decode_plans_and_events_equal_the_per_lane_path(seed: int) -> None:  # spec: SPEC-43, SPEC-44, SPEC-50, CACHE-23
    per_lane, none, state = _trace(False, seed)
    columnar, blocks, columnar_state = _trace(True, seed)
    assert none == 0 and blocks > 20, f"the columnar run used {blocks} blocks"
    assert state["pipelined"] > 20 and state["generated"] > 200
    assert state["writes_to_shared"] == []
    assert len(columnar) == len(per_lane)
    for i, (want, got) in enumerate(zip(per_lane, columnar)):
        assert got == want, f"record {i} differs"
    assert columnar_state == state


@pytest.mark.parametrize("seed", range(4))
def test_failed_rounds_release_the_same_fences_with_blocks(seed: int) -> None:
    # a block round that hands its requests' fence to the round behind it, then fails (and that
    # round with it): every request's rounds in flight, events and pages as lane by lane
    per_lane, _, state = _trace(False, 100 + seed, steps=300, failures=True)
    columnar, blocks, columnar_state = _trace(True, 100 + seed, steps=300, failures=True)
    assert blocks > 10 and sum(1 for kind, *_ in per_lane if kind == "events") > 100
    assert any(record[0] == "events" and any(ev[0] == "terminal" and b"failed" in ev[2] for ev in record[1])
               for record in per_lane)
    assert len(columnar) == len(per_lane)
    for i, (want, got) in enumerate(zip(per_lane, columnar)):
        assert got == want, f"record {i} differs"
    assert columnar_state == state


def test_a_block_round_hands_its_fence_to_the_round_behind_it() -> None:
    reqs = _requests(3)
    first = DecodeBlock.of(reqs, [4, 5, 6], [17, 16, 15])
    assert first.take_fence() == reqs                            # nothing to carry: one fence each
    second = first.advance(np.array([True, False, True]))
    assert second.take_fence() == [] and first.handed is second.kept
    assert first.release_fence() == [reqs[1]]                    # the others' fence is the second's now
    assert second.release_fence() == [reqs[0], reqs[2]]
    assert second.source is None                                 # settled: it holds no chain of earlier blocks
    third = second.advance(np.array([True, True]))             # behind a settled round: one fence each
    assert third.take_fence() == [reqs[0], reqs[2]] and second.handed is None
    # the round behind fails before the one it follows completed: it hands the fence back
    again = DecodeBlock.of(reqs, [4, 5, 6], [17, 16, 15])
    behind = again.advance(np.array([True, True, True]))
    assert behind.take_fence() == []
    assert behind.release_fence() == [] and again.handed is None
    assert again.release_fence() == reqs


def _requests(n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(100 + i, RequestSpec((1, 2, 3), 20, SamplingSettings(), observe_timestamps=i % 2 == 1,
                                           ignore_eos=i == 2), i)
        req.slot, req.generation, req.pages, req.token_limit = 7 - i, 3 + i, [10 + i, 20 + i], 23
        reqs.append(req)
    return reqs


def test_a_block_reads_as_the_lanes_it_holds() -> None:
    reqs = _requests(3)
    block = DecodeBlock.of(reqs, [4, 5, 6], [17, 16, 15])
    extra = Lane(reqs[0], 1, 9, 0, [1, 2, 3], True, 20, snapshot_row=2, initialize=True)
    block.append(extra)
    want = [Lane(req, req.slot, req.generation, start, [PENDING_TOKEN], True, limit)
            for req, start, limit in zip(reqs, (4, 5, 6), (17, 16, 15))] + [extra]
    assert list(block) == want and len(block) == 4 and block.size == 3
    assert block[-1] is extra and block[1:3] == want[1:3] and block[0] is block[0]
    for got, lanes in zip(lane_columns(block), lane_columns(want)):
        assert got.tolist() == lanes.tolist()
    assert lane_requests(block) == [lane.request for lane in want] == lane_requests(want)
    nxt = block.advance(np.array([True, False, True]))
    assert [(lane.request.serial, lane.start, lane.output_limit) for lane in nxt] == [(100, 5, 16), (102, 7, 14)]
    assert block.starts.tolist() == [4, 5, 6]                    # the round in flight keeps its columns
    joined = nxt.joined(DecodeBlock.of(reqs[1:2], [9], [3]))
    assert joined.serials.tolist() == [100, 102, 101] and joined.page_counts.tolist() == [2, 2, 2]


def test_token_blocks_travel_and_expand_to_the_emitted_events() -> None:
    block = TokenBlock(np.array([4, 8, 15], np.int64), np.array([16, 23, 42], np.int32),
                       np.array([-1, 77, -1], np.int64), np.array([-0.5, -1.25, 0.0], np.float32))
    bare = TokenBlock(np.array([1], np.int64), np.array([2], np.int32), None, None)
    terminal = Terminal(8, ep.TerminalEvent(finished=ep.Finished(reason=ep.FINISH_REASON_LENGTH)))
    emitted = [Emitted(4, 16, -1, -0.5, None, None), Emitted(8, 23, 77, -1.25, None, None),
               Emitted(15, 42, -1, 0.0, None, None)]
    assert expand([block, terminal, bare]) == emitted + [terminal, Emitted(1, 2, -1, 0.0, None, None)]
    received = unpack_events(pickle.loads(pickle.dumps(pack_events([block, terminal, emitted[0]]))))
    assert expand(received) == emitted + [terminal, emitted[0]]


def test_terminal_events_travel_as_bytes_and_arrive_equal() -> None:
    finished = ep.TerminalEvent(finished=ep.Finished(reason=ep.FINISH_REASON_STOP_STRING))
    finished.finished.usage.prompt_tokens, finished.finished.usage.completion_tokens = 32, 128
    finished.finished.performance.admitted_ns = 12345
    failed = ep.TerminalEvent(failed=ep.ExecutionFailure(message="round failed", completion_tokens=3))
    terminals = [Terminal(2**40 + 3, finished, first_token=True), Terminal(9, failed), Terminal(0, ep.TerminalEvent())]
    packed = pack_events(terminals)
    assert all(type(row) is bytes for row in packed)
    received = unpack_events(pickle.loads(pickle.dumps(packed)))
    assert received == terminals
    assert [isinstance(ev, Terminal) and ev.first_token for ev in received] == [True, False, False]


def test_the_round_after_a_round_of_prompts_is_planned_from_the_parked_block(monkeypatch: pytest.MonkeyPatch) -> None:  # spec: SPEC-43, SPEC-44
    """The workloads above (whose plans and events equal the per-lane path's) plan the round after
    a round of prompts from the block completed before it: a path they must keep exercising."""
    from helios_backend.scheduler.scheduler import Scheduler
    planned: list[int] = []
    rejoining = Scheduler._rejoining

    def counted(self: Scheduler, *args: object) -> DecodeBlock | None:
        block = rejoining(self, *args)         # type: ignore[arg-type]
        if block:
            planned.append(block.size)
        return block
    monkeypatch.setattr(Scheduler, "_rejoining", counted)
    for seed in range(4):
        _trace(True, seed)
    assert len(planned) > 10 and max(planned) > 4
