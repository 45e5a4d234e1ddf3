"""The round being built (RoundBuilder) and the prompt-round policy (PromptRounds), on their own:
the running sums, the chunk that fits, what planning behind a round in flight refuses, and
that a round of prompts never follows another."""
from __future__ import annotations

from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.plan import PENDING_TOKEN, Lane, Variant
from helios_backend.scheduler.prompt_rounds import PromptRounds
from helios_backend.scheduler.request import Request, RequestSpec, SamplingSettings
from helios_backend.scheduler.round_builder import RoundBuilder
from helios_backend.scheduler.variants import VariantTable

# a MIXED program that tells its host-fed lanes by their prompt tokens (any row may be one)
TABLE = VariantTable([
    Variant(cp.OPERATION_DECODE, "decode.r4", 4, 4),
    Variant(cp.OPERATION_MIXED, "mixed.r4.t36", 4, 36, host_fed_rows=4),
    Variant(cp.OPERATION_PREFILL, "prefill.r4.t64", 4, 64),
])


def request(serial: int, prompt_len: int) -> Request:
    return Request(serial, RequestSpec(tuple(range(3, 3 + prompt_len)), 8, SamplingSettings()), serial)


def decode_lane(serial: int) -> Lane:
    return Lane(request(serial, 5), serial, 1, 5, [PENDING_TOKEN], True, 8)


def prompt_lane(serial: int, tokens: int) -> Lane:
    return Lane(request(serial, tokens), serial, 1, 0, list(range(3, 3 + tokens)), True, 8, initialize=True)


def test_the_running_sums_follow_every_added_lane() -> None:
    round_ = RoundBuilder(row_limit=2)
    round_.add(decode_lane(0), pending=True)
    round_.add(prompt_lane(1, 10), pending=False)
    assert (round_.rows, round_.tokens, round_.host_fed, round_.initializing) == (2, 11, 1, 1)
    assert round_.full


def test_a_prompt_beside_a_decode_lane_takes_prefill_only_when_no_round_is_in_flight() -> None:  # spec: SPEC-44
    # 50 prompt tokens beside one decode lane: only PREFILL holds them whole (its decode lane then
    # feeds its last token); behind a round in flight that lane's input is still on the device,
    # so the prompt takes the MIXED round's spare tokens (35) and its rest later
    for behind, chunk in ((False, 50), (True, 35)):
        round_ = RoundBuilder(row_limit=4, behind_inflight=behind)
        round_.add(decode_lane(0), pending=True)
        assert round_.fit_chunk(TABLE, 50, pending_one=False) == chunk


def test_a_second_prompt_behind_a_round_in_flight_goes_in_whole_or_not_at_all() -> None:  # spec: SPEC-44
    # a part of it would need its next chunk by completion feedback, stopping the second frame
    for behind, want, chunk in ((False, 30, 30), (True, 30, 0), (True, 20, 20)):
        round_ = RoundBuilder(row_limit=4, behind_inflight=behind)
        round_.add(decode_lane(0), pending=True)
        round_.add(prompt_lane(1, 10), pending=False)
        assert round_.fit_chunk(TABLE, want, pending_one=False) == chunk, (behind, want)


def test_a_pending_decode_token_fits_where_a_host_fed_one_does_not() -> None:
    # no MIXED program: three decode lanes and a fourth one-token chunk stay a DECODE round only
    # when that token is the slot's device-owned pending one; host-fed it needs a PREFILL row
    no_mixed = VariantTable([Variant(cp.OPERATION_DECODE, "decode.r4", 4, 4),
                             Variant(cp.OPERATION_PREFILL, "prefill.r1.t64", 1, 64)])
    round_ = RoundBuilder(row_limit=8)
    for serial in range(3):
        round_.add(decode_lane(serial), pending=True)
    assert round_.fit_chunk(no_mixed, 1, pending_one=True) == 1
    assert round_.fit_chunk(no_mixed, 1, pending_one=False) == 0
    round_.add(decode_lane(3), pending=True)
    assert round_.fit_chunk(no_mixed, 1, pending_one=True) == 0        # no variant of five rows
    assert RoundBuilder(row_limit=4).fit_chunk(no_mixed, 0, pending_one=False) == 0


def test_a_round_of_prompts_is_due_for_a_burst_and_never_twice_in_a_row() -> None:
    rounds = PromptRounds(admission_burst=2, variants=TABLE)
    waiting = [((0, i), request(i, 40)) for i in range(3)]
    assert rounds.due(waiting, running=1, free_slots=3, max_active=4)
    rounds.planned(prompts_only=True)
    assert not rounds.due(waiting, running=1, free_slots=3, max_active=4)
    rounds.planned(prompts_only=False)
    assert rounds.due(waiting, running=1, free_slots=3, max_active=4)
    assert not rounds.due(waiting[:1], running=1, free_slots=3, max_active=4)   # below the burst
    assert not rounds.due(waiting, running=0, free_slots=3, max_active=4)       # nobody decodes
    assert not rounds.due(waiting, running=3, free_slots=1, max_active=4)       # no room for two
    # a MIXED round takes prompts up to its spare tokens (36 - 4) beside its decode lanes
    short = [((0, i), request(i, 32)) for i in range(3)]
    assert not rounds.due(short, running=1, free_slots=3, max_active=4)
