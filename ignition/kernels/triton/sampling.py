"""Sampling: logit adjustment (penalties, grammar mask) and the draw (greedy / temperature,
top-k, top-p, min-p) with the Philox4x32-10 counter RNG.

Semantics follow helios_backend/kernels/sampling.py: candidates ordered by scaled logit
descending, token id ascending; the draw is an inverse CDF over that order with
u = (philox(counter = (generated[slot], 0, 0, 0), key = seeds[slot]).word0 >> 8) * 2^-24.
The integer RNG is bit-exact with the reference; the float selection agrees up to rounding.

The draw never sorts the vocabulary: every "prefix of the sorted order" the reference takes
(top-k, top-p, the inverse-CDF position) is found by bisection on a logit threshold x, with
count(x) = #{s >= x} and mass(x) = sum_{s >= x} exp(s - max) evaluated by streaming the row
(one pass per step: ~1 + 24 passes for plain temperature, up to ~75 with top-k and top-p).
Tokens more than SPAN nats below the best (relative probability < 1e-13) are never drawn.

The draw reads its row through _chunk, which can apply the penalties and the grammar mask on
the fly (the adjustment adjust_logits applies in place): speculative verification samples
positions whose penalties change as the lane commits tokens, over a read-only logits table.
"""
import triton
import triton.language as tl

from ignition.kernels.triton.common import wait_for_predecessors

SAMPLING_WORDS = tl.constexpr(8)     # temperature, top_p, top_k, min_p, presence, frequency, repetition, -
SPAN = tl.constexpr(30.0)            # nats below the best (scaled) logit the bisection covers
BISECTION_STEPS = tl.constexpr(24)   # 30 nats / 2^24 = 1.8e-6: about one f32 ulp at |s| ~ 16


@triton.jit
def _penalized(x, v, in_vocab, prompt_bins, output_bins, presence, frequency, repetition):
    """Repetition (prompt + output histograms), then frequency and presence (output)."""
    out_count = tl.load(output_bins + v, mask=in_vocab, other=0)
    prompt_count = tl.load(prompt_bins + v, mask=in_vocab, other=0)
    seen = (prompt_count > 0) | (out_count > 0)
    x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * out_count.to(tl.float32)
    return x - presence * (out_count > 0).to(tl.float32)


@triton.jit
def _masked(x, v, in_vocab, mask_row, mask_words):
    """Grammar mask: bit j of word w allows token 32 w + j; disallowed -> -inf."""
    word_index = v // 32
    words = tl.load(mask_row + word_index, mask=in_vocab & (word_index < mask_words),
                    other=0xFFFFFFFF)
    allowed = ((words >> (v % 32).to(tl.uint32)) & 1) != 0
    return tl.where(allowed, x, float("-inf"))


@triton.jit
def adjust_logits(logits, sampling, prompt_histogram, output_histogram, grammar_mask, row_slot,
                  sample_flag, rows, vocab, histogram_bins, mask_words,
                  BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """In place on logits f32 [rows, vocab]: the penalties, then the grammar mask
    u32 [rows, mask_words]. Grid (cdiv(vocab, BLOCK_V), rows). Histograms are
    i32 [slots, histogram_bins]."""
    wait_for_predecessors(PDL)
    r = tl.program_id(1)
    slot = tl.load(row_slot + r)
    if (slot >= 0) & (tl.load(sample_flag + r) != 0):
        params = sampling + slot * SAMPLING_WORDS
        presence = tl.load(params + 4)
        frequency = tl.load(params + 5)
        repetition = tl.load(params + 6)
        v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_vocab = v < vocab
        row = logits + r.to(tl.int64) * vocab + v
        x = tl.load(row, mask=in_vocab, other=0.0)
        # neutral penalties leave x bit-identical: skip the two histogram streams
        if (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0):
            bins = slot.to(tl.int64) * histogram_bins
            x = _penalized(x, v, in_vocab, prompt_histogram + bins, output_histogram + bins,
                           presence, frequency, repetition)
        tl.store(row, _masked(x, v, in_vocab, grammar_mask + r * mask_words, mask_words),
                 mask=in_vocab)


@triton.jit
def _philox_word0(counter, key0, key1):
    """Word 0 of Philox4x32-10(counter = (counter, 0, 0, 0), key = (key0, key1)); all u32."""
    c0 = counter
    c1 = counter * 0
    c2 = c1
    c3 = c1
    k0 = key0
    k1 = key1
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit
def _philox_uniform(counter, key0, key1):
    """u = top 24 bits of the Philox word as an exact f32 in [0, 1)."""
    return (_philox_word0(counter, key0, key1) >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def philox_words(words, counters, seed, count, BLOCK: tl.constexpr):
    """words u32 [count] = word 0 of Philox4x32-10((counters[i], 0, 0, 0), seed u32 [2]).
    Conformance probe for the RNG (not part of the serving ABI)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    counter = tl.load(counters + i, mask=i < count, other=0)
    word = _philox_word0(counter, tl.load(seed), tl.load(seed + 1))
    tl.store(words + i, word, mask=i < count)


@triton.jit
def _chunk(row, v0, vocab, prompt_bins, output_bins, mask_row, mask_words, presence, frequency,
           repetition, penalize, masked, BLOCK_V: tl.constexpr):
    """Token ids and (adjusted) logits of the row's chunk at v0; -inf past the vocabulary."""
    v = v0 + tl.arange(0, BLOCK_V)
    in_vocab = v < vocab
    x = tl.load(row + v, mask=in_vocab, other=float("-inf"))
    if penalize:
        x = _penalized(x, v, in_vocab, prompt_bins, output_bins, presence, frequency, repetition)
    if masked:
        x = _masked(x, v, in_vocab, mask_row, mask_words)
    return v, x


@triton.jit
def _chunk_max(maxima, v0, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """The (adjusted) maximum of the row's chunk at v0, from pass 1's per-chunk maxima."""
    index = tl.arange(0, MAX_CHUNKS)
    return tl.max(tl.where(index == v0 // BLOCK_V, maxima, float("-inf")), axis=0)


@triton.jit
def _count_mass(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate, best, threshold,
                maxima, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """(count, mass) of the logits x >= threshold; mass in units of exp((x - best) / T),
    rate = log2(e) / T (so one FMA and one exp2 per element, no division). Chunks whose
    maximum is below the threshold contribute nothing and are not read: as a bisection
    narrows on the head of a peaked distribution, most of the vocabulary is skipped."""
    count = 0
    mass = 0.0
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, BLOCK_V, MAX_CHUNKS) >= threshold:
            ids, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
            keep = x >= threshold
            count += tl.sum(keep.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(keep, tl.exp2((x - best) * rate), 0.0), axis=0)
    return count, mass


@triton.jit
def _threshold(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate, best, low, high,
               goal, maxima, by_count: tl.constexpr, strict: tl.constexpr,
               BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """Bisection for the largest x in [low, high] whose prefix {logits >= x} reaches `goal`
    (count >= goal, or mass >= goal; mass > goal when strict). `low` must reach it."""
    for _ in range(BISECTION_STEPS):
        middle = low + (high - low) * 0.5
        count, mass = _count_mass(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate,
                                  best, middle, maxima, BLOCK_V, MAX_CHUNKS)
        if by_count:
            reached = count >= goal
        elif strict:
            reached = mass > goal
        else:
            reached = mass >= goal
        low = tl.where(reached, middle, low)
        high = tl.where(reached, high, middle)
    return low


@triton.jit
def sample_row(row, vocab, pb, ob, mr, mw, pen, msk, params, counter, key0, key1,
               BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """One token from a logits row read through _chunk (pb/ob: the slot's prompt and output
    histogram rows, mr/mw: the mask row and its words; pen/msk: apply penalties / mask).
    Greedy (temperature <= 0): argmax, lowest id on ties. Otherwise the inverse-CDF draw.

    Thresholds live in logit space: with T > 0, s = x / T is monotone in x, so the prefix
    {s >= t} is {x >= t T} and exp(s - s_best) = exp2((x - x_best) log2(e) / T)."""
    temperature = tl.load(params)
    pres = tl.load(params + 4)
    freq = tl.load(params + 5)
    rep = tl.load(params + 6)
    rate = tl.where(temperature > 0.0, 1.4426950408889634 / temperature, 0.0)
    # pass 1: best logit, its lowest id, and the total mass sum(exp((x - best) / T)) kept
    # online (rescaled whenever the best moves)
    best = float("-inf")
    best_id = 0
    total = 0.0
    maxima = tl.full((MAX_CHUNKS,), float("-inf"), tl.float32)    # per-chunk maxima
    for v0 in range(0, vocab, BLOCK_V):
        v, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
        chunk_best = tl.max(x, axis=0)
        maxima = tl.where(tl.arange(0, MAX_CHUNKS) == v0 // BLOCK_V, chunk_best, maxima)
        chunk_id = tl.min(tl.where(x == chunk_best, v, 0x7FFFFFFF), axis=0)
        better = chunk_best > best
        new_best = tl.maximum(best, chunk_best)
        total = (total * tl.exp2((best - new_best) * rate)
                 + tl.sum(tl.exp2((x - new_best) * rate), axis=0))
        best_id = tl.where(better, chunk_id, best_id)
        best = new_best
    token = best_id
    if temperature > 0.0:
        token = _draw(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, temperature, rate,
                      best, total, maxima, params, counter, key0, key1, BLOCK_V, MAX_CHUNKS)
    return token


@triton.jit
def _draw(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, temperature, rate, best, total,
          maxima, params, counter, key0, key1, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    top_p = tl.load(params + 1)
    top_k = tl.load(params + 2).to(tl.int32)
    min_p = tl.load(params + 3)
    floor = best - SPAN * temperature
    # kept prefix: top-k, then top-p relative to the top-k mass, then min-p
    keep = floor
    if (top_k > 0) & (top_k < vocab):
        keep = _threshold(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate, best,
                          floor, best, top_k, maxima, True, False, BLOCK_V, MAX_CHUNKS)
        top_count, total = _count_mass(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk,
                                       rate, best, keep, maxima, BLOCK_V, MAX_CHUNKS)
    if top_p < 1.0:
        keep = _threshold(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate, best,
                          keep, best, top_p * total, maxima, False, False, BLOCK_V, MAX_CHUNKS)
    if min_p > 0.0:
        keep = tl.maximum(keep, best + temperature * tl.log(min_p))
    kept_count, kept_mass = _count_mass(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk,
                                        rate, best, keep, maxima, BLOCK_V, MAX_CHUNKS)
    # inverse CDF: the first token (sorted order) whose cumulative mass exceeds the target
    target = _philox_uniform(counter, key0, key1) * kept_mass
    cut = _threshold(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate, best, keep,
                     best, target, maxima, False, True, BLOCK_V, MAX_CHUNKS)
    # the token group at the boundary value, entered in id order
    value = float("inf")
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, BLOCK_V, MAX_CHUNKS) >= cut:
            ids, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
            value = tl.minimum(value, tl.min(tl.where(x >= cut, x, float("inf")), axis=0))
    above = 0.0
    ties = 0
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, BLOCK_V, MAX_CHUNKS) >= value:
            ids, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
            above += tl.sum(tl.where(x > value, tl.exp2((x - best) * rate), 0.0), axis=0)
            ties += tl.sum((x == value).to(tl.int32), axis=0)
    unit = tl.exp2((value - best) * rate)
    rank = tl.minimum(tl.maximum(((target - above) / unit).to(tl.int32), 0), ties - 1)
    token = 0
    seen = 0
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, BLOCK_V, MAX_CHUNKS) >= value:
            v, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
            tie = x == value
            position = seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            token += tl.sum(tl.where(tie & (position == rank), v, 0), axis=0)
            seen += tl.sum(tie.to(tl.int32), axis=0)
    return token


@triton.jit
def draw_tokens(sampled, logits, sampling, seeds, generated, row_slot, sample_flag, rows, vocab,
                BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """sampled i32 [rows] = a token in [0, vocab) for rows that sample, -1 otherwise.
    Grid (rows,): one program streams its (already adjusted) logits row, f32 [rows, vocab]."""
    wait_for_predecessors(PDL)
    r = tl.program_id(0)
    slot = tl.load(row_slot + r)
    token = -1
    if (slot >= 0) & (tl.load(sample_flag + r) != 0):
        token = sample_row(logits + r.to(tl.int64) * vocab, vocab, generated, generated, seeds, 0,
                           False, False, sampling + slot * SAMPLING_WORDS,
                           tl.load(generated + slot).to(tl.uint32), tl.load(seeds + 2 * slot),
                           tl.load(seeds + 2 * slot + 1), BLOCK_V, MAX_CHUNKS)
    tl.store(sampled + r, token)
