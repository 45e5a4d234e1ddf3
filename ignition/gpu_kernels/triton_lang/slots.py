"""Per-slot state updates and completion records: admission and the end-of-step commit.

Completion record layout: records.py. Every one of the `rows` records is written each step:
rows past live_rows (or with slot < 0) get the inactive record.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import live_lane, wait_for_predecessors
from ignition.gpu_kernels.triton_lang.records import (FINISH_EOS, FINISH_LENGTH, write_header,
                                              write_records)

@triton.jit
def commit_samples(completion, pending, generated, output_histogram, sampled, eos_ids,
                   output_limit, row_slot, row_generation, query_length, consumed, sample_flag,
                   transport_header, live_rows, rows, eos_capacity, histogram_bins, operation,
                   MAX_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Publish sampled tokens (pending token, draw counter, output histogram) and write the
    completion record of every row. Grid (1,): rows <= MAX_ROWS lanes of one program.

    Two dependent loads: every per-row value is loaded at once (masked by the capacity, not by
    what another load returns), then the sampling rows' slot state."""
    wait_for_predecessors(PDL)
    r = tl.arange(0, MAX_ROWS)
    lane = r < rows
    live = tl.minimum(tl.load(live_rows), rows)
    slot = tl.load(row_slot + r, mask=lane, other=-1)
    flag = tl.load(sample_flag + r, mask=lane, other=0)
    drawn = tl.load(sampled + r, mask=lane, other=-1)
    generation = tl.load(row_generation + r, mask=lane, other=-1)
    endpoint = (tl.load(consumed + r, mask=lane, other=0)
                + tl.load(query_length + r, mask=lane, other=0))
    sequence = tl.load(transport_header)
    active = (r < live) & (slot >= 0)
    sampling = active & (flag != 0)
    token = tl.where(sampling, drawn, -1)
    count = tl.load(generated + slot, mask=sampling, other=0) + 1
    limit = tl.load(output_limit + slot, mask=sampling, other=0)
    # EOS ids as BLOCK_E one-dimensional loads per pass: every [MAX_ROWS] value keeps one
    # layout (a [rows, ids] tile cost layout conversions through shared memory)
    is_eos = tl.zeros((MAX_ROWS,), dtype=tl.int1)
    eos_row = eos_ids + slot * eos_capacity
    for e0 in range(0, eos_capacity, BLOCK_E):
        for e in tl.static_range(BLOCK_E):
            present = sampling & (slot * 0 + (e0 + e) < eos_capacity)
            ids = tl.load(eos_row + e0 + e, mask=present, other=-1)
            is_eos = is_eos | (ids == token)
    tl.store(pending + slot, token, mask=sampling)
    tl.store(generated + slot, count, mask=sampling)
    # relaxed: later nodes read the histogram after this kernel completes (no fence needed)
    tl.atomic_add(output_histogram + slot.to(tl.int64) * histogram_bins + token,
                  tl.full((MAX_ROWS,), 1, tl.int32), mask=sampling, sem="relaxed")
    finish = tl.where(is_eos, FINISH_EOS, tl.where(count >= limit, FINISH_LENGTH, 0))
    finish = tl.where(sampling, finish, 0)
    write_records(completion, r, lane, slot, generation, token, endpoint, sampling.to(tl.int32),
                  finish, active)
    write_header(completion, sequence, live, operation, rows)


@triton.jit
def admit_requests(seeds, sampling, output_limit, eos_ids, prompt_histogram, output_histogram,
                   generated, pending, completion, in_seeds, in_sampling, in_output_limit,
                   in_eos_ids, in_histogram, row_slot, row_generation, transport_header,
                   live_rows, rows, eos_capacity, histogram_bins, operation,
                   BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Initialization: copy each admitted row's sampling state into its slot (seeds u32 [2],
    sampling f32 [8], output limit, EOS ids [eos_capacity], prompt histogram [bins]); zero the
    output histogram and draw counter; pending token -1. Grid (cdiv(bins, BLOCK_H), rows):
    program (b, r) copies histogram chunk b of row r; programs (0, r) do the rest."""
    wait_for_predecessors(PDL)
    r = tl.program_id(1)
    live, slot = live_lane(row_slot, live_rows, rows, r)
    active = (r < live) & (slot >= 0)
    if active:
        h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < histogram_bins
        source = tl.load(in_histogram + r.to(tl.int64) * histogram_bins + h, mask=h_mask)
        bins = slot.to(tl.int64) * histogram_bins + h
        tl.store(prompt_histogram + bins, source, mask=h_mask)
        tl.store(output_histogram + bins, tl.zeros((BLOCK_H,), dtype=tl.int32), mask=h_mask)
    if tl.program_id(0) == 0:
        if active:
            w = tl.arange(0, 8)
            tl.store(seeds + 2 * slot + w, tl.load(in_seeds + 2 * r + w, mask=w < 2), mask=w < 2)
            tl.store(sampling + 8 * slot + w, tl.load(in_sampling + 8 * r + w))
            tl.store(output_limit + slot, tl.load(in_output_limit + r))
            for e0 in range(0, eos_capacity, BLOCK_E):
                e = e0 + tl.arange(0, BLOCK_E)
                e_mask = e < eos_capacity
                tl.store(eos_ids + slot * eos_capacity + e,
                         tl.load(in_eos_ids + r * eos_capacity + e, mask=e_mask), mask=e_mask)
            tl.store(generated + slot, 0)
            tl.store(pending + slot, -1)
        one = tl.arange(0, 1) + r
        write_records(completion, one, one < rows, tl.zeros((1,), tl.int32) + slot,
                       tl.zeros((1,), tl.int32) + tl.load(row_generation + r),
                       tl.full((1,), -1, tl.int32), tl.zeros((1,), tl.int32),
                       tl.zeros((1,), tl.int32), tl.zeros((1,), tl.int32), active)
        if r == 0:
            write_header(completion, tl.load(transport_header), live, operation, rows)
