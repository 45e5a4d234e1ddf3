"""Speculative generation over a NativeModel, synchronously (the CPU path of docs/speculative.md).

Admission and prefill are raw lanes (raw_lanes.py) on slots 0, 1, ...; then every round is
planned by the serving planner (SpeculativeTable.plan) from validated completions only (SPEC-15),
even where no lane has a proposal (a width-one round: the tests check those programs too, where
the SpeculativeScheduler would plan a plain DECODE), packed with the copied proposals, launched
through the ProgramRunner, validated (scheduler/speculative.validate_completion) and only then
applied to the requests.

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
from helios_backend.lockstep.generator import GenerationRequest, GenerationResult
from helios_backend.lockstep.raw_lanes import RawLanes, RawRequest
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


class SpeculativeLockstepGenerator:
    def __init__(self, model: NativeModel, options: SpeculativeOptions) -> None:
        self.model = model
        self.table = SpeculativeTable.select(model.graphs, options)
        self.plain = RawLanes(model)
        self.format = self.plain.format
        self.vocab = model.contract.model.vocabulary.sampled_tokens
        self.context = model.contract.context_tokens

    def candidates(self, actives: Sequence[RawRequest]) -> list[Candidate]:
        out = []
        for key, a in enumerate(actives):
            if a.result.finish:
                continue
            history = list(a.request.prompt) + a.result.tokens
            out.append(Candidate(key, a.slot, a.generation, a.consumed, history,
                                 output_left=a.request.max_tokens - len(a.result.tokens),
                                 context_left=self.context - a.consumed))
        return out

    def run_round(self, actives: Sequence[RawRequest], round_: SpeculativeRound, frame: int = 0) -> list[LaneOutcome]:
        """Pack, launch, validate; request state changes only after validation."""
        lanes = []
        allocates = round_.program.length_source == C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT
        for lane in round_.lanes:
            active = actives[lane.candidate.key]
            self.plain.ensure_pages(active, lane.reserve_end)   # pages cover the lane's full ceiling (SPEC-21)
            lanes.append(PackedLane(slot=active.slot, generation=active.generation, start=active.consumed,
                              page_table=list(active.pages), proposals=np.asarray(lane.proposals, dtype=np.int32),
                              proposal_generation=active.generation, proposal_consumed=active.consumed,
                              prefix_limit=lane.ceiling if allocates else 0))
        runner = self.plain.runner
        submission = runner.launch_lanes(round_.program.program, round_.program.variant.operation, lanes, frame)
        round_.sequence, round_.frame = submission.sequence, submission.frame
        words = runner.wait_lanes(submission)
        return validate_completion(self.format, words, round_, self.vocab, self.table.max_width)

    def apply(self, actives: Sequence[RawRequest], round_: SpeculativeRound, outcomes: Sequence[LaneOutcome]) -> None:
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
