"""Reference kernels for attention over a paged key/value cache.

Cache plane layout (one plane for keys, one for values, same geometry):

    plane = page[0] | page[1] | ...            page_stride elements per page
    page  = layer[0] | ... | layer[L-1]          each [page_tokens, kv_heads, head_dim] f16

A node's cache pointer already carries the layer's byte offset inside a page, so
the element of (page p, token slot i, kv head h, dim d) is
    p * page_stride + (i * kv_heads + h) * head_dim + d.
The page table is indexed by physical slot: page_table[slot * pages_per_row + j] is
the page holding positions [j * page_tokens, (j + 1) * page_tokens) of that slot.

Query heads are grouped: query head h reads kv head h // (q_heads // kv_heads).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from helios_backend.kernel_abi.linear import _matrix, rms_norm
from helios_backend.kernel_abi.rope import apply_rope
from helios_backend.kernel_abi.state import live_tokens, row_starts, token_rows


def _pages_view(plane: np.ndarray, page_elements: int, page_stride: int) -> np.ndarray:
    """[pages, page_elements] strided view over a flat plane pointer (no copy)."""
    pages = (plane.size - page_elements) // page_stride + 1
    return as_strided(plane, shape=(pages, page_elements), strides=(page_stride * plane.itemsize, plane.itemsize))


def _cache_offsets(positions: np.ndarray, slots: np.ndarray, page_table: np.ndarray, pages_per_row: int,
                   page_tokens: int, page_stride: int, token_elements: int) -> np.ndarray:
    pages = page_table[slots * pages_per_row + positions // page_tokens].astype(np.int64)
    return pages * page_stride + (positions % page_tokens).astype(np.int64) * token_elements


def qkv_rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, hidden: np.ndarray,
                   norm_weight: np.ndarray, qkv_weight: np.ndarray, rope_table: np.ndarray,
                   positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                   geometry: np.ndarray, tokens: int, dim: int, q_heads: int, kv_heads: int,
                   head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                   eps: float, rope_pairing: int) -> None:
    """Fused: rms_norm -> [q | k | v] projection -> RoPE on q, k -> k, v written into their cache pages.

    q_out [tokens, q_heads * head_dim] f32; qkv_weight [(q_heads + 2 kv_heads) * head_dim, dim].
    """
    _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, None, rope_table, positions,
                    page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads, head_dim, page_tokens,
                    pages_per_row, page_stride, eps, rope_pairing)


def qkv_bias_rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, hidden: np.ndarray,
                        norm_weight: np.ndarray, qkv_weight: np.ndarray, qkv_bias: np.ndarray,
                        rope_table: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                        row_slot: np.ndarray, geometry: np.ndarray, tokens: int, dim: int, q_heads: int,
                        kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                        eps: float, rope_pairing: int) -> None:
    """qkv_rope_store with a bias added to the projection before RoPE.

    qkv_bias f32 [(q_heads + 2 kv_heads) * head_dim]: f32 because key biases reach |145|
    (Qwen2-family checkpoints), where f16 keeps only 0.125 steps.
    """
    _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias, rope_table, positions,
                    page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads, head_dim, page_tokens,
                    pages_per_row, page_stride, eps, rope_pairing)


def qkv_norm_rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, hidden: np.ndarray,
                        norm_weight: np.ndarray, qkv_weight: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray,
                        rope_table: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                        row_slot: np.ndarray, geometry: np.ndarray, tokens: int, dim: int, q_heads: int,
                        kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                        eps: float, rope_pairing: int) -> None:
    """qkv_rope_store with an RMSNorm of every query and key head (weights q_norm, k_norm
    [head_dim], eps as the input norm's) between the projection and RoPE ("q/k norm")."""
    _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, None, rope_table, positions,
                    page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads, head_dim, page_tokens,
                    pages_per_row, page_stride, eps, rope_pairing, (q_norm, k_norm))


def _qkv_rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, hidden: np.ndarray,
                    norm_weight: np.ndarray, qkv_weight: np.ndarray, qkv_bias: np.ndarray | None,
                    rope_table: np.ndarray, positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                    geometry: np.ndarray, tokens: int, dim: int, q_heads: int, kv_heads: int, head_dim: int,
                    page_tokens: int, pages_per_row: int, page_stride: int, eps: float, rope_pairing: int,
                    head_norms: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    n = live_tokens(geometry)
    if n == 0:
        return
    q_width = q_heads * head_dim
    kv_width = kv_heads * head_dim
    normed = rms_norm(_matrix(hidden, tokens, dim)[:n], norm_weight[:dim], eps)
    projected = normed @ _matrix(qkv_weight, q_width + 2 * kv_width, dim).T
    _rope_store_projected(q_out, k_cache, v_cache, projected, qkv_bias, rope_table, positions, page_table, row_slot,
                          geometry, tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                          eps, rope_pairing, head_norms)


def rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, projected: np.ndarray,
               rope_table: np.ndarray, positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
               geometry: np.ndarray, tokens: int, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
               pages_per_row: int, page_stride: int, rope_pairing: int) -> None:
    """The second half of qkv_rope_store on the product path: RoPE on q and k of an f32 projection
    projected [tokens, (q_heads + 2 kv_heads) * head_dim] (linear.product_f32.v1), then q_out and
    the k, v cache entries."""
    bias_rope_store(q_out, k_cache, v_cache, projected, None, rope_table, positions, page_table, row_slot,
                    geometry, tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                    rope_pairing)


def bias_rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, projected: np.ndarray,
                    qkv_bias: np.ndarray | None, rope_table: np.ndarray, positions: np.ndarray,
                    page_table: np.ndarray, row_slot: np.ndarray, geometry: np.ndarray, tokens: int, q_heads: int,
                    kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                    rope_pairing: int) -> None:
    """rope_store with the f32 q/k/v bias added to the projection first (qkv_bias_rope_store's second half)."""
    width = (q_heads + 2 * kv_heads) * head_dim
    _rope_store_projected(q_out, k_cache, v_cache, _matrix(projected, tokens, width)[:live_tokens(geometry)],
                          qkv_bias, rope_table, positions, page_table, row_slot, geometry, tokens, q_heads,
                          kv_heads, head_dim, page_tokens, pages_per_row, page_stride, 0.0, rope_pairing)


def _rope_store_projected(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, projected: np.ndarray,
                          qkv_bias: np.ndarray | None, rope_table: np.ndarray, positions: np.ndarray,
                          page_table: np.ndarray, row_slot: np.ndarray, geometry: np.ndarray, tokens: int,
                          q_heads: int, kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int,
                          page_stride: int, eps: float, rope_pairing: int,
                          head_norms: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The live tokens' projection [n, (q_heads + 2 kv_heads) * head_dim] -> (+ bias, head norms,
    RoPE) -> q_out rows and k, v cache entries."""
    n = projected.shape[0]
    if n == 0:
        return
    q_width = q_heads * head_dim
    kv_width = kv_heads * head_dim
    projected = projected.astype(np.float32, copy=False)
    if qkv_bias is not None:     # a new array: `projected` may be a view of the caller's buffer
        projected = projected + qkv_bias[:q_width + 2 * kv_width].astype(np.float32, copy=False)
    token_positions = positions[:n]
    cos_sin = rope_table.reshape(-1, head_dim // 2, 2)[token_positions]
    q = np.ascontiguousarray(projected[:, :q_width]).reshape(n, q_heads, head_dim)
    k = np.ascontiguousarray(projected[:, q_width:q_width + kv_width]).reshape(n, kv_heads, head_dim)
    if head_norms is not None:
        q = rms_norm(q, head_norms[0][:head_dim], eps)
        k = rms_norm(k, head_norms[1][:head_dim], eps)
    q = apply_rope(q, cos_sin, rope_pairing)
    k = apply_rope(k, cos_sin, rope_pairing)
    v = projected[:, q_width + kv_width:]
    _matrix(q_out, tokens, q_width)[:n] = q.reshape(n, q_width)
    slots = row_slot[token_rows(geometry, tokens)[:n]]
    base = _cache_offsets(token_positions, slots, page_table, pages_per_row, page_tokens, page_stride, kv_width)
    index = base[:, None] + np.arange(kv_width, dtype=np.int64)[None, :]
    k_cache[index] = k.reshape(n, kv_width)
    v_cache[index] = v


def _hidden_keys(key_positions: np.ndarray, query_positions: np.ndarray, window: int) -> np.ndarray:
    """[queries, keys] True where a query does not see a key: a later position, or (window > 0)
    one `window` or more positions back (a query sees itself and the window - 1 before it)."""
    future = key_positions[None, :] > query_positions[:, None]
    if window > 0:
        future |= key_positions[None, :] <= query_positions[:, None] - window
    return future


def _single_token_rows(out_rows: np.ndarray, queries: np.ndarray, query_positions: np.ndarray, slots: np.ndarray,
                       k_pages: np.ndarray, v_pages: np.ndarray, page_table: np.ndarray, pages_per_row: int,
                       page_tokens: int, kv_heads: int, group: int, head_dim: int, scale: float,
                       window: int = 0) -> None:
    """Decode rows (one query each) batched: one gather and two batched matmuls for all of them.

    queries [n, q_heads * head_dim]; keys gathered as [n, context_max, kv_heads, head_dim], masked past each row.
    """
    n = queries.shape[0]
    context = int(query_positions.max()) + 1
    page_count = -(-context // page_tokens)
    table = page_table[(slots * pages_per_row)[:, None] + np.arange(page_count)[None, :]]
    keys = k_pages[table].reshape(n, page_count * page_tokens, kv_heads, head_dim)[:, :context]
    values = v_pages[table].reshape(n, page_count * page_tokens, kv_heads, head_dim)[:, :context]
    keys = keys.astype(np.float32, copy=False).transpose(0, 2, 3, 1)           # [n, kv, hd, context]
    values = values.astype(np.float32, copy=False).transpose(0, 2, 1, 3)       # [n, kv, context, hd]
    grouped = queries.reshape(n, kv_heads, group, head_dim)
    scores = (grouped @ keys) * np.float32(scale)                               # [n, kv, group, context]
    future = _hidden_keys(np.arange(context), query_positions, window)           # [n, context]
    scores[np.broadcast_to(future[:, None, None, :], scores.shape)] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out_rows[...] = (scores @ values).reshape(n, kv_heads * group * head_dim)


def paged_attention(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                    geometry: np.ndarray, rows: int, tokens: int, q_heads: int, kv_heads: int,
                    head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                    scale: float) -> None:
    """Causal attention of each row's packed queries over that row's cached history.

    A query at position p sees keys at positions 0..p of its slot. out, q: [tokens, q_heads * head_dim] f32.
    Rows with one query (decode) are batched together; longer rows run one by one.
    """
    _paged_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows, tokens, q_heads,
                     kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale, 0)


def paged_window_attention(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                           positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                           geometry: np.ndarray, rows: int, tokens: int, q_heads: int, kv_heads: int,
                           head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                           scale: float, window: int) -> None:
    """paged_attention over a sliding window: a query at position p sees keys at positions
    max(0, p - window + 1)..p (window > 0; the history of a HISTORY_KIND_SLIDING_WINDOW region)."""
    _paged_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows, tokens, q_heads,
                     kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale, window)


def _paged_attention(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                     geometry: np.ndarray, rows: int, tokens: int, q_heads: int, kv_heads: int,
                     head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                     scale: float, window: int) -> None:
    starts = row_starts(geometry, rows, tokens)
    group = q_heads // kv_heads
    kv_width = kv_heads * head_dim
    page_elements = page_tokens * kv_width
    k_pages = _pages_view(k_cache, page_elements, page_stride)
    v_pages = _pages_view(v_cache, page_elements, page_stride)
    queries = _matrix(q, tokens, q_heads * head_dim)
    outputs = _matrix(out, tokens, q_heads * head_dim)
    lengths = starts[1:] - starts[:-1]
    single = np.nonzero(lengths == 1)[0]
    if single.size:
        first_tokens = starts[single]
        gathered = np.empty((single.size, q_heads * head_dim), dtype=np.float32)
        _single_token_rows(gathered, queries[first_tokens], positions[first_tokens].astype(np.int64),
                           row_slot[single].astype(np.int64), k_pages, v_pages, page_table, pages_per_row,
                           page_tokens, kv_heads, group, head_dim, scale, window)
        outputs[first_tokens] = gathered
    for r in np.nonzero(lengths > 1)[0]:
        first, end = int(starts[r]), int(starts[r + 1])
        count = end - first
        query_positions = positions[first:end].astype(np.int64)
        context = int(query_positions.max()) + 1
        page_count = -(-context // page_tokens)
        table = page_table[int(row_slot[r]) * pages_per_row:][:page_count]
        keys = k_pages[table].reshape(-1, kv_heads, head_dim)[:context].astype(np.float32, copy=False)
        values = v_pages[table].reshape(-1, kv_heads, head_dim)[:context].astype(np.float32, copy=False)
        # [kv_heads, group * count, head_dim]: the queries sharing one kv head, stacked
        grouped = queries[first:end].reshape(count, kv_heads, group, head_dim).transpose(1, 2, 0, 3)
        grouped = grouped.reshape(kv_heads, group * count, head_dim)
        scores = (grouped @ keys.transpose(1, 2, 0)) * np.float32(scale)   # [kv_heads, group*count, context]
        scores = scores.reshape(kv_heads, group, count, context)
        future = _hidden_keys(np.arange(context, dtype=np.int64), query_positions, window)  # [count, context]
        scores[:, :, future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        mixed = scores.reshape(kv_heads, group * count, context) @ values.transpose(1, 0, 2)
        mixed = mixed.reshape(kv_heads, group, count, head_dim).transpose(2, 0, 1, 3)
        outputs[first:end] = mixed.reshape(count, q_heads * head_dim)


def paged_attention_split(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                          positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                          geometry: np.ndarray, partials: np.ndarray, arrivals: np.ndarray, rows: int,
                          tokens: int, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
                          pages_per_row: int, page_stride: int, scale: float, splits: int) -> None:
    """Split-KV variant of paged_attention (same result). On a GPU each of `splits` programs per query
    block writes (acc, m, l) into `partials` [splits, tokens, q_heads, head_dim + 2] and the last to
    bump `arrivals` [tokens, kv_heads] (zero between steps) merges in split order. Here both
    scratch pointers stay untouched: the merge of exact partials is the unsplit softmax."""
    paged_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows, tokens,
                    q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale)
