"""Whole requests run synchronously through the serving path: the CLI's, tests' and benchmarks'.

The real Scheduler (helios_backend/scheduler) plans every round, as in serving: admission,
rounds of prompts, prefill chunks, prefix and snapshot reuse, MIXED rounds, decode until EOS
or the output limit. The ProgramRunner (engine/runner.py) packs, launches and validates each
round as serving does, one round in flight (completion feedback, on frame 0). So the tokens
generated here are those the server schedules for the same requests; what differs is only
that nothing else runs beside them and no thread or clock is involved.

    driver = LockstepGenerator(model)
    [result] = driver.generate([GenerationRequest(prompt_ids, max_tokens=64)])

Oracle tests that must choose slots, rows, pages or programs themselves step hand-built lanes
with RawLanes (raw_lanes.py) instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from helios_proto import exchange_pb2 as ep

from helios_backend.engine.model import NativeModel
from helios_backend.engine.runner import ProgramRunner
from helios_backend.engine.settings import StartupOptions, resolve
from helios_backend.engine.setup import scheduler_config
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.scheduler.events import Emitted, Event
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.scheduler.variants import VariantTable


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParameters = SamplingParameters()
    seed: int = 0
    eos_ids: Optional[Sequence[int]] = None     # None or empty: the core's EOS ids; (-1,): none


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    finish: str = ""                            # "eos" or "length"


TokenCallback = Callable[[int, int], None]   # (request index, token id), as each token is recorded

_FINISH = {ep.FINISH_REASON_EOS: "eos", ep.FINISH_REASON_LENGTH: "length"}


class LockstepGenerator:
    def __init__(self, model: NativeModel, on_token: Optional[TokenCallback] = None,
                 prefill_chunk: Optional[int] = None) -> None:
        """`prefill_chunk`: the most prompt tokens one lane consumes in a round (the scheduler's
        prefill_chunk_tokens); None: as many as a prepared variant holds, as in serving."""
        self.model = model
        self.on_token = on_token
        self.prefill_chunk = prefill_chunk or 0
        self.variants = VariantTable.from_graphs(model.graphs)
        # serving's settings for this model: the core's defaults at the loaded concurrency
        self.settings = resolve(StartupOptions(core_path=Path(), concurrency=model.concurrency), model.contract)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request (one EOS set for all of them); results in request order."""
        eos = {tuple(r.eos_ids) if r.eos_ids else None for r in requests}
        if len(eos) > 1:
            raise ValueError("eos_ids: the requests of one generate() call share their EOS ids")
        eos_ids = next(iter(eos), None)
        model = self.model
        settings = dataclasses.replace(self.settings, queue_capacity=max(len(requests), 1))
        config = dataclasses.replace(scheduler_config(model.contract, model.execution_manifest, model, settings),
                                     prefill_chunk_tokens=self.prefill_chunk)
        if eos_ids is not None:
            config = dataclasses.replace(config, eos_ids=eos_ids)
        scheduler = Scheduler(config, self.variants, generations=model.generations)
        runner = ProgramRunner.for_model(model, config.eos_ids)
        for serial, request in enumerate(requests):
            sampling = SamplingSettings(**dataclasses.asdict(request.sampling), seed=request.seed)
            scheduler.add(serial, RequestSpec(tuple(request.prompt), request.max_tokens, sampling))
        results = [GenerationResult() for _ in requests]
        while scheduler.has_work():
            plan = scheduler.schedule()
            if plan is None:
                raise RuntimeError("requests wait but no round fits the model's capacities")
            scheduler.complete(plan, runner.run(plan))
            self._deliver(scheduler.take_events(), results)
        return results

    def _deliver(self, events: Sequence[Event], results: list[GenerationResult]) -> None:
        for event in events:
            if isinstance(event, Emitted):
                results[event.serial].tokens.append(event.token)
                if self.on_token is not None:
                    self.on_token(event.serial, event.token)
                continue
            terminal = event.event
            if terminal.HasField("failed"):
                raise RuntimeError(f"request {event.serial} failed: {terminal.failed.message}")
            results[event.serial].finish = _FINISH.get(terminal.finished.reason, "")
