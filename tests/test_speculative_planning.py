"""A speculative round planned from columns (Scheduler._decode_columns, then the speculative
round built from the block's columns and its ceilings reserved in one allocation) against the
per-lane reference: the base loop's Lane per lane, Candidates read from the Lanes and each lane's
pages reserved in turn, which is how the scheduler planned them before.

Two schedulers run the worker's loop over the same random workload on a model that mostly
repeats its history (copies accepted in part, so rounds go speculative and back), with
finishing lanes (EOS, output and context limits), host stops, constrained lanes (min_tokens,
logit bias: width one with completion feedback), logprobs, cancels in flight, page boundaries
and page shortages; every round's plans (programs, lanes, proposals, ceilings, each lane's page
table), events, fences and the page pool must be identical, and the columnar run must have
planned speculative rounds from columns.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.decode_block import DecodeBlock, explicit_lanes
from helios_backend.scheduler.events import expand
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.plan import PENDING_TOKEN, RoundPlan, Submission
from helios_backend.scheduler.request import LogitBias, RequestSpec, SamplingSettings, StopSettings
from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
from helios_backend.scheduler.speculative import Candidate
from helios_backend.scheduler.speculative_scheduler import ScheduledSpeculativeLane, SpeculativeScheduler
from helios_backend.scheduler.speculative_width import WidthPolicy, expected_tokens
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import variants
from tests.test_decode_block import _event_record
from tests.test_speculative_completion import EOS, ROWS, VOCAB, _rows, _table


class PerLaneSpeculativeScheduler(SpeculativeScheduler):
    """The reference: the speculative round planned lane by lane (config.columnar_decode off, so
    the base loop makes a Lane per lane), as the scheduler planned it before the columns."""

    def _speculative_schedule(self) -> RoundPlan | None:
        plan = Scheduler.schedule(self)
        if plan is None or not self.speculative.active:
            return plan
        main = plan.main
        assert not isinstance(main.lanes, DecodeBlock)
        if plan.restoration or plan.initialization or main.operation != cp.OPERATION_DECODE:
            return plan
        if any(lane.tokens != [PENDING_TOKEN] for lane in explicit_lanes(main.lanes)):
            return plan
        weighing = self._weighed(main.lanes)
        if weighing is None:
            return plan
        acceptance = weighing.acceptance
        limits = self._cheapest_width(weighing)
        eos_ids, stops, context = self.config.eos_ids, self._stops, self.config.context_tokens
        candidates = []
        for lane, limit in zip(main.lanes, limits):
            req = lane.request
            spec = req.spec
            if (req.host_values and (req.needs_mask(eos_ids) or spec.logit_bias is not None)) \
                    or spec.logprobs or spec.top_logprobs > 0 or req.serial in stops:
                return plan
            tokens = req.tokens
            candidates.append(Candidate(req.serial, lane.slot, lane.generation, lane.start, tokens,
                                        spec.max_tokens - req.output_len, context - len(tokens),
                                        req.inflight - 1, req.device_pending, False, False, limit))
        round_ = self.speculative.plan(candidates, self._lookup)
        if round_ is None or len(round_.lanes) != len(main.lanes):
            self._idle(acceptance)
            return plan
        policy, rates = self.policy, weighing.rates
        for i, (a, limit, lane) in enumerate(zip(acceptance, limits, round_.lanes)):
            if limit and not lane.proposals:
                a.miss(policy)
                rates[i] = a.rate
        expected = sum(expected_tokens(p, 1 + len(lane.proposals)) for p, lane in zip(rates, round_.lanes))
        if not any(lane.proposals for lane in round_.lanes) or \
                not policy.worth(expected, len(round_.lanes), round_.program.width,
                                 self._ratio(round_.program, len(round_.lanes))):
            self._idle([a for a, lane in zip(acceptance, round_.lanes) if lane.proposals or not lane.candidate.draft_limit])
            return plan
        for decoded, spec_lane in zip(main.lanes, round_.lanes):
            if not self._reserve_pages(decoded.request, spec_lane.reserve_end):
                return plan
        lanes = [ScheduledSpeculativeLane(decoded.request, decoded.slot, decoded.generation, decoded.start,
                                          decoded.tokens, decoded.sample, decoded.output_limit,
                                          proposals=spec_lane.proposals, ceiling=spec_lane.ceiling, round=round_)
                 for decoded, spec_lane in zip(main.lanes, round_.lanes)]
        plan.main = Submission(round_.program.variant, lanes)
        self.counters.launched(cp.OPERATION_DECODE, -1)
        self.counters.launched(cp.OPERATION_SPECULATIVE)
        return plan


class ColumnarSpeculativeScheduler(SpeculativeScheduler):
    """The product, counting the speculative rounds it planned from a block of columns."""
    from_columns = 0

    def _speculative_schedule(self) -> RoundPlan | None:
        plan = super()._speculative_schedule()
        if plan is not None and plan.main.operation == cp.OPERATION_SPECULATIVE and self._last_from_columns:
            self.from_columns += 1
        return plan

    def _decode_columns(self) -> RoundPlan | None:
        plan = super()._decode_columns()
        self._last_from_columns = plan is not None
        return plan

    _last_from_columns = False


def _spec(rng: random.Random) -> RequestSpec:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))]
    kw: dict[str, object] = {}
    roll = rng.random()
    if roll < 0.04:
        kw["min_tokens"] = rng.randrange(1, 6)                       # host values while below it
    elif roll < 0.07:
        kw["logit_bias"] = LogitBias(np.array([3, 7], np.int32), np.array([1.5, -2.0], np.float32))
    elif roll < 0.10:
        kw["stops"] = StopSettings(token_ids=(rng.randrange(VOCAB),))   # host stops: feedback rounds
    elif roll < 0.13:
        kw["logprobs"] = True
    return RequestSpec(tuple(prompt), rng.randrange(1, 60), SamplingSettings(), ignore_eos=rng.random() < 0.5,
                       observe_timestamps=rng.random() < 0.3, **kw)  # type: ignore[arg-type]


def _lane_record(lane) -> tuple:  # type: ignore[no-untyped-def]
    return (lane.request.serial, lane.slot, lane.generation, lane.start, list(lane.tokens), lane.sample,
            lane.output_limit, lane.initialize, list(getattr(lane, "proposals", ())), getattr(lane, "ceiling", None),
            list(lane.request.pages))


def _plan_record(plan: RoundPlan) -> list:
    if plan.main.operation == cp.OPERATION_SPECULATIVE:     # the columns the runner packs are the lanes'
        columns = getattr(plan.main.lanes[0].round, "columns", None)
        if columns is not None:
            assert [c.tolist() for c in columns] == [[lane.slot for lane in plan.main.lanes],
                                                     [lane.generation for lane in plan.main.lanes],
                                                     [lane.start for lane in plan.main.lanes]]
    return [(sub.variant.program, [_lane_record(lane) for lane in sub.lanes]) for sub in plan.submissions()]


def _trace(kind: type, columnar: bool, seed: int, steps: int = 300) -> tuple[list, dict, SpeculativeScheduler]:
    rng = random.Random(seed)
    config = SchedulerConfig(page_tokens=4, num_pages=rng.choice((48, 64, 400)), request_slots=16,
                             max_active=rng.choice((8, 16)), queue_capacity=256, context_tokens=rng.choice((48, 96)),
                             max_pages_per_row=24, vocab_size=VOCAB, input_vocab_size=VOCAB, eos_ids=EOS,
                             logprobs_recorded=True, columnar_decode=columnar)
    sched = kind(config, VariantTable(variants(rows=ROWS, tokens=(16, 64))), _table(),
                 stop_factory=lambda spec: HostStopCheck(spec.stops, None),
                 policy=WidthPolicy(7, row_cost=0.05, measured=False))
    trace: list = []
    serial = 0
    inflight: list[RoundPlan] = []
    for step in range(steps + 5000):
        if step >= steps and not inflight and not sched.has_work():
            break
        arrivals = rng.choice((0,) * 10 + (1, 1, 3)) if step < steps else 0
        cancel = rng.randrange(serial + 1) if step < steps and rng.random() < 0.04 else -1
        for _ in range(arrivals):
            sched.add(serial, _spec(rng))
            serial += 1
        if not inflight:
            plan = sched.schedule()
            if plan is None:
                trace.append(("idle", step))
                continue
            trace.append(("plan", _plan_record(plan)))
            inflight.append(plan)
        if len(inflight) == 1:
            nxt = sched.pipeline_next(inflight[0])
            if nxt is not None:
                trace.append(("plan", _plan_record(nxt)))
                inflight.append(nxt)
        if cancel >= 0:
            sched.cancel(cancel)
        plan = inflight.pop(0)
        sched.complete(plan, _rows(plan))
        trace.append(("events", [_event_record(ev) for ev in expand(sched.take_worker_events())]))
        trace.append(("fence", sorted((req.serial, req.inflight) for req in sched._by_serial.values())))
        pool = sched.pool
        trace.append(("pool", sorted(pool._key_of.items()), list(pool._lru), pool.free_pages))
    state = {"finished": dict(sched.counters.finished), "generated": sched.counters.generated_tokens,
             "launches": dict(sched.counters.launches), "drafting": dict(vars(sched.drafting)),
             "preemptions": sched.counters.preemptions}
    return trace, state, sched


@pytest.mark.parametrize("seed", range(10))
def test_speculative_rounds_planned_from_columns_equal_the_per_lane_plans(seed: int) -> None:  # spec: SPEC-13, SPEC-15, SPEC-21, SPEC-44, SPEC-50
    reference, state, _ = _trace(PerLaneSpeculativeScheduler, False, seed)
    columnar, columnar_state, sched = _trace(ColumnarSpeculativeScheduler, True, seed)
    assert isinstance(sched, ColumnarSpeculativeScheduler)
    assert state["launches"].get(cp.OPERATION_SPECULATIVE, 0) > 10 and state["generated"] > 300
    assert sched.from_columns > 0, f"{sched.from_columns} speculative rounds planned from columns"
    assert len(columnar) == len(reference)
    for i, (want, got) in enumerate(zip(reference, columnar)):
        assert got == want, f"record {i} differs"
    assert columnar_state == state


def test_the_workload_reaches_the_fallbacks() -> None:
    # the mixes the equivalence runs over: constrained and host-stop lanes beside speculative
    # rounds, preemption on page shortages, lanes finishing by EOS and length
    states = [_trace(PerLaneSpeculativeScheduler, False, seed)[1] for seed in range(10)]
    assert sum(s["preemptions"] for s in states) > 0
    finished = {reason for s in states for reason in s["finished"]}
    assert len(finished) >= 3                   # EOS, length, cancelled (and stops)
