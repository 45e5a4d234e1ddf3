"""ProgramRunner for speculative rounds: packs copied proposals, validates the speculative
completion before the scheduler sees it (scheduler/speculative.validate_completion).

A SPECULATIVE submission is packed as the packer's columns (slots, generations, consumed
endpoints, lengths, proposal counts, ceilings, and each lane's proposals), a few gathers per
round instead of a PackedLane per lane; the same bytes as its PackedLanes
(tests/test_speculative_packing.py). Its lanes carry no host values: the scheduler plans no
constrained, biased or logprob lane into a speculative round.

    runner = SpeculativeProgramRunner(executor, packer, layout, vocab, bins, eos_ids,
                                      mask_words=..., max_width=table.max_width)

Other submissions go through ProgramRunner unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Sequence, cast

import numpy as np
from helios_proto import contract_pb2 as cp

from helios_backend.packing import LaneValues, PackedLane, RaggedRows
from helios_backend.scheduler.completion import CompletionRows
from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, RoundPlan, Submission
from helios_backend.scheduler.speculative import SpeculativeRound, validate_completion
from helios_backend.scheduler.speculative_scheduler import ScheduledSpeculativeLane, SpeculativeRows
from helios_backend.engine.runner import ProgramRunner

_HOST_VALUES = attrgetter("request.host_values")
_PENDING = [PENDING_TOKEN]               # a lane's tokens when it reads its device-owned pending token
_SLOT, _GENERATION, _START = attrgetter("slot"), attrgetter("generation"), attrgetter("start")
_SAMPLE, _SNAPSHOT_ROW = attrgetter("sample"), attrgetter("snapshot_row")
_PAGES, _CEILING = attrgetter("request.pages"), attrgetter("ceiling")
_PROPOSALS, _TOKENS = attrgetter("proposals"), attrgetter("tokens")


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
        return SpeculativeRows.of(outcomes)

    def _pack(self, sub: Submission, frame: int, plain: bool | None = None) -> None:
        lanes = cast(Sequence[ScheduledSpeculativeLane], sub.lanes)      # (where the operation is SPECULATIVE)
        if sub.operation != cp.OPERATION_SPECULATIVE or not lanes or any(map(_HOST_VALUES, lanes)) \
                or any(map(_PENDING.__ne__, map(_TOKENS, lanes))):       # (none: the scheduler plans neither)
            super()._pack(sub, frame, plain)
            return
        round_ = _round_of(lanes[0])
        program = round_.program
        n = len(lanes)
        copies = list(map(_PROPOSALS, lanes))
        counts = np.fromiter(map(len, copies), np.int64, n)
        # every lane's copies in one array (the packer writes them in one go, not a row per lane;
        # one lane's row is cheaper written as it is)
        proposals: LaneValues = [np.asarray(copies[0], dtype=np.int32)] if n == 1 else \
            RaggedRows(np.fromiter(chain.from_iterable(copies), np.int32, int(counts.sum())), counts)
        if round_.columns is not None:          # planned from columns: the scheduler's
            slots, generations, starts = round_.columns
        else:
            slots = np.fromiter(map(_SLOT, lanes), np.int64, n)
            generations = np.fromiter(map(_GENERATION, lanes), np.int64, n)
            starts = np.fromiter(map(_START, lanes), np.int64, n)
        if program.length_source == cp.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT:
            # the program writes each lane's length (<= its ceiling, total <= P): one query row here
            lengths, limits = np.ones(n, np.int64), np.fromiter(map(_CEILING, lanes), np.int64, n)
        else:
            lengths, limits = counts + 1, np.zeros(n, np.int64)
        columns: dict[int, np.ndarray] = {
            cp.VALUE_SOURCE_SLOT: slots,
            cp.VALUE_SOURCE_GENERATION: generations,
            cp.VALUE_SOURCE_CONSUMED_TOKENS: starts,
            cp.VALUE_SOURCE_QUERY_LENGTH: lengths,
            cp.VALUE_SOURCE_SAMPLING_DECISION: np.fromiter(map(_SAMPLE, lanes), np.int64, n),
            cp.VALUE_SOURCE_SNAPSHOT_DESTINATION: np.fromiter(map(_SNAPSHOT_ROW, lanes), np.int64, n),
            cp.VALUE_SOURCE_PROPOSAL_COUNT: counts,
            cp.VALUE_SOURCE_PROPOSAL_GENERATION: generations,    # the copies were made for this lane's
            cp.VALUE_SOURCE_PROPOSAL_CONSUMED: starts,           # generation and consumed endpoint
            cp.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: limits,
        }
        values: dict[int, LaneValues] = {cp.VALUE_SOURCE_PAGE_TABLE: list(map(_PAGES, lanes)),
                                         cp.VALUE_SOURCE_PROPOSAL_IDS: proposals}
        self.packer.pack_columns(sub.variant.program, frame, n, columns, values)

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
