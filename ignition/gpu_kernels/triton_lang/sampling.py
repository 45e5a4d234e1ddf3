"""Sampling: logit adjustment (penalties, grammar mask) and the draw (greedy / temperature,
top-k, top-p, min-p) with the Philox4x32-10 counter RNG.

Semantics follow helios_backend/kernel_abi/sampling.py: candidates ordered by scaled logit
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

from ignition.gpu_kernels.triton_lang.common import wait_for_predecessors

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
def add_logit_bias(logits, bias_ids, bias_values, rows, vocab, bias_capacity,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """In place on logits f32 [rows, vocab]: logits[r, bias_ids[r, k]] += bias_values[r, k]
    for ids in [0, vocab) (padding -1 adds nothing). Grid (cdiv(bias_capacity, BLOCK_K), rows).
    A row's ids are distinct, so the scattered read-add-writes never overlap."""
    wait_for_predecessors(PDL)
    r = tl.program_id(1)
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    entry = r.to(tl.int64) * bias_capacity + k
    in_row = k < bias_capacity
    ids = tl.load(bias_ids + entry, mask=in_row, other=-1)
    live = in_row & (ids >= 0) & (ids < vocab)
    bias = tl.load(bias_values + entry, mask=live, other=0.0)
    target = logits + r.to(tl.int64) * vocab + ids
    tl.store(target, tl.load(target, mask=live, other=0.0) + bias, mask=live)


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
def _chunk_span(vocab, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """Chunks per entry of the maxima: 1 up to BLOCK_V * MAX_CHUNKS tokens, and beyond that as
    many as keep every chunk inside MAX_CHUNKS entries (an entry holds its chunks' maximum), so
    any vocabulary fits the registers; a wider entry only skips less."""
    return tl.cdiv(tl.cdiv(vocab, BLOCK_V), MAX_CHUNKS)


@triton.jit
def _chunk_max(maxima, v0, span, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """An upper bound of the (adjusted) logits of the row's chunk at v0: the maximum of its
    entry in pass 1's maxima (span chunks per entry, _chunk_span)."""
    index = tl.arange(0, MAX_CHUNKS)
    return tl.max(tl.where(index == v0 // BLOCK_V // span, maxima, float("-inf")), axis=0)


@triton.jit
def _count_mass(row, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, rate, best, threshold,
                maxima, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """(count, mass) of the logits x >= threshold; mass in units of exp((x - best) / T),
    rate = log2(e) / T (so one FMA and one exp2 per element, no division). Chunks whose
    maximum is below the threshold contribute nothing and are not read: as a bisection
    narrows on the head of a peaked distribution, most of the vocabulary is skipped."""
    count = 0
    mass = 0.0
    span = _chunk_span(vocab, BLOCK_V, MAX_CHUNKS)
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, span, BLOCK_V, MAX_CHUNKS) >= threshold:
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
    maxima = tl.full((MAX_CHUNKS,), float("-inf"), tl.float32)    # per-entry maxima
    span = _chunk_span(vocab, BLOCK_V, MAX_CHUNKS)
    for v0 in range(0, vocab, BLOCK_V):
        v, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
        chunk_best = tl.max(x, axis=0)
        maxima = tl.where(tl.arange(0, MAX_CHUNKS) == v0 // BLOCK_V // span,
                          tl.maximum(maxima, chunk_best), maxima)
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
    span = _chunk_span(vocab, BLOCK_V, MAX_CHUNKS)
    value = float("inf")
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, span, BLOCK_V, MAX_CHUNKS) >= cut:
            ids, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
            value = tl.minimum(value, tl.min(tl.where(x >= cut, x, float("inf")), axis=0))
    above = 0.0
    ties = 0
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, span, BLOCK_V, MAX_CHUNKS) >= value:
            ids, x = _chunk(row, v0, vocab, pb, ob, mr, mw, pres, freq, rep, pen, msk, BLOCK_V)
            above += tl.sum(tl.where(x > value, tl.exp2((x - best) * rate), 0.0), axis=0)
            ties += tl.sum((x == value).to(tl.int32), axis=0)
    unit = tl.exp2((value - best) * rate)
    rank = tl.minimum(tl.maximum(((target - above) / unit).to(tl.int32), 0), ties - 1)
    token = 0
    seen = 0
    for v0 in range(0, vocab, BLOCK_V):
        if _chunk_max(maxima, v0, span, BLOCK_V, MAX_CHUNKS) >= value:
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


# ---- sampling.draw.v2: the vocabulary of a row spread over programs --------------------------
#
# Grid (chunks = cdiv(vocab, BLOCK_V), rows). Program (c, r) reads chunk c of row r once: the
# GROUP-token groups g = c, c + chunks, c + 2 chunks, ... (interleaved, so the many likely
# low-id tokens of a BPE vocabulary spread over every chunk), applies the penalties and the
# grammar mask on the fly (sampling.adjust's arithmetic; the logits stay raw), and leaves a
# record in partials i32 [rows, _partial_words(vocab)]:
#
#   row r = stats[chunks][STAT_WORDS] | keys[chunks][CANDIDATES] (int64)
#   stats = [ x_max f32 | s_max f32 | mass f32 | argmax i32 | - | path | bound i64 ]
#
# x = adjusted logit, s = x / temperature, mass = sum exp(s - s_max) over the chunk, keys = the
# chunk's CANDIDATES best order keys (s descending, id ascending: _order_key; _select_top),
# bound = its next best key. It then bumps arrivals[r]; the last program of the row to arrive finishes the row
# (reading every record) and sets the counter back to 0 for the next step.
#
# Finishing. Greedy: the best chunk maximum, lowest id on ties. Temperature: every key above
# B = max over chunks of bound is a candidate, so the candidates above B, sorted, are an exact
# prefix of the reference's sorted order (with their probabilities). Top-k, top-p, min-p and the
# inverse-CDF draw are resolved on that prefix whenever their cut falls inside it (_prefix_draw).
# With 24 chunks of 32 candidates (vocab 49,152) the prefix holds ~550 tokens on SmolLM2 text
# (median; at least 440): at temperature 0.7 every tested cut fell inside, at 1.0 98 % of plain
# draws, all top-p 0.9 and 90 % of top-p 0.95 rows. When a cut falls past it, the finishing
# program runs the one-program draw (sample_row: bisection passes over the row). It notes how it
# decided in chunk 0's `path` word (PATH_*), for tests and inspection.
#
# The finisher reads the records MAX_CHUNKS at a time, so any vocabulary fits: past
# BLOCK_V * MAX_CHUNKS tokens it keeps the MAX_CHUNKS * CANDIDATES best keys seen so far, merging
# each further block of records into them (_merge_top); a key it drops raises B to at least that
# key, so the candidates above B stay an exact (shorter) prefix of the sorted order.

STAT_WORDS = tl.constexpr(8)
GROUP = tl.constexpr(8)                      # tokens per interleaved group: 32 bytes of logits
KEY_NONE = tl.constexpr(-(2 ** 63))          # an empty candidate slot: below every order key
PATH_GREEDY = tl.constexpr(1)
PATH_PREFIX = tl.constexpr(2)                # resolved on the sorted candidate prefix
PATH_BISECTION = tl.constexpr(3)             # a cut fell past the prefix: sample_row


@triton.jit
def _partial_words(vocab):
    """Row stride of `partials` in words: helios_backend.kernel_abi.sampling.partial_words."""
    return tl.cdiv(tl.maximum(vocab // 8, 1024), 16) * 16


@triton.jit
def _order_key(value, token):
    """int64 whose signed order is (value descending, token ascending) in a descending sort:
    the float's order-preserving int32 image in the high word, 0x7FFFFFFF - token below.
    (+ 0.0 turns -0.0 into +0.0, which the reference treats as equal.)"""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64)


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _key_token(key):
    return 0x7FFFFFFF - key.to(tl.int32)


@triton.jit
def _select_top(value, token, valid, keys, K: tl.constexpr):
    """Store the order keys of the K best valid entries (value descending, token ascending; all
    of them when fewer are valid) at keys[0 .. K) in token order, KEY_NONE in the slots left;
    return the largest valid key left out (KEY_NONE when none): every entry above it is stored.
    value, token, valid: 1-D, in token order.

    Exact radix selection instead of a bitonic top-k (about a third of the instructions):
    four passes over 8 bits of the values' order-preserving image, each a 256-bin shared-memory
    histogram of the entries still tied with the K-th best, find the K-th best value; entries
    above it are taken, entries equal to it lowest token first."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    image = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    need = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), K)
    digits = tl.arange(0, 256)
    live = valid
    taken = valid & (bits != bits)
    for shift in tl.static_range(24, -8, -8):
        digit = ((image >> shift) & 255).to(tl.int32)
        counts = tl.histogram(digit, 256, mask=live)
        above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0)     # entries in higher digits
        pick = tl.max(tl.where((above < need) & (above + counts >= need), digits, -1), axis=0)
        need -= tl.sum(tl.where(digits == pick, above, 0), axis=0)
        taken = taken | (live & (digit > pick))
        live = live & (digit == pick)
    chosen = taken | (live & (tl.cumsum(live.to(tl.int32), axis=0) <= need))
    key = _order_key(value, token)
    tl.store(keys + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, key, mask=chosen)
    slots = tl.arange(0, K)
    tl.store(keys + slots, tl.full((K,), KEY_NONE, tl.int64),
             mask=slots >= tl.sum(chosen.to(tl.int32), axis=0))
    return tl.max(tl.where(valid & ~chosen, key, KEY_NONE), axis=0)


@triton.jit
def _merge_top(kept, block, bound):
    """(the len(kept) best of kept and block, sorted descending; bound raised to the best key
    left out). kept: sorted descending; block: any order, the same length. The elementwise
    maximum of a descending and an ascending list holds exactly the best half of both."""
    rising = tl.sort(block, descending=False)
    left_out = tl.max(tl.minimum(kept, rising), axis=0)
    return tl.sort(tl.maximum(kept, rising), descending=True), tl.maximum(bound, left_out)


@triton.jit
def _allowed(v, in_vocab, mask_row, mask_words):
    """Grammar mask bits of tokens v (bit j of word w allows token 32 w + j)."""
    word_index = v // 32
    words = tl.load(mask_row + word_index, mask=in_vocab & (word_index < mask_words),
                    other=0xFFFFFFFF)
    return ((words >> (v % 32).to(tl.uint32)) & 1) != 0


@triton.jit
def _chunk_best(x, v):
    """(max, lowest token at the max) of a [groups, GROUP] chunk."""
    best = tl.max(tl.max(x, axis=1), axis=0)
    return best, tl.min(tl.min(tl.where(x == best, v, 0x7FFFFFFF), axis=1), axis=0)


@triton.jit
def _prefix_draw(keys, bound, best_s, total_all, vocab, top_p, top_k, min_p, u):
    """(token, resolved) of the reference draw (helios_backend/kernel_abi/sampling.sample_row) from
    an exact sorted prefix: `keys` sorted descending, the prefix is the keys above `bound`;
    total_all = sum exp(s - best_s) over the row. resolved = 0 when a cut (top-k, top-p,
    min-p, the draw) falls past the prefix."""
    index = tl.arange(0, keys.shape[0])
    inside = keys > bound
    known = tl.sum(inside.to(tl.int32), axis=0)
    p = tl.where(inside, tl.exp(_key_value(keys) - best_s), 0.0)
    resolved = known * 0 + 1
    # top-k: the first top_k tokens, their own mass as the total (reference: probs.sum())
    by_k = (top_k > 0) & (top_k < vocab)
    if by_k:
        resolved = (top_k <= known).to(tl.int32)
        limit = tl.minimum(top_k, known)
        total = tl.sum(tl.where(index < limit, p, 0.0), axis=0)
    else:
        limit = known
        total = total_all
    closed = by_k | (known >= vocab)            # the list ends at `limit` (no tail past it)
    probs = tl.where(index < limit, p / total, 0.0)
    cdf = tl.cumsum(probs, axis=0)
    open_keep = vocab + 1                       # "past the prefix"
    keep = tl.where(closed, limit, open_keep)
    if top_p < 1.0:
        reach = tl.sum(((index < limit) & (cdf < top_p)).to(tl.int32), axis=0)
        keep = tl.where(reach < limit, tl.minimum(keep, reach + 1), keep)
        resolved = tl.where((reach >= limit) & ~closed, 0, resolved)
    if min_p > 0.0:
        floor = min_p * (1.0 / total)           # min_p * probs[0]
        within = tl.minimum(keep, limit)
        count = tl.sum(((index < within) & (probs >= floor)).to(tl.int32), axis=0)
        resolved = tl.where((keep == open_keep) & (count >= limit), 0, resolved)
        keep = tl.minimum(keep, count)
    keep = tl.maximum(keep, 1)
    if keep == open_keep:
        target = u                              # the whole row's cdf ends at 1
        pick = tl.sum(((index < limit) & (cdf <= target)).to(tl.int32), axis=0)
        resolved = tl.where(pick >= limit, 0, resolved)
    else:
        target = u * tl.sum(tl.where(index == keep - 1, cdf, 0.0), axis=0)
        pick = tl.minimum(tl.sum(((index < keep) & (cdf <= target)).to(tl.int32), axis=0),
                          keep - 1)
    token = tl.sum(tl.where(index == pick, _key_token(keys), 0), axis=0)
    return token, resolved


@triton.jit
def draw_adjusted_tokens(sampled, logits, sampling, seeds, generated, prompt_histogram,
                         output_histogram, grammar_mask, row_slot, sample_flag, partials,
                         arrivals, rows, vocab, histogram_bins, mask_words,
                         BLOCK_V: tl.constexpr, CANDIDATES: tl.constexpr,
                         MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """sampled i32 [rows] = a token in [0, vocab) for rows that sample, -1 otherwise, from the
    raw logits f32 [rows, vocab] adjusted on the fly. Grid (cdiv(vocab, BLOCK_V), rows); the
    chunks, the layout of partials and the finishing step are described above."""
    wait_for_predecessors(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1)
    chunks = tl.num_programs(0)
    row = logits + r.to(tl.int64) * vocab
    mask_row = grammar_mask + r.to(tl.int64) * mask_words
    groups = c + chunks * tl.arange(0, BLOCK_V // GROUP)
    v = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]      # [BLOCK_V / GROUP, GROUP]
    in_vocab = v < vocab
    # issued before the row's slot is known: the chunk and its mask bits need only r. The mask
    # goes first (the reference masks after the penalties; they leave -inf at -inf)
    x = tl.load(row + v, mask=in_vocab, other=float("-inf"))
    x = tl.where(_allowed(v, in_vocab, mask_row, mask_words), x, float("-inf"))
    slot = tl.load(row_slot + r)
    flag = tl.load(sample_flag + r)
    if (slot >= 0) & (flag != 0):
        params = sampling + slot * SAMPLING_WORDS
        temperature = tl.load(params)
        pres = tl.load(params + 4)
        freq = tl.load(params + 5)
        rep = tl.load(params + 6)
        # the greedy answer of the unpenalized chunk while the sampling vector is in flight
        x_max, first = _chunk_best(x, v)
        penalize = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
        prompt_bins = prompt_histogram + slot.to(tl.int64) * histogram_bins
        output_bins = output_histogram + slot.to(tl.int64) * histogram_bins
        if penalize:
            x = _penalized(x, v, in_vocab, prompt_bins, output_bins, pres, freq, rep)
            x_max, first = _chunk_best(x, v)
        base = partials + r.to(tl.int64) * _partial_words(vocab)
        stats = base + c * STAT_WORDS
        stats_f = stats.to(tl.pointer_type(tl.float32))
        keys = (base + chunks * STAT_WORDS).to(tl.pointer_type(tl.int64))
        if temperature > 0.0:
            s = x / temperature
            s_max = tl.max(tl.max(s, axis=1), axis=0)
            shift = tl.where(s_max == float("-inf"), 0.0, s_max)
            bound = _select_top(tl.reshape(s, [BLOCK_V]), tl.reshape(v, [BLOCK_V]),
                                tl.reshape(in_vocab, [BLOCK_V]), keys + c * CANDIDATES, CANDIDATES)
            tl.store(stats_f + 1, s_max)
            tl.store(stats_f + 2, tl.sum(tl.sum(tl.exp(s - shift), axis=1), axis=0))
            tl.store(stats.to(tl.pointer_type(tl.int64)) + 3, bound)
        else:
            tl.store(stats_f, x_max)
            tl.store(stats + 3, first)
        tl.debug_barrier()          # every thread's record stores precede the release below
        if tl.atomic_add(arrivals + r, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            tl.debug_barrier()
            index = tl.arange(0, MAX_CHUNKS)
            if temperature > 0.0:
                best_s = float("-inf")
                prefix_bound = tl.full((), KEY_NONE, tl.int64)
                for start in range(0, chunks, MAX_CHUNKS):
                    present = start + index < chunks
                    records = base + (start + index) * STAT_WORDS
                    s_maxima = tl.load(records.to(tl.pointer_type(tl.float32)) + 1, mask=present,
                                       other=float("-inf"), cache_modifier=".cg")
                    bounds = tl.load(records.to(tl.pointer_type(tl.int64)) + 3, mask=present,
                                     other=KEY_NONE, cache_modifier=".cg")
                    best_s = tl.maximum(best_s, tl.max(s_maxima, axis=0))
                    prefix_bound = tl.maximum(prefix_bound, tl.max(bounds, axis=0))
                total = 0.0
                for start in range(0, chunks, MAX_CHUNKS):
                    present = start + index < chunks
                    records_f = (base + (start + index) * STAT_WORDS).to(tl.pointer_type(tl.float32))
                    s_maxima = tl.load(records_f + 1, mask=present, other=float("-inf"),
                                       cache_modifier=".cg")
                    masses = tl.load(records_f + 2, mask=present, other=0.0, cache_modifier=".cg")
                    total += tl.sum(tl.where(masses > 0.0, masses * tl.exp(s_maxima - best_s), 0.0),
                                    axis=0)
                slots = tl.arange(0, MAX_CHUNKS * CANDIDATES)
                ordered = tl.sort(tl.load(keys + slots, mask=slots < chunks * CANDIDATES,
                                          other=KEY_NONE, cache_modifier=".cg"), descending=True)
                for start in range(MAX_CHUNKS * CANDIDATES, chunks * CANDIDATES,
                                   MAX_CHUNKS * CANDIDATES):
                    ordered, prefix_bound = _merge_top(ordered, tl.load(
                        keys + start + slots, mask=start + slots < chunks * CANDIDATES,
                        other=KEY_NONE, cache_modifier=".cg"), prefix_bound)
                counter = tl.load(generated + slot).to(tl.uint32)
                key0 = tl.load(seeds + 2 * slot)
                key1 = tl.load(seeds + 2 * slot + 1)
                token, resolved = _prefix_draw(ordered, prefix_bound, best_s, total,
                                               vocab, tl.load(params + 1),
                                               tl.load(params + 2).to(tl.int32),
                                               tl.load(params + 3),
                                               _philox_uniform(counter, key0, key1))
                tl.store(base + 5, tl.where(resolved != 0, PATH_PREFIX, PATH_BISECTION))
                if resolved == 0:
                    token = sample_row(row, vocab, prompt_bins, output_bins, mask_row, mask_words,
                                       penalize, True, params, counter, key0, key1, BLOCK_V,
                                       MAX_CHUNKS)
            else:
                best_x = float("-inf")
                token = 0x7FFFFFFF
                for start in range(0, chunks, MAX_CHUNKS):
                    present = start + index < chunks
                    records = base + (start + index) * STAT_WORDS
                    maxima = tl.load(records.to(tl.pointer_type(tl.float32)), mask=present,
                                     other=float("-inf"), cache_modifier=".cg")
                    argmaxes = tl.load(records + 3, mask=present, other=0x7FFFFFFF,
                                       cache_modifier=".cg")
                    block_x = tl.max(maxima, axis=0)
                    block_token = tl.min(tl.where(maxima == block_x, argmaxes, 0x7FFFFFFF), axis=0)
                    # chunks interleave their groups: a tie takes the lowest id of any block
                    token = tl.where(block_x > best_x, block_token,
                                     tl.where(block_x == best_x, tl.minimum(token, block_token),
                                              token))
                    best_x = tl.maximum(best_x, block_x)
                tl.store(base + 5, PATH_GREEDY)
            tl.store(sampled + r, token)
            tl.store(arrivals + r, 0)
    elif c == 0:
        tl.store(sampled + r, -1)
