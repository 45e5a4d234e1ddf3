"""Paged attention of decode rows and short chunks, compiled: one (token, kv head) pair at a time.

`attention_pairs` runs a range of pairs on the calling thread; `attention_claimed` is the form
every thread of a shared call runs (claiming.py), each with its own score scratch. Heads of 64
and 128 elements go through attention_codegen.py's vector intrinsics, other widths through loops.
The f32 summation order is the only difference from kernel_abi/attention.py's reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from helios_backend.executors.cpu.attention_codegen import (
    head_axpy64, head_axpy128, head_dot64, head_dot128, page_axpy64, page_axpy128, page_dots64, page_dots128)
from helios_backend.executors.cpu.claiming import claim_chunks
from helios_backend.executors.cpu.elements import as_f32, exp_nonpositive


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _head_dot(a: np.ndarray, a_at: int, b: np.ndarray, b_at: int, head_dim: int) -> np.float32:
    """sum(a[a_at:][:head_dim] * b[b_at:][:head_dim]). Widths 64 and 128 as one vector product
    (head_dot64/128): the numba loop over slices of the cache cost a slice (and the reference
    counting numba keeps for it) per cached key, 4-6x the arithmetic."""
    if head_dim == 64:
        return head_dot64(a, a_at, b, b_at)
    if head_dim == 128:
        return head_dot128(a, a_at, b, b_at)
    total = np.float32(0.0)
    for d in range(head_dim):
        total += a[a_at + d] * as_f32(b[b_at + d])
    return total


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _head_axpy(target: np.ndarray, t_at: int, weight: np.float32, value: np.ndarray, v_at: int,
               head_dim: int) -> None:
    """target[t_at:][:head_dim] += weight * value[v_at:][:head_dim] (vector forms as in _head_dot)."""
    if head_dim == 64:
        head_axpy64(target, t_at, weight, value, v_at)
    elif head_dim == 128:
        head_axpy128(target, t_at, weight, value, v_at)
    else:
        for d in range(head_dim):
            target[t_at + d] += weight * as_f32(value[v_at + d])


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _page_dots(scores: np.ndarray, s_at: int, q: np.ndarray, q_at: int, cache: np.ndarray, base: int, count: int,
               stride: int, scale: np.float32, head_dim: int) -> None:
    """One head's scores against one page's `count` keys (page_dots64/128, else head by head)."""
    if head_dim == 64:
        page_dots64(scores, s_at, q, q_at, cache, base, count, stride, scale)
    elif head_dim == 128:
        page_dots128(scores, s_at, q, q_at, cache, base, count, stride, scale)
    else:
        for s in range(count):
            scores[s_at + s] = _head_dot(q, q_at, cache, base + s * stride, head_dim) * scale


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _page_axpy(target: np.ndarray, t_at: int, weights: np.ndarray, w_at: int, cache: np.ndarray, base: int,
               count: int, stride: int, head_dim: int) -> None:
    """One head's weighted sum of one page's `count` values into target (page_axpy64/128, else a loop)."""
    if head_dim == 64:
        page_axpy64(target, t_at, weights, w_at, cache, base, count, stride)
    elif head_dim == 128:
        page_axpy128(target, t_at, weights, w_at, cache, base, count, stride)
    else:
        for s in range(count):
            _head_axpy(target, t_at, weights[w_at + s], cache, base + s * stride, head_dim)


@njit(cache=True, fastmath=True, nogil=True)
def attention_pairs(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    positions: np.ndarray, token_row: np.ndarray, row_slot: np.ndarray, page_table: np.ndarray,
                    chosen: np.ndarray, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int,
                    page_stride: int, scale: float, scores: np.ndarray, first: int, last: int) -> None:
    """out[t] = softmax(q[t] k^T * scale) v over positions 0..positions[t] of token t's slot, for the
    (token, kv head) pairs first <= pair < last (pair = j * kv_heads + kv head, token t = chosen[j]). Serial.

    Every live token alike, decode rows and prefill chunks (the step's keys are already in the
    cache). A pair serves the kv head's group of q_heads / kv_heads query heads, so each cached
    key and value is read once per group. Three passes per pair (scores, exp and normalize,
    weighted values) over `scores` (>= group * context floats, preallocated); one exp per key,
    pages walked in order (no division per key).
    """
    group = q_heads // kv_heads
    kv_width = kv_heads * head_dim
    q_width = q_heads * head_dim
    for pair in range(first, last):
        t = chosen[pair // kv_heads]
        kv = pair % kv_heads
        slot = row_slot[token_row[t]]
        context = positions[t] + 1
        start = t * q_width + kv * group * head_dim
        pages = (context + page_tokens - 1) // page_tokens
        for p in range(pages):
            base = page_table[slot * pages_per_row + p] * page_stride + kv * head_dim
            count = min(page_tokens, context - p * page_tokens)
            for h in range(group):
                _page_dots(scores, h * context + p * page_tokens, q, start + h * head_dim, k_cache, base, count,
                           kv_width, np.float32(scale), head_dim)
        for h in range(group):
            weights = scores[h * context:(h + 1) * context]
            best = weights[0]
            for j in range(context):
                best = max(best, weights[j])
            norm = np.float32(0.0)
            for j in range(context):
                weight = exp_nonpositive(weights[j] - best)
                weights[j] = weight
                norm += weight
            inverse = np.float32(1.0) / norm
            for j in range(context):
                weights[j] *= inverse
        out[start:start + group * head_dim] = 0.0
        for p in range(pages):
            base = page_table[slot * pages_per_row + p] * page_stride + kv * head_dim
            count = min(page_tokens, context - p * page_tokens)
            for h in range(group):
                _page_axpy(out, start + h * head_dim, scores, h * context + p * page_tokens, v_cache, base, count,
                           kv_width, head_dim)


@njit(cache=True, fastmath=True, nogil=True)
def _pairs_chunk(index: int, chunks: int, args: tuple) -> None:
    """Chunk `index` of `chunks` of attention_claimed's pairs (args: attention_pairs' arguments but the
    range, then the number of pairs)."""
    (out, q, k_cache, v_cache, positions, token_row, row_slot, page_table, chosen, q_heads, kv_heads, head_dim,
     page_tokens, pages_per_row, page_stride, scale, scores, pairs) = args
    attention_pairs(out, q, k_cache, v_cache, positions, token_row, row_slot, page_table, chosen, q_heads,
                    kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale, scores,
                    index * pairs // chunks, (index + 1) * pairs // chunks)


@njit(cache=True, fastmath=True, nogil=True)
def attention_claimed(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      positions: np.ndarray, token_row: np.ndarray, row_slot: np.ndarray, page_table: np.ndarray,
                      chosen: np.ndarray, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
                      pages_per_row: int, page_stride: int, scale: float, scores: np.ndarray, pairs: int,
                      chunks: int, counters: np.ndarray, calls: np.ndarray, caller: bool) -> None:
    """attention_pairs over the chunks of (token, kv head) pairs this thread claims (`scores`: its own)."""
    claim_chunks(_pairs_chunk, (out, q, k_cache, v_cache, positions, token_row, row_slot, page_table, chosen,
                                q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale, scores,
                                pairs), chunks, counters, calls, caller)


@njit(cache=True, fastmath=True, nogil=True, error_model="numpy")
def causal_softmax(scores: np.ndarray, rows: int, context: int, group: int, positions: np.ndarray, first: int,
                   scale: float) -> None:
    """In place over scores [rows, context], row i the query at positions[first + i // group] (a block of
    a prefill chunk's queries, each of its kv head's `group` query heads): softmax(scale * scores) over
    the keys the query sees (0 .. its position), 0 past them. One pass for the maximum, one for the
    exps (exp_nonpositive, which vectorizes) and their sum, one to normalize: numpy's form (scale,
    mask, max, subtract, exp, sum, divide) made eight passes over the matrix, ~45 % of a 512-token
    prefill's attention on one thread."""
    for i in range(rows):
        row = scores[i * context:(i + 1) * context]
        seen = min(context, positions[first + i // group] + 1)
        best = row[0]
        for j in range(1, seen):
            best = max(best, row[j])
        total = np.float32(0.0)
        for j in range(seen):
            weight = exp_nonpositive((row[j] - best) * np.float32(scale))
            row[j] = weight
            total += weight
        inverse = np.float32(1.0) / total
        for j in range(seen):
            row[j] *= inverse
        for j in range(seen, context):
            row[j] = np.float32(0.0)
