"""ProgramRunner for speculative rounds: packs copied proposals, validates the speculative
completion before the scheduler sees it (scheduler/speculative.validate_completion).

    runner = SpeculativeProgramRunner(executor, packer, layout, vocab, bins, eos_ids,
                                      mask_words=..., max_width=table.max_width)

Other submissions go through ProgramRunner unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from helios_proto import contract_pb2 as cp

from helios_backend.packing import PackedLane
from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.plan import Lane, RoundPlan
from helios_backend.scheduler.speculative import SpeculativeRound, validate_completion
from helios_backend.scheduler.speculative_scheduler import ScheduledSpeculativeLane, SpeculativeRows
from helios_backend.engine.runner import ProgramRunner


@dataclass
class SpeculativeProgramRunner(ProgramRunner):
    max_width: int = 1                   # the core's largest speculative width (extension records)

    def collect(self, plan: RoundPlan) -> CompletionRows:
        main = plan.main
        if main.operation != cp.OPERATION_SPECULATIVE:
            return super().collect(plan)
        round_ = _round_of(main.lanes[0])
        round_.sequence, round_.frame = main.sequence, main.frame
        words = self._main_words(plan)
        outcomes = validate_completion(self.fmt, words, round_, self.vocab_size, self.max_width)
        # the base rows carry each lane's last emitted token; the outcomes carry all of them
        return SpeculativeRows(np.array([o.tokens[-1] for o in outcomes], np.int32),
                               np.array([o.consumed for o in outcomes], np.int32),
                               np.array([o.finish for o in outcomes], np.int32), None, None, None,
                               outcomes=outcomes)

    def _packed(self, lane: Lane, operation: cp.Operation.ValueType) -> PackedLane:
        packed = super()._packed(lane, operation)
        if operation == cp.OPERATION_SPECULATIVE and isinstance(lane, ScheduledSpeculativeLane):
            packed.proposals = np.asarray(lane.proposals, dtype=np.int32)
            packed.proposal_generation = lane.generation
            packed.proposal_consumed = lane.start
            if _round_of(lane).program.length_source == cp.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT:
                packed.prefix_limit = lane.ceiling
        return packed


def _round_of(lane: Lane) -> SpeculativeRound:
    """The speculative round a SPECULATIVE submission's lane belongs to (set by the scheduler)."""
    if not isinstance(lane, ScheduledSpeculativeLane) or lane.round is None:
        raise TypeError("a SPECULATIVE submission's lanes are ScheduledSpeculativeLanes with their round")
    return lane.round
