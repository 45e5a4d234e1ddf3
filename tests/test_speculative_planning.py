"""A speculative round planned from columns (Scheduler._decode_columns, then the speculative
round built from the block's columns and its ceilings reserved in one allocation) against the
per-lane reference: the base loop's Lane per lane, the round's fields read from the Lanes and each
lane's pages reserved in turn, which is how the scheduler planned them before (the traces of this
test were also compared with the scheduler before the columns: identical).

Two schedulers run the worker's loop over the same random workload on a model that mostly
repeats its history (copies accepted in part, so rounds go speculative and back), with
finishing lanes (EOS, output and context limits), host stops, constrained lanes (min_tokens,
logit bias: width one with completion feedback), logprobs, cancels in flight, page boundaries
and page shortages; every round's plans (programs, lanes, proposals, ceilings, each lane's page
table), events, fences and the page pool must be identical, and the columnar run must have
planned speculative rounds from columns.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.scheduler.plan import RoundPlan
from helios_backend.scheduler.request import RequestSpec
from helios_backend.scheduler.scheduler import SchedulerConfig
from helios_backend.scheduler.speculative_scheduler import SpeculativeScheduler
from helios_backend.scheduler.speculative_width import WidthPolicy
from helios_backend.scheduler.variants import VariantTable
from tests.scheduler_sim import variants
from tests.test_decode_block import _spec as _decode_block_spec
from tests.test_speculative_completion import EOS, ROWS, VOCAB, _drive, _table


class PerLaneSpeculativeScheduler(SpeculativeScheduler):
    """The reference: the speculative round planned lane by lane, as before the columns. Run with
    config.columnar_decode off, so the base loop makes a Lane per lane and the round's fields are
    read from those Lanes; each candidate's output left is read from its request, and each lane's
    pages are reserved in turn."""

    def _candidates(self, fields, limits):  # type: ignore[no-untyped-def]
        found = super()._candidates(fields, limits)
        return None if found is None else \
            [c._replace(output_left=req.spec.max_tokens - req.output_len) for c, req in zip(found, fields.requests)]

    def _reserve_ceilings(self, requests, lanes) -> bool:  # type: ignore[no-untyped-def]
        for req, lane in zip(requests, lanes):
            if not self._reserve_pages(req, lane.reserve_end):
                return False
        return True


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


def _spec(rng: random.Random, bases: list[list[int]]) -> RequestSpec:
    """The decode-block test's mix (shared prefixes, EOS, ignore_eos, limits, min_tokens, logit
    bias, host stops, observed timestamps), now and then a logprob request."""
    spec = _decode_block_spec(rng, bases)
    return dataclasses.replace(spec, logprobs=True) if rng.random() < 0.04 else spec


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
    bases = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
    trace = _drive(sched, rng, steps, lambda r: _spec(r, bases), _plan_record, arrivals=(0,) * 10 + (1, 1, 3),
                   fences=True)
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
