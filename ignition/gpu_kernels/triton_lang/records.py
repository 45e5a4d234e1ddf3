"""Completion records (int32 words; drawn in helios_backend/kernel_abi/state.py):
    header = [ sequence | live_rows | operation | rows ]
    row    = [ slot | generation | token | consumed | emitted | finish | draft_cursor | reserved_model ]
Inactive rows (past live_rows or slot < 0) get -1 everywhere except consumed, emitted,
finish = 0.
"""
import triton
import triton.language as tl

HEADER_WORDS = tl.constexpr(4)
ROW_WORDS = tl.constexpr(8)
FINISH_EOS = tl.constexpr(1)
FINISH_LENGTH = tl.constexpr(2)


@triton.jit
def write_records(completion, r, write, slot, generation, token, consumed, emitted, finish,
                  active):
    """One record per lane r (where `write`); inactive lanes get the inactive record."""
    record = completion + HEADER_WORDS + r * ROW_WORDS
    tl.store(record + 0, tl.where(active, slot, -1), mask=write)
    tl.store(record + 1, tl.where(active, generation, -1), mask=write)
    tl.store(record + 2, tl.where(active, token, -1), mask=write)
    tl.store(record + 3, tl.where(active, consumed, 0), mask=write)
    tl.store(record + 4, tl.where(active, emitted, 0), mask=write)
    tl.store(record + 5, tl.where(active, finish, 0), mask=write)
    tl.store(record + 6, tl.full(r.shape, -1, tl.int32), mask=write)     # draft_cursor
    tl.store(record + 7, tl.full(r.shape, -1, tl.int32), mask=write)     # reserved_model


@triton.jit
def write_header(completion, sequence, live, operation, rows):
    tl.store(completion + 0, sequence)
    tl.store(completion + 1, live)
    tl.store(completion + 2, operation)
    tl.store(completion + 3, rows)
