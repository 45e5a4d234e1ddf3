"""Products over F16 weights (row-major [out, in], read in place as their uint16 bits), compiled.

`linear_rows` is the product of few tokens (memory-bound: each weight byte is read once per
call, widened in registers); `linear_claimed` the form every thread of a shared call runs
(claiming.py); `widen` fills the f32 tiles that products of many tokens hand to BLAS
(kernels.py). Serial and without the GIL, writing into arrays they are given.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from helios_backend.executors.cpu import isa
from helios_backend.executors.cpu.claiming import chunk_rows, claim_chunks
from helios_backend.executors.cpu.elements import as_f32, f16_bits_to_f32, store

# 2 rows x 8 tokens a pass keeps 16 vector accumulators beside the widened halves and the inputs:
# AVX-512's 32 registers hold them, AVX2's 16 do not (spilled: [576, 1536] x 8 tokens 199 us on
# the AVX2 path of a Zen 5 core, one thread, against 140 us as two passes of 2 rows x 4 tokens;
# [3072, 576] 372 -> 300 us; the AVX-512 path 67 / 138 us). Read at compile time (isa.py: numba's
# cache keys the machine code by the target the path chose).
EIGHT_TOKENS_A_PASS = isa.active().vector_bits >= 512


@njit(cache=True, fastmath=True, nogil=True)
def widen(out: np.ndarray, bits: np.ndarray, count: int) -> None:
    """out[:count] = f32(bits[:count]) (a weight tile for a BLAS product). Serial and without the
    GIL: the product's worker threads each widen their own tiles."""
    for i in range(count):
        out[i] = f16_bits_to_f32(bits[i])


@njit(cache=True, fastmath=True, nogil=True)
def linear_rows(out: np.ndarray, x: np.ndarray, weight: np.ndarray, n: int, k: int, m: int, accumulate: bool,
                first: int, last: int, row_base: int) -> None:
    """out[t, o] (+)= sum_i x[t, i] * weight[o - row_base, i] for t < n and first <= o < last; out [n, m],
    x [n, k], weight [m, k] f16 bits (f32 rows work too, through as_f32; row_base: the matrix row of
    weight's first row). Serial: a product too small to share runs on the calling thread, a larger
    one's rows are shared over threads in chunks (linear_claimed; docs/cpu-executor.md).

    Output rows go in pairs: each weight half is widened once per token block of 8 (then 4, then
    1; blocks of 4 only where vectors are 256 bits wide: EIGHT_TOKENS_A_PASS) and multiplied into
    both rows' accumulators, so the weight is read once per call whatever n
    is and each loaded input feeds two products (an 8-token product is bound by loads: 2 rows x 8
    tokens measured 1.7x one row x 8 tokens, docs/cpu-executor.md).
    """
    o = first
    while o < last:
        if o + 1 < last:
            rows = weight[(o - row_base) * k:(o - row_base + 2) * k]
            t = 0
            while t + 8 <= n and EIGHT_TOKENS_A_PASS:
                _dot8x2(out, x, rows, t, k, m, o, accumulate)
                t += 8
            while t + 4 <= n:
                _dot4x2(out, x, rows, t, k, m, o, accumulate)
                t += 4
            for r in range(2):
                for u in range(t, n):
                    _dot1(out, x, rows[r * k:(r + 1) * k], u, k, m, o + r, accumulate)
            o += 2
        else:                           # an odd last row
            row = weight[(o - row_base) * k:(o - row_base + 1) * k]
            t = 0
            while t + 8 <= n:
                _dot8(out, x, row, t, k, m, o, accumulate)
                t += 8
            while t + 4 <= n:
                _dot4(out, x, row, t, k, m, o, accumulate)
                t += 4
            for u in range(t, n):
                _dot1(out, x, row, u, k, m, o, accumulate)
            o += 1


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot1(out: np.ndarray, x: np.ndarray, row: np.ndarray, t: int, k: int, m: int, o: int,
          accumulate: bool) -> None:
    xs = x[t * k:(t + 1) * k]
    acc = np.float32(0.0)
    for i in range(k):
        acc += as_f32(row[i]) * xs[i]
    store(out, t * m + o, acc, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot4x2(out: np.ndarray, x: np.ndarray, rows: np.ndarray, t: int, k: int, m: int, o: int,
            accumulate: bool) -> None:
    """Tokens t..t+3 against weight rows o and o+1 (rows: their 2k halves)."""
    r0 = rows[:k]
    r1 = rows[k:2 * k]
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for i in range(k):
        u = as_f32(r0[i])
        v = as_f32(r1[i])
        a0 += u * x0[i]
        b0 += v * x0[i]
        a1 += u * x1[i]
        b1 += v * x1[i]
        a2 += u * x2[i]
        b2 += v * x2[i]
        a3 += u * x3[i]
        b3 += v * x3[i]
    for j, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
        store(out, (t + j) * m + o, a, accumulate)
        store(out, (t + j) * m + o + 1, b, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot8x2(out: np.ndarray, x: np.ndarray, rows: np.ndarray, t: int, k: int, m: int, o: int,
            accumulate: bool) -> None:
    """Tokens t..t+7 against weight rows o and o+1: sixteen accumulators, two widened halves."""
    r0 = rows[:k]
    r1 = rows[k:2 * k]
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    x4 = x[(t + 4) * k:(t + 5) * k]
    x5 = x[(t + 5) * k:(t + 6) * k]
    x6 = x[(t + 6) * k:(t + 7) * k]
    x7 = x[(t + 7) * k:(t + 8) * k]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
    for i in range(k):
        u = as_f32(r0[i])
        v = as_f32(r1[i])
        a0 += u * x0[i]
        b0 += v * x0[i]
        a1 += u * x1[i]
        b1 += v * x1[i]
        a2 += u * x2[i]
        b2 += v * x2[i]
        a3 += u * x3[i]
        b3 += v * x3[i]
        a4 += u * x4[i]
        b4 += v * x4[i]
        a5 += u * x5[i]
        b5 += v * x5[i]
        a6 += u * x6[i]
        b6 += v * x6[i]
        a7 += u * x7[i]
        b7 += v * x7[i]
    for j, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3), (a4, b4), (a5, b5), (a6, b6), (a7, b7))):
        store(out, (t + j) * m + o, a, accumulate)
        store(out, (t + j) * m + o + 1, b, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot4(out: np.ndarray, x: np.ndarray, row: np.ndarray, t: int, k: int, m: int, o: int,
          accumulate: bool) -> None:
    """Tokens t..t+3 against one weight row: each half widened once, four accumulators."""
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(k):
        w = as_f32(row[i])
        a0 += w * x0[i]
        a1 += w * x1[i]
        a2 += w * x2[i]
        a3 += w * x3[i]
    store(out, t * m + o, a0, accumulate)
    store(out, (t + 1) * m + o, a1, accumulate)
    store(out, (t + 2) * m + o, a2, accumulate)
    store(out, (t + 3) * m + o, a3, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot8(out: np.ndarray, x: np.ndarray, row: np.ndarray, t: int, k: int, m: int, o: int,
          accumulate: bool) -> None:
    """Tokens t..t+7 against one weight row (a decode step of 8 rows: one pass over the weight).
    _dot4's shape with eight accumulators: measured 0.56 ms vs 0.68 ms for two _dot4 blocks on a
    [3072, 576] product of 8 tokens, one thread."""
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    x4 = x[(t + 4) * k:(t + 5) * k]
    x5 = x[(t + 5) * k:(t + 6) * k]
    x6 = x[(t + 6) * k:(t + 7) * k]
    x7 = x[(t + 7) * k:(t + 8) * k]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(k):
        w = as_f32(row[i])
        a0 += w * x0[i]
        a1 += w * x1[i]
        a2 += w * x2[i]
        a3 += w * x3[i]
        a4 += w * x4[i]
        a5 += w * x5[i]
        a6 += w * x6[i]
        a7 += w * x7[i]
    store(out, t * m + o, a0, accumulate)
    store(out, (t + 1) * m + o, a1, accumulate)
    store(out, (t + 2) * m + o, a2, accumulate)
    store(out, (t + 3) * m + o, a3, accumulate)
    store(out, (t + 4) * m + o, a4, accumulate)
    store(out, (t + 5) * m + o, a5, accumulate)
    store(out, (t + 6) * m + o, a6, accumulate)
    store(out, (t + 7) * m + o, a7, accumulate)


@njit(cache=True, fastmath=True, nogil=True)
def _rows_chunk(index: int, chunks: int, args: tuple) -> None:
    """Chunk `index` of `chunks` of linear_claimed's output rows (args: out, x, weight, n, k, m, accumulate)."""
    out, x, weight, n, k, m, accumulate = args
    first, last = chunk_rows(index, chunks, m)
    linear_rows(out, x, weight, n, k, m, accumulate, first, last, 0)


@njit(cache=True, fastmath=True, nogil=True)
def linear_claimed(out: np.ndarray, x: np.ndarray, weight: np.ndarray, n: int, k: int, m: int, accumulate: bool,
                   chunks: int, counters: np.ndarray, calls: np.ndarray, caller: bool) -> None:
    """linear_rows (f16 bits) over the row chunks this thread claims (claiming.claim_chunks)."""
    claim_chunks(_rows_chunk, (out, x, weight, n, k, m, accumulate), chunks, counters, calls, caller)
