"""Raw lanes: hand-built lanes stepped through chosen programs, for the oracle tests.

LockstepGenerator (generator.py) runs whole requests through the serving Scheduler, which
chooses slots, pages, rows, chunks and programs itself. The oracle tests need the opposite:
to show that results do not depend on those choices they make them explicitly (slots, the
decode row order, the physical page order, a prefill chunk), and to check programs the
scheduler schedules only in particular situations, or never, they step lanes through a named
program (RESUME, RESTORATION, SCORED_PREFILL, a MIXED round of their making). This is the entry
point for that, and only for that; the benchmarks of single steps use it too.

Launch, wait and the completion checks are the serving ones: ProgramRunner.step_lanes packs
through the model's Packer, numbers the submission from the model's SubmissionSequence and
checks the completion header (scheduler/completion.validate_header); slot generations come from
the model (NativeModel.generations).

    lanes = RawLanes(model, page_order=[5, 9, 2])
    [active] = lanes.admit([GenerationRequest(prompt, max_tokens=8)], slots=[3])
    lanes.prefill(active)
    rows = lanes.step(model.program(C.OPERATION_RESUME, 1, 1), [PackedLane(...)])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
from helios_proto import contract_pb2 as C

from helios_backend.engine.model import NativeModel
from helios_backend.engine.runner import ProgramRunner
from helios_backend.kernel_abi.state import FINISH_EOS, FINISH_LENGTH
from helios_backend.lockstep.generator import GenerationRequest, GenerationResult, TokenCallback
from helios_backend.packing import CapacityError, PackedLane, SlotInitialization


@dataclass
class RawRequest:
    """One request on raw lanes: its slot, generation, pages and consumed endpoint."""
    request: GenerationRequest
    slot: int
    generation: int
    pages: list[int] = field(default_factory=list)
    consumed: int = 0
    index: int = 0                                  # position in the admitted request list
    result: GenerationResult = field(default_factory=GenerationResult)


class PageAllocator:
    """Hands out page ids in a given order (tests scatter them to show page-id independence)."""

    def __init__(self, order: Iterable[int]) -> None:
        self._free = list(order)[::-1]

    def take(self) -> int:
        if not self._free:
            raise CapacityError("out of cache pages")
        return self._free.pop()

    def give_back(self, pages: Iterable[int]) -> None:
        self._free.extend(pages)


class RawLanes:
    """Hand-built lanes through chosen programs, synchronously (the module docstring says why
    this exists beside LockstepGenerator): explicit slots, page order, chunk size and row order."""

    def __init__(self, model: NativeModel, page_order: Optional[Sequence[int]] = None,
                 prefill_chunk: Optional[int] = None, on_token: Optional[TokenCallback] = None) -> None:
        self.model = model
        self.on_token = on_token
        self.page_tokens = model.contract.model.cache.page_tokens
        self.pages = PageAllocator(page_order if page_order is not None else range(model.manifests[0].cache_pages))
        prefill = [g.capacity.tokens for g in model.graphs if g.operation == C.OPERATION_PREFILL]
        self.prefill_chunk = prefill_chunk or max(prefill)
        self.eos_ids = tuple(model.contract.defaults.eos_token_ids)
        # the EOS ids of a lane's initialization are its request's (packed per lane below)
        self.runner = ProgramRunner.for_model(model)
        self.format = self.runner.fmt
        self._operations = {p.name: p.operation for p in model.execution_manifest.programs}
        self.last_words: Optional[np.ndarray] = None   # the last whole completion (header fields such as scores)

    # ---- one step ------------------------------------------------------------------------
    def step(self, program: str, lanes: Sequence[PackedLane], frame: int = 0) -> np.ndarray:
        """Pack, launch, wait; the completion rows [len(lanes), row_words] after the header checks."""
        self.last_words, rows = self.runner.step_lanes(program, self._operations[program], lanes, frame)
        return rows

    def ensure_pages(self, active: RawRequest, tokens: int) -> None:
        """Pages (in the allocator's order) covering positions [0, tokens) of `active`."""
        while len(active.pages) * self.page_tokens < tokens:
            active.pages.append(self.pages.take())

    # ---- phases --------------------------------------------------------------------------
    def admit(self, requests: Sequence[GenerationRequest], slots: Sequence[int]) -> list[RawRequest]:
        """Each request on its given slot: a fresh generation and one INITIALIZATION step."""
        actives = []
        for index, (request, slot) in enumerate(zip(requests, slots)):
            active = RawRequest(request, slot, self.model.generations.next(slot), index=index)
            initialization = SlotInitialization.for_prompt(request.prompt, self.runner.histogram_bins, request.seed,
                                                           request.sampling, request.max_tokens,
                                                           request.eos_ids or self.eos_ids)
            lane = PackedLane(slot=slot, generation=active.generation, initialization=initialization)
            self.step(self.model.program(C.OPERATION_INITIALIZATION, 1), [lane])
            actives.append(active)
        return actives

    def prefill(self, active: RawRequest) -> None:
        """The prompt in chunks of `prefill_chunk`, one PREFILL step each; the last one samples."""
        prompt = np.asarray(active.request.prompt, dtype=np.int32)
        while active.consumed < prompt.size:
            chunk = prompt[active.consumed:active.consumed + self.prefill_chunk]
            last = active.consumed + chunk.size == prompt.size
            self.ensure_pages(active, active.consumed + chunk.size)
            lane = PackedLane(slot=active.slot, generation=active.generation, start=active.consumed, tokens=chunk,
                              sample=last, page_table=list(active.pages))
            [row] = self.step(self.model.program(C.OPERATION_PREFILL, 1, chunk.size), [lane])
            active.consumed += chunk.size
            if last:
                self._record(active, row)

    def decode_round(self, actives: Sequence[RawRequest]) -> None:
        """One DECODE step of `actives`, in this row order (each reads its device pending token)."""
        lanes = []
        for active in actives:
            self.ensure_pages(active, active.consumed + 1)
            lanes.append(PackedLane(slot=active.slot, generation=active.generation, start=active.consumed,
                                    page_table=list(active.pages)))
        rows = self.step(self.model.program(C.OPERATION_DECODE, len(lanes), len(lanes)), lanes)
        for active, row in zip(actives, rows):
            active.consumed += 1
            self._record(active, row)

    def _record(self, active: RawRequest, row: np.ndarray) -> None:
        token = int(row[self.format.row["token"]])
        active.result.tokens.append(token)
        if self.on_token is not None:
            self.on_token(active.index, token)
        finish = int(row[self.format.row["finish"]])
        if finish == FINISH_EOS:
            active.result.finish = "eos"
        elif finish == FINISH_LENGTH:
            active.result.finish = "length"

    def generate(self, requests: Sequence[GenerationRequest], slots: Sequence[int],
                 row_order: Optional[Sequence[int]] = None) -> list[GenerationResult]:
        """Whole requests on explicit slots, every prompt first, then decode rounds until each
        ends; `row_order` permutes which decode row each request takes. The oracle of the
        independence tests: LockstepGenerator.generate is the scheduled (served) order."""
        actives = self.admit(requests, slots)
        for active in actives:
            self.prefill(active)
        order = list(row_order) if row_order is not None else list(range(len(actives)))
        while True:
            running = [actives[i] for i in order if not actives[i].result.finish]
            if not running:
                break
            self.decode_round(running)
        for active in actives:
            self.pages.give_back(active.pages)
        return [active.result for active in actives]
