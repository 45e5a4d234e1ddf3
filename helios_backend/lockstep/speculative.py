"""Speculative generation over a NativeModel, synchronously (the CPU path of docs/speculative.md).

SlotInitialization and prefill come from the plain LockstepGenerator; then each round is planned from validated
completions only (SPEC-15), packed with the copied proposals, launched, validated
(scheduler/speculative.validate_completion) and only then applied to the requests.

    driver = SpeculativeLockstepGenerator(model, SpeculativeOptions(enabled=True, history_drafting=True))
    [result] = driver.generate([GenerationRequest(prompt, max_tokens=32)])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from helios_proto import contract_pb2 as C

from helios_backend.engine.model import NativeModel
from helios_backend.packing import PackedLane
from helios_backend.lockstep.generator import LockstepGenerator, GenerationRequest, GenerationResult, _Active
from helios_backend.scheduler.speculative import (
    Candidate,
    LaneOutcome,
    SpeculativeOptions,
    SpeculativeRound,
    SpeculativeTable,
    publishable,
    validate_completion,
)


@dataclass
class RoundStats:
    program: str
    offers: list[int]
    accepted: list[int]


@dataclass
class SpeculativeRun:
    results: list[GenerationResult]
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(sum(r.accepted) for r in self.rounds)


class _CountingDriver(LockstepGenerator):
    """The plain driver, counting launches: the executor numbers every submission (CACHE-16).
    `launches` is the sequence the next submission gets; the count starts from the sequence of
    this driver's first completion (a model may have served others before)."""

    launches: int | None = None

    def step(self, program: str, lanes: Sequence[PackedLane], frame: int = 0) -> np.ndarray:
        rows = super().step(program, lanes, frame)
        if self.launches is None:
            completion = self.model.execution_manifest.transport.completion_buffer
            self.launches = int(self.model.executor.read_buffer(completion).view(np.int32)[0])
        self.launches += 1
        return rows

    def take_sequence(self) -> int:
        """The sequence of a submission made outside `step` (a speculative round), counted."""
        if self.launches is None:
            raise RuntimeError("a speculative round before the first plain step: its sequence is unknown")
        sequence = self.launches
        self.launches += 1
        return sequence


class SpeculativeLockstepGenerator:
    def __init__(self, model: NativeModel, options: SpeculativeOptions) -> None:
        self.model = model
        self.table = SpeculativeTable.select(model.graphs, options)
        self.plain = _CountingDriver(model)
        self.format = self.plain.format
        self.vocab = model.contract.model.vocabulary.sampled_tokens
        self.context = model.contract.context_tokens

    def candidates(self, actives: Sequence[_Active]) -> list[Candidate]:
        out = []
        for key, a in enumerate(actives):
            if a.result.finish:
                continue
            history = list(a.request.prompt) + a.result.tokens
            out.append(Candidate(key, a.slot, a.generation, a.consumed, history,
                                 output_left=a.request.max_tokens - len(a.result.tokens),
                                 context_left=self.context - a.consumed))
        return out

    def run_round(self, actives: Sequence[_Active], round_: SpeculativeRound, frame: int = 0) -> list[LaneOutcome]:
        """Pack, launch, validate; request state changes only after validation."""
        lanes = []
        allocates = round_.program.length_source == C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT
        for lane in round_.lanes:
            active = actives[lane.candidate.key]
            self.plain._ensure_pages(active, lane.reserve_end)   # pages cover the lane's full ceiling (SPEC-21)
            lanes.append(PackedLane(slot=active.slot, generation=active.generation, start=active.consumed,
                              page_table=list(active.pages), proposals=np.asarray(lane.proposals, dtype=np.int32),
                              proposal_generation=active.generation, proposal_consumed=active.consumed,
                              prefix_limit=lane.ceiling if allocates else 0))
        executor = self.model.executor
        self.model.packer.pack(round_.program.program, frame, lanes)
        executor.launch(round_.program.program, frame)
        round_.sequence, round_.frame = self.plain.take_sequence(), frame
        words = executor.wait(frame)
        return validate_completion(self.format, words, round_, self.vocab, self.table.max_width)

    def apply(self, actives: Sequence[_Active], round_: SpeculativeRound, outcomes: Sequence[LaneOutcome]) -> None:
        for outcome in publishable(round_, outcomes):
            active = actives[outcome.key]
            active.consumed = outcome.consumed
            active.result.tokens.extend(outcome.tokens)
            if outcome.finish == 1:
                active.result.finish = "eos"
            elif outcome.finish == 2 or len(active.result.tokens) >= active.request.max_tokens:
                active.result.finish = "length"

    def generate(self, requests: Sequence[GenerationRequest]) -> SpeculativeRun:
        actives = self.plain.admit(requests, range(len(requests)))
        for active in actives:
            self.plain.prefill(active)
        run = SpeculativeRun([a.result for a in actives])
        while True:
            candidates = self.candidates(actives)
            if not candidates:
                return run
            round_ = self.table.plan(candidates)
            if round_ is None:
                raise RuntimeError("speculation is not enabled on this model")
            outcomes = self.run_round(actives, round_)
            self.apply(actives, round_, outcomes)
            run.rounds.append(RoundStats(round_.program.program, [o.offers for o in outcomes],
                                         [o.accepted for o in outcomes]))
