"""A small synchronous driver: admit, prefill in chunks, decode in lockstep.

It is the stand-in for the scheduler (helios_backend/scheduler) for the CLI, tests and
benchmarks: no prefix reuse, no preemption, one frame in flight. It uses exactly the
surfaces the scheduler uses: NativeModel.program, Packer.pack, Executor.launch/wait,
and the completion records.

    driver = LockstepGenerator(model)
    [result] = driver.generate([GenerationRequest(prompt_ids, max_tokens=64)])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
from helios_proto import contract_pb2 as C

from helios_backend.kernel_abi.state import (
    COMPLETION_HEADER_WORDS,
    COMPLETION_ROW_FIELDS,
    COMPLETION_ROW_WORDS,
    FINISH_EOS,
    FINISH_LENGTH,
)
from helios_backend.engine.model import NativeModel
from helios_backend.packing import SlotInitialization, CapacityError, PackedLane, SamplingParameters

_ROW = {name: index for index, name in enumerate(COMPLETION_ROW_FIELDS)}


class CompletionError(RuntimeError):
    """A completion record that does not match the submitted lane."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParameters = SamplingParameters()
    seed: int = 0
    eos_ids: Optional[Sequence[int]] = None     # None: the core's EOS ids


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    finish: str = ""                            # "eos" or "length"


@dataclass
class _Active:
    request: GenerationRequest
    slot: int
    generation: int
    pages: list[int] = field(default_factory=list)
    consumed: int = 0
    index: int = 0                                  # position in the generate() request list
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


TokenCallback = Callable[[int, int], None]   # (request index, token id), as each token is recorded


class LockstepGenerator:
    def __init__(self, model: NativeModel, page_order: Optional[Sequence[int]] = None,
                 prefill_chunk: Optional[int] = None, on_token: Optional[TokenCallback] = None) -> None:
        self.model = model
        self.on_token = on_token
        self.page_tokens = model.contract.model.cache.page_tokens
        pages = model.manifests[0].cache_pages
        self.pages = PageAllocator(page_order if page_order is not None else range(pages))
        prefill = [g.capacity.tokens for g in model.graphs if g.operation == C.OPERATION_PREFILL]
        self.prefill_chunk = prefill_chunk or max(prefill)
        self.eos_ids = tuple(model.contract.defaults.eos_token_ids)
        self.histogram_bins = model.contract.model.vocabulary.histogram_bins

    # ---- one step ------------------------------------------------------------------------
    def step(self, program: str, lanes: Sequence[PackedLane], frame: int = 0) -> np.ndarray:
        """Pack, launch, wait; returns the completion rows [len(lanes), row_words] after checking them."""
        executor = self.model.executor
        self.model.packer.pack(program, frame, lanes)
        executor.launch(program, frame)
        words = executor.wait(frame)
        self.last_words = words            # the whole completion (header fields such as scores)
        # standard records only (logprob extension records may follow the capacity's records)
        rows = words[COMPLETION_HEADER_WORDS:COMPLETION_HEADER_WORDS + len(lanes) * COMPLETION_ROW_WORDS].reshape(
            -1, COMPLETION_ROW_WORDS)
        for lane, row in zip(lanes, rows):
            if row[_ROW["slot"]] != lane.slot or row[_ROW["generation"]] != lane.generation:
                raise CompletionError(f"completion row {row.tolist()} does not match slot {lane.slot}")
        return rows

    def _ensure_pages(self, active: _Active, tokens: int) -> None:
        while len(active.pages) * self.page_tokens < tokens:
            active.pages.append(self.pages.take())

    # ---- phases --------------------------------------------------------------------------
    def admit(self, requests: Sequence[GenerationRequest], slots: Sequence[int]) -> list[_Active]:
        actives = []
        for index, (request, slot) in enumerate(zip(requests, slots)):
            active = _Active(request, slot, self.model.next_generation(slot), index=index)
            admission = SlotInitialization.for_prompt(request.prompt, self.histogram_bins, request.seed, request.sampling,
                                             request.max_tokens, request.eos_ids or self.eos_ids)
            lane = PackedLane(slot=slot, generation=active.generation, initialization=admission)
            self.step(self.model.program(C.OPERATION_INITIALIZATION, 1), [lane])
            actives.append(active)
        return actives

    def prefill(self, active: _Active) -> None:
        prompt = np.asarray(active.request.prompt, dtype=np.int32)
        while active.consumed < prompt.size:
            chunk = prompt[active.consumed:active.consumed + self.prefill_chunk]
            last = active.consumed + chunk.size == prompt.size
            self._ensure_pages(active, active.consumed + chunk.size)
            lane = PackedLane(slot=active.slot, generation=active.generation, consumed=active.consumed, tokens=chunk,
                        sample=last, pages=list(active.pages))
            [row] = self.step(self.model.program(C.OPERATION_PREFILL, 1, chunk.size), [lane])
            active.consumed += chunk.size
            if last:
                self._record(active, row)

    def decode_round(self, actives: Sequence[_Active]) -> None:
        lanes = []
        for active in actives:
            self._ensure_pages(active, active.consumed + 1)
            lanes.append(PackedLane(slot=active.slot, generation=active.generation, consumed=active.consumed,
                              pages=list(active.pages)))
        rows = self.step(self.model.program(C.OPERATION_DECODE, len(lanes), len(lanes)), lanes)
        for active, row in zip(actives, rows):
            active.consumed += 1
            self._record(active, row)

    def _record(self, active: _Active, row: np.ndarray) -> None:
        active.result.tokens.append(int(row[_ROW["token"]]))
        if self.on_token is not None:
            self.on_token(active.index, int(row[_ROW["token"]]))
        finish = int(row[_ROW["finish"]])
        if finish == FINISH_EOS:
            active.result.finish = "eos"
        elif finish == FINISH_LENGTH:
            active.result.finish = "length"

    def generate(self, requests: Sequence[GenerationRequest], slots: Optional[Sequence[int]] = None,
                 row_order: Optional[Sequence[int]] = None) -> list[GenerationResult]:
        """Generate for every request; `row_order` permutes which decode row each request takes."""
        slots = list(slots) if slots is not None else list(range(len(requests)))
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
