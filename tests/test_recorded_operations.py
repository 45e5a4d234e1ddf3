"""Recorded operations beyond INITIALIZATION / PREFILL / DECODE / MIXED / RESTORATION.

RESUME: a one-token-per-row step whose pending token the host feeds (a PENDING_TOKEN binding,
GraphContract.pending_token.host_destination) instead of reading state.pending; it writes the
device pending-token state, so later DECODE rounds continue device-owned.

SCORED_PREFILL: a prefill chunk that also writes, per packed token, the log-probability of a
given target token (log_softmax of the raw logits at that position; logits.score_targets.v1)
into the completion words the layout's `scores` field declares.
"""
from __future__ import annotations

import numpy as np
from helios_proto import contract_pb2 as C

from helios_backend.contract import PreparedContract
from helios_backend.packing import PackedLane
from helios_backend.lockstep.generator import GenerationRequest
from helios_backend.lockstep.raw_lanes import RawLanes
from tests.engine_fixtures import prepared_in_memory
from tests.test_numpy_executor import LOGIT_TOLERANCE, PROMPT, VOCAB


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
    reference = RawLanes(model)
    [a] = reference.admit([GenerationRequest(PROMPT, 4)], [0])
    reference.prefill(a)
    reference.decode_round([a])
    reference.decode_round([a])
    expected = list(a.result.tokens)                                          # prefill + 2 decode tokens
    reference.pages.give_back(a.pages)

    driver = RawLanes(model)
    [b] = driver.admit([GenerationRequest(PROMPT, 4)], [1])
    driver.prefill(b)
    assert b.result.tokens == expected[:1]
    pending = model.executor.buffer_view("state.pending", np.int32)
    pending[1] = 7                          # the device no longer holds the pending token
    driver.ensure_pages(b, b.consumed + 1)
    lane = PackedLane(slot=1, generation=b.generation, start=b.consumed, page_table=list(b.pages),
                pending_token=b.result.tokens[-1])
    [row] = driver.step(model.program(C.OPERATION_RESUME, 1, 1), [lane])
    b.consumed += 1
    assert int(row[2]) == expected[1] and int(row[3]) == b.consumed
    assert int(pending[1]) == expected[1]                                    # device-owned again
    driver.decode_round([b])                                                  # DECODE reads state.pending
    assert b.result.tokens[-1] == expected[2]
    driver.pages.give_back(b.pages)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_scored_prefill_graph_declares_targets_and_the_scores_field():
    # spec: BND-7, STA-5
    prepared = prepared_in_memory()
    PreparedContract.decode(prepared.contract, prepared.manifest,
                            resource_ids=frozenset(r.id for r in prepared.resources))
    [graph] = _graphs(prepared, C.OPERATION_SCORED_PREFILL)
    assert (graph.capacity.rows, graph.capacity.tokens) == (1, 64)
    sources = {b.source: b for b in graph.bindings}
    assert sources[C.VALUE_SOURCE_SCORED_TARGET_TOKENS].index == C.INDEX_MODE_PACKED_TOKEN
    assert C.VALUE_SOURCE_PROMPT_TOKENS in sources
    assert graph.pending_token.device_state_view == "state.pending"
    assert {a.view.name: a.access for a in graph.state_accesses}["state.pending"] == C.ACCESS_READ_WRITE
    [scores] = [f for f in prepared.manifest.completion.header if f.name == "scores"]
    assert scores.words == 64 and scores.dtype == C.DTYPE_F32
    assert 4 * (scores.word + scores.words) <= prepared.manifest.transport.completion_nbytes
    [program] = [p for p in prepared.manifest.programs if p.name == graph.program]
    assert [n.kernel for n in program.nodes].count("logits.score_targets.v1") == 1


def test_scored_prefill_scores_are_the_log_softmax_of_the_logits_at_each_position(smollm2_model, reference_llama):
    # spec: BND-7
    model = smollm2_model
    chunk = np.asarray(PROMPT[:-1], np.int32)                # score every next prompt token
    targets = np.asarray(PROMPT[1:], np.int32)
    driver = RawLanes(model)
    [active] = driver.admit([GenerationRequest(PROMPT, 4)], [2])
    driver.ensure_pages(active, chunk.size)
    lane = PackedLane(slot=2, generation=active.generation, tokens=chunk, page_table=list(active.pages),
                scored_targets=targets)
    program = model.program(C.OPERATION_SCORED_PREFILL, 1, chunk.size)
    driver.step(program, [lane])
    words = driver.last_words
    [field] = [f for f in model.execution_manifest.completion.header if f.name == "scores"]
    scores = np.asarray(words[field.word:field.word + chunk.size], np.int32).view(np.float32)
    # against the independent oracle at every position: logits agree within LOGIT_TOLERANCE, so
    # logprobs within 2x that; measured 0.014 (fp16 weights and cache), asserted 0.05
    expected_logits = reference_llama.forward(list(chunk), 0)
    expected = np.array([_log_softmax(expected_logits[t])[targets[t]] for t in range(chunk.size)])
    np.testing.assert_allclose(scores, expected, atol=0.05, rtol=0)
    assert 0.05 < 2 * LOGIT_TOLERANCE
    # against the executor's own last-token logits of the same step (same arithmetic, f32)
    logits = model.executor.buffer_view("scratch.logits", np.float32)[:VOCAB]
    assert abs(scores[-1] - _log_softmax(logits)[targets[-1]]) <= 1e-3
    # the normal prefill effects: the row sampled from the last position and is consumed
    row = words[4:12]
    assert int(row[3]) == chunk.size and int(row[2]) == int(np.argmax(logits))
    driver.pages.give_back(active.pages)
