"""sampling.logprobs.v1: the sampled token's log-softmax and the top-N alternatives, and
sampling.keep_logits.v1: the raw logits copy they read (sampling.adjust works in place).

Semantics follow helios_backend/kernels/logprobs.py (record layout, ordering: logit
descending, token id ascending; rows that sampled nothing get logprob 0, ids -1, 0s).

One program per row, no sort. Pass 1 streams the row once: the online log-sum-exp and each
BLOCK_V chunk's maximum (MAX_CHUNKS maxima in registers). The top-N are then selected by
repeated max over the chunk maxima: selection proceeds in the global order, so a chunk's
"remaining maximum" is the maximum of its elements ranked after the last selected one; each
step picks the chunk with the largest remaining maximum (lowest chunk on ties: lower ids),
reads that one chunk to take its best remaining element and recompute its remaining maximum.
Work per row: one pass over the vocabulary + top_n chunk reads.
"""
import triton
import triton.language as tl

from ignition.kernels.triton.common import wait_for_predecessors


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
            here = chunk_index == v0 // BLOCK_V
            maxima = tl.where(here, chunk_max, maxima)
            alive = tl.where(here, 1, alive)
        lse = best + tl.log(total)
        tl.store(floats, tl.load(row + token) - lse)
        # top-N by repeated max; (prev_x, prev_id) is the last selected element
        prev_x = float("inf")
        prev_id = -1
        for k in range(0, top_n):
            top = tl.max(tl.where(alive != 0, maxima, float("-inf")), axis=0)
            chunk = tl.min(tl.where((alive != 0) & (maxima == top), chunk_index, MAX_CHUNKS), axis=0)
            v = chunk * BLOCK_V + lanes
            x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
            after = (v < vocab) & ((x < prev_x) | ((x == prev_x) & (v > prev_id)))
            pick_x = tl.max(tl.where(after, x, float("-inf")), axis=0)
            pick_id = tl.min(tl.where(after & (x == pick_x), v, vocab), axis=0)
            tl.store(record + 1 + k, pick_id)
            tl.store(floats + 1 + top_n + k, pick_x - lse)
            prev_x = pick_x
            prev_id = pick_id
            rest = after & (v != pick_id)
            remaining = tl.max(tl.where(rest, x, float("-inf")), axis=0)
            count = tl.sum(rest.to(tl.int32), axis=0)
            maxima = tl.where(chunk_index == chunk, remaining, maxima)
            alive = tl.where(chunk_index == chunk, (count > 0).to(tl.int32), alive)
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
