"""Reference sampling kernels and the Philox4x32-10 counter-based RNG.

Per-slot sampling state (written at admission by state.admit_requests):
    sampling [slots, 8] f32  temperature, top_p, top_k, min_p, presence, frequency, repetition, logprobs
    seeds    [slots, 2] u32  Philox key (the request's 64 seed bits, low word first)
    generated [slots] i32    tokens sampled so far; the draw counter

The draw for a row is Philox4x32-10(counter = (generated[slot], 0, 0, 0), key = seeds[slot]),
word 0 -> u = (word >> 8) * 2^-24 in [0, 1). The same seed therefore gives the same
tokens whatever row, slot or capacity variant serves the request. All arithmetic
is integer numpy (uint64 holding 32-bit lanes), bit-exact with a GPU implementation.

Sampling order: the request's logit bias (add_logit_bias, in place: the logprobs see it, as
OpenAI's do), penalties and grammar mask (adjust_logits), then temperature (0 = greedy
argmax, lowest id on ties), top-k, softmax, top-p (smallest prefix reaching top_p),
min-p (relative to the most likely token), renormalize, inverse-CDF draw.
Candidates are ordered by logit descending, then token id ascending.
"""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi.linear import _matrix
from helios_backend.kernel_abi.state import SAMPLING_PARAMETER_WORDS

_MASK32 = np.uint64(0xFFFFFFFF)
_PHILOX_M0 = np.uint64(0xD2511F53)
_PHILOX_M1 = np.uint64(0xCD9E8D57)
_PHILOX_W0 = np.uint64(0x9E3779B9)
_PHILOX_W1 = np.uint64(0xBB67AE85)
_SHIFT32 = np.uint64(32)
PHILOX_ROUNDS = 10


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = PHILOX_ROUNDS) -> np.ndarray:
    """Philox4x32 (Salmon et al. 2011): counter [..., 4] u32, key [..., 2] u32 -> [..., 4] u32."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0 = key[..., 0].astype(np.uint64)
    k1 = key[..., 1].astype(np.uint64)
    for _ in range(rounds):
        product0 = _PHILOX_M0 * c[0]
        product1 = _PHILOX_M1 * c[2]
        hi0, lo0 = product0 >> _SHIFT32, product0 & _MASK32
        hi1, lo1 = product1 >> _SHIFT32, product1 & _MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return np.stack(c, axis=-1).astype(np.uint32)


def uniform_from_word(word: np.ndarray) -> np.ndarray:
    """Top 24 bits of a u32 as an exact float32 in [0, 1)."""
    return (word >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def draw_uniform(seed: np.ndarray, draw_index: int) -> float:
    counter = np.array([draw_index & 0xFFFFFFFF, 0, 0, 0], dtype=np.uint32)
    return float(uniform_from_word(philox4x32(counter, seed.astype(np.uint32))[0]))


def _allowed_tokens(mask_words: np.ndarray, vocab: int) -> np.ndarray:
    """Bit j of word w allows token 32 w + j."""
    bits = np.unpackbits(mask_words.astype(np.uint32).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def adjust_logits(logits: np.ndarray, sampling: np.ndarray, prompt_histogram: np.ndarray,
                  output_histogram: np.ndarray, grammar_mask: np.ndarray, row_slot: np.ndarray,
                  sample_flag: np.ndarray, rows: int, vocab: int, histogram_bins: int,
                  mask_words: int) -> None:
    """In place on logits [rows, vocab]: repetition (prompt + output), frequency and presence
    (output) penalties, then the grammar mask [rows, mask_words] u32 (disallowed -> -inf)."""
    table = _matrix(logits, rows, vocab)
    for r in range(rows):
        slot = int(row_slot[r])
        if slot < 0 or not sample_flag[r]:
            continue
        row = table[r]
        params = sampling[slot * SAMPLING_PARAMETER_WORDS:(slot + 1) * SAMPLING_PARAMETER_WORDS]
        presence, frequency, repetition = float(params[4]), float(params[5]), float(params[6])
        bins = slice(slot * histogram_bins, slot * histogram_bins + vocab)
        if repetition != 1.0 or presence != 0.0 or frequency != 0.0:
            output_counts = output_histogram[bins]
            if repetition != 1.0:
                seen = (prompt_histogram[bins] > 0) | (output_counts > 0)
                row[seen] = np.where(row[seen] > 0, row[seen] / np.float32(repetition),
                                     row[seen] * np.float32(repetition))
            if frequency != 0.0:
                row -= np.float32(frequency) * output_counts.astype(np.float32)
            if presence != 0.0:
                row -= np.float32(presence) * (output_counts > 0).astype(np.float32)
        words = grammar_mask[r * mask_words:(r + 1) * mask_words]
        if not np.all(words == np.uint32(0xFFFFFFFF)):
            row[~_allowed_tokens(words, vocab)] = -np.inf


# OpenAI's bound on logit_bias entries per request: the row width of the logit-bias
# destinations that preparation declares (ignition/preparation/contract.py)
LOGIT_BIAS_CAPACITY = 300


def add_logit_bias(logits: np.ndarray, bias_ids: np.ndarray, bias_values: np.ndarray, rows: int, vocab: int,
                   bias_capacity: int) -> None:
    """sampling.logit_bias.v1, in place on logits [rows, vocab]: row r's entry k adds
    bias_values[r, k] to the logit of token bias_ids[r, k]; ids outside [0, vocab) (the -1
    padding) add nothing. A row's ids are distinct (the backend checks), so the GPU's
    per-entry read-add-write never races."""
    table = _matrix(logits, rows, vocab)
    ids = _matrix(bias_ids, rows, bias_capacity)
    values = _matrix(bias_values, rows, bias_capacity)
    live = (ids >= 0) & (ids < vocab)
    row_index = np.nonzero(live)[0]
    if row_index.size:
        np.add.at(table, (row_index, ids[live]), values[live])


def _ordered_candidates(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Token ids by logit descending, id ascending; only as many as top-k / top-p can keep."""
    vocab = scaled.size
    limit = vocab if top_k <= 0 else min(top_k, vocab)
    probe = min(limit, 64)
    if probe < vocab and (top_k > 0 or top_p < 1.0):
        candidates = np.argpartition(-scaled, probe - 1)[:probe]
        # keep only candidates strictly above the probe's boundary value, plus every tie of it
        boundary = scaled[candidates].min()
        candidates = np.nonzero(scaled >= boundary)[0]
        ordered = candidates[np.lexsort((candidates, -scaled[candidates]))]
        if top_k > 0 and ordered.size >= limit:
            return ordered[:limit]
        if top_k <= 0:
            probs = np.exp(scaled[ordered] - scaled[ordered[0]])
            total = np.exp(scaled - scaled[ordered[0]]).sum(dtype=np.float32)
            if probs.sum(dtype=np.float32) / total >= top_p:
                return ordered
    ordered = np.argsort(-scaled, kind="stable")
    return ordered[:limit]


def kept_distribution(logits_row: np.ndarray, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their f32 CDF) that a temperature draw (params[0] > 0) chooses from: the
    candidates in sorted order after temperature, top-k, top-p and min-p."""
    top_p, top_k, min_p = float(params[1]), int(params[2]), float(params[3])
    scaled = logits_row / np.float32(params[0])
    candidates = _ordered_candidates(scaled, top_k, top_p)
    probs = np.exp(scaled[candidates] - scaled[candidates[0]])
    total = np.exp(scaled - scaled[candidates[0]]).sum(dtype=np.float32) if top_k <= 0 else probs.sum(dtype=np.float32)
    probs = probs / total
    keep = probs.size
    if top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs, dtype=np.float32), np.float32(top_p))) + 1)
    if min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(probs >= np.float32(min_p) * probs[0])))
    keep = max(keep, 1)
    return candidates[:keep], np.cumsum(probs[:keep], dtype=np.float32)


def sample_row(logits_row: np.ndarray, params: np.ndarray, seed: np.ndarray, draw_index: int) -> int:
    if float(params[0]) <= 0.0:
        return int(np.argmax(logits_row))
    candidates, cdf = kept_distribution(logits_row, params)
    target = np.float32(draw_uniform(seed, draw_index)) * cdf[-1]
    index = min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)
    return int(candidates[index])


def draw_tokens(sampled: np.ndarray, logits: np.ndarray, sampling: np.ndarray, seeds: np.ndarray,
                generated: np.ndarray, row_slot: np.ndarray, sample_flag: np.ndarray,
                rows: int, vocab: int) -> None:
    """sampled[r] = a token in [0, vocab) for rows that sample, -1 otherwise."""
    table = _matrix(logits, rows, vocab)
    sampled[:rows] = -1
    for r in range(rows):
        slot = int(row_slot[r])
        if slot < 0 or not sample_flag[r]:
            continue
        params = sampling[slot * SAMPLING_PARAMETER_WORDS:(slot + 1) * SAMPLING_PARAMETER_WORDS]
        sampled[r] = sample_row(table[r], params, seeds[2 * slot:2 * slot + 2], int(generated[slot]))


def partial_words(vocab: int) -> int:
    """Words per row of `partials`, the scratch of the multi-program sampling kernels
    (sampling.draw.v2, sampling.logprobs.v2; one buffer serves both, they run one after the
    other): vocab / 8, at least 1024, a multiple of 16. The kernels compute the same row stride;
    the kernel table (ignition specs.py) checks at preparation that their per-chunk records
    fit in it."""
    return -(-max(1024, int(vocab) // 8) // 16) * 16


def draw_adjusted_tokens(sampled: np.ndarray, logits: np.ndarray, sampling: np.ndarray,
                         seeds: np.ndarray, generated: np.ndarray, prompt_histogram: np.ndarray,
                         output_histogram: np.ndarray, grammar_mask: np.ndarray, row_slot: np.ndarray,
                         sample_flag: np.ndarray, partials: np.ndarray, arrivals: np.ndarray, rows: int,
                         vocab: int, histogram_bins: int, mask_words: int) -> None:
    """sampling.draw.v2: adjust_logits then draw_tokens, with `logits` left as they are (the raw
    model logits, which the logprobs read): the adjustment applies to a copy here and on the
    fly on the GPU. On a GPU the row's vocabulary is spread over many programs that leave
    per-chunk records in `partials` [rows, partial_words(vocab)] and count themselves in `arrivals`
    [rows] (zero between steps); here both scratch pointers stay untouched."""
    adjusted = _matrix(logits, rows, vocab).copy()
    adjust_logits(adjusted.reshape(-1), sampling, prompt_histogram, output_histogram, grammar_mask,
                  row_slot, sample_flag, rows, vocab, histogram_bins, mask_words)
    draw_tokens(sampled, adjusted.reshape(-1), sampling, seeds, generated, row_slot, sample_flag, rows,
                vocab)
