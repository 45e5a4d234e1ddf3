"""Products over block weights (Q8_0 / Q4_1, kernel_abi/blocks.py) read in place, compiled.

The loops here check their arrays and choose the shapes; block_codegen.py's intrinsics do the
arithmetic of each pass over a row's blocks. `dequantize_rows` expands rows for the BLAS
products of many tokens and `block_gather_rows` the embedding rows of a block table.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from helios_backend.executors.cpu.block_codegen import (
    BLOCK_Q8_0, dots1x1, dots1x4, dots1x8, dots2x1, dots2x4, dots2x8, dots4x1, q4_1_store, q8_0_store, q8_block)
from helios_backend.executors.cpu.claiming import chunk_rows, claim_chunks
from helios_backend.executors.cpu.elements import store
from helios_backend.kernel_abi.activations import Q8_BLOCK_BYTES


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _block_bytes(code: int) -> int:
    return 34 if code == BLOCK_Q8_0 else 20


@njit(cache=True, fastmath=True, nogil=True)
def dequantize_rows(out: np.ndarray, data: np.ndarray, code: int, first: int, rows: int, k: int) -> None:
    """out[:rows * k] = the f32 weights of rows first .. first + rows - 1 of a [m, k] block matrix."""
    size = _block_bytes(code)
    blocks = k // 32
    if out.size < rows * k or data.size < (first + rows) * blocks * size:
        raise IndexError("dequantize_rows: arrays smaller than the rows")
    for block in range(rows * blocks):
        at = (first * blocks + block) * size
        if code == BLOCK_Q8_0:
            q8_0_store(out, block * 32, data, at)
        else:
            q4_1_store(out, block * 32, data, at)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _block_dots(data: np.ndarray, code: int, at: int, row_bytes: int, x: np.ndarray, x_at: int, stride: int,
                blocks: int, rows: int, tokens: int, sums: np.ndarray) -> None:
    if tokens == 8:
        if rows == 2:
            dots2x8(data, code, at, row_bytes, x, x_at, stride, blocks, sums)
        else:
            dots1x8(data, code, at, row_bytes, x, x_at, stride, blocks, sums)
    elif tokens == 4:
        if rows == 2:
            dots2x4(data, code, at, row_bytes, x, x_at, stride, blocks, sums)
        else:
            dots1x4(data, code, at, row_bytes, x, x_at, stride, blocks, sums)
    elif rows == 4:
        dots4x1(data, code, at, row_bytes, x, x_at, stride, blocks, sums)
    elif rows == 2:
        dots2x1(data, code, at, row_bytes, x, x_at, stride, blocks, sums)
    else:
        dots1x1(data, code, at, row_bytes, x, x_at, stride, blocks, sums)


@njit(cache=True, fastmath=True, nogil=True)
def block_linear_rows(out: np.ndarray, x: np.ndarray, data: np.ndarray, code: int, n: int, k: int, m: int,
                      accumulate: bool, first: int, last: int, sums: np.ndarray) -> None:
    """linear_rows over a [m, k] block matrix (code: BLOCK_*): out[t, o] (+)= sum_i x[t, i] * w[o, i]
    for t < n, first <= o < last. `sums` >= 16 floats of scratch. x: f32 [n, k], or int8: the q8
    blocks of the activations (`quantize_rows`; kernel_abi/activations.py), multiplied as integers.

    Output rows in pairs (4 at a time for q8 activations of fewer than 4 tokens; then 1 for an odd
    last row), tokens in groups of 8 (then 4, then 1): each
    block is widened in registers once per token group and multiplied into one accumulator per
    (row, token) (with 256-bit vectors a pair of 8 tokens is one row a pass: block_codegen.passes), and each loaded input feeds both rows of the pair (nothing of the weight is written
    to memory; an 8-token group reads the row once for 8 tokens). Measured one thread, weights in
    cache, [3072, 576] Q4_1: docs/cpu-executor.md.
    """
    size = _block_bytes(code)
    blocks = k // 32
    row_bytes = blocks * size
    stride = k if x.itemsize == 4 else blocks * Q8_BLOCK_BYTES     # elements of one token's activations
    if x.size < n * stride or out.size < n * m or data.size < last * row_bytes or sums.size < 16 or k % 32:
        raise IndexError("block_linear_rows: arrays smaller than the product")
    # q8 activations of fewer than 4 tokens (one token a group): 4 rows a pass, their block sums
    # reduced and scaled together (block_codegen._emit_q8_dots; one thread, AVX2 path: docs/cpu-executor.md)
    width = 4 if x.itemsize == 1 and n < 4 else 2
    o = first
    while o < last:
        rows = width if o + width <= last else (2 if o + 2 <= last else 1)
        at = o * row_bytes
        t = 0
        while t < n:
            group = token_group(t, n)
            _block_dots(data, code, at, row_bytes, x, t * stride, stride, blocks, rows, group, sums)
            for r in range(rows):
                for j in range(group):
                    store(out, (t + j) * m + o + r, sums[r * group + j], accumulate)
            t += group
        o += rows


@njit(inline="always", cache=True, nogil=True)
def token_group(t: int, n: int) -> int:
    """Tokens of the group starting at token t of n (activations.TOKEN_GROUPS: 8, else 4, else 1)."""
    return 8 if t + 8 <= n else (4 if t + 4 <= n else 1)


@njit(inline="always", cache=True, nogil=True)
def _q8_block(token: int, b: int, n: int, blocks: int) -> tuple[int, int, int]:
    """(byte of block b of the token's group, the group's tokens, the token's place in it) in the q8
    activations of n tokens (kernel_abi/activations.py: groups of 8, then 4, then 1, as token_group)."""
    full = n - n % 8                   # tokens in groups of 8
    if token < full:
        first, size = token - token % 8, 8
    elif n - full >= 4 and token < full + 4:
        first, size = full, 4
    else:
        first, size = token, 1
    return (first * blocks + b * size) * Q8_BLOCK_BYTES, size, token - first


@njit(cache=True, nogil=True)
def quantize_rows(out: np.ndarray, x: np.ndarray, n: int, k: int) -> None:
    """out[:n * k / 32 * Q8_BLOCK_BYTES] = the q8 blocks of f32 x [n, k] (kernel_abi/activations.py
    `quantize`, bit for bit: block_codegen.q8_block). out: int8."""
    blocks = k // 32
    if x.size < n * k or out.size < n * blocks * Q8_BLOCK_BYTES or k % 32:
        raise IndexError("quantize_rows: arrays smaller than the activations")
    for token in range(n):
        for b in range(blocks):
            at, size, j = _q8_block(token, b, n, blocks)
            q8_block(out, at, size, j, x, token * k + b * 32)


@njit(cache=True, fastmath=True, nogil=True)
def _rows_chunk(index: int, chunks: int, args: tuple) -> None:
    """Chunk `index` of `chunks` of block_linear_claimed's output rows (args: block_linear_rows' arguments
    but the row range)."""
    out, x, data, code, n, k, m, accumulate, sums = args
    first, last = chunk_rows(index, chunks, m)
    block_linear_rows(out, x, data, code, n, k, m, accumulate, first, last, sums)


@njit(cache=True, fastmath=True, nogil=True)
def block_linear_claimed(out: np.ndarray, x: np.ndarray, data: np.ndarray, code: int, n: int, k: int, m: int,
                         accumulate: bool, chunks: int, counters: np.ndarray, sums: np.ndarray, calls: np.ndarray,
                         caller: bool) -> None:
    """block_linear_rows over the row chunks this thread claims (claiming.claim_chunks): every thread of a
    shared call runs it with its own `sums`."""
    claim_chunks(_rows_chunk, (out, x, data, code, n, k, m, accumulate, sums), chunks, counters, calls, caller)


@njit(cache=True, fastmath=True, nogil=True)
def block_gather_rows(out: np.ndarray, data: np.ndarray, code: int, ids: np.ndarray, n: int, k: int) -> None:
    """out[t] = row ids[t] of a block table (its f32 weights) for t < n."""
    for t in range(n):
        dequantize_rows(out[t * k:(t + 1) * k], data, code, ids[t], 1, k)
