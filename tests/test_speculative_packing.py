"""A SPECULATIVE submission packed as the packer's columns (SpeculativeProgramRunner._pack) writes
the bytes of the same lanes packed one PackedLane each (SpeculativeProgramRunner._packed), round
after round, page-table memory included, for programs with exact lengths (QUERY_LENGTH) and
device-allocated ones (SPECULATIVE_PREFIX_LIMIT), over bindings re-tuned with offsets, paddings
and ACTIVE_ROW."""
from __future__ import annotations

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_backend.engine.speculative_runner import SpeculativeProgramRunner
from helios_backend.packing import Packer
from helios_backend.scheduler.plan import PENDING_TOKEN, Submission
from helios_backend.scheduler.request import Request, RequestSpec, SamplingSettings
from helios_backend.scheduler.speculative import (
    Candidate,
    SpeculativeLane,
    SpeculativeOptions,
    SpeculativeRound,
    SpeculativeTable,
)
from helios_backend.scheduler.speculative_scheduler import ScheduledSpeculativeLane
from tests.engine_fixtures import prepared_in_memory
from tests.test_packing_equivalence import _tuned

VARIANTS = ((2, 1, 0, 2), (2, 4, 3, 8), (2, 4, 3, 5, 1), (4, 8, 7, 32))   # (B, W, D, P[, device allocation])


@pytest.fixture(scope="module")
def prepared():
    return prepared_in_memory(speculative_variants=VARIANTS)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_speculative_columns_write_the_bytes_of_its_packed_lanes(prepared, seed: int) -> None:
    # spec: SPEC-17, SPEC-18, SPEC-20
    rng = np.random.default_rng(seed)
    manifest, vocab = prepared.manifest, prepared.contract.model.vocabulary
    graphs = _tuned(prepared.contract.model.graphs, rng) if rng.random() < 0.7 else list(prepared.contract.model.graphs)
    table = SpeculativeTable.select(graphs, SpeculativeOptions(enabled=True, history_drafting=True))
    assert {p.length_source for p in table.programs} == {C.VALUE_SOURCE_QUERY_LENGTH,
                                                         C.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT}
    start = rng.integers(0, 256, manifest.transport.frame_nbytes, dtype=np.uint8)
    frames, expected = [start.copy() for _ in range(2)], [start.copy() for _ in range(2)]
    runners = [SpeculativeProgramRunner(None, Packer(graphs, manifest.transport, manifest.request_slots, f),  # type: ignore[arg-type]
                                        manifest.completion, vocab.sampled_tokens, vocab.histogram_bins, (2,),
                                        max_width=table.max_width)
               for f in (frames, expected)]
    width = manifest.max_pages_per_row
    for _ in range(10):
        program = table.programs[int(rng.integers(len(table.programs)))]
        round_ = SpeculativeRound(program, [])
        lanes = []
        same = int(rng.integers(0, program.lane_limit)) if rng.random() < 0.4 else -1   # every lane as many copies
        for slot in rng.choice(manifest.request_slots, int(rng.integers(0, program.rows + 1)), replace=False).tolist():
            req = Request(slot, RequestSpec(tuple(range(3, 9)), 8, SamplingSettings()), slot)
            req.pages = [int(p) for p in rng.integers(0, 96, int(rng.integers(1, width + 1)))]
            req.slot, req.generation = slot, int(rng.integers(1, 4))
            ceiling = int(rng.integers(1, program.lane_limit + 1))
            count = min(same, ceiling - 1) if same >= 0 else int(rng.integers(0, ceiling))
            proposals = rng.integers(0, vocab.sampled_tokens, count).tolist()
            consumed = int(rng.integers(0, 400))
            candidate = Candidate(slot, slot, req.generation, consumed, req.tokens, 8, 100)
            round_.lanes.append(SpeculativeLane(candidate, proposals, ceiling))
            lanes.append(ScheduledSpeculativeLane(req, slot, req.generation, consumed, [PENDING_TOKEN], True, 8,
                                                  proposals=proposals, ceiling=ceiling, round=round_))
        if program.length_source == C.VALUE_SOURCE_QUERY_LENGTH:     # exact lengths within P (SPEC-17)
            while lanes and sum(1 + len(lane.proposals) for lane in lanes) > program.packed:
                lanes.pop()
        if lanes and rng.random() < 0.5:          # planned from columns: the scheduler's arrays
            round_.columns = tuple(np.array([getattr(lane, name) for lane in lanes], np.int64)
                                   for name in ("slot", "generation", "start"))  # type: ignore[assignment]
        sub = Submission(program.variant, lanes)
        frame = int(rng.integers(2))
        runners[0]._pack(sub, frame)
        runners[1].packer.pack(program.program, frame, [runners[1]._packed(lane, C.OPERATION_SPECULATIVE) for lane in lanes])
        for f in range(2):
            assert np.array_equal(frames[f], expected[f]), f"{program.program} frame {f}"
