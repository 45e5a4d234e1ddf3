"""The multi-program sampling kernels (sampling.draw.v2, sampling.logprobs.v2) against their numpy
references, in Triton's interpreter (and from the cubin where a GPU is present).

Each row's vocabulary is spread over cdiv(vocab, BLOCK_V) programs that leave per-chunk records in
the `partials` scratch and count themselves in `arrivals`; the last to arrive finishes the row and
resets its counter. Every case runs the kernel twice over the same scratch (the second launch must
find the counters back at zero) and compares both launches with the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from helios_backend.kernel_abi import abi  # noqa: E402
from helios_backend.kernel_abi.sampling import partial_words  # noqa: E402
from helios_backend.kernel_abi.state import LOGPROBS_WORD  # noqa: E402
from ignition.gpu_kernels.specs import SPECS_BY_ID  # noqa: E402
from tests.test_gpu_kernels import DRAW_SETTINGS as V1_DRAW_SETTINGS  # noqa: E402
from tests.test_gpu_kernels import (_completion_kept_apart, _sampling_rows,  # noqa: E402,F401
                                       check_against_reference, interpreter, library, runner)

RNG = np.random.default_rng(2026)
DRAW = "sampling.draw.v2"
LOGPROBS = "sampling.logprobs.v2"


def _scratch_read(kernel_id: str) -> abi.KernelSpec:
    """The ABI entry with the scratch pointers declared READ: the reference never writes them, so
    the comparison skips them (the tests check the counters themselves)."""
    spec = abi.kernel(kernel_id)
    params = tuple(abi.Param(p.name, p.kind, p.dtype, abi.Access.READ) if p.name in ("partials", "arrivals")
                   else p for p in spec.params)
    return abi.KernelSpec(spec.id, params, spec.reference, spec.summary)


def _scratch(rows: int, vocab: int) -> dict[str, np.ndarray]:
    return {"partials": np.full((rows, partial_words(vocab)), 0x5A5A5A5A, np.int32),
            "arrivals": np.zeros(rows, np.int32)}


def _chunks(kernel_id: str, vocab: int) -> int:
    return -(-vocab // SPECS_BY_ID[kernel_id].constexprs["BLOCK_V"])


# ---------------------------------------------------------------------------------------------
# sampling.draw.v2

def _draw_case(logits: np.ndarray, settings: list[tuple], *, generated=None, seeds=None,
               sample_flag=None, row_slot=None, penalties=None, mask=None):
    """Buffers of one draw: row r samples with settings[r] = (temperature, top_p, top_k, min_p)
    and penalties[r] = (presence, frequency, repetition) (neutral by default), from the slot
    row_slot[r] (reversed rows by default); generated / seeds are per slot."""
    rows, vocab = logits.shape
    slots = rows
    bins = vocab
    mask_words = -(-vocab // 32)
    row_slot = row_slot if row_slot is not None else np.arange(rows, dtype=np.int32)[::-1].copy()
    penalties = penalties if penalties is not None else np.tile([0.0, 0.0, 1.0], (rows, 1))
    sampling = _sampling_rows([(1, 1, 0, 0, 0, 0, 1)] * slots)
    for r, slot in enumerate(row_slot):
        if slot >= 0:
            sampling[slot, :7] = tuple(settings[r]) + tuple(penalties[r])
    return {
        "sampled": np.full(rows, -9, np.int32), "logits": logits, "sampling": sampling,
        "seeds": seeds if seeds is not None else RNG.integers(0, 2**32, (slots, 2), dtype=np.uint64).astype(np.uint32),
        "generated": generated if generated is not None else RNG.integers(0, 1000, slots).astype(np.int32),
        "prompt_histogram": RNG.integers(0, 2, (slots, bins)).astype(np.int32),
        "output_histogram": (RNG.integers(0, 3, (slots, bins)) * RNG.integers(0, 2, (slots, bins))).astype(np.int32),
        "grammar_mask": mask if mask is not None else np.full((rows, mask_words), 0xFFFFFFFF, np.uint32),
        "row_slot": row_slot,
        "sample_flag": sample_flag if sample_flag is not None else np.ones(rows, np.int32),
        **_scratch(rows, vocab)}, {"rows": rows, "vocab": vocab, "histogram_bins": bins, "mask_words": mask_words}


# how the finishing program decided (chunk 0's `path` word of the row's record, sampling.py)
GREEDY, PREFIX, BISECTION = 1, 2, 3


def _within_rounding(logits_row: np.ndarray, params: np.ndarray, seed: np.ndarray, counter: int, token: int,
                     tolerance: float = 2e-5) -> bool:
    """Whether `token` is the reference's inverse-CDF pick (sampling.sample_row, neutral
    penalties) for some target within `tolerance` of the reference's own: the reference sums
    its CDF sequentially in f32, the kernels in another order, so a target that falls within
    rounding of a CDF step may pick the neighbouring token (deep in a flat tail the steps are
    ~1e-6 wide)."""
    from helios_backend.kernel_abi.sampling import draw_uniform, kept_distribution
    candidates, cdf = kept_distribution(logits_row, params)
    hits = np.nonzero(candidates == token)[0]
    if not hits.size:
        return False
    i = int(hits[0])
    target = np.float32(draw_uniform(seed, counter)) * cdf[-1]
    low = cdf[i - 1] if i else 0.0
    return bool(low - tolerance <= target <= cdf[i] + tolerance)


def check_draw(runner, buffers: dict, immediates: dict, launches: int = 2,
               rounding: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Launch `launches` times over the same scratch, the draw counters advancing between launches;
    each launch equals the reference (with `rounding`, a differing token must be within CDF
    rounding of the reference's, _within_rounding) and leaves every arrival counter at zero.
    Returns (tokens, path per row) per launch."""
    spec = _scratch_read(DRAW)
    if rounding:
        spec = abi.KernelSpec(spec.id, tuple(abi.Param(p.name, p.kind, p.dtype, abi.Access.READ)
                                             if p.name == "sampled" else p for p in spec.params),
                              spec.reference, spec.summary)
    results = []
    for _ in range(launches):
        out = check_against_reference(runner, DRAW, buffers, immediates, spec=spec)
        assert (out["arrivals"] == 0).all()                       # self-resetting for the next step
        assert (out["logits"] == buffers["logits"]).all()         # the raw logits are left as they are
        if rounding:
            want = np.full_like(buffers["sampled"], -9)
            spec.reference(want, *[np.ascontiguousarray(buffers[p.name]).reshape(-1) if p.is_pointer
                                   else immediates[p.name] for p in spec.params[1:]])
            for r in np.nonzero(out["sampled"] != want)[0]:
                slot = buffers["row_slot"][r]
                assert _within_rounding(buffers["logits"][r], buffers["sampling"][slot], buffers["seeds"][slot],
                                        int(buffers["generated"][slot]), int(out["sampled"][r])), (r, want[r])
        results.append((out["sampled"].copy(), out["partials"][:, 5].copy()))
        buffers = dict(buffers, partials=out["partials"], arrivals=out["arrivals"],
                       generated=buffers["generated"] + 1)
    return results


# v1's settings (greedy, plain, top-p, top-k, all three, min-p) and a top-k past the prefix
DRAW_SETTINGS = V1_DRAW_SETTINGS + [(0.8, 1.0, 300, 0.0)]


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", DRAW_SETTINGS)
def test_draw_v2_one_chunk_matches_the_reference(runner, temperature, top_p, top_k, min_p):
    rows, vocab = 6, 304
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32) * 2
    logits[0, [3, 77]] = logits[0].max() + 1           # a tie for the best token
    flags = np.array([1] * (rows - 1) + [0], np.int32)
    buffers, immediates = _draw_case(logits, [(temperature, top_p, top_k, min_p)] * rows, sample_flag=flags)
    for tokens, paths in check_draw(runner, buffers, immediates):
        assert tokens[-1] == -1
        assert set(paths[:-1]) <= ({GREEDY} if temperature == 0 else {PREFIX, BISECTION})


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", DRAW_SETTINGS[:3] + DRAW_SETTINGS[4:5])
def test_draw_v2_over_many_programs_matches_the_reference(runner, temperature, top_p, top_k, min_p):
    """4 chunks per row (several programs and one finisher per row); each row's head sits in
    one place or is spread over the vocabulary."""
    rows, vocab = 4, 8192
    assert _chunks(DRAW, vocab) == 4
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):
        if r % 2:
            head = RNG.integers(0, vocab - 64)
            logits[r, head:head + 64] += 6 * RNG.random(64).astype(np.float32)
        else:
            logits[r, RNG.integers(0, vocab, 40)] += 4 + 4 * RNG.random(40).astype(np.float32)
    logits[3, [100, 5000, 8016]] = logits[3].max() + 0.5   # tied best tokens in chunks 0, 1 and 2
    buffers, immediates = _draw_case(logits, [(temperature, top_p, top_k, min_p)] * rows)
    check_draw(runner, buffers, immediates, launches=1)


def test_draw_v2_seeded_draws_equal_the_reference_token_for_token(runner):
    """Peaked rows (24 likely tokens, a tail holding ~1e-3 of the mass) under many seeds and
    draw counters: plain, top-p, top-k + min-p and min-p draws all resolve on the sorted
    candidate prefix, token for token with the reference."""
    rows, vocab = 16, 4096
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):
        logits[r, RNG.choice(vocab, 24, replace=False)] += 12 + RNG.random(24).astype(np.float32)
    settings = [(0.8, 1.0, 0, 0.0), (1.0, 0.9, 0, 0.0), (0.6, 1.0, 20, 0.02), (1.2, 0.7, 0, 0.1)]
    buffers, immediates = _draw_case(logits, [settings[r % 4] for r in range(rows)],
                                     seeds=np.tile(np.array([[7, 11]], np.uint32), (rows, 1)),
                                     generated=np.arange(rows, dtype=np.int32) * 7)
    for tokens, paths in check_draw(runner, buffers, immediates):
        assert len(set(tokens.tolist())) > 8                                  # real draws, not one token
        assert (paths == PREFIX).all()


def test_draw_v2_past_the_prefix_bisects_the_row(runner):
    """Flat rows at temperature 1: most draws fall past the candidate prefix and take the
    finishing program's bisection. The CDF steps are ~2e-4 wide, within reach of f32 rounding
    of a 4096-term sum, so tokens are compared up to CDF rounding (_within_rounding)."""
    rows, vocab = 6, 4096
    logits = (RNG.standard_normal((rows, vocab)) * 0.3).astype(np.float32)
    buffers, immediates = _draw_case(logits, [(1.0, 1.0, 0, 0.0)] * rows)
    for tokens, paths in check_draw(runner, buffers, immediates, rounding=True):
        assert len(set(tokens.tolist())) > rows // 2
        assert (paths == BISECTION).mean() > 0.5


def test_draw_v2_applies_penalties_and_the_grammar_mask_itself(runner):
    rows, vocab = 5, 2304                                  # 2 chunks of 144 interleaved groups
    logits = (RNG.standard_normal((rows, vocab)) * 3).astype(np.float32)
    mask = np.full((rows, vocab // 32), 0xFFFFFFFF, np.uint32)
    mask[1] = RNG.integers(0, 2**32, vocab // 32, dtype=np.uint64).astype(np.uint32)
    mask[3, :40] = 0                                       # the first 1280 tokens disallowed
    settings = [(0.0, 1, 0, 0), (0.0, 1, 0, 0), (0.9, 0.9, 0, 0), (0.0, 1, 0, 0), (1.1, 1, 8, 0)]
    penalties = np.array([[0.5, 0.25, 1.3], [0, 0, 1], [0.1, 0, 0.8], [0, 1.5, 1], [0.2, 0.3, 1.2]], np.float32)
    buffers, immediates = _draw_case(logits, settings, penalties=penalties, mask=mask)
    (first, _), _ = check_draw(runner, buffers, immediates)
    assert first[3] >= 1280


def test_draw_v2_walks_tied_logits_in_id_order(runner):
    """All logits equal over 2 chunks: the candidate prefix holds only the 64 lowest ids (1.6 %
    of the mass), so nearly every draw comes from the finishing program's bisection, which
    enters the tie group in id order."""
    rows, vocab = 8, 4096
    buffers, immediates = _draw_case(np.zeros((rows, vocab), np.float32), [(1.0, 1.0, 0, 0.0)] * rows,
                                     seeds=np.tile(np.array([[5, 6]], np.uint32), (rows, 1)),
                                     generated=np.arange(rows, dtype=np.int32))
    (first, paths), _ = check_draw(runner, buffers, immediates)
    assert len(set(first.tolist())) > rows // 2
    assert (paths == BISECTION).mean() >= 0.5


def test_draw_v2_greedy_takes_the_lowest_id_of_a_tie_across_chunks(runner):
    rows, vocab = 3, 3072
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    logits[:, [2900, 1500, 2000]] = 9.0
    buffers, immediates = _draw_case(logits, [(0.0, 1.0, 0, 0.0)] * rows,
                                     row_slot=np.array([1, -1, 0], np.int32))
    (first, paths), _ = check_draw(runner, buffers, immediates)
    assert first.tolist() == [1500, -1, 1500]
    assert paths[[0, 2]].tolist() == [GREEDY, GREEDY]


# ---------------------------------------------------------------------------------------------
# sampling.logprobs.v2

def _logprobs_case(runner, logits: np.ndarray, sampled: np.ndarray, sample_flag: np.ndarray, top_n: int,
                   wants: np.ndarray, launches: int = 2) -> np.ndarray:
    """Run sampling.logprobs.v2 and its reference `launches` times over the same scratch;
    ids exactly, logprobs to 1e-5; counters back at zero. Returns the records [rows, width]."""
    from helios_backend.kernel_abi.logprobs import logprob_record_words
    rows, vocab = logits.shape
    base, width = 12, logprob_record_words(top_n)
    sampling = _sampling_rows([(1, 1, 0, 0, 0, 0, 1)] * rows)
    row_slot = np.arange(rows, dtype=np.int32)[::-1].copy()
    sampling[row_slot, LOGPROBS_WORD] = wants
    compared, reference_out = _completion_kept_apart(LOGPROBS)
    scratch = _scratch(rows, vocab)
    for _ in range(launches):
        produced = check_against_reference(runner, LOGPROBS, {
            "completion": np.full(base + rows * width, 0x7EADBEEF, np.int32), "logits": logits,
            "sampled": sampled, "sampling": sampling, "row_slot": row_slot, "sample_flag": sample_flag,
            "live_rows": np.array([rows], np.int32), **scratch},
            {"rows": rows, "vocab": vocab, "top_n": top_n, "record_base": base}, spec=compared)
        got, want = produced["completion"], reference_out["completion"]
        np.testing.assert_array_equal(got[:base], want[:base])
        got_r, want_r = got[base:].reshape(rows, width), want[base:].reshape(rows, width)
        np.testing.assert_array_equal(got_r[:, 1:1 + top_n], want_r[:, 1:1 + top_n])      # ids
        for cols in (slice(0, 1), slice(1 + top_n, width)):                                 # logprobs
            np.testing.assert_allclose(got_r[:, cols].view(np.float32), want_r[:, cols].view(np.float32),
                                       atol=1e-5, rtol=0)
        assert (produced["arrivals"] == 0).all()
        scratch = {"partials": produced["partials"], "arrivals": produced["arrivals"]}
    return got_r


@pytest.mark.parametrize("vocab", [304, 8192])
def test_logprobs_v2_match_the_reference(runner, vocab):
    rows, top_n = 6, 20
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[0, [7, 200, 301]] = logits[0].max() + 1      # tied best: id order (across chunks at 8192)
    logits[1, :] = 0.5                                  # all tied: ids 0..top_n-1
    logits[2, ::2] = -np.inf                            # a grammar-masked row
    logits[5, :64] += 30                                # the whole top-N inside one chunk
    sampled = np.array([7, 3, 1, 9, 11, 30], np.int32)
    flag = np.array([1, 1, 1, 1, 0, 1], np.int32)       # row 4 sampled nothing
    records = _logprobs_case(runner, logits, sampled, flag, top_n, wants=np.zeros(rows, np.float32))
    assert list(records[0, 1:4]) == [7, 200, 301]
    assert list(records[1, 1:1 + top_n]) == list(range(top_n))
    assert (records[4, 1:1 + top_n] == -1).all() and records[4, 0] == 0
    assert set(records[5, 1:1 + top_n]) <= set(range(64))


def test_logprobs_v2_skip_rows_that_did_not_ask(runner):
    rows, vocab, top_n = 4, 4096, 5
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    sampled = np.array([1, 2, 3, 4], np.int32)
    records = _logprobs_case(runner, logits, sampled, np.ones(rows, np.int32), top_n,
                             wants=np.array([-1, 1, -1, 0], np.float32))     # by slot (row_slot reversed)
    asked = [r for r in range(rows) if records[r, 1] != -1]
    assert asked == [1, 3]                                                   # wants >= 0
    assert (records[[0, 2], 0] == 0).all() and (records[[0, 2], 1 + top_n:] == 0).all()


def test_logprobs_v2_programs_exit_when_no_row_asks(runner):
    """No row wants logprobs: every record is the empty one and no program touches the scratch."""
    from helios_backend.kernel_abi.logprobs import logprob_record_words
    rows, vocab, top_n = 3, 8192, 20
    sampling = _sampling_rows([(1, 1, 0, 0, 0, 0, 1)] * rows)
    sampling[:, LOGPROBS_WORD] = -1
    width = logprob_record_words(top_n)
    out = check_against_reference(runner, LOGPROBS, {
        "completion": np.full(rows * width, 0x7EADBEEF, np.int32),
        "logits": RNG.standard_normal((rows, vocab)).astype(np.float32), "sampled": np.array([1, 2, 3], np.int32),
        "sampling": sampling, "row_slot": np.arange(rows, dtype=np.int32), "sample_flag": np.ones(rows, np.int32),
        "live_rows": np.array([rows], np.int32), **_scratch(rows, vocab)},
        {"rows": rows, "vocab": vocab, "top_n": top_n, "record_base": 0}, spec=_scratch_read(LOGPROBS))
    assert (out["partials"] == 0x5A5A5A5A).all() and (out["arrivals"] == 0).all()
    records = out["completion"].reshape(rows, width)
    assert (records[:, 0] == 0).all() and (records[:, 1:1 + top_n] == -1).all()


# ---------------------------------------------------------------------------------------------
# sampling.logit_bias.v1

@pytest.mark.parametrize("capacity", [300, 7])
def test_logit_bias_adds_each_rows_entries_in_place(runner, capacity):
    # spec: BND-17
    """Rows with full, partial and no entry lists (-1 padding); ids outside the vocabulary add
    nothing; the reference and the kernel agree bit for bit."""
    rows, vocab = 4, 8192
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32)
    ids = np.full((rows, capacity), -1, np.int32)
    values = np.zeros((rows, capacity), np.float32)
    ids[0] = RNG.choice(vocab, capacity, replace=False)
    values[0] = RNG.uniform(-100, 100, capacity)
    ids[1, :3] = [5, vocab - 1, vocab + 3]                 # the last is past the vocabulary
    values[1, :3] = [100.0, -100.0, 50.0]
    buffers = {"logits": logits, "bias_ids": ids, "bias_values": values}
    immediates = {"rows": rows, "vocab": vocab, "bias_capacity": capacity}
    out = check_against_reference(runner, "sampling.logit_bias.v1", buffers, immediates)
    biased = out["logits"].reshape(rows, vocab)
    want = logits.copy()
    want[0, ids[0]] += values[0]
    want[1, 5] += 100.0
    want[1, vocab - 1] -= 100.0
    assert (biased == want).all()
    assert (biased[2:] == logits[2:]).all()
