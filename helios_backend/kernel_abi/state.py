"""Reference kernels for step geometry, input ids, admission state and completion records.

Step geometry (scratch, int32), written by the first node of every generation program:

    geometry = [ n | token_row[0 .. tokens) | row_start[0 .. rows] ]
      n            live packed tokens = sum(query_length[:rows])
      token_row[t] row of packed token t, -1 past n
      row_start[r] first packed token of row r; row_start[rows] = n

Completion records (int32 words; the manifest's CompletionLayout declares the same):

    header = [ sequence | live_rows | operation | rows ]
    row    = [ slot | generation | token | consumed | emitted | finish | draft_cursor | reserved_model ]
      token     sampled id in [0, vocab) or -1 when the row sampled nothing
      consumed  token endpoint after this step (consumed before + query length)
      finish    FINISH_NONE / FINISH_EOS / FINISH_LENGTH
      draft_cursor, reserved_model   -1 (no speculative drafting; ABI6 reserved field)
"""
from __future__ import annotations

import numpy as np

COMPLETION_HEADER_FIELDS = ("sequence", "live_rows", "operation", "rows")
COMPLETION_ROW_FIELDS = ("slot", "generation", "token", "consumed", "emitted", "finish",
                         "draft_cursor", "reserved_model")
COMPLETION_HEADER_WORDS = len(COMPLETION_HEADER_FIELDS)
COMPLETION_ROW_WORDS = len(COMPLETION_ROW_FIELDS)
FINISH_NONE = 0
FINISH_EOS = 1
FINISH_LENGTH = 2

# Transport header written by the executor at launch (not a value binding): [sequence, frame].
TRANSPORT_HEADER_WORDS = 2

# Sampling parameter vector per slot, float32 [SAMPLING_PARAMETER_WORDS].
# Word 7 ("logprobs") says whether the request wants logprob records: < 0 it asked for none
# (sampling.logprobs.v2 skips the row: its record reads as a non-sampling row's); 0 (what a
# packer that leaves the word zero writes) or > 0: the records are written.
SAMPLING_PARAMETER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "logprobs")
SAMPLING_PARAMETER_WORDS = len(SAMPLING_PARAMETER_FIELDS)
LOGPROBS_WORD = SAMPLING_PARAMETER_FIELDS.index("logprobs")


def live_tokens(geometry: np.ndarray) -> int:
    return int(geometry[0])


def token_rows(geometry: np.ndarray, tokens: int) -> np.ndarray:
    return geometry[1: 1 + tokens]


def row_starts(geometry: np.ndarray, rows: int, tokens: int) -> np.ndarray:
    return geometry[1 + tokens: 2 + tokens + rows]


def geometry_words(rows: int, tokens: int) -> int:
    return 2 + tokens + rows


def step_geometry(geometry: np.ndarray, query_length: np.ndarray, rows: int, tokens: int) -> None:
    lengths = np.maximum(query_length[:rows], 0)
    starts = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=starts[1:])
    n = int(starts[-1])
    geometry[0] = n
    token_row = token_rows(geometry, tokens)
    token_row[:] = -1
    token_row[:n] = np.repeat(np.arange(rows, dtype=np.int32), lengths)
    row_starts(geometry, rows, tokens)[:] = starts


def select_input_ids(ids: np.ndarray, prompt_tokens: np.ndarray, pending: np.ndarray,
                     row_slot: np.ndarray, prefill_row: np.ndarray, geometry: np.ndarray,
                     rows: int, tokens: int) -> None:
    """ids[t] = prompt_tokens[t] for tokens of row prefill_row[0], else the row's device-owned pending token.

    prefill_row = -1 (decode) makes every row read its pending token.
    """
    n = live_tokens(geometry)
    token_row = token_rows(geometry, tokens)[:n]
    from_host = token_row == int(prefill_row[0])
    ids[:n] = np.where(from_host, prompt_tokens[:n], pending[row_slot[token_row]])


def select_input_ids_by_token(ids: np.ndarray, prompt_tokens: np.ndarray, pending: np.ndarray,
                              row_slot: np.ndarray, geometry: np.ndarray, rows: int, tokens: int) -> None:
    """ids[t] = prompt_tokens[t] where the host fed one (>= 0), else the row's device-owned pending token.

    The host marks a lane that reads its pending token by the prompt tokens' padding (-1), so
    any number of rows of a MIXED step may be host-fed (prompts beside the decode lanes)."""
    n = live_tokens(geometry)
    token_row = token_rows(geometry, tokens)[:n]
    host = prompt_tokens[:n]
    ids[:n] = np.where(host >= 0, host, pending[row_slot[token_row]])


def _write_row_records(completion: np.ndarray, header: tuple[int, int, int, int], records: np.ndarray) -> None:
    completion[:COMPLETION_HEADER_WORDS] = header
    rows = records.shape[0]
    completion[COMPLETION_HEADER_WORDS: COMPLETION_HEADER_WORDS + rows * COMPLETION_ROW_WORDS] = records.ravel()


def _inactive_records(rows: int) -> np.ndarray:
    records = np.full((rows, COMPLETION_ROW_WORDS), -1, dtype=np.int32)
    records[:, 3:6] = 0  # consumed, emitted, finish
    return records


def commit_samples(completion: np.ndarray, pending: np.ndarray, generated: np.ndarray,
                   output_histogram: np.ndarray, sampled: np.ndarray, eos_ids: np.ndarray,
                   output_limit: np.ndarray, row_slot: np.ndarray, row_generation: np.ndarray,
                   query_length: np.ndarray, consumed: np.ndarray, sample_flag: np.ndarray,
                   transport_header: np.ndarray, live_rows: np.ndarray, rows: int,
                   eos_capacity: int, histogram_bins: int, operation: int) -> None:
    """Publish sampled tokens into per-slot state and write one completion record per row."""
    records = _inactive_records(rows)
    live = min(int(live_rows[0]), rows)
    for r in range(live):
        slot = int(row_slot[r])
        if slot < 0:
            continue
        record = records[r]
        record[0] = slot
        record[1] = row_generation[r]
        record[3] = int(consumed[r]) + int(query_length[r])
        if not sample_flag[r]:
            continue
        token = int(sampled[r])
        pending[slot] = token
        generated[slot] += 1
        output_histogram[slot * histogram_bins + token] += 1
        record[2] = token
        record[4] = 1
        if token in eos_ids[slot * eos_capacity: (slot + 1) * eos_capacity]:
            record[5] = FINISH_EOS
        elif generated[slot] >= output_limit[slot]:
            record[5] = FINISH_LENGTH
    _write_row_records(completion, (int(transport_header[0]), live, operation, rows), records)


def admit_requests(seeds: np.ndarray, sampling: np.ndarray, output_limit: np.ndarray,
                   eos_ids: np.ndarray, prompt_histogram: np.ndarray, output_histogram: np.ndarray,
                   generated: np.ndarray, pending: np.ndarray, completion: np.ndarray,
                   in_seeds: np.ndarray, in_sampling: np.ndarray, in_output_limit: np.ndarray,
                   in_eos_ids: np.ndarray, in_histogram: np.ndarray, row_slot: np.ndarray,
                   row_generation: np.ndarray, transport_header: np.ndarray, live_rows: np.ndarray,
                   rows: int, eos_capacity: int, histogram_bins: int, operation: int) -> None:
    """Initialization: copy each admitted row's sampling state into its slot; reset output counters."""
    records = _inactive_records(rows)
    live = min(int(live_rows[0]), rows)
    words = len(SAMPLING_PARAMETER_FIELDS)
    for r in range(live):
        slot = int(row_slot[r])
        if slot < 0:
            continue
        seeds[2 * slot: 2 * slot + 2] = in_seeds[2 * r: 2 * r + 2]
        sampling[words * slot: words * (slot + 1)] = in_sampling[words * r: words * (r + 1)]
        output_limit[slot] = in_output_limit[r]
        eos_ids[eos_capacity * slot: eos_capacity * (slot + 1)] = in_eos_ids[eos_capacity * r: eos_capacity * (r + 1)]
        bins = slice(histogram_bins * slot, histogram_bins * (slot + 1))
        prompt_histogram[bins] = in_histogram[histogram_bins * r: histogram_bins * (r + 1)]
        output_histogram[bins] = 0
        generated[slot] = 0
        pending[slot] = -1
        records[r, 0] = slot
        records[r, 1] = row_generation[r]
    _write_row_records(completion, (int(transport_header[0]), live, operation, rows), records)
