"""Reference kernels of the SPECULATIVE operation: device prefix allocation and the verify block."""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi import abi
from helios_backend.kernel_abi import sampling as sampling_kernels
from helios_backend.kernel_abi.speculative import allocate_lengths, allocate_prefixes, broadcast_rank_zero, expand_block


def _brute_force(conf: np.ndarray, ceilings, P: int) -> np.ndarray:
    """Independent oracle: rank every (lane, row) by (FP64 survival desc, row asc, lane asc),
    keep a row only when its predecessor is kept, until P rows (pending rows first)."""
    lanes = len(ceilings)
    lengths = np.ones(lanes, dtype=np.int32)
    candidates = []
    for b in range(lanes):
        survival = np.float64(1.0)
        for k in range(int(ceilings[b]) - 1):
            survival *= np.float64(conf[b, k])
            candidates.append((-survival, k + 2, b))
    budget = P - lanes
    for _, n, b in sorted(candidates):
        if budget == 0:
            break
        if lengths[b] == n - 1:
            lengths[b] = n
            budget -= 1
    return lengths


def test_every_lane_starts_with_its_pending_row():
    # spec: SPEC-24
    conf = np.zeros((3, 3), dtype=np.float32)
    assert allocate_lengths(conf, [4, 4, 4], 3).tolist() == [1, 1, 1]
    assert allocate_lengths(conf, [4, 1, 2], 9).tolist() == [4, 1, 2]   # zero confidence still fills spare rows


def test_highest_frontier_survival_first():
    # spec: SPEC-25
    conf = np.array([[0.9, 0.9, 0.9], [0.95, 0.1, 0.1]], dtype=np.float32)
    # frontier 0.9 vs 0.95 -> lane 1; then 0.9 vs 0.095 -> lane 0, then 0.81 vs 0.095 -> lane 0
    assert allocate_lengths(conf, [4, 4], 3).tolist() == [1, 2]
    assert allocate_lengths(conf, [4, 4], 4).tolist() == [2, 2]
    assert allocate_lengths(conf, [4, 4], 5).tolist() == [3, 2]


def test_survival_multiplies_fp32_values_in_fp64():
    # spec: SPEC-26
    x = np.float32(1.0 - 2.0 ** -24)           # largest float32 below 1
    u = np.float32(1.0 - 2.0 ** -23)
    # in FP32, x * x rounds to u: the products tie; in FP64, x * x = u + 2^-48 > u
    assert np.float32(x) * np.float32(x) == u
    assert np.float64(x) * np.float64(x) > np.float64(u)
    conf = np.array([[u, 1.0], [x, x]], dtype=np.float32)
    # row admitted first: lane 1's x > lane 0's u. Then lane 0's u (prefix 2) against lane 1's x*x
    # (prefix 3): an FP32 product would tie and the shorter prefix (lane 0) would win.
    assert allocate_lengths(conf, [3, 3], 4).tolist() == [1, 3]


def test_ties_prefer_shorter_prefix_then_lower_row():
    # spec: SPEC-27
    conf = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=np.float32)
    # every survival is 1.0: rows go by prefix length first (breadth-first), then lane order
    assert allocate_lengths(conf, [4, 4], 3).tolist() == [2, 1]
    assert allocate_lengths(conf, [4, 4], 4).tolist() == [2, 2]
    assert allocate_lengths(conf, [4, 4], 5).tolist() == [3, 2]


def test_equal_survival_and_length_goes_to_the_earlier_row():
    # spec: SPEC-28
    conf = np.array([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=np.float32)
    assert allocate_lengths(conf, [3, 3, 3], 4).tolist() == [2, 1, 1]
    assert allocate_lengths(conf, [3, 3, 3], 5).tolist() == [2, 2, 1]


def test_a_later_confidence_never_admits_its_predecessor():
    # spec: SPEC-29
    conf = np.array([[0.1, 1.0, 1.0], [0.5, 0.0, 0.0]], dtype=np.float32)
    # lane 0's row 3 has confidence 1.0 but its predecessor (0.1) is behind lane 1's 0.5
    lengths = allocate_lengths(conf, [4, 4], 3)
    assert lengths.tolist() == [1, 2]


def test_rows_fit_P_while_ceilings_may_exceed_it():
    # spec: SPEC-19
    # spec: SPEC-20
    rng = np.random.default_rng(7)
    for _ in range(300):
        lanes = int(rng.integers(1, 5))
        width = int(rng.integers(1, 5))
        conf = rng.random((lanes, max(width - 1, 1))).astype(np.float32)
        conf[rng.random(conf.shape) < 0.2] = 0.5    # ties
        ceilings = rng.integers(1, width + 1, size=lanes)
        P = int(rng.integers(lanes, lanes * width + 1))
        lengths = allocate_lengths(conf, ceilings, P)
        assert lengths.sum() <= P
        assert (lengths >= 1).all() and (lengths <= ceilings).all()
        assert lengths.sum() == min(P, int(ceilings.sum()))
        assert lengths.tolist() == _brute_force(conf, ceilings, P).tolist()


def test_allocation_draws_no_random_numbers(monkeypatch):
    # spec: SPEC-32
    def forbidden(*args, **kwargs):
        raise AssertionError("allocation drew a random number")

    monkeypatch.setattr(sampling_kernels, "philox4x32", forbidden)
    monkeypatch.setattr(np.random, "random", forbidden)
    state = np.random.get_state()
    conf = np.array([[0.4, 0.3], [0.9, 0.8]], dtype=np.float32)
    assert allocate_lengths(conf, [3, 3], 4).tolist() == [1, 3]
    assert np.array_equal(np.random.get_state()[1], state[1])


def test_abi_form_reads_the_frame_of_the_transport_header():
    # spec: SPEC-37
    # spec: SPEC-38
    slots, capacity = 4, 3
    confidence = np.zeros((2, slots, capacity), dtype=np.float32)
    confidence[0, 0] = [0.9, 0.9, 0.9]      # frame 0 favours row 0
    confidence[1, 1] = [0.9, 0.9, 0.9]      # frame 1 favours row 1
    lengths = np.zeros(4, dtype=np.int32)
    for frame, expected in ((0, [3, 1]), (1, [1, 3])):
        allocate_prefixes(lengths, confidence.ravel(), np.array([4, 4, 0, 0], np.int32),
                          np.array([2, 0, -1, -1], np.int32), np.array([5, frame], np.int32),
                          np.array([2], np.int32), rows=4, request_slots=slots, draft_capacity=capacity,
                          confidence_width=3, packed_capacity=4)
        assert lengths[:2].tolist() == expected
        assert lengths[2:].tolist() == [0, 0]


def test_expand_discards_stale_copies_and_clamps_to_width():
    # spec: SPEC-8
    # spec: SPEC-9
    # spec: SPEC-13
    P, B, D = 8, 2, 3
    out = {k: np.zeros(P, np.int32) for k in ("ids", "positions", "token_slot", "token_length")}
    lengths = np.zeros(B, np.int32)
    pending = np.array([11, 22, 33], np.int32)
    proposals = np.array([1, 2, 3, 4, 5, 6], np.int32)
    expand_block(out["ids"], out["positions"], out["token_slot"], out["token_length"], lengths,
                 requested=np.array([9, 4], np.int32), pending=pending, proposal_ids=proposals,
                 proposal_count=np.array([3, 3], np.int32), proposal_generation=np.array([7, 1], np.int32),
                 proposal_consumed=np.array([10, 20], np.int32), row_slot=np.array([2, 0], np.int32),
                 row_generation=np.array([7, 2], np.int32), consumed=np.array([10, 20], np.int32),
                 live_rows=np.array([2], np.int32), rows=B, tokens=P, draft_stride=D, draft_tokens=D, width=4)
    # lane 0: fresh copies, requested 9 clamped to W=4; lane 1: generation 1 != 2 -> stale, pending only
    assert lengths.tolist() == [4, 1]
    assert out["ids"][:5].tolist() == [33, 1, 2, 3, 11]
    assert out["positions"][:5].tolist() == [10, 11, 12, 13, 20]
    assert out["token_slot"][:6].tolist() == [2, 2, 2, 2, 0, -1]
    assert out["token_length"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def test_kernels_are_in_the_abi_table():
    # spec: SPEC-1
    for kernel_id in ("speculative.allocate.v1", "speculative.expand.v1", "speculative.verify_commit.v1"):
        spec = abi.kernel(kernel_id)
        pointers = [p for p in spec.params if p.is_pointer]
        immediates = [p for p in spec.params if not p.is_pointer]
        assert spec.params == tuple(pointers + immediates)   # pointers first, then immediates


def test_rank_zero_confidence_is_broadcast_before_allocation():
    # spec: SPEC-30
    import threading

    slots, capacity, frame = 2, 3, 1
    base = np.zeros((2, slots, capacity), np.float32)
    base[frame] = [[0.6, 0.5, 0.5], [0.6, 0.5, 0.5]]
    ranks = [base.ravel().copy(), base.ravel().copy()]
    ranks[1].reshape(base.shape)[frame, 1, 0] = np.nextafter(np.float32(0.6), np.float32(1))  # last-bit drift
    results: list[list[int] | None] = [None, None]
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        if r == 0:
            broadcast_rank_zero(ranks, frame, slots, capacity)
        barrier.wait()                                   # every rank allocates after the broadcast
        lengths = np.zeros(2, np.int32)
        allocate_prefixes(lengths, ranks[r], np.array([4, 4], np.int32), np.array([0, 1], np.int32),
                          np.array([0, frame], np.int32), np.array([2], np.int32), rows=2,
                          request_slots=slots, draft_capacity=capacity, confidence_width=3, packed_capacity=3)
        results[r] = lengths.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == [2, 1]
    # without the broadcast, rank 1 would have admitted its own lane first
    drifted = base.copy()
    drifted[frame, 1, 0] = np.nextafter(np.float32(0.6), np.float32(1))
    assert allocate_lengths(drifted[frame], [4, 4], 3).tolist() == [1, 2]


def test_expand_offers_at_most_D_proposals():
    # spec: SPEC-8
    P, D = 6, 2
    out = {k: np.zeros(P, np.int32) for k in ("ids", "positions", "token_slot", "token_length")}
    lengths = np.zeros(1, np.int32)
    expand_block(out["ids"], out["positions"], out["token_slot"], out["token_length"], lengths,
                 requested=np.array([6], np.int32), pending=np.array([9], np.int32),
                 proposal_ids=np.array([1, 2, 3, 4], np.int32), proposal_count=np.array([4], np.int32),
                 proposal_generation=np.array([1], np.int32), proposal_consumed=np.array([0], np.int32),
                 row_slot=np.array([0], np.int32), row_generation=np.array([1], np.int32),
                 consumed=np.array([0], np.int32), live_rows=np.array([1], np.int32), rows=1, tokens=P,
                 draft_stride=4, draft_tokens=D, width=6)
    assert lengths.tolist() == [D + 1]                    # W = 6 allows more; D = 2 draws are all there are
    assert out["ids"][:3].tolist() == [9, 1, 2]
