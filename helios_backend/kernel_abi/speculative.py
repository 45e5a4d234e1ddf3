"""Reference kernels of the complete SPECULATIVE operation (SPEC-1): proposals from copied ids,
optional device prefix allocation, target verification over packed rows, accepted-state commit.

A speculative round of B lanes, per-lane target capacity W (pending token + up to D proposals)
and P packed target rows runs as one program:

    [speculative.allocate]  SPECULATIVE_PREFIX_LIMIT graphs only: confidence -> lane lengths
    speculative.expand      lane lengths -> one *token row* per target position:
                              ids[t]       pending[slot] for the lane's first row, then proposals
                              positions[t] consumed[lane] + i
                              token_slot[t] the lane's slot;  token_length[t] = 1 (0 past n)
    step.geometry           over token_length: P rows of one token each
    forward pass            the recipe's ordinary forward over P one-token rows: each row's query
                            at position p attends to its slot's cache 0..p, which holds the
                            block's earlier tokens written by the same layer, so the block is
                            causal without a tree mask; logits for every target position
    speculative.verify_commit  sample the target at each position (same penalties, mask and
                            Philox keying as DECODE), accept the longest matching prefix,
                            commit accepted + 1 tokens, write ONE completion per lane

Lane lengths (int32 [B]) count target rows including the pending token: 1 <= n <= W.

Completion words: the standard records (kernel_abi/state.py) with token = the last emitted id,
consumed = consumed + accepted + 1, emitted = accepted + 1 (fewer when EOS or the output limit
ends the lane), draft_cursor = max(consumed - lag, 0) (-1 when the graph has none); then, after
the `completion_rows` standard records, one extension record per submitted row:

    ext[r] = [ offers | accepted | tokens[0 .. ext_width - 2) ]     (-1 padded)
      offers    target rows the lane was given (its verified length n)
      accepted  proposals accepted (<= offers - 1)

Allocation and verification draw no random numbers of their own; the target draws use
counter = generated[slot] exactly as DECODE does, so speculative output equals plain output.
"""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi import sampling as sampling_kernels
from helios_backend.kernel_abi.state import (
    COMPLETION_HEADER_WORDS,
    COMPLETION_ROW_WORDS,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_NONE,
    SAMPLING_PARAMETER_WORDS,
)

EXTENSION_FIELDS = ("offers", "accepted")   # then the emitted token ids
EXTENSION_FIXED_WORDS = len(EXTENSION_FIELDS)


def extension_words(width: int) -> int:
    """Words of one extension record for programs of target width up to `width`."""
    return EXTENSION_FIXED_WORDS + width


# ---- allocation -------------------------------------------------------------------------------

def allocate_lengths(confidence: np.ndarray, ceilings: np.ndarray, packed_capacity: int) -> np.ndarray:
    """Causal prefix allocation (SPEC-23..29, SPEC-32) on dense arrays; returns lengths int32 [B].

    confidence [B, K] float32: confidence of lane b's proposal k (target row k + 1).
    ceilings   [B] int: the lane's immutable ceiling (rows incl. the pending token), >= 1 for a live lane.
    Every live lane starts with its pending row. Then, while rows remain, the frontier row of
    largest survival probability (the product of the lane's FP32 confidences up to it, multiplied
    in FP64) is admitted; ties prefer the shorter prefix, then the lower submission row.
    A lane's frontier is its next row only, so a later confidence never admits its predecessor.
    No random draws.
    """
    conf = np.asarray(confidence, dtype=np.float32)
    lanes = len(ceilings)
    lengths = np.array([1 if int(c) >= 1 else 0 for c in ceilings], dtype=np.int32)
    survival = np.ones(lanes, dtype=np.float64)          # survival of the rows admitted so far
    budget = int(packed_capacity) - int(lengths.sum())
    if budget < 0:
        raise ValueError(f"{int(lengths.sum())} live lanes exceed P={packed_capacity}")
    while budget > 0:
        best = -1
        best_key: tuple[float, int, int] | None = None
        for b in range(lanes):
            n = int(lengths[b])
            if n == 0 or n >= int(ceilings[b]) or n - 1 >= conf.shape[1]:
                continue
            frontier = survival[b] * np.float64(conf[b, n - 1])
            key = (-frontier, n, b)
            if best_key is None or key < best_key:
                best, best_key = b, key
        if best < 0:
            break
        survival[best] *= np.float64(conf[best, int(lengths[best]) - 1])
        lengths[best] += 1
        budget -= 1
    return lengths


def allocate_prefixes(lengths: np.ndarray, confidence: np.ndarray, prefix_limit: np.ndarray,
                      row_slot: np.ndarray, transport_header: np.ndarray, live_rows: np.ndarray,
                      rows: int, request_slots: int, draft_capacity: int, confidence_width: int,
                      packed_capacity: int) -> None:
    """ABI form of allocate_lengths: confidence is the framed proposal_confidence
    [2, request_slots, draft_capacity] f32; the transport header's frame index selects the
    frame and submitted row r reads row r (lane order is kept, SPEC-37/38). Writes lengths [rows]."""
    live = min(int(live_rows[0]), rows)
    frame = int(transport_header[1])
    table = confidence[:2 * request_slots * draft_capacity].reshape(2, request_slots, draft_capacity)[frame]
    ceilings = np.where(row_slot[:live] >= 0, prefix_limit[:live], 0)
    lengths[:rows] = 0
    lengths[:live] = allocate_lengths(table[:live, :confidence_width], ceilings, packed_capacity)


def copy_confidence(confidence: np.ndarray, proposal_count: np.ndarray, proposal_generation: np.ndarray,
                    proposal_consumed: np.ndarray, row_generation: np.ndarray, consumed: np.ndarray,
                    row_slot: np.ndarray, transport_header: np.ndarray, live_rows: np.ndarray, rows: int,
                    request_slots: int, draft_capacity: int, draft_tokens: int) -> None:
    """Confidence of copied proposals, written in the graph for the allocation that follows:
    1.0 for each usable copy (fresh generation and consumed endpoint, at most D), 0.0 past them.
    Copies carry no learned probability, so equal confidence makes allocation breadth-first
    (shorter prefixes, then lower rows). Writes frame header[1] of
    confidence [2, request_slots, draft_capacity] f32, row r = submitted row r."""
    frame = int(transport_header[1])
    table = confidence[:2 * request_slots * draft_capacity].reshape(2, request_slots, draft_capacity)[frame]
    table[:rows] = 0.0
    for r in range(min(int(live_rows[0]), rows)):
        fresh = int(proposal_generation[r]) == int(row_generation[r]) and int(proposal_consumed[r]) == int(consumed[r])
        if int(row_slot[r]) >= 0 and fresh:
            table[r, :min(int(proposal_count[r]), draft_tokens, draft_capacity)] = 1.0


def broadcast_rank_zero(rank_confidence: list[np.ndarray], frame: int, request_slots: int,
                        draft_capacity: int) -> None:
    """Rank-zero confidence broadcast before allocation (SPEC-30), for thread ranks sharing host
    memory: every rank's frame of proposal_confidence [2, request_slots, draft_capacity] becomes
    rank zero's, so every rank allocates the same prefixes even when their drafts' confidences
    differ in the last bits. (A device executor does the same with an in-graph broadcast.)"""
    shape = (2, request_slots, draft_capacity)
    source = rank_confidence[0][:np.prod(shape)].reshape(shape)[frame]
    for confidence in rank_confidence[1:]:
        confidence[:np.prod(shape)].reshape(shape)[frame] = source


# ---- the verify block -------------------------------------------------------------------------

def expand_block(ids: np.ndarray, positions: np.ndarray, token_slot: np.ndarray, token_length: np.ndarray,
                 lengths: np.ndarray, requested: np.ndarray, pending: np.ndarray, proposal_ids: np.ndarray,
                 proposal_count: np.ndarray, proposal_generation: np.ndarray, proposal_consumed: np.ndarray,
                 row_slot: np.ndarray, row_generation: np.ndarray, consumed: np.ndarray, live_rows: np.ndarray,
                 rows: int, tokens: int, draft_stride: int, draft_tokens: int, width: int) -> None:
    """Lay the lanes' target rows out as one-token rows (module docstring).

    A lane's usable proposals are its copied ids when their generation and consumed endpoint match
    the lane (stale copies are offered nothing), at most D of them. Its length is the requested
    length clamped to [1, min(W, 1 + usable)]; rows past P are not offered (the host never asks).
    """
    live = min(int(live_rows[0]), rows)
    ids[:tokens] = -1
    positions[:tokens] = 0
    token_slot[:tokens] = -1
    token_length[:tokens] = 0
    lengths[:rows] = 0
    cursor = 0
    for r in range(live):
        slot = int(row_slot[r])
        if slot < 0:
            continue
        fresh = int(proposal_generation[r]) == int(row_generation[r]) and int(proposal_consumed[r]) == int(consumed[r])
        usable = min(int(proposal_count[r]), draft_tokens) if fresh else 0
        n = max(1, min(int(requested[r]), width, 1 + usable, tokens - cursor))
        if cursor >= tokens:
            break
        lengths[r] = n
        block = slice(cursor, cursor + n)
        ids[cursor] = pending[slot]
        ids[cursor + 1:cursor + n] = proposal_ids[r * draft_stride:r * draft_stride + n - 1]
        positions[block] = int(consumed[r]) + np.arange(n)
        token_slot[block] = slot
        token_length[block] = 1
        cursor += n


def verify_commit(completion: np.ndarray, pending: np.ndarray, generated: np.ndarray,
                  output_histogram: np.ndarray, draft_cursor: np.ndarray, logits: np.ndarray,
                  sampling: np.ndarray, seeds: np.ndarray, prompt_histogram: np.ndarray,
                  grammar_mask: np.ndarray, eos_ids: np.ndarray, output_limit: np.ndarray, ids: np.ndarray,
                  lengths: np.ndarray, row_slot: np.ndarray, row_generation: np.ndarray, consumed: np.ndarray,
                  transport_header: np.ndarray, live_rows: np.ndarray, rows: int, tokens: int, vocab: int,
                  histogram_bins: int, mask_words: int, eos_capacity: int, lag_tokens: int,
                  completion_rows: int, ext_width: int, operation: int) -> None:
    """Verify each lane's proposals against the target and commit the accepted prefix.

    logits [tokens, vocab] f32: row t = target logits after input ids[t]. Lane position i draws
    with counter generated[slot] (advanced per committed token, as DECODE), after the same
    penalties over the output histogram that already counts the lane's earlier tokens of this
    round; the lane's grammar mask applies at its first position only (constrained requests are
    scheduled at width one). Position i's draw is accepted when it equals the proposal ids[t + 1]
    and i < n - 1; the first mismatch (or the last position) ends the lane. EOS and the output
    limit end it too. lag_tokens < 0: the graph reports no draft cursor (-1).
    """
    live = min(int(live_rows[0]), rows)
    table = logits[:tokens * vocab].reshape(tokens, vocab)
    records = np.full((rows, COMPLETION_ROW_WORDS), -1, dtype=np.int32)
    records[:, 3:6] = 0
    extension = np.full((rows, ext_width), -1, dtype=np.int32)
    extension[:, :EXTENSION_FIXED_WORDS] = 0
    unconstrained = np.full(mask_words, 0xFFFFFFFF, dtype=np.uint32)
    one = np.ones(1, dtype=np.int32)
    start = 0
    for r in range(live):
        slot = int(row_slot[r])
        n = int(lengths[r])
        if slot < 0 or n <= 0:
            continue
        record = records[r]
        record[0], record[1] = slot, int(row_generation[r])
        params = sampling[slot * SAMPLING_PARAMETER_WORDS:(slot + 1) * SAMPLING_PARAMETER_WORDS]
        eos = eos_ids[slot * eos_capacity:(slot + 1) * eos_capacity]
        accepted, emitted, finish, token = 0, 0, FINISH_NONE, -1
        for i in range(n):
            row = table[start + i].copy()
            mask = grammar_mask[r * mask_words:(r + 1) * mask_words] if i == 0 else unconstrained
            sampling_kernels.adjust_logits(row, sampling, prompt_histogram, output_histogram, mask,
                                           np.array([slot], dtype=np.int32), one, 1, vocab, histogram_bins,
                                           mask_words)
            token = sampling_kernels.sample_row(row, params, seeds[2 * slot:2 * slot + 2], int(generated[slot]))
            pending[slot] = token
            generated[slot] += 1
            output_histogram[slot * histogram_bins + token] += 1
            extension[r, EXTENSION_FIXED_WORDS + emitted] = token
            emitted += 1
            if token in eos:
                finish = FINISH_EOS
                break
            if generated[slot] >= output_limit[slot]:
                finish = FINISH_LENGTH
                break
            if i == n - 1 or token != int(ids[start + i + 1]):
                break
            accepted += 1
        endpoint = int(consumed[r]) + accepted + 1
        record[2], record[3], record[4], record[5] = token, endpoint, emitted, finish
        cursor = -1 if lag_tokens < 0 else max(endpoint - lag_tokens, 0)
        record[6] = cursor
        draft_cursor[slot] = cursor
        extension[r, 0], extension[r, 1] = n, accepted
        start += n
    completion[:COMPLETION_HEADER_WORDS] = (int(transport_header[0]), live, operation, rows)
    body = COMPLETION_HEADER_WORDS
    completion[body:body + rows * COMPLETION_ROW_WORDS] = records.ravel()
    ext = COMPLETION_HEADER_WORDS + completion_rows * COMPLETION_ROW_WORDS
    completion[ext:ext + rows * ext_width] = extension.ravel()
