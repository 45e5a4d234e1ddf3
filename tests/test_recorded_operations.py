"""Recorded operations beyond INITIALIZATION / PREFILL / DECODE / MIXED / RESTORATION.

RESUME: a one-token-per-row step whose pending token the host feeds (a PENDING_TOKEN binding,
GraphContract.pending_token.host_destination) instead of reading state.pending; it writes the
device pending-token state, so later DECODE rounds continue device-owned.
"""
from __future__ import annotations

import numpy as np
from helios_proto import contract_pb2 as C

from helios_backend.contract import PreparedContract
from helios_backend.packing import Lane
from helios_backend.runtime.driver import Driver, GenerationRequest
from tests.engine_fixtures import prepared_in_memory
from tests.test_numpy_executor import PROMPT


def _graphs(prepared, operation):
    return [g for g in prepared.contract.model.graphs if g.operation == operation]


def test_resume_graphs_bind_a_host_owned_pending_token_and_write_device_state():
    # spec: STA-5, STA-6, BND-7
    prepared = prepared_in_memory()
    PreparedContract.decode(prepared.contract, prepared.manifest,
                            resource_ids=frozenset(r.id for r in prepared.resources))
    resume = _graphs(prepared, C.OPERATION_RESUME)
    assert sorted(g.capacity.rows for g in resume) == [1, 4]
    programs = {p.name: p for p in prepared.manifest.programs}
    for graph in resume:
        assert graph.capacity.tokens == graph.capacity.rows                  # one token per row
        assert graph.pending_token.WhichOneof("owner") == "host_destination"
        [pending] = [b for b in graph.bindings if b.source == C.VALUE_SOURCE_PENDING_TOKEN]
        assert pending.destination == graph.pending_token.host_destination
        assert pending.index == C.INDEX_MODE_PACKED_TOKEN
        accesses = {a.view.name: a.access for a in graph.state_accesses}
        assert accesses["state.pending"] in (C.ACCESS_WRITE, C.ACCESS_READ_WRITE)   # STA-5: produces it
        kernels = [n.kernel for n in programs[graph.program].nodes]
        assert "tokens.select_input.v1" not in kernels                      # never reads the device token
        assert "state.commit.v1" in kernels


def test_resume_with_the_host_fed_token_continues_like_decode(smollm2_model):
    # spec: STA-5, STA-6
    model = smollm2_model
    reference = Driver(model)
    [a] = reference.admit([GenerationRequest(PROMPT, 4)], [0])
    reference.prefill(a)
    reference.decode_round([a])
    reference.decode_round([a])
    expected = list(a.result.tokens)                                          # prefill + 2 decode tokens
    reference.pages.give_back(a.pages)

    driver = Driver(model)
    [b] = driver.admit([GenerationRequest(PROMPT, 4)], [1])
    driver.prefill(b)
    assert b.result.tokens == expected[:1]
    pending = model.executor.buffer_view("state.pending", np.int32)
    pending[1] = 7                          # the device no longer holds the pending token
    driver._ensure_pages(b, b.consumed + 1)
    lane = Lane(slot=1, generation=b.generation, consumed=b.consumed, pages=list(b.pages),
                pending_token=b.result.tokens[-1])
    [row] = driver.step(model.program(C.OPERATION_RESUME, 1, 1), [lane])
    b.consumed += 1
    assert int(row[2]) == expected[1] and int(row[3]) == b.consumed
    assert int(pending[1]) == expected[1]                                    # device-owned again
    driver.decode_round([b])                                                  # DECODE reads state.pending
    assert b.result.tokens[-1] == expected[2]
    driver.pages.give_back(b.pages)
