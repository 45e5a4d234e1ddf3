"""Adaptive speculative width without a model: per-request decaying acceptance, the proposals a
lane is offered, and whether a round is worth a SPECULATIVE program (scheduler/speculative_width.py)."""
from __future__ import annotations

import pytest

from helios_backend.scheduler.speculative_width import DraftAcceptance, RoundCosts, WidthPolicy, expected_tokens

POLICY = WidthPolicy(max_drafts=7)


def test_a_new_request_is_offered_nothing_until_evidence_and_widens_as_drafts_are_accepted():
    acceptance = DraftAcceptance()
    assert acceptance.draft_limit(POLICY) == 0                # the prior alone pays for no round
    acceptance.observe(POLICY, 1, 1)                          # one copy accepted
    first = acceptance.draft_limit(POLICY)
    assert 1 <= first < POLICY.max_drafts
    limits = [first]
    for _ in range(6):
        offered = acceptance.draft_limit(POLICY)
        acceptance.observe(POLICY, offered, offered)          # every proposal accepted
        limits.append(acceptance.draft_limit(POLICY))
    assert limits == sorted(limits) and limits[-1] == POLICY.max_drafts


def test_a_settled_shadow_is_observed_as_the_round_that_would_have_offered_it():
    history = [5, 6, 7, 8]
    shadowed, verified = DraftAcceptance(), DraftAcceptance()
    shadowed.shadow_offer(POLICY, [9, 10, 11], len(history))
    assert shadowed.settle(POLICY, history)                   # nothing emitted yet: pending
    assert shadowed.settle(POLICY, history + [9, 10])         # two copies equal so far: pending
    assert not shadowed.settle(POLICY, history + [9, 10, 12])  # the third differs: decided
    verified.observe(POLICY, 3, 2)
    assert shadowed == verified and not shadowed.shadow
    # a first copy that differs decides at once, whatever follows
    early, late = DraftAcceptance(), DraftAcceptance()
    early.shadow_offer(POLICY, [9, 10, 11], len(history))
    assert not early.settle(POLICY, history + [4])
    late.observe(POLICY, 3, 0)
    assert early == late
    # every copy emitted: all accepted
    full = DraftAcceptance()
    full.shadow_offer(POLICY, [9, 10], len(history))
    assert not full.settle(POLICY, history + [9, 10, 3])
    assert full.successes == 2.0 and full.failures == 0.0 and full.draft_limit(POLICY) > 1
    # a long shadow is decided once shadow_tokens copies were emitted equal: those accepted
    long = DraftAcceptance()
    long.shadow_offer(POLICY, [9, 10, 11, 12, 13, 14, 15], len(history))
    assert long.settle(POLICY, history + [9, 10])
    assert not long.settle(POLICY, history + [9, 10, 11])
    assert POLICY.shadow_tokens == 3 and long.successes == 3.0 and long.failures == 0.0 and not long.shadow


def test_a_shadow_lookup_that_finds_nothing_is_a_miss():
    missed, rejected = DraftAcceptance(), DraftAcceptance()
    missed.shadow_offer(POLICY, [], 10)
    rejected.observe(POLICY, 1, 0)
    assert missed == rejected and missed.observed and not missed.settle(POLICY, list(range(20)))


def test_rejected_drafts_fall_back_to_no_drafting():
    acceptance = DraftAcceptance(successes=5.0)
    assert acceptance.draft_limit(POLICY) > 0
    rounds = 0
    while acceptance.draft_limit(POLICY):
        acceptance.observe(POLICY, acceptance.draft_limit(POLICY), 0)
        rounds += 1
    assert 1 <= rounds <= 8
    assert acceptance.rate < POLICY.reach


def test_recent_rounds_weigh_more_than_old_ones():
    early_good = DraftAcceptance()
    late_good = DraftAcceptance()
    for good in (True, True, True, False, False, False):
        early_good.observe(POLICY, 4, 4 if good else 0)
    for good in (False, False, False, True, True, True):
        late_good.observe(POLICY, 4, 4 if good else 0)
    assert late_good.rate > early_good.rate


def test_only_an_accepted_copy_opens_drafting():
    # a request whose lookups found nothing or only rejected copies is never offered drafts: p is
    # still 1/3 >= reach after one of them, but no round that waits for feedback is paid on that
    missed, rejected = DraftAcceptance(), DraftAcceptance()
    missed.miss(POLICY)
    rejected.observe(POLICY, 4, 0)
    for acceptance in (missed, rejected):
        assert acceptance.rate >= POLICY.reach and acceptance.draft_limit(POLICY) == 0
        acceptance.idle(POLICY, 200)                          # fading alone never probes again
        assert acceptance.draft_limit(POLICY) == 0
        # a later shadow lookup whose first copy was emitted does
        acceptance.shadow_offer(POLICY, [1, 2], 3)
        assert not acceptance.settle(POLICY, [0, 0, 0, 1, 5])
        assert acceptance.draft_limit(POLICY) >= 1


def test_offering_nothing_counts_as_idle():
    a, b = DraftAcceptance(failures=3.0), DraftAcceptance(failures=3.0)
    a.observe(POLICY, 0, 0)
    b.idle(POLICY)
    assert a == b


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_drafts_reach_the_target_with_at_least_the_reach_probability(p):
    k = POLICY.drafts_for(p)
    assert 0 <= k <= POLICY.max_drafts
    if k:
        assert p ** k >= POLICY.reach - 1e-12
    if k < POLICY.max_drafts:
        assert p ** (k + 1) < POLICY.reach


def test_expected_tokens_of_a_lane():
    assert expected_tokens(0.5, 1) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.75)
    assert expected_tokens(1.0, 8) == 8.0
    assert expected_tokens(0.0, 8) == 1.0


def test_a_round_is_worth_it_only_when_it_beats_decode_per_cost():
    # one lane, width 4 program: costs 1 + 3 x row_cost decode steps
    assert POLICY.worth(expected_tokens(0.9, 4), 1, 4)
    assert not POLICY.worth(expected_tokens(0.05, 2), 1, 4)
    # one promising lane in a batch of 32 does not pay for verifying the whole batch wider
    assert not POLICY.worth(31 + expected_tokens(0.9, 4), 32, 4)
    assert POLICY.worth(32 * expected_tokens(0.9, 8), 32, 8)
    assert not POLICY.worth(5.0, 1, 1)


def test_measured_costs_replace_the_prior():
    costs = RoundCosts()
    assert costs.ratio("speculative.r1.w4.t4", "decode.r1") is None
    costs.observe("decode.r1", 0.010)
    costs.observe("speculative.r1.w4.t4", 0.040)             # a CPU: every target row costs a step
    ratio = costs.ratio("speculative.r1.w4.t4", "decode.r1")
    assert ratio == pytest.approx(4.0)
    lane = expected_tokens(0.9, 4)                            # ~3.4 tokens for 4 rows' cost
    assert POLICY.worth(lane, 1, 4) and not POLICY.worth(lane, 1, 4, ratio)
    fixed = WidthPolicy(max_drafts=7, measured=False)
    assert fixed.worth(lane, 1, 4, ratio)                     # the fixed cost model ignores measurements
    costs.observe("speculative.r1.w4.t4", 0.012)              # a decaying average moves toward new rounds
    assert 1.2 < costs.ratio("speculative.r1.w4.t4", "decode.r1") < 4.0


def test_an_unmeasured_program_is_estimated_from_the_cost_per_target_row():
    cpu = RoundCosts()
    cpu.observe("decode.r1.t1", 0.010, 1)
    assert cpu.ratio("speculative.r8.w4.t32", "decode.r1.t1", 32) is None     # one row count: the prior decides
    cpu.observe("decode.r4.t4", 0.016, 4)
    cpu.observe("decode.r8.t8", 0.024, 8)                     # 2 ms per row on top of 8 ms
    ratio = cpu.ratio("speculative.r8.w4.t32", "decode.r8.t8", 32)
    assert ratio == pytest.approx(0.072 / 0.024)
    # eight lanes each offered one copy at p = 0.5 pay at the prior, not at the estimate
    expected = 8 * expected_tokens(0.5, 2)
    assert POLICY.worth(expected, 8, 4) and not POLICY.worth(expected, 8, 4, ratio)
    # rows that cost nothing extra (a GPU): the estimate stays at the DECODE cost
    gpu = RoundCosts()
    for program, rows in (("decode.r1.t1", 1), ("decode.r8.t8", 8)):
        gpu.observe(program, 0.004, rows)
    assert gpu.ratio("speculative.r8.w8.t64", "decode.r8.t8", 64) == pytest.approx(1.0)
    # a measured program is its measurement, not the line
    cpu.observe("speculative.r8.w4.t32", 0.030, 32)
    assert cpu.ratio("speculative.r8.w4.t32", "decode.r8.t8", 32) == pytest.approx(0.030 / 0.024)
