"""The auxiliary frame: a round's initialization launched without waiting for its frame.

The program runner launches INITIALIZATION (and RESTORATION) submissions on the executor's
auxiliary frame and waits for them in collect(), so a round that admits requests behind the
round in flight packs its main step at once. Served here on the real numpy executor behind
a stream: launches queue and run in order only when a later wait needs them, and each one
copies its host frame when it runs, as a CUDA graph's copy-in does. A host frame rewritten
before its submission ran would change the outputs, so the two-frame outputs are compared
with completion feedback's on the same requests.
"""
from __future__ import annotations

import numpy as np
import pytest
from helios_proto import contract_pb2 as cp

from helios_backend.engine.runner import ProgramRunner
from helios_backend.packing import Packer
from helios_backend.scheduler.plan import RoundPlan
from helios_backend.scheduler.request import RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Emitted, Scheduler, SchedulerConfig
from helios_backend.scheduler.variants import VariantTable

EOS = (49151,)


class StreamExecutor:
    """The numpy executor with one auxiliary host frame, run in submission order at wait()."""

    def __init__(self, executor) -> None:  # type: ignore[no-untyped-def]
        self.executor = executor
        self.frames = executor.frames
        self.auxiliary_frames = 1
        executor._frames.append(np.zeros_like(executor._frames[0]))
        executor._results.append(None)
        self._queue: list[tuple[str, int]] = []
        self.launched: list[tuple[str, int]] = []

    def staging(self, frame: int) -> np.ndarray:
        return self.executor.staging(frame)

    def launch(self, program: str, frame: int) -> None:
        assert all(f != frame for _, f in self._queue), f"frame {frame} relaunched before it ran"
        self._queue.append((program, frame))
        self.launched.append((program, frame))

    def wait(self, frame: int) -> np.ndarray:
        while any(f == frame for _, f in self._queue):
            program, f = self._queue.pop(0)
            self.executor.launch(program, f)         # copies host frame f now, as the stream would
        return self.executor.wait(frame)


def _runtime(bootstrap, auxiliary: bool):  # type: ignore[no-untyped-def]
    from helios_backend.engine.model import ModelOptions, NativeModel

    model = NativeModel.load(bootstrap.contract, bootstrap.manifest, bootstrap.read_resource,
                             ModelOptions(cache_pages=128))
    manifest, contract = model.execution_manifest, model.contract
    executor = StreamExecutor(model.executor) if auxiliary else model.executor
    frames = [executor.staging(f) for f in range(manifest.transport.frames + (1 if auxiliary else 0))]
    packer = Packer(model.graphs, manifest.transport, manifest.request_slots, frames,
                    layout_graphs=list(contract.model.graphs))
    vocab = contract.model.vocabulary
    runner = ProgramRunner(executor, packer, manifest.completion, vocab.sampled_tokens,
                           vocab.histogram_bins or vocab.sampled_tokens, EOS, mask_words=vocab.mask_words,
                           auxiliary_frame=manifest.transport.frames if auxiliary else None)
    config = SchedulerConfig(page_tokens=contract.model.cache.page_tokens, num_pages=model.manifests[0].cache_pages,
                             request_slots=manifest.request_slots, max_active=4, queue_capacity=16,
                             context_tokens=contract.context_tokens, max_pages_per_row=manifest.max_pages_per_row,
                             vocab_size=vocab.sampled_tokens, input_vocab_size=vocab.sampled_tokens, eos_ids=EOS)
    return model, executor, runner, Scheduler(config, VariantTable.from_graphs(model.graphs))


PROMPTS = [(1, 9690, 253, 28, 17 + i) for i in range(6)]
LIMITS = [9, 7, 5, 6, 4, 5]
ARRIVALS = {0: (0, 1), 3: (2,), 5: (3, 4, 5)}        # round -> requests: admissions behind decode rounds


def _serve(bootstrap, two_frames: bool):  # type: ignore[no-untyped-def]
    model, executor, runner, sched = _runtime(bootstrap, auxiliary=two_frames)
    tokens: dict[int, list[int]] = {}
    inflight: list[RoundPlan] = []
    behind: list[int] = []
    try:
        for step in range(500):
            for serial in ARRIVALS.get(step, ()):
                sched.add(serial, RequestSpec(PROMPTS[serial], LIMITS[serial], SamplingSettings(), ignore_eos=True))
            if not inflight:
                plan = sched.schedule()
                if plan is None:
                    if step > max(ARRIVALS):
                        break
                    continue
                runner.launch(plan, 0)
                inflight.append(plan)
            if two_frames and len(inflight) == 1:
                nxt = sched.pipeline_next(inflight[0])
                if nxt is not None:
                    behind.append(nxt.main.operation)
                    runner.launch(nxt, 1 - inflight[0].main.frame)
                    inflight.append(nxt)
            plan = inflight.pop(0)
            sched.complete(plan, runner.collect(plan))
            for ev in sched.take_events():
                if isinstance(ev, Emitted):
                    tokens.setdefault(ev.serial, []).append(ev.token)
        assert not sched.has_work() and not inflight
        return tokens, executor, behind
    finally:
        model.close()


@pytest.mark.slow
def test_initialization_on_the_auxiliary_frame_matches_completion_feedback(smollm2_bootstrap):
    # spec: SPEC-43, SPEC-44, BND-20, CACHE-16
    reference, _, _ = _serve(smollm2_bootstrap, two_frames=False)
    tokens, executor, behind = _serve(smollm2_bootstrap, two_frames=True)
    assert tokens == reference and [len(tokens[i]) for i in range(6)] == LIMITS
    auxiliary = [program for program, frame in executor.launched if frame == executor.frames]
    assert auxiliary and all(program.startswith("initialization") for program in auxiliary)
    # admissions went behind a round in flight
    assert cp.OPERATION_MIXED in behind or cp.OPERATION_PREFILL in behind
