"""Numpy reference kernels against independent formulas (small random shapes, no model)."""
from __future__ import annotations

import numpy as np
import pytest

from helios_backend.kernel_abi import abi, attention, linear, rope, sampling, state

RNG = np.random.default_rng(7)


# ---- Philox4x32-10 -------------------------------------------------------------------------

@pytest.mark.parametrize("counter,key,expected", [
    # Random123 known-answer vectors (kat_vectors: philox4x32 10 rounds)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    # spec: BND-9 (seed bits drive a counter-based RNG that a GPU kernel can reproduce bit-exactly)
    out = sampling.philox4x32(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32))
    assert tuple(int(x) for x in out) == expected


def test_philox_is_vectorized_and_counter_based():
    counters = np.zeros((5, 4), dtype=np.uint32)
    counters[:, 0] = np.arange(5)
    keys = np.tile(np.array([1, 2], dtype=np.uint32), (5, 1))
    batch = sampling.philox4x32(counters, keys)
    for i in range(5):
        assert np.array_equal(batch[i], sampling.philox4x32(counters[i], keys[i]))
    assert len({tuple(row) for row in batch.tolist()}) == 5


def test_uniform_uses_top_24_bits_exactly():
    words = np.array([0, 0xFF, 0x100, 0xFFFFFFFF], dtype=np.uint32)
    u = sampling.uniform_from_word(words)
    assert u.dtype == np.float32
    assert u.tolist() == [0.0, 0.0, 2.0 ** -24, 1.0 - 2.0 ** -24]


# ---- RoPE ----------------------------------------------------------------------------------

def _complex_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Adjacent pairs as complex numbers times e^{i p w_k} (independent formula)."""
    d = x.shape[-1]
    w = theta ** (-np.arange(0, d, 2) / d)
    z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2]
    z = z * np.exp(1j * positions[:, None, None] * w[None, None, :])
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def test_rope_adjacent_pairs_match_complex_rotation():
    x = RNG.standard_normal((6, 3, 64)).astype(np.float32)
    positions = np.array([0, 1, 5, 17, 100, 511])
    table = rope.rope_table(512, 64, 100000.0)
    got = rope.apply_rope(x, table[positions], rope.ROPE_ADJACENT_PAIRS)
    np.testing.assert_allclose(got, _complex_rope(x, positions, 100000.0), rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[0], x[0])   # position 0 is the identity


def test_rope_half_pairs_differ_and_preserve_norms():
    x = RNG.standard_normal((4, 2, 64)).astype(np.float32)
    table = rope.rope_table(64, 64, 10000.0)[[3, 9, 20, 33]]
    adjacent = rope.apply_rope(x, table, rope.ROPE_ADJACENT_PAIRS)
    half = rope.apply_rope(x, table, rope.ROPE_HALF_PAIRS)
    np.testing.assert_allclose(np.linalg.norm(half, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    assert np.abs(adjacent - half).max() > 0.1
    with pytest.raises(ValueError):
        rope.apply_rope(x, table, 7)


# ---- geometry, dense kernels ------------------------------------------------------------------

def _geometry(lengths, rows, tokens):
    g = np.zeros(state.geometry_words(rows, tokens), dtype=np.int32)
    q = np.zeros(rows, dtype=np.int32)
    q[:len(lengths)] = lengths
    state.step_geometry(g, q, rows, tokens)
    return g


def test_step_geometry_layout():
    g = _geometry([2, 0, 3], rows=4, tokens=8)
    assert state.live_tokens(g) == 5
    assert state.token_rows(g, 8).tolist() == [0, 0, 2, 2, 2, -1, -1, -1]
    assert state.row_starts(g, 4, 8).tolist() == [0, 2, 2, 5, 5]


def test_linear_residual_touches_only_live_tokens():
    tokens, d_in, d_out = 4, 8, 5
    x = RNG.standard_normal(tokens * d_in).astype(np.float32)
    w = RNG.standard_normal(d_out * d_in).astype(np.float16)
    hidden = np.ones(tokens * d_out, dtype=np.float32)
    linear.linear_residual(hidden, x, w, _geometry([3], 1, tokens), tokens, d_in, d_out)
    expected = 1 + x.reshape(tokens, d_in)[:3] @ w.astype(np.float32).reshape(d_out, d_in).T
    np.testing.assert_allclose(hidden.reshape(tokens, d_out)[:3], expected, rtol=1e-5)
    assert np.all(hidden.reshape(tokens, d_out)[3] == 1)


def test_norm_gate_up_silu_matches_formula():
    tokens, d, f = 2, 8, 6
    h = RNG.standard_normal(tokens * d).astype(np.float32)
    g = RNG.standard_normal(d).astype(np.float32)
    w = RNG.standard_normal(2 * f * d).astype(np.float32)
    out = np.zeros(tokens * f, dtype=np.float32)
    linear.norm_gate_up_silu(out, h, g, w, _geometry([2], 1, tokens), tokens, d, f, 1e-5)
    x = h.reshape(tokens, d)
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    gu = n @ w.reshape(2 * f, d).T
    expected = gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]
    np.testing.assert_allclose(out.reshape(tokens, f), expected, rtol=1e-4, atol=1e-5)


def test_norm_logits_reads_each_rows_last_token():
    rows, tokens, d, v = 3, 6, 4, 7
    h = RNG.standard_normal(tokens * d).astype(np.float32)
    head = RNG.standard_normal(v * d).astype(np.float32)
    logits = np.full(rows * v, 5, dtype=np.float32)
    linear.norm_logits(logits, h, np.ones(d, np.float32), head, _geometry([2, 0, 4], rows, tokens),
                       rows, tokens, d, v, 1e-5)
    x = h.reshape(tokens, d)
    for row, last in ((0, 1), (2, 5)):
        n = x[last] / np.sqrt((x[last] ** 2).mean() + 1e-5)
        np.testing.assert_allclose(logits.reshape(rows, v)[row], n @ head.reshape(v, d).T, rtol=1e-5)
    assert np.all(logits.reshape(rows, v)[1] == 0)


# ---- paged attention ------------------------------------------------------------------------

def test_paged_attention_equals_dense_causal_attention_with_scattered_pages():
    # spec: CON-7 (page tables map logical pages to arbitrary physical pages)
    layers, page_tokens, kv_heads, hd, q_heads = 2, 4, 2, 8, 4
    cache = attention  # alias for readability
    context = 10
    pages = np.array([5, 1, 3], dtype=np.int32)      # scattered physical pages of slot 1
    pages_per_row, slots, n_pages = 4, 2, 6
    page_stride = layers * page_tokens * kv_heads * hd
    k_plane = np.zeros(n_pages * page_stride, dtype=np.float16)
    v_plane = np.zeros(n_pages * page_stride, dtype=np.float16)
    page_table = np.zeros(slots * pages_per_row, dtype=np.int32)
    page_table[1 * pages_per_row:1 * pages_per_row + 3] = pages
    layer = 1
    layer_offset = layer * page_tokens * kv_heads * hd
    keys = RNG.standard_normal((context, kv_heads, hd)).astype(np.float16)
    values = RNG.standard_normal((context, kv_heads, hd)).astype(np.float16)
    for p in range(context):
        base = pages[p // page_tokens] * page_stride + layer_offset + (p % page_tokens) * kv_heads * hd
        k_plane[base:base + kv_heads * hd] = keys[p].ravel()
        v_plane[base:base + kv_heads * hd] = values[p].ravel()
    # one row (slot 1) with three queries at positions 7, 8, 9
    q = RNG.standard_normal((3, q_heads * hd)).astype(np.float32)
    out = np.zeros_like(q)
    positions = np.array([7, 8, 9], dtype=np.int32)
    cache.paged_attention(out.ravel(), q.ravel(), k_plane[layer_offset:], v_plane[layer_offset:], positions,
                          page_table, np.array([1], np.int32), _geometry([3], 1, 3), 1, 3, q_heads, kv_heads, hd,
                          page_tokens, pages_per_row, page_stride, 1 / np.sqrt(hd))
    group = q_heads // kv_heads
    for t, pos in enumerate(positions):
        for h in range(q_heads):
            k = keys[:pos + 1, h // group].astype(np.float32)
            v = values[:pos + 1, h // group].astype(np.float32)
            s = k @ q[t, h * hd:(h + 1) * hd] / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[t, h * hd:(h + 1) * hd], p @ v, rtol=1e-4, atol=1e-5)


def test_batched_decode_rows_equal_dense_attention():
    # several one-token rows (the batched path) over different slots and context lengths
    page_tokens, kv_heads, hd, q_heads, pages_per_row = 4, 1, 4, 2, 3
    page_stride = page_tokens * kv_heads * hd
    n_pages = 6
    k_plane = RNG.standard_normal(n_pages * page_stride).astype(np.float32)
    v_plane = RNG.standard_normal(n_pages * page_stride).astype(np.float32)
    page_table = np.array([4, 0, 2, 5, 1, 3], dtype=np.int32)      # slot 0: pages 4,0,2; slot 1: 5,1,3
    row_slot = np.array([1, 0], dtype=np.int32)
    positions = np.array([9, 2], dtype=np.int32)
    q = RNG.standard_normal((2, q_heads * hd)).astype(np.float32)
    out = np.zeros_like(q)
    attention.paged_attention(out.ravel(), q.ravel(), k_plane, v_plane, positions, page_table, row_slot,
                              _geometry([1, 1], 2, 2), 2, 2, q_heads, kv_heads, hd, page_tokens, pages_per_row,
                              page_stride, 0.5)
    for r in range(2):
        pages = page_table[row_slot[r] * pages_per_row:(row_slot[r] + 1) * pages_per_row]
        keys = np.concatenate([k_plane[p * page_stride:(p + 1) * page_stride] for p in pages]).reshape(-1, hd)
        values = np.concatenate([v_plane[p * page_stride:(p + 1) * page_stride] for p in pages]).reshape(-1, hd)
        for h in range(q_heads):
            s = keys[:positions[r] + 1] @ q[r, h * hd:(h + 1) * hd] * 0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[r, h * hd:(h + 1) * hd], (p / p.sum()) @ values[:positions[r] + 1],
                                       rtol=1e-5, atol=1e-6)


# ---- sampling -------------------------------------------------------------------------------

def _params(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence=0.0, frequency=0.0, repetition=1.0):
    return np.array([temperature, top_p, top_k, min_p, presence, frequency, repetition, 0], dtype=np.float32)


def test_greedy_takes_argmax_lowest_id_on_ties():
    logits = np.array([0.5, 2.0, 2.0, -1.0], dtype=np.float32)
    assert sampling.sample_row(logits, _params(), np.zeros(2, np.uint32), 0) == 1


def test_top_k_one_is_greedy_and_seed_repeats():
    logits = RNG.standard_normal(1000).astype(np.float32)
    seed = np.array([11, 0], dtype=np.uint32)
    assert sampling.sample_row(logits, _params(1.0, top_k=1), seed, 3) == int(np.argmax(logits))
    draws = [sampling.sample_row(logits, _params(1.0), seed, i) for i in range(20)]
    assert draws == [sampling.sample_row(logits, _params(1.0), seed, i) for i in range(20)]
    other = [sampling.sample_row(logits, _params(1.0), np.array([12, 0], np.uint32), i) for i in range(20)]
    assert draws != other


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    seen = {sampling.sample_row(logits, _params(1.0, top_p=0.7), np.array([s, 0], np.uint32), 0) for s in range(200)}
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    seen = {sampling.sample_row(logits, _params(1.0, min_p=0.4), np.array([s, 0], np.uint32), 0) for s in range(200)}
    assert seen == {0, 1}


def test_draw_frequencies_follow_probabilities():
    probs = np.array([0.6, 0.3, 0.1])
    logits = np.log(probs).astype(np.float32)
    draws = [sampling.sample_row(logits, _params(1.0), np.array([3, 4], np.uint32), i) for i in range(3000)]
    freq = np.bincount(draws, minlength=3) / 3000
    np.testing.assert_allclose(freq, probs, atol=0.04)


def test_penalties_and_grammar_mask():
    vocab, bins, words = 40, 40, 2
    logits = np.full(vocab, 1.0, dtype=np.float32)
    params = _params(0.0, presence=0.5, frequency=0.25, repetition=2.0)
    prompt_hist = np.zeros(bins, np.int32)
    prompt_hist[3] = 1
    output_hist = np.zeros(bins, np.int32)
    output_hist[5] = 2
    mask = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    mask[1] &= ~np.uint32(1 << (33 - 32))          # disallow token 33
    sampling.adjust_logits(logits, params, prompt_hist, output_hist, mask, np.array([0], np.int32),
                           np.array([1], np.int32), 1, vocab, bins, words)
    assert logits[3] == pytest.approx(0.5)                    # repetition (prompt)
    assert logits[5] == pytest.approx(0.5 - 0.5 - 0.5)        # repetition, frequency 2 x 0.25, presence
    assert logits[33] == -np.inf
    assert logits[0] == 1.0


def test_commit_reports_eos_and_length():
    slots, bins, eos_cap = 2, 8, 4
    completion = np.zeros(state.COMPLETION_HEADER_WORDS + 2 * state.COMPLETION_ROW_WORDS, np.int32)
    pending = np.full(slots, -1, np.int32)
    generated = np.array([0, 4], np.int32)
    out_hist = np.zeros(slots * bins, np.int32)
    eos = np.array([2, 0, -1, -1, 2, 0, -1, -1], np.int32)
    limit = np.array([10, 5], np.int32)
    state.commit_samples(completion, pending, generated, out_hist, np.array([2, 7], np.int32), eos, limit,
                         np.array([0, 1], np.int32), np.array([9, 8], np.int32), np.array([1, 1], np.int32),
                         np.array([4, 6], np.int32), np.array([1, 1], np.int32), np.array([42, 0], np.int32),
                         np.array([2], np.int32), 2, eos_cap, bins, 5)
    header = completion[:state.COMPLETION_HEADER_WORDS].tolist()
    rows = completion[state.COMPLETION_HEADER_WORDS:].reshape(2, -1)
    assert header == [42, 2, 5, 2]
    assert rows[0].tolist() == [0, 9, 2, 5, 1, state.FINISH_EOS, -1, -1]
    assert rows[1].tolist() == [1, 8, 7, 7, 1, state.FINISH_LENGTH, -1, -1]
    assert pending.tolist() == [2, 7] and generated.tolist() == [1, 5] and out_hist[bins + 7] == 1


def test_abi_table_references_match_parameter_count():
    import inspect

    for spec in abi.KERNELS.values():
        assert len(inspect.signature(spec.reference).parameters) == len(spec.params), spec.id
    with pytest.raises(abi.UnknownKernelError):
        abi.kernel("no.such.kernel.v1")


# ---- snapshot continuation rows --------------------------------------------------------------

def test_snapshot_then_restore_copies_the_endpoint_page_through_a_continuation_row():
    from helios_backend.kernel_abi import cache

    page_tokens, pages_per_row, page_stride, rows = 4, 3, 10, 2
    k_plane = RNG.standard_normal(8 * page_stride).astype(np.float32)
    v_plane = RNG.standard_normal(8 * page_stride).astype(np.float32)
    k_rows = np.zeros(3 * page_stride, np.float32)
    v_rows = np.zeros(3 * page_stride, np.float32)
    page_table = np.array([6, 2, 7, 0, 0, 0], np.int32)            # slot 0: pages 6, 2, 7
    one = lambda *v: np.array(v, np.int32)  # noqa: E731
    # slot 0 ends its prompt at 6 tokens (partial page index 1 -> physical page 2) -> continuation row 2
    cache.snapshot_partial_pages(k_rows, v_rows, k_plane, v_plane, page_table, one(0, -1), one(2, -1), one(4, 0),
                                 one(2, 0), one(1), rows, page_tokens, pages_per_row, page_stride, page_stride)
    assert np.array_equal(k_rows[2 * page_stride:], k_plane[2 * page_stride:3 * page_stride])
    assert not k_rows[:2 * page_stride].any()
    # an endpoint on a page boundary has no partial page: nothing is copied
    before = k_rows.copy()
    cache.snapshot_partial_pages(k_rows, v_rows, k_plane, v_plane, page_table, one(0), one(0), one(4), one(4),
                                 one(1), 1, page_tokens, pages_per_row, page_stride, page_stride)
    assert np.array_equal(k_rows, before)
    # slot 1 restores row 2 into its private page 5 at endpoint 6 (page index 1)
    page_table[pages_per_row:] = [0, 5, 0]
    completion = np.zeros(4 + 8 * rows, np.int32)
    cache.restore_partial_pages(k_plane, v_plane, completion, k_rows, v_rows, page_table, one(1, -1), one(3, -1),
                                one(2, -1), one(6, 0), one(11, 0), one(1), rows, page_tokens, pages_per_row,
                                page_stride, page_stride, 8)
    assert np.array_equal(k_plane[5 * page_stride:6 * page_stride], k_plane[2 * page_stride:3 * page_stride])
    assert np.array_equal(v_plane[5 * page_stride:6 * page_stride], v_plane[2 * page_stride:3 * page_stride])
    assert completion[:4].tolist() == [11, 1, 8, 2]
    assert completion[4:12].tolist() == [1, 3, -1, 6, 0, 0, -1, -1]


def test_keep_logits_copies_live_sampling_rows_only():
    from helios_backend.kernel_abi.logprobs import keep_logits
    logits = RNG.standard_normal((3, 8)).astype(np.float32)
    raw = np.zeros((3, 8), np.float32)
    keep_logits(raw.reshape(-1), logits.reshape(-1), np.array([0, 1, 2], np.int32), np.array([1, 0, 1], np.int32),
                np.array([2], np.int32), 3, 8)
    assert (raw[0] == logits[0]).all() and (raw[1:] == 0).all()      # row 1 does not sample, row 2 is not live


def test_logprobs_are_the_log_softmax_of_the_sampled_token_and_the_top_n():
    from helios_backend.kernel_abi.logprobs import logprob_record_words, sampled_logprobs
    rows, vocab, top_n, base = 3, 97, 20, 6
    logits = (RNG.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[1, [5, 40]] = logits[1].max() + 2                 # a tie: lower id first
    sampled = np.array([11, 40, 3], np.int32)
    completion = np.full(base + rows * logprob_record_words(top_n), 77, np.int32)
    sampled_logprobs(completion, logits.reshape(-1), sampled, np.array([2, 0, 1], np.int32),
                     np.array([1, 1, 0], np.int32), np.array([rows], np.int32), rows, vocab, top_n, base)
    assert (completion[:base] == 77).all()
    records = completion[base:].reshape(rows, -1)
    floats = records.view(np.float32)
    for r in range(2):
        x = logits[r].astype(np.float64)            # independent: log(exp(x) / sum(exp(x)))
        expected = np.log(np.exp(x - x.max()) / np.exp(x - x.max()).sum())
        assert floats[r, 0] == pytest.approx(expected[sampled[r]], abs=1e-6)
        order = sorted(range(vocab), key=lambda i: (-x[i], i))[:top_n]
        assert records[r, 1:1 + top_n].tolist() == order
        np.testing.assert_allclose(floats[r, 1 + top_n:], expected[order], atol=1e-6)
        assert floats[r, 0] <= 0 and np.all(np.diff(floats[r, 1 + top_n:]) <= 0)
    assert records[1, 1:3].tolist() == [5, 40]
    assert records[2, 0] == 0 and (records[2, 1:1 + top_n] == -1).all() and (records[2, 1 + top_n:] == 0).all()


def test_draw_v2_is_adjust_then_draw_over_a_copy_of_the_logits():
    rows, vocab, mask_words = 3, 64, 2
    logits = (RNG.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = np.zeros((rows, 8), np.float32)
    params[:, :7] = [(0, 1, 0, 0, 0.5, 0.5, 1.3), (0.9, 0.9, 0, 0, 0, 0, 1), (0, 1, 0, 0, 0, 0, 1)]
    prompt_hist = RNG.integers(0, 2, (rows, vocab)).astype(np.int32)
    output_hist = RNG.integers(0, 3, (rows, vocab)).astype(np.int32)
    mask = np.full((rows, mask_words), 0xFFFFFFFF, np.uint32)
    mask[2, 0] = 0                                              # tokens 0..31 disallowed for row 2
    seeds = np.arange(2 * rows, dtype=np.uint32)
    generated = np.array([3, 4, 5], np.int32)
    slots, flags = np.arange(rows, dtype=np.int32), np.ones(rows, np.int32)
    raw = logits.copy()
    got = np.full(rows, -9, np.int32)
    sampling.draw_adjusted_tokens(got, logits.reshape(-1), params.reshape(-1), seeds, generated, prompt_hist.reshape(-1),
                                  output_hist.reshape(-1), mask.reshape(-1), slots, flags, None, None, rows, vocab,
                                  vocab, mask_words)
    assert np.array_equal(logits, raw)                          # the raw logits stay (the logprobs read them)
    adjusted = raw.reshape(-1).copy()
    sampling.adjust_logits(adjusted, params.reshape(-1), prompt_hist.reshape(-1), output_hist.reshape(-1),
                           mask.reshape(-1), slots, flags, rows, vocab, vocab, mask_words)
    want = np.full(rows, -9, np.int32)
    sampling.draw_tokens(want, adjusted, params.reshape(-1), seeds, generated, slots, flags, rows, vocab)
    assert np.array_equal(got, want) and got[2] >= 32


def test_logprobs_v2_write_only_the_rows_that_asked():
    from helios_backend.kernel_abi.logprobs import logprob_record_words, requested_logprobs, sampled_logprobs
    rows, vocab, top_n = 3, 50, 4
    logits = RNG.standard_normal((rows, vocab)).astype(np.float32).reshape(-1)
    params = np.zeros((rows, 8), np.float32)
    params[:, state.LOGPROBS_WORD] = [0.0, -1.0, 1.0]           # unspecified (written), none, asked
    sampled, slots = np.array([4, 5, 6], np.int32), np.array([0, 1, 2], np.int32)
    live, width = np.array([rows], np.int32), logprob_record_words(top_n)
    got = np.full(rows * width, 77, np.int32)
    requested_logprobs(got, logits, sampled, params.reshape(-1), slots, np.ones(rows, np.int32), live, None, None,
                       rows, vocab, top_n, 0)
    want = np.full(rows * width, 77, np.int32)
    sampled_logprobs(want, logits, sampled, slots, np.array([1, 0, 1], np.int32), live, rows, vocab, top_n, 0)
    assert np.array_equal(got, want)
    assert got.reshape(rows, width)[1, 0] == 0 and (got.reshape(rows, width)[1, 1:1 + top_n] == -1).all()
