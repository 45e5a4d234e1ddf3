"""Speculative round kernels (drawn in helios_backend/kernel_abi/speculative.py): device prefix
allocation, the verify block's token rows, and verification + commit of accepted prefixes.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import wait_for_predecessors
from ignition.gpu_kernels.triton_lang.records import (FINISH_EOS, FINISH_LENGTH, HEADER_WORDS, ROW_WORDS,
                                              write_header)
from ignition.gpu_kernels.triton_lang.sampling import SAMPLING_WORDS, sample_row

EXTENSION_FIXED_WORDS = tl.constexpr(2)      # offers, accepted; then the emitted ids
NO_LANE = tl.constexpr(0x7FFFFFFF)


@triton.jit
def allocate_prefixes(lengths, confidence, prefix_limit, row_slot, transport_header, live_rows,
                      rows, request_slots, draft_capacity, confidence_width, packed_capacity,
                      MAX_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Causal prefix allocation within P = packed_capacity rows. Grid (1,): one lane per thread
    lane (rows <= MAX_ROWS). Every live lane starts with its pending row; then, one row per
    step, the frontier row of largest survival (FP64 product of the lane's confidences) is
    admitted, ties to the shorter prefix, then the lower row. confidence f32
    [2 frames, request_slots, draft_capacity]; the frame is transport_header[1]."""
    wait_for_predecessors(PDL)
    live = tl.minimum(tl.load(live_rows), rows)
    r = tl.arange(0, MAX_ROWS)
    lane = r < live
    slot = tl.load(row_slot + r, mask=lane, other=-1)
    ceiling = tl.where(lane & (slot >= 0), tl.load(prefix_limit + r, mask=lane, other=0), 0)
    n = tl.where(ceiling >= 1, 1, 0)
    survival = tl.full((MAX_ROWS,), 1.0, tl.float64)
    table = confidence + (tl.load(transport_header + 1) * request_slots + r) * draft_capacity
    for _ in range(0, packed_capacity - tl.sum(n, axis=0)):
        eligible = (n > 0) & (n < ceiling) & (n - 1 < confidence_width)
        conf = tl.load(table + n - 1, mask=eligible, other=0.0).to(tl.float64)
        frontier = survival * conf
        best = tl.max(tl.where(eligible, frontier, -1.0), axis=0)
        pick = eligible & (frontier == best)
        shortest = tl.min(tl.where(pick, n, NO_LANE), axis=0)
        pick = pick & (n == shortest)
        pick = r == tl.min(tl.where(pick, r, NO_LANE), axis=0)
        survival = tl.where(pick, frontier, survival)
        n = tl.where(pick, n + 1, n)
    tl.store(lengths + r, tl.where(lane, n, 0), mask=r < rows)


@triton.jit
def copy_confidence(confidence, proposal_count, proposal_generation, proposal_consumed,
                    row_generation, consumed, row_slot, transport_header, live_rows, rows,
                    request_slots, draft_capacity, draft_tokens,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Confidence of copied proposals for the allocation that follows: 1.0 for each usable
    copy (fresh generation and consumed endpoint, at most draft_tokens), 0.0 past them, in
    frame transport_header[1] of confidence f32 [2, request_slots, draft_capacity].
    Grid (rows,): program r writes row r."""
    wait_for_predecessors(PDL)
    r = tl.program_id(0)
    live = tl.minimum(tl.load(live_rows), rows)
    alive = r < live
    fresh = ((tl.load(proposal_generation + r, mask=alive, other=0)
              == tl.load(row_generation + r, mask=alive, other=1))
             & (tl.load(proposal_consumed + r, mask=alive, other=0)
                == tl.load(consumed + r, mask=alive, other=1)))
    usable = tl.minimum(tl.load(proposal_count + r, mask=alive, other=0), draft_tokens)
    usable = tl.where(alive & fresh & (tl.load(row_slot + r, mask=alive, other=-1) >= 0), usable,
                      0)
    row = confidence + (tl.load(transport_header + 1) * request_slots + r) * draft_capacity
    for k0 in range(0, draft_capacity, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        tl.store(row + k, tl.where(k < usable, 1.0, 0.0), mask=k < draft_capacity)


@triton.jit
def expand_block(ids, positions, token_slot, token_length, lengths, requested, pending,
                 proposal_ids, proposal_count, proposal_generation, proposal_consumed, row_slot,
                 row_generation, consumed, live_rows, rows, tokens, draft_stride, draft_tokens,
                 width, BLOCK_T: tl.constexpr, MAX_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Lanes' target rows as one-token rows: lane r gets n_r = clamp(requested, 1,
    min(width, 1 + usable proposals)) consecutive rows (pending token, then its proposals),
    cut at `tokens`. Grid (cdiv(tokens, BLOCK_T),); lane quantities are recomputed per program
    (rows <= MAX_ROWS); program 0 writes lengths."""
    wait_for_predecessors(PDL)
    live = tl.minimum(tl.load(live_rows), rows)
    r = tl.arange(0, MAX_ROWS)
    lane = r < live
    slot = tl.load(row_slot + r, mask=lane, other=-1)
    active = lane & (slot >= 0)
    fresh = ((tl.load(proposal_generation + r, mask=active, other=0)
              == tl.load(row_generation + r, mask=active, other=1))
             & (tl.load(proposal_consumed + r, mask=active, other=0)
                == tl.load(consumed + r, mask=active, other=1)))
    usable = tl.where(fresh, tl.minimum(tl.load(proposal_count + r, mask=active, other=0),
                                        draft_tokens), 0)
    wanted = tl.minimum(tl.minimum(tl.load(requested + r, mask=active, other=1), width),
                        1 + usable)
    wanted = tl.where(active, tl.maximum(wanted, 1), 0)
    ends = tl.cumsum(wanted, axis=0)
    starts = ends - wanted
    n = tl.where(starts < tokens, tl.minimum(wanted, tokens - starts), 0)
    if tl.program_id(0) == 0:
        tl.store(lengths + r, n, mask=r < rows)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # the lane of token t: the number of lanes whose rows end at or before t
    owner = tl.sum((tl.where(r < MAX_ROWS, tl.minimum(starts + n, tokens), 0)[None, :]
                    <= t[:, None]).to(tl.int32), axis=1)
    owner = tl.minimum(owner, MAX_ROWS - 1)
    hit = r[None, :] == owner[:, None]
    start = tl.sum(tl.where(hit, starts, 0), axis=1)
    count = tl.sum(tl.where(hit, n, 0), axis=1)
    lane_slot = tl.sum(tl.where(hit, slot, 0), axis=1)
    lane_consumed = tl.sum(tl.where(hit, tl.load(consumed + r, mask=active, other=0)[None, :], 0),
                           axis=1)
    i = t - start
    valid = (t < tokens) & (i >= 0) & (i < count)
    first = tl.load(pending + lane_slot, mask=valid & (i == 0), other=-1)
    proposal = tl.load(proposal_ids + owner * draft_stride + i - 1, mask=valid & (i > 0),
                       other=-1)
    in_range = t < tokens
    tl.store(ids + t, tl.where(valid, tl.where(i == 0, first, proposal), -1), mask=in_range)
    tl.store(positions + t, tl.where(valid, lane_consumed + i, 0), mask=in_range)
    tl.store(token_slot + t, tl.where(valid, lane_slot, -1), mask=in_range)
    tl.store(token_length + t, tl.where(valid, 1, 0), mask=in_range)


@triton.jit
def _is_eos(eos_ids, slot, eos_capacity, token, BLOCK_E: tl.constexpr):
    found = 0
    for e0 in range(0, eos_capacity, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        ids = tl.load(eos_ids + slot * eos_capacity + e, mask=e < eos_capacity, other=-1)
        found = tl.maximum(found, tl.max((ids == token).to(tl.int32), axis=0))
    return found != 0


@triton.jit
def verify_commit(completion, pending, generated, output_histogram, draft_cursor, logits,
                  sampling, seeds, prompt_histogram, grammar_mask, eos_ids, output_limit, ids,
                  lengths, row_slot, row_generation, consumed, transport_header, live_rows,
                  rows, tokens, vocab, histogram_bins, mask_words, eos_capacity, lag_tokens,
                  completion_rows, ext_width, operation,
                  MAX_ROWS: tl.constexpr, BLOCK_V: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr, PDL: tl.constexpr):
    """Sample the target at each of lane r's n positions (penalties over the output histogram
    as it grows, grammar mask at the first position only, Philox counter generated[slot] as in
    DECODE), accept the longest prefix matching the proposals ids[t + 1], commit accepted + 1
    tokens (fewer at EOS / output limit) and write the lane's record and extension record
        ext[r] = [ offers | accepted | emitted ids ... (-1 padded to ext_width) ]
    after the completion_rows standard records. Grid (rows,): one program per lane, walking
    its positions in order; lane r's first row is the sum of the earlier lanes' lengths.
    logits f32 [tokens, vocab] is read-only: adjustments apply on the fly (sampling._chunk)."""
    wait_for_predecessors(PDL)
    r = tl.program_id(0)
    live = tl.minimum(tl.load(live_rows), rows)
    lanes = tl.arange(0, MAX_ROWS)
    lane_slot = tl.load(row_slot + lanes, mask=lanes < live, other=-1)
    lane_n = tl.load(lengths + lanes, mask=lanes < live, other=0)
    counted = tl.where((lanes < live) & (lane_slot >= 0) & (lane_n > 0), lane_n, 0)
    start = tl.sum(tl.where(lanes < r, counted, 0), axis=0)
    slot = tl.load(row_slot + r, mask=r < live, other=-1)
    n = tl.load(lengths + r, mask=r < live, other=0)
    record = completion + HEADER_WORDS + r * ROW_WORDS
    extension = completion + HEADER_WORDS + completion_rows * ROW_WORDS + r * ext_width
    for x0 in range(0, ext_width, BLOCK_X):
        x = x0 + tl.arange(0, BLOCK_X)
        tl.store(extension + x, tl.where(x < 2, 0, -1), mask=x < ext_width)
    tl.debug_barrier()              # defaults land before the lane's own words below
    if (r < live) & (slot >= 0) & (n > 0):
        params = sampling + slot * SAMPLING_WORDS
        penalize = ((tl.load(params + 6) != 1.0) | (tl.load(params + 5) != 0.0)
                    | (tl.load(params + 4) != 0.0))
        prompt_bins = prompt_histogram + slot.to(tl.int64) * histogram_bins
        output_bins = output_histogram + slot.to(tl.int64) * histogram_bins
        key0 = tl.load(seeds + 2 * slot)
        key1 = tl.load(seeds + 2 * slot + 1)
        count = tl.load(generated + slot)
        limit = tl.load(output_limit + slot)
        accepted = 0
        emitted = 0
        finish = 0
        token = -1
        done = 0
        for i in range(0, n):
            if done == 0:
                tl.debug_barrier()  # the previous position's histogram update is visible
                token = sample_row(logits + (start + i).to(tl.int64) * vocab, vocab, prompt_bins,
                                   output_bins, grammar_mask + r * mask_words, mask_words,
                                   penalize, i == 0, params, count.to(tl.uint32), key0, key1,
                                   BLOCK_V, MAX_CHUNKS)
                count += 1
                tl.store(pending + slot, token)
                tl.store(generated + slot, count)
                tl.store(output_bins + token, tl.load(output_bins + token) + 1)
                tl.store(extension + 2 + emitted, token)
                emitted += 1
                if _is_eos(eos_ids, slot, eos_capacity, token, BLOCK_E):
                    finish = FINISH_EOS
                    done = 1
                elif count >= limit:
                    finish = FINISH_LENGTH
                    done = 1
                elif (i == n - 1) | (token != tl.load(ids + start + i + 1, mask=i < n - 1,
                                                      other=-1)):
                    done = 1
                else:
                    accepted += 1
        endpoint = tl.load(consumed + r) + accepted + 1
        cursor = tl.where(lag_tokens < 0, -1, tl.maximum(endpoint - lag_tokens, 0))
        tl.store(draft_cursor + slot, cursor)
        tl.store(record + 0, slot)
        tl.store(record + 1, tl.load(row_generation + r))
        tl.store(record + 2, token)
        tl.store(record + 3, endpoint)
        tl.store(record + 4, emitted)
        tl.store(record + 5, finish)
        tl.store(record + 6, cursor)
        tl.store(record + 7, -1)
        tl.store(extension + 0, n)
        tl.store(extension + 1, accepted)
    elif r < rows:
        for w in tl.static_range(8):
            tl.store(record + w, tl.where((w >= 3) & (w <= 5), 0, -1))
    if r == 0:
        write_header(completion, tl.load(transport_header), live, operation, rows)
