"""Host side of speculative rounds without a model: history drafting, cohort and program choice,
lane ceilings, reservations, completion feedback, validation agreement, confidence layouts."""
from __future__ import annotations

import copy

import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.contract import ContractError, PreparedContract
from helios_backend.scheduler.speculative import (
    Candidate,
    FeedbackReason,
    HistoryIndex,
    SpeculativeOptions,
    SpeculativeProgram,
    SpeculativeTable,
    feedback_reasons,
    lane_ceiling,
    propose,
    ranks_agree,
)

QL = C.VALUE_SOURCE_QUERY_LENGTH


def _table(*programs: SpeculativeProgram, history: bool = True) -> SpeculativeTable:
    return SpeculativeTable(programs, SpeculativeOptions(enabled=True, history_drafting=history))


W1 = SpeculativeProgram("w1", rows=4, drafts=0, width=1, packed=4, length_source=QL, reports_cursor=True, lag=0)
W4 = SpeculativeProgram("w4", rows=4, drafts=3, width=4, packed=10, length_source=QL, reports_cursor=True, lag=0)
CYCLE = [5, 6, 7, 8] * 4


def _candidate(key=0, history=CYCLE, output_left=100, context_left=100, **kw) -> Candidate:
    return Candidate(key, slot=key, generation=1, consumed=len(history) - 1, history=history,
                     output_left=output_left, context_left=context_left, **kw)


def test_propose_copies_what_followed_the_latest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]
    assert propose([1, 2, 3, 4], 3) == []                                  # nothing repeats
    assert propose([4, 1, 5, 1], 2) == [5, 1]                              # unigram fallback
    assert propose(CYCLE, 0) == []


def test_propose_searches_a_bounded_window():
    history = [42, 43] + list(range(1000, 3000)) + [42]
    assert propose(history, 1) == []                                       # the match is outside the window
    assert propose(history, 1, window=len(history)) == [43]


def _reference_propose(history, limit, sizes=(3, 2, 1), window=1024):
    """The definition, spelled out: latest earlier occurrence of the last n tokens, longest n first."""
    tail = list(history[-window:])
    for n in sizes:
        if limit <= 0 or len(tail) <= n:
            continue
        for i in range(len(tail) - n - 1, -1, -1):
            if tail[i:i + n] == tail[-n:]:
                return tail[i + n:i + n + limit]
    return []


def test_propose_equals_its_definition_on_random_histories():
    import random
    rng = random.Random(11)
    for _ in range(3000):
        history = [rng.randrange(rng.choice((2, 3, 7, 60))) for _ in range(rng.randrange(0, 50))]
        limit, window = rng.randrange(0, 9), rng.choice((1024, 4, 13))
        assert propose(history, limit, window=window) == _reference_propose(history, limit, window=window), \
            (history, limit, window)


def test_a_history_index_proposes_what_propose_does_as_the_history_grows():
    # one index per growing history: lookups after rounds of 0..40 new tokens, windows shorter
    # than the history (its positions forgotten as they leave), then a shorter history (a new one)
    import random
    rng = random.Random(12)
    for _ in range(300):
        vocab = rng.choice((2, 3, 7, 60, 5000))
        window = rng.choice((1024, 2, 4, 13))
        index = HistoryIndex(window)
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        for _ in range(60):
            limit = rng.randrange(0, 9)
            assert index.propose(history, limit) == propose(history, limit, window=window), (history, limit, window)
            history.extend(rng.randrange(vocab) for _ in range(rng.choice((0, 1, 1, 3, 5, 40))))
        history = history[:rng.randrange(len(history) + 1)]
        for _ in range(5):
            assert index.propose(history, 7) == propose(history, 7, window=window)
            history.append(rng.randrange(vocab))


def test_lane_ceiling_is_bounded_by_program_and_request_limits():
    # spec: SPEC-13
    # spec: SPEC-14
    narrow = SpeculativeProgram("d2", rows=2, drafts=2, width=4, packed=8, length_source=QL,
                                reports_cursor=True, lag=0)
    assert lane_ceiling(narrow, _candidate()) == 3                         # min(D + 1, W) with D = W - 2
    assert lane_ceiling(W4, _candidate(output_left=2)) == 2
    assert lane_ceiling(W4, _candidate(context_left=1)) == 1
    round_ = _table(W1, W4).plan([_candidate(output_left=2)])
    assert [lane.length for lane in round_.lanes] == [2]


def test_cohort_is_chosen_from_completed_observations():
    # spec: SPEC-15
    table = _table(W1, W4)
    inflight = _candidate(1, inflight=1)
    round_ = table.plan([_candidate(0), inflight])
    assert [lane.candidate.key for lane in round_.lanes] == [0]
    assert round_.program.program == "w4" and round_.lanes[0].proposals == [5, 6, 7]
    assert table.plan([inflight]) is None


def test_host_lengths_fit_P():
    # spec: SPEC-17
    small = SpeculativeProgram("p5", rows=4, drafts=3, width=4, packed=5, length_source=QL,
                               reports_cursor=True, lag=0)
    round_ = _table(small).plan([_candidate(k) for k in range(3)])
    assert sum(lane.length for lane in round_.lanes) <= 5
    assert all(lane.length >= 1 for lane in round_.lanes)


def test_reservations_cover_the_full_ceiling():
    # spec: SPEC-21
    round_ = _table(W4).plan([_candidate(history=[1, 2, 3, 4, 5])])       # no match: one row offered
    lane = round_.lanes[0]
    assert lane.length == 1 and lane.ceiling == 4
    assert lane.reserve_end == lane.candidate.consumed + 4


def test_lanes_needing_width_one_get_no_proposals():
    # spec: SPEC-45
    # spec: SPEC-46
    table = _table(W1, W4)
    for flags in ({"constrained": True}, {"host_stops": True}, {"device_pending": False}):
        round_ = table.plan([_candidate(**flags)])
        assert round_.lanes[0].proposals == [] and round_.program.program == "w1"
    assert _table(W1, W4, history=False).plan([_candidate()]).program.program == "w1"


def test_completion_feedback_reasons():
    # spec: SPEC-43
    # spec: SPEC-44
    # spec: SPEC-45
    # spec: SPEC-46
    # spec: SPEC-47
    # spec: SPEC-48
    # spec: SPEC-49
    assert feedback_reasons(_candidate()) == []                            # may take the second frame
    assert feedback_reasons(_candidate(device_pending=False)) == [FeedbackReason.HOST_FED_PENDING]
    assert feedback_reasons(_candidate(constrained=True)) == [FeedbackReason.GRAMMAR]
    assert feedback_reasons(_candidate(host_stops=True)) == [FeedbackReason.HOST_STOPS]
    assert feedback_reasons(_candidate(), proposals=[1]) == [FeedbackReason.HISTORY_INPUTS]
    assert feedback_reasons(_candidate(), cost_known=False) == [FeedbackReason.STALE_COST]
    assert feedback_reasons(_candidate(), phase_change=True) == [FeedbackReason.PHASE_CHANGE]


def test_validation_agreement_suppresses_commit_on_every_rank():
    # spec: SPEC-31
    assert ranks_agree([True, True])
    assert not ranks_agree([True, False])
    assert not ranks_agree([])


# ---- confidence layouts (contract checks) ---------------------------------------------------

@pytest.fixture(scope="module")
def prepared():
    from tests.engine_fixtures import prepared_in_memory

    return prepared_in_memory(speculative_variants=((2, 1, 0, 2), (2, 4, 3, 8), (2, 4, 3, 5, 1)))


def _with_confidence(prepared, shape, width=3, capacity=3, dtype=C.DTYPE_F32):
    contract = copy.deepcopy(prepared.contract)
    manifest = copy.deepcopy(prepared.manifest)
    count = 1
    for s in shape:
        count *= s
    manifest.buffers.append(M.Buffer(name="state.synthetic_confidence", kind=M.BUFFER_KIND_STATE, dtype=dtype,
                                     shape=list(shape), nbytes=4 * count, alignment=256))
    graph = next(g for g in contract.model.graphs if g.program == "speculative.r2.w4.t8")
    graph.speculative.confidence_width = width
    graph.speculative.confidence_buffer = "state.synthetic_confidence"
    graph.speculative.confidence_draft_capacity = capacity
    return PreparedContract.decode(contract, manifest)


def test_framed_confidence_layout(prepared):
    # spec: SPEC-34
    # spec: SPEC-35
    # spec: SPEC-36
    # spec: SPEC-39
    slots = prepared.manifest.request_slots
    _with_confidence(prepared, [2, slots, 3])
    with pytest.raises(ContractError):
        _with_confidence(prepared, [slots, 3])                          # unframed
    with pytest.raises(ContractError):
        _with_confidence(prepared, [2, slots, 3], width=2)              # confidence_width != D
    with pytest.raises(ContractError):
        _with_confidence(prepared, [2, slots, 2], capacity=2)           # capacity below the width
    with pytest.raises(ContractError):
        _with_confidence(prepared, [2, slots, 3], dtype=C.DTYPE_I32)    # not FP32
