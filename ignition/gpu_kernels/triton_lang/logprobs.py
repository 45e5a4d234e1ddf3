"""sampling.logprobs.v1: the sampled token's log-softmax and the top-N alternatives, and
sampling.keep_logits.v1: the raw logits copy they read (sampling.adjust works in place).

Semantics follow helios_backend/kernel_abi/logprobs.py (record layout, ordering: logit
descending, token id ascending; rows that sampled nothing get logprob 0, ids -1, 0s).

One program per row, no sort. Pass 1 streams the row once: the online log-sum-exp and each
BLOCK_V chunk's maximum (MAX_CHUNKS maxima in registers; past BLOCK_V * MAX_CHUNKS tokens an
entry holds the maximum of several consecutive chunks, read together). The top-N are then selected by
repeated max over the chunk maxima: selection proceeds in the global order, so a chunk's
"remaining maximum" is the maximum of its elements ranked after the last selected one; each
step picks the chunk with the largest remaining maximum (lowest chunk on ties: lower ids),
reads that one chunk to take its best remaining element and recompute its remaining maximum.
Work per row: one pass over the vocabulary + top_n chunk reads.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import wait_for_predecessors
from ignition.gpu_kernels.triton_lang.sampling import (KEY_NONE, SAMPLING_WORDS, STAT_WORDS, _chunk_span,
                                              _key_token, _key_value, _merge_top, _partial_words,
                                              _select_top)


@triton.jit
def keep_logits(raw_logits, logits, row_slot, sample_flag, live_rows, rows, vocab,
                BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """sampling.keep_logits.v1: raw_logits[r] = logits[r] for live sampling rows, before
    sampling.adjust rewrites logits in place. Grid (cdiv(vocab, BLOCK_V), rows)."""
    wait_for_predecessors(PDL)
    r = tl.program_id(1)
    live = tl.minimum(tl.load(live_rows), rows)
    slot = tl.load(row_slot + r, mask=r < live, other=-1)
    if (slot >= 0) & (tl.load(sample_flag + r) != 0):
        v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        offset = r.to(tl.int64) * vocab + v
        tl.store(raw_logits + offset, tl.load(logits + offset, mask=v < vocab), mask=v < vocab)


@triton.jit
def sampled_logprobs(completion, logits, sampled, row_slot, sample_flag, live_rows,
                     rows, vocab, top_n, record_base,
                     BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows,). Record r at completion + record_base + r * (1 + 2 top_n) (words)."""
    wait_for_predecessors(PDL)
    r = tl.program_id(0)
    width = 1 + 2 * top_n
    record = completion + record_base + r * width
    live = tl.minimum(tl.load(live_rows), rows)
    slot = tl.load(row_slot + r, mask=r < live, other=-1)
    flag = tl.load(sample_flag + r)
    token = tl.load(sampled + r)
    active = (slot >= 0) & (flag != 0) & (token >= 0) & (token < vocab)
    floats = record.to(tl.pointer_type(tl.float32))
    if active:
        row = logits + r.to(tl.int64) * vocab
        lanes = tl.arange(0, BLOCK_V)
        chunk_index = tl.arange(0, MAX_CHUNKS)
        maxima = tl.full([MAX_CHUNKS], float("-inf"), tl.float32)
        alive = tl.zeros([MAX_CHUNKS], tl.int32)
        span = _chunk_span(vocab, BLOCK_V, MAX_CHUNKS)      # chunks per entry of the maxima
        best = -float("inf")
        total = 0.0
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + lanes
            x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
            chunk_max = tl.max(x, axis=0)
            new_best = tl.maximum(best, chunk_max)
            # guard exp(-inf - -inf) while every logit so far is -inf
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
            best = new_best
            here = chunk_index == v0 // BLOCK_V // span
            maxima = tl.where(here, tl.maximum(maxima, chunk_max), maxima)
            alive = tl.where(here, 1, alive)
        lse = best + tl.log(total)
        tl.store(floats, tl.load(row + token) - lse)
        # top-N by repeated max; (prev_x, prev_id) is the last selected element
        prev_x = float("inf")
        prev_id = -1
        for k in range(0, top_n):
            top = tl.max(tl.where(alive != 0, maxima, float("-inf")), axis=0)
            chunk = tl.min(tl.where((alive != 0) & (maxima == top), chunk_index, MAX_CHUNKS), axis=0)
            # the entry's span chunks in id order: the best element ranked after the last
            # selected one (lowest id on ties), and the maximum and count of those left
            pick_x = float("-inf")
            pick_id = vocab
            remaining = float("-inf")
            count = 0
            for part in range(0, span):
                v = (chunk * span + part) * BLOCK_V + lanes
                x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
                after = (v < vocab) & ((x < prev_x) | ((x == prev_x) & (v > prev_id)))
                part_x = tl.max(tl.where(after, x, float("-inf")), axis=0)
                part_id = tl.min(tl.where(after & (x == part_x), v, vocab), axis=0)
                part_rest = tl.max(tl.where(after & (v != part_id), x, float("-inf")), axis=0)
                found = tl.sum(after.to(tl.int32), axis=0)
                better = (found > 0) & ((part_x > pick_x) | (pick_id == vocab))
                remaining = tl.where(better, tl.maximum(remaining, tl.maximum(pick_x, part_rest)),
                                     tl.maximum(remaining, part_x))
                pick_id = tl.where(better, part_id, pick_id)
                pick_x = tl.where(better, part_x, pick_x)
                count += found
            count -= 1
            tl.store(record + 1 + k, pick_id)
            tl.store(floats + 1 + top_n + k, pick_x - lse)
            prev_x = pick_x
            prev_id = pick_id
            maxima = tl.where(chunk_index == chunk, remaining, maxima)
            alive = tl.where(chunk_index == chunk, tl.where(count > 0, 1, 0), alive)
    else:
        tl.store(record, 0)
        for k in range(0, top_n):
            tl.store(record + 1 + k, -1)
            tl.store(record + 1 + top_n + k, 0)


@triton.jit
def score_targets(completion, hidden, norm_weight, head, targets, geometry,
                  tokens, dim, vocab, eps, record_base,
                  BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """logits.score_targets.v1 (SCORED_PREFILL). Grid (tokens,): program t computes the logits of
    packed token t chunk by chunk (rms_norm(hidden[t]) @ head^T, never stored), an online
    log-sum-exp, and stores logit[target] - lse as f32 at completion + record_base + t; tokens
    past the live count or with a target outside [0, vocab) store 0.0. Simple, not fast: each
    program streams the whole head."""
    wait_for_predecessors(PDL)
    t = tl.program_id(0)
    n = tl.load(geometry)
    target = tl.load(targets + t)
    out = completion.to(tl.pointer_type(tl.float32)) + record_base + t
    if (t < n) & (target >= 0) & (target < vocab):
        row = hidden + t.to(tl.int64) * dim
        ks = tl.arange(0, BLOCK_K)
        sum_sq = 0.0
        for k0 in range(0, dim, BLOCK_K):
            x = tl.load(row + k0 + ks, mask=k0 + ks < dim, other=0.0)
            sum_sq += tl.sum(x * x, axis=0)
        rstd = 1.0 / tl.sqrt(sum_sq / dim + eps)
        lanes = tl.arange(0, BLOCK_V)
        best = -float("inf")
        total = 0.0
        picked = 0.0
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + lanes
            acc = tl.zeros([BLOCK_V], tl.float32)
            for k0 in range(0, dim, BLOCK_K):
                k = k0 + ks
                x = tl.load(row + k, mask=k < dim, other=0.0) * rstd
                x = x * tl.load(norm_weight + k, mask=k < dim, other=0.0).to(tl.float32)
                w = tl.load(head + v[:, None].to(tl.int64) * dim + k[None, :],
                            mask=(v[:, None] < vocab) & (k[None, :] < dim), other=0.0).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
            acc = tl.where(v < vocab, acc, float("-inf"))
            new_best = tl.maximum(best, tl.max(acc, axis=0))
            total = total * tl.exp(best - new_best) + tl.sum(tl.exp(acc - new_best), axis=0)
            best = new_best
            picked += tl.sum(tl.where(v == target, acc, 0.0), axis=0)
        tl.store(out, picked - (best + tl.log(total)))
    else:
        tl.store(out, 0.0)


# ---- sampling.logprobs.v2: only the rows that asked, the vocabulary spread over programs -----
#
# Grid (chunks = cdiv(vocab, BLOCK_V), rows). A row is worked on only when its request wants
# logprobs (word LOGPROBS_WORD of its slot's sampling vector not negative) and it sampled a
# token; other rows' programs exit after reading that (program 0 writes the empty record), so a
# step where no row asks costs two dependent loads. Program (c, r) of a working row leaves in
# partials i32 [rows, _partial_words(vocab)] (the scratch sampling.draw.v2 uses before it):
#
#   row r = stats[chunks][STAT_WORDS] | keys[chunks][TOP_C] (int64)
#   stats = [ x_max f32 | sum exp(x - x_max) f32 | - ... ]
#
# keys = the chunk's TOP_C best order keys (logit descending, id ascending; _select_top). Since
# top_n <= TOP_C, the row's top_n are among them; the last program of the row to arrive (the
# arrival counter, reset to 0 after) merges the log-sum-exp, takes the TOP_C best keys of all
# chunks and writes the record.

LOGPROBS_WORD = tl.constexpr(7)              # of the slot's sampling vector (SAMPLING_WORDS f32)


@triton.jit
def requested_logprobs(completion, logits, sampled, sampling, row_slot, sample_flag, live_rows,
                       partials, arrivals, rows, vocab, top_n, record_base,
                       BLOCK_V: tl.constexpr, TOP_C: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                       PDL: tl.constexpr):
    """Record r at completion + record_base + r * (1 + 2 top_n) (words), from the raw logits
    f32 [rows, vocab]. Grid (cdiv(vocab, BLOCK_V), rows); see above."""
    wait_for_predecessors(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1)
    chunks = tl.num_programs(0)
    live = tl.minimum(tl.load(live_rows), rows)
    slot = tl.load(row_slot + r)
    flag = tl.load(sample_flag + r)
    token = tl.load(sampled + r)
    active = (r < live) & (slot >= 0) & (flag != 0) & (token >= 0) & (token < vocab)
    wanted = tl.load(sampling + slot * SAMPLING_WORDS + LOGPROBS_WORD, mask=active,
                     other=-1.0) >= 0.0
    record = completion + record_base + r * (1 + 2 * top_n)
    floats = record.to(tl.pointer_type(tl.float32))
    k = tl.arange(0, TOP_C)
    if active & wanted:
        row = logits + r.to(tl.int64) * vocab
        v = c * BLOCK_V + tl.arange(0, BLOCK_V)
        in_vocab = v < vocab
        x = tl.load(row + v, mask=in_vocab, other=float("-inf"))
        x_max = tl.max(x, axis=0)
        shift = tl.where(x_max == float("-inf"), 0.0, x_max)
        base = partials + r.to(tl.int64) * _partial_words(vocab)
        stats = (base + c * STAT_WORDS).to(tl.pointer_type(tl.float32))
        keys = (base + chunks * STAT_WORDS).to(tl.pointer_type(tl.int64))
        tl.store(stats, x_max)
        tl.store(stats + 1, tl.sum(tl.exp(x - shift), axis=0))
        _select_top(x, v, in_vocab, keys + c * TOP_C, TOP_C)
        tl.debug_barrier()          # every thread's record stores precede the release below
        if tl.atomic_add(arrivals + r, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            tl.debug_barrier()
            # the records MAX_CHUNKS at a time (any vocabulary): the maxima, then the sums
            index = tl.arange(0, MAX_CHUNKS)
            best = float("-inf")
            for start in range(0, chunks, MAX_CHUNKS):
                records = (base + (start + index) * STAT_WORDS).to(tl.pointer_type(tl.float32))
                best = tl.maximum(best, tl.max(tl.load(records, mask=start + index < chunks,
                                                       other=float("-inf"), cache_modifier=".cg"),
                                               axis=0))
            total = 0.0
            for start in range(0, chunks, MAX_CHUNKS):
                present = start + index < chunks
                records = (base + (start + index) * STAT_WORDS).to(tl.pointer_type(tl.float32))
                maxima = tl.load(records, mask=present, other=float("-inf"), cache_modifier=".cg")
                sums = tl.load(records + 1, mask=present, other=0.0, cache_modifier=".cg")
                total += tl.sum(tl.where(sums > 0.0, sums * tl.exp(maxima - best), 0.0), axis=0)
            lse = best + tl.log(total)
            slots = tl.arange(0, MAX_CHUNKS * TOP_C)
            top = tl.topk(tl.load(keys + slots, mask=slots < chunks * TOP_C, other=KEY_NONE,
                                  cache_modifier=".cg"), TOP_C)
            for start in range(MAX_CHUNKS * TOP_C, chunks * TOP_C, MAX_CHUNKS * TOP_C):
                more = tl.topk(tl.load(keys + start + slots, mask=start + slots < chunks * TOP_C,
                                       other=KEY_NONE, cache_modifier=".cg"), TOP_C)
                top, _ = _merge_top(top, more, KEY_NONE)
            real = top != KEY_NONE                  # fewer tokens than TOP_C in the row
            tl.store(floats, tl.load(row + token) - lse)
            tl.store(record + 1 + k, tl.where(real, _key_token(top), -1), mask=k < top_n)
            tl.store(floats + 1 + top_n + k, tl.where(real, _key_value(top) - lse, 0.0),
                     mask=k < top_n)
            tl.store(arrivals + r, 0)
    elif c == 0:                    # top_n <= TOP_C (the kernel table checks it)
        tl.store(record, 0)
        tl.store(record + 1 + k, tl.full((TOP_C,), -1, tl.int32), mask=k < top_n)
        tl.store(record + 1 + top_n + k, tl.zeros((TOP_C,), tl.int32), mask=k < top_n)
