"""The token-budget scheduler with speculative rounds: a subclass, so the loop itself is unchanged.

    scheduler = SpeculativeScheduler(config, variants, SpeculativeTable.select(graphs, options))
    runner = SpeculativeProgramRunner(...)          # helios_backend/engine/speculative_runner.py

A round that the base scheduler planned as plain DECODE (every lane reads its device-owned
pending token, nothing to restore or initialize) becomes a SPECULATIVE round when every lane may
carry proposals (no grammar, no host stops: those need width one and feedback, SPEC-44..49; no
logit bias: the speculative programs have no logit-bias input) and
history drafting found at least one: the cohort is the DECODE cohort, chosen from completed
observations (SPEC-15); pages are reserved for each lane's full ceiling (SPEC-21).

Completion: the runner validates the whole completion first (validate_completion, SPEC-40..42);
then each emitted token goes through the base scheduler's own completion path, one token at a
time, so EOS, output limits, events, timestamps, page publication, cancellation (SPEC-50: a
cancelled lane publishes nothing and retires at this fence, SPEC-51) stay in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan, Submission, Variant
from helios_backend.scheduler.request import Request, RequestState
from helios_backend.scheduler.scheduler import Scheduler, StopFactory
from helios_backend.scheduler.speculative import (
    Candidate,
    LaneOutcome,
    SpeculativeRound,
    SpeculativeTable,
)
from helios_backend.scheduler.config import SchedulerConfig
from helios_backend.scheduler.errors import ConfigurationError
from helios_backend.scheduler.generations import SlotGenerations
from helios_backend.scheduler.variants import VariantTable


@dataclass
class ScheduledSpeculativeLane(Lane):
    """A plan lane of a SPECULATIVE submission: the DECODE lane plus its proposals and ceiling."""
    proposals: list[int] = field(default_factory=list)
    ceiling: int = 1
    round: SpeculativeRound | None = None


@dataclass
class SpeculativeRows(CompletionRows):
    """Validated rows of a SPECULATIVE submission: one outcome per lane."""
    outcomes: list[LaneOutcome] = field(default_factory=list)


class SpeculativeScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, variants: VariantTable, table: SpeculativeTable,
                 stop_factory: StopFactory | None = None, generations: SlotGenerations | None = None) -> None:
        super().__init__(config, variants, stop_factory, generations)
        self.speculative = table

    def schedule(self) -> RoundPlan | None:
        plan = super().schedule()
        if plan is None or not self.speculative.active:
            return plan
        main = plan.main
        if plan.restoration or plan.initialization or main.operation != cp.OPERATION_DECODE:
            return plan
        if any(lane.tokens != [PENDING_TOKEN] for lane in main.lanes):
            return plan
        candidates = [self._candidate(lane) for lane in main.lanes]
        if any(c.constrained or c.host_stops for c in candidates):
            return plan
        round_ = self.speculative.plan(candidates)
        if round_ is None or len(round_.lanes) != len(main.lanes) or not any(l.proposals for l in round_.lanes):
            return plan
        for lane in round_.lanes:
            if not self._reserve_pages(self._by_serial[lane.candidate.key], lane.reserve_end):
                return plan                      # a shortage: plain decode this round
        lanes = [ScheduledSpeculativeLane(lane.request, lane.slot, lane.generation, lane.start, lane.tokens,
                                          lane.sample, lane.output_limit, proposals=list(spec.proposals),
                                          ceiling=spec.ceiling, round=round_)
                 for lane, spec in zip(main.lanes, round_.lanes)]
        plan.main = Submission(round_.program.variant, lanes)
        self.counters.launched(cp.OPERATION_DECODE, -1)           # the DECODE submission it replaces
        self.counters.launched(cp.OPERATION_SPECULATIVE)
        return plan

    def _candidate(self, lane: Lane) -> Candidate:
        req = lane.request
        return Candidate(req.serial, lane.slot, lane.generation, lane.start, req.tokens,
                         output_left=req.spec.max_tokens - req.output_len,
                         context_left=self.config.context_tokens - len(req.tokens),
                         inflight=req.inflight - 1,          # this round, planned but not submitted
                         device_pending=req.device_pending,
                         # speculative programs apply no logit bias: a biased request decodes plainly
                         constrained=req.needs_mask(self.config.eos_ids) or req.spec.logit_bias is not None,
                         host_stops=req.serial in self._stops)

    def complete(self, plan: RoundPlan, rows: CompletionRows) -> None:
        if plan.main.operation != cp.OPERATION_SPECULATIVE:
            super().complete(plan, rows)
            return
        if not isinstance(rows, SpeculativeRows):
            raise TypeError("a SPECULATIVE round completes with SpeculativeRows (validated outcomes)")
        decode = self.variants.fit(cp.OPERATION_DECODE, 1, 1)
        if decode is None:
            raise ConfigurationError("a SPECULATIVE round completed without a DECODE variant to retire it")
        for lane, outcome in zip(plan.main.lanes, rows.outcomes):
            self._apply(lane, outcome, decode)

    def _apply(self, lane: Lane, outcome: LaneOutcome, decode: Variant) -> None:
        """Each emitted token through the base completion path, as a one-token decode step."""
        req: Request = lane.request
        for j, token in enumerate(outcome.tokens):
            if j:
                req.inflight += 1                    # the base path retires one step per call
            step = Lane(req, lane.slot, lane.generation, lane.start + j, [PENDING_TOKEN], sample=True,
                        output_limit=lane.output_limit - j)
            one = CompletionRows(np.array([token], np.int32), np.array([step.end], np.int32),
                                 np.zeros(1, np.int32), None, None, None)
            super().complete(RoundPlan(Submission(decode, [step])), one)
            if req.state is RequestState.FINISHED or req.cancelled or req.finish:
                return
