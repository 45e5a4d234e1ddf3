"""Attention: fused norm + QKV projection + RoPE + paged cache write, and paged causal GQA.

Cache plane (one for keys, one for values; drawn in helios_backend/kernel_abi/attention.py):
    element (page p, token slot i, kv head h, dim d) = p * page_stride + (i * kv_heads + h) * head_dim + d
    page_table[slot * pages_per_row + j] holds positions [j * page_tokens, (j + 1) * page_tokens)
q / out: f32 [tokens, q_heads * head_dim]; query head h reads kv head h // (q_heads // kv_heads).
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import (accumulator_scale, gemv_span, gemv_tiles,
                                             inverse_rms, norm_scales, prefetch_l2,
                                             row_sum_squares, scaled_rows, tile_dot,
                                             wait_for_predecessors)

ROPE_ADJACENT_PAIRS = tl.constexpr(0)   # (2i, 2i + 1): llama.cpp / GGUF order
# any other value: ROPE_HALF_PAIRS (i, i + head_dim / 2): NeoX / Hugging Face order


@triton.jit
def qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, rope_table,
                   positions, page_table, row_slot, geometry,
                   tokens, dim, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                   page_stride, eps, rope_pairing,
                   BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                   GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr, GEMV_P: tl.constexpr,
                   GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr, PDL: tl.constexpr):
    """rms_norm -> [q | k | v] projection -> RoPE(q, k) -> q_out, k and v into their pages.

    Grid ((q_heads + 2 kv_heads) * cdiv(head_dim / 2, BLOCK_P), cdiv(tokens, BLOCK_M)).
    A program owns BLOCK_P rotation pairs of one head for BLOCK_M tokens: it multiplies the
    normed rows by the weight rows of the pairs' first and second dims (two [BLOCK_M, BLOCK_P]
    accumulators), so the rotation needs no data exchange. v heads use the same path unrotated.
    qkv_weight f16 [(q_heads + 2 kv_heads) * head_dim, dim]; rope_table f32 [pos, head_dim/2, 2].
    """
    _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_weight, rope_table,
                    positions, page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads,
                    head_dim, page_tokens, pages_per_row, page_stride, eps, rope_pairing, False,
                    qkv_weight, qkv_weight, False, BLOCK_M, BLOCK_P, BLOCK_K, GEMV_TOKENS, GEMV_K, GEMV_P, GEMV_STEPS,
                    GEMV_MAX_K, PDL)


@triton.jit
def qkv_bias_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                        rope_table, positions, page_table, row_slot, geometry,
                        tokens, dim, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                        page_stride, eps, rope_pairing,
                        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                        GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr, GEMV_P: tl.constexpr,
                        GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr, PDL: tl.constexpr):
    """qkv_rope_store with qkv_bias (f32 [(q_heads + 2 kv_heads) * head_dim]) added to the
    projection before the rotation, in f32 (key biases of Qwen2-family models reach |145|)."""
    _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias, rope_table,
                    positions, page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads,
                    head_dim, page_tokens, pages_per_row, page_stride, eps, rope_pairing, True,
                    qkv_weight, qkv_weight, False, BLOCK_M, BLOCK_P, BLOCK_K, GEMV_TOKENS, GEMV_K, GEMV_P, GEMV_STEPS,
                    GEMV_MAX_K, PDL)


@triton.jit
def qkv_norm_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, q_norm, k_norm,
                        rope_table, positions, page_table, row_slot, geometry,
                        tokens, dim, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                        page_stride, eps, rope_pairing,
                        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """qkv_rope_store with an RMSNorm of every q and k head (weights q_norm, k_norm f16
    [head_dim], the input norm's eps) between the projection and the rotation.

    The head's sum of squares needs all of its dims, so a program owns whole heads: BLOCK_P
    >= head_dim / 2 pairs (specs.py checks it), grid (q_heads + 2 kv_heads, cdiv(tokens,
    BLOCK_M)), and every shape takes the tensor-core tiles (the GEMV path's registers hold a
    few pairs, not a head)."""
    _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_weight, rope_table,
                    positions, page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads,
                    head_dim, page_tokens, pages_per_row, page_stride, eps, rope_pairing, False,
                    q_norm, k_norm, True, BLOCK_M, BLOCK_P, BLOCK_K, 0, 0, 0, 0, 0, PDL)


@triton.jit
def _qkv_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias, rope_table,
                    positions, page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads,
                    head_dim, page_tokens, pages_per_row, page_stride, eps, rope_pairing,
                    HAS_BIAS: tl.constexpr, q_norm, k_norm, HEAD_NORM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_K: tl.constexpr, GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr,
                    GEMV_P: tl.constexpr, GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr,
                    PDL: tl.constexpr):
    if HEAD_NORM:
        _qkv_rope_store_tiles(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                              rope_table, positions, page_table, row_slot, geometry, dim,
                              q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                              page_stride, eps, rope_pairing, HAS_BIAS, q_norm, k_norm, True,
                              BLOCK_M, BLOCK_P, BLOCK_K, PDL)
    elif (tokens <= 1) & (dim <= GEMV_MAX_K):     # batch-1 decode: a 1-row tile
        _qkv_rope_store_gemv(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                             rope_table, positions, page_table, row_slot, geometry, tokens, dim,
                             q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                             eps, rope_pairing, HAS_BIAS, 1, GEMV_K, GEMV_P, GEMV_STEPS,
                             GEMV_MAX_K > GEMV_K * GEMV_STEPS, PDL)
    elif (tokens <= GEMV_TOKENS) & (dim <= GEMV_K * GEMV_STEPS):
        _qkv_rope_store_gemv(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                             rope_table, positions, page_table, row_slot, geometry, tokens, dim,
                             q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                             eps, rope_pairing, HAS_BIAS, GEMV_TOKENS, GEMV_K, GEMV_P, GEMV_STEPS,
                             False, PDL)
    else:
        _qkv_rope_store_tiles(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                              rope_table, positions, page_table, row_slot, geometry, dim,
                              q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                              page_stride, eps, rope_pairing, HAS_BIAS, q_norm, k_norm, False,
                              BLOCK_M, BLOCK_P, BLOCK_K, PDL)


@triton.jit
def _rope_and_store(acc_first, acc_second, t, live, pair, pair_mask, first, second, head,
                    q_out, k_cache, v_cache, qkv_bias, rope_table, positions, page_table, row_slot,
                    geometry, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                    page_stride, eps, HAS_BIAS: tl.constexpr, q_norm, k_norm,
                    HEAD_NORM: tl.constexpr):
    """Add the bias (HAS_BIAS), norm q and k heads (HEAD_NORM: the program holds every pair of
    its head), rotate q and k pairs by their token's position, then write q rows or cache
    entries."""
    if HAS_BIAS:
        acc_first += tl.load(qkv_bias + head * head_dim + first, mask=pair_mask, other=0.0)[None, :]
        acc_second += tl.load(qkv_bias + head * head_dim + second, mask=pair_mask, other=0.0)[None, :]
    if HEAD_NORM:
        if head < q_heads + kv_heads:
            # pairs past the head are 0 (masked weights), so the row sums cover the head exactly
            rstd = inverse_rms(tl.sum(acc_first * acc_first + acc_second * acc_second, axis=1),
                               head_dim, eps)[:, None]
            gains = q_norm
            if head >= q_heads:
                gains = k_norm
            acc_first = acc_first * rstd * tl.load(gains + first, mask=pair_mask,
                                                   other=0.0).to(tl.float32)[None, :]
            acc_second = acc_second * rstd * tl.load(gains + second, mask=pair_mask,
                                                     other=0.0).to(tl.float32)[None, :]
    half = head_dim // 2
    pos = tl.load(positions + t, mask=live, other=0)
    mask = live[:, None] & pair_mask[None, :]
    if head < q_heads + kv_heads:
        cs = rope_table + (pos[:, None] * half + pair[None, :]) * 2
        cos = tl.load(cs, mask=mask, other=1.0)
        sin = tl.load(cs + 1, mask=mask, other=0.0)
        out_first = acc_first * cos - acc_second * sin
        out_second = acc_first * sin + acc_second * cos
    else:
        out_first = acc_first
        out_second = acc_second
    if head < q_heads:
        q_row = q_out + t[:, None] * (q_heads * head_dim) + head * head_dim
        tl.store(q_row + first[None, :], out_first, mask=mask)
        tl.store(q_row + second[None, :], out_second, mask=mask)
    else:
        kv_head = head - q_heads
        plane = k_cache
        if kv_head >= kv_heads:
            kv_head -= kv_heads
            plane = v_cache
        row = tl.load(geometry + 1 + t, mask=live, other=0)
        slot = tl.load(row_slot + row, mask=live, other=0)
        page = tl.load(page_table + slot * pages_per_row + pos // page_tokens, mask=live, other=0)
        base = (page.to(tl.int64) * page_stride
                + ((pos % page_tokens) * kv_heads + kv_head) * head_dim)
        tl.store(plane + base[:, None] + first[None, :], out_first.to(tl.float16), mask=mask)
        tl.store(plane + base[:, None] + second[None, :], out_second.to(tl.float16), mask=mask)


@triton.jit
def rope_store(q_out, k_cache, v_cache, projected, rope_table, positions, page_table, row_slot, geometry,
               tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride, rope_pairing,
               BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """The product path's second half of qkv_rope_store: RoPE on q and k of the f32 projection
    projected [tokens, (q_heads + 2 kv_heads) * head_dim] (linear.product_f32.v1), q rows and
    cache entries written as there. Grid ((q_heads + 2 kv_heads) * cdiv(head_dim / 2, BLOCK_P),
    cdiv(tokens, BLOCK_M)): a program rotates BLOCK_P pairs of one head for BLOCK_M tokens."""
    _rope_store_projection(q_out, k_cache, v_cache, projected, projected, rope_table, positions, page_table,
                           row_slot, geometry, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                           page_stride, rope_pairing, False, BLOCK_M, BLOCK_P, PDL)


@triton.jit
def bias_rope_store(q_out, k_cache, v_cache, projected, qkv_bias, rope_table, positions, page_table, row_slot,
                    geometry, tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                    rope_pairing, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """rope_store with the f32 q/k/v bias added to the projection first."""
    _rope_store_projection(q_out, k_cache, v_cache, projected, qkv_bias, rope_table, positions, page_table,
                           row_slot, geometry, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                           page_stride, rope_pairing, True, BLOCK_M, BLOCK_P, PDL)


@triton.jit
def _rope_store_projection(q_out, k_cache, v_cache, projected, qkv_bias, rope_table, positions, page_table,
                           row_slot, geometry, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                           page_stride, rope_pairing, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(1) * BLOCK_M < n:
        head, pair, pair_mask, first, second = _rotation_pairs(head_dim, rope_pairing, BLOCK_P)
        t = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = t < n
        mask = live[:, None] & pair_mask[None, :]
        source = projected + t[:, None].to(tl.int64) * ((q_heads + 2 * kv_heads) * head_dim) + head * head_dim
        acc_first = tl.load(source + first[None, :], mask=mask, other=0.0)
        acc_second = tl.load(source + second[None, :], mask=mask, other=0.0)
        _rope_and_store(acc_first, acc_second, t, live, pair, pair_mask, first, second, head, q_out, k_cache,
                        v_cache, qkv_bias, rope_table, positions, page_table, row_slot, geometry, q_heads,
                        kv_heads, head_dim, page_tokens, pages_per_row, page_stride, 0.0, HAS_BIAS,
                        projected, projected, False)


@triton.jit
def _rotation_pairs(head_dim, rope_pairing, BLOCK_P: tl.constexpr):
    """(head, pair indices, pair mask, first dims, second dims) of program_id(0)'s BLOCK_P
    rotation pairs: program p takes pairs [(p % chunks) * BLOCK_P, ...) of head p // chunks."""
    half = head_dim // 2
    chunks = tl.cdiv(half, BLOCK_P)
    head = tl.program_id(0) // chunks
    pair = (tl.program_id(0) % chunks) * BLOCK_P + tl.arange(0, BLOCK_P)
    if rope_pairing == ROPE_ADJACENT_PAIRS:
        first = 2 * pair
        second = 2 * pair + 1
    else:
        first = pair
        second = pair + half
    return head, pair, pair < half, first, second


@triton.jit
def _qkv_rope_store_gemv(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                         rope_table, positions, page_table, row_slot, geometry, tokens, dim,
                         q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride, eps,
                         rope_pairing, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, GEMV_K: tl.constexpr,
                         GEMV_P: tl.constexpr, GEMV_STEPS: tl.constexpr, SPANS: tl.constexpr,
                         PDL: tl.constexpr):
    """Decode shape: grid (heads * cdiv(head_dim / 2, GEMV_P), 1, 1); GEMV_P pairs of one head
    for every token of the capacity (only live ones are stored)."""
    head, pair, pair_mask, first, second = _rotation_pairs(head_dim, rope_pairing, GEMV_P)
    first_w = gemv_tiles(qkv_weight, head * head_dim + first, pair_mask, dim, 0, dim, GEMV_P,
                         GEMV_K, GEMV_STEPS)
    second_w = gemv_tiles(qkv_weight, head * head_dim + second, pair_mask, dim, 0, dim, GEMV_P,
                          GEMV_K, GEMV_STEPS)
    same = tl.zeros((GEMV_P,), dtype=tl.int32)
    norms = gemv_tiles(norm_weight, same, same == 0, 0, 0, dim, GEMV_P, GEMV_K, GEMV_STEPS)
    wait_for_predecessors(PDL)
    t = tl.arange(0, ROWS)
    computed = t < tokens
    acc_first, acc_second = gemv_span(first_w, second_w, norms, qkv_weight, head * head_dim + first,
                                      head * head_dim + second, pair_mask, norm_weight, hidden, t,
                                      computed, dim, True, True, ROWS, GEMV_P, GEMV_K, GEMV_STEPS,
                                      SPANS)
    rstd = inverse_rms(row_sum_squares(hidden, t, computed, dim, ROWS, GEMV_K), dim, eps)[:, None]
    live = t < tl.load(geometry)
    _rope_and_store(acc_first * rstd, acc_second * rstd, t, live, pair, pair_mask, first,
                    second, head, q_out, k_cache, v_cache, qkv_bias, rope_table, positions,
                    page_table, row_slot, geometry, q_heads, kv_heads, head_dim, page_tokens,
                    pages_per_row, page_stride, eps, HAS_BIAS, qkv_weight, qkv_weight, False)


@triton.jit
def _qkv_rope_store_tiles(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, qkv_bias,
                          rope_table, positions, page_table, row_slot, geometry, dim, q_heads,
                          kv_heads, head_dim, page_tokens, pages_per_row, page_stride, eps,
                          rope_pairing, HAS_BIAS: tl.constexpr, q_norm, k_norm,
                          HEAD_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # the head's weight rows into L2 before waiting: once per head (first pair chunk,
        # first token tile)
        chunks_per_head = tl.cdiv(head_dim // 2, BLOCK_P)
        if (tl.program_id(1) == 0) & (tl.program_id(0) % chunks_per_head == 0):
            prefetch_l2(qkv_weight + (tl.program_id(0) // chunks_per_head) * head_dim * dim,
                        head_dim * dim * 2, 256)
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(1) * BLOCK_M < n:
        head, pair, pair_mask, first, second = _rotation_pairs(head_dim, rope_pairing, BLOCK_P)
        t = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = t < n
        pre = norm_scales(hidden, t, live, dim, eps, BLOCK_M, BLOCK_K)[:, None]
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        # two K-interleaved accumulator pairs: four independent MMA chains (decode latency)
        first_even = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        first_odd = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        second_even = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        second_odd = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        first_rows = (head * head_dim + first)[None, :] * dim
        second_rows = (head * head_dim + second)[None, :] * dim
        for k0 in range(0, dim, 2 * BLOCK_K):
            # RMSNorm's 1/rms is a per-row scalar: multiply x * g now, scale rows at the end
            a0, sq0 = scaled_rows(hidden, norm_weight, t, live, k0, dim, BLOCK_K)
            a1, sq1 = scaled_rows(hidden, norm_weight, t, live, k0 + BLOCK_K, dim, BLOCK_K)
            a0 = a0 * pre
            a1 = a1 * pre
            sum_sq += sq0 + sq1
            k = k0 + tl.arange(0, BLOCK_K)
            mask0 = pair_mask[None, :] & (k < dim)[:, None]
            mask1 = pair_mask[None, :] & (k + BLOCK_K < dim)[:, None]
            first_even = tile_dot(a0, tl.load(qkv_weight + first_rows + k[:, None], mask=mask0,
                                              other=0.0), first_even)
            first_odd = tile_dot(a1, tl.load(qkv_weight + first_rows + (k + BLOCK_K)[:, None],
                                             mask=mask1, other=0.0), first_odd)
            second_even = tile_dot(a0, tl.load(qkv_weight + second_rows + k[:, None], mask=mask0,
                                               other=0.0), second_even)
            second_odd = tile_dot(a1, tl.load(qkv_weight + second_rows + (k + BLOCK_K)[:, None],
                                              mask=mask1, other=0.0), second_odd)
        acc_first = first_even + first_odd
        acc_second = second_even + second_odd
        scale = accumulator_scale(pre, sum_sq[:, None], dim, eps)
        acc_first = acc_first * scale
        acc_second = acc_second * scale
        _rope_and_store(acc_first, acc_second, t, live, pair, pair_mask, first, second, head,
                        q_out, k_cache, v_cache, qkv_bias, rope_table, positions, page_table,
                        row_slot, geometry, q_heads, kv_heads, head_dim, page_tokens,
                        pages_per_row, page_stride, eps, HAS_BIAS, q_norm, k_norm, HEAD_NORM)


@triton.jit
def _query_block(geometry, rows, tokens, group, BLOCK_M: tl.constexpr, MAX_ROWS: tl.constexpr,
                 REVERSED: tl.constexpr = False):
    """_row_block over the narrowest row vector that holds `rows`: a decode step of a few rows
    scans 16 geometry entries instead of MAX_ROWS (one load round and a short prefix sum)."""
    if rows <= 16:
        return _row_block(geometry, rows, tokens, group, BLOCK_M, 16, REVERSED)
    else:
        return _row_block(geometry, rows, tokens, group, BLOCK_M, MAX_ROWS, REVERSED)


@triton.jit
def _row_block(geometry, rows, tokens, group, BLOCK_M: tl.constexpr, MAX_ROWS: tl.constexpr,
               REVERSED: tl.constexpr):
    """(row, first token, row end) of program_id(0)'s query block; row == rows if none.

    Rows are cut into blocks of BLOCK_M // group consecutive queries; program p takes the
    p-th block in row order (prefix sum of the rows' block counts, rows <= MAX_ROWS), or
    (REVERSED) the p-th from the grid's end."""
    per_block = BLOCK_M // group
    r = tl.arange(0, MAX_ROWS)
    r_mask = r < rows
    starts = tl.load(geometry + 1 + tokens + r, mask=r_mask, other=0)
    ends = tl.load(geometry + 2 + tokens + r, mask=r_mask, other=0)
    blocks = (ends - starts + per_block - 1) // per_block
    block_ends = tl.cumsum(blocks, axis=0)
    pid = tl.program_id(0)
    if REVERSED:
        pid = tl.num_programs(0) - 1 - pid
    row = tl.sum((tl.where(r_mask, block_ends, 0x7FFFFFFF) <= pid).to(tl.int32), axis=0)
    this = r == row
    end = tl.sum(tl.where(this, ends, 0), axis=0)
    first = (tl.sum(tl.where(this, starts, 0), axis=0)
             + (pid - tl.sum(tl.where(this, block_ends - blocks, 0), axis=0)) * per_block)
    return row, first, end


@triton.jit
def _attend(q_tile, q_pos, table, k_cache, v_cache, kv_head, kv_heads, head_dim, page_tokens,
            page_stride, scale, key_begin, key_end, window, WINDOWED: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online-softmax partial (acc [BLOCK_M, BLOCK_D], max m, sum l) of the BLOCK_M query rows
    over keys [key_begin, key_end) of one kv head; m = -1e30, l = 0 for an empty range.
    A query at position p sees keys at positions <= p, and (WINDOWED) > p - window."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k0 in range(key_begin, key_end, BLOCK_N):
        k_pos = k0 + tl.arange(0, BLOCK_N)
        k_valid = k_pos < key_end
        page = tl.load(table + k_pos // page_tokens, mask=k_valid, other=0)
        base = (page.to(tl.int64) * page_stride
                + ((k_pos % page_tokens) * kv_heads + kv_head) * head_dim)
        kv_mask = k_valid[:, None] & d_mask[None, :]
        keys = tl.load(k_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        values = tl.load(v_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tile_dot(q_tile, tl.trans(keys), tl.zeros((BLOCK_M, BLOCK_N), tl.float32)) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if WINDOWED:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, scores, values, False)
    return acc, m_i, l_i


@triton.jit
def _softmax_step(acc, m_i, l_i, scores, values, LOG2: tl.constexpr):
    """One key block of the online softmax: rescale (acc, l) to the new row maxima, add the
    block's p @ values. LOG2: scores are in log2 units (exp2), else natural (exp)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    if LOG2:
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tile_dot(p, values, acc * alpha[:, None])      # p in [0, 1]: f16-safe
    return acc, m_new, l_i


@triton.jit
def _query_rows(positions, first, end, kv_head, group, q_heads, head_dim, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Query rows of one block: row i = (token first + i // group, head kv_head*group + i % group).
    Returns (positions (-1 for padding rows), element mask, q/out offsets, valid rows): step
    state only, no data of the previous node."""
    m_idx = tl.arange(0, BLOCK_M)
    tok = first + m_idx // group
    valid = (m_idx < (BLOCK_M // group) * group) & (tok < end)
    head = kv_head * group + m_idx % group
    d = tl.arange(0, BLOCK_D)
    offsets = tok[:, None] * (q_heads * head_dim) + head[:, None] * head_dim + d[None, :]
    mask = valid[:, None] & (d < head_dim)[None, :]
    q_pos = tl.load(positions + tok, mask=valid, other=-1)
    return q_pos, mask, offsets, valid


@triton.jit
def _load_queries(q, positions, first, end, kv_head, group, q_heads, head_dim,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """_query_rows and the block's f32 q tile: (q tile, positions, element mask, q/out offsets,
    valid rows)."""
    q_pos, mask, offsets, valid = _query_rows(positions, first, end, kv_head, group, q_heads,
                                              head_dim, BLOCK_M, BLOCK_D)
    return tl.load(q + offsets, mask=mask, other=0.0), q_pos, mask, offsets, valid


@triton.jit
def paged_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                    rows, tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                    page_stride, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    WIDE_N: tl.constexpr, WIDE_D: tl.constexpr, MAX_ROWS: tl.constexpr,
                    LARGE_TOKENS: tl.constexpr, LARGE_M: tl.constexpr, LARGE_N: tl.constexpr,
                    LARGE_D: tl.constexpr, LARGE_FLASH: tl.constexpr, PAGE_TOKENS: tl.constexpr,
                    PDL: tl.constexpr):
    """Causal GQA of each row's packed queries over its paged history (flash-style, online softmax).

    Grid (cdiv(tokens, BLOCK_M // group) + rows, kv_heads), group = q_heads // kv_heads.
    A program takes up to BLOCK_M // group consecutive queries of one row and the `group`
    query heads sharing one kv head: BLOCK_M query rows (token-major, head-minor) against one
    stream of keys, so decode (1 query) and prefill chunks use the same kernel. The grid
    bound covers the worst split of tokens among rows (each row may leave one partial
    block); surplus programs exit at once. Keys/values are gathered per key through the
    page table, so any page_tokens works. Heads wider than BLOCK_D take the [WIDE_N keys,
    WIDE_D dims] instantiation of the same code, compiled only when WIDE_D > BLOCK_D (the
    library widens the tiles for cores that launch such heads: specs.Widening).
    From LARGE_TOKENS tokens (prefill chunks, wide MIXED steps) a block holds LARGE_M query
    rows against [LARGE_N keys, BLOCK_D or LARGE_D dims] tiles: each key and value tile then
    serves LARGE_M // group queries instead of BLOCK_M // group (a 4,096-token prefill of a
    group-4 layer read its keys 1,024 times a head; now 256), heads to LARGE_D dims.
    LARGE_FLASH (a tile-table choice, specs.ATTENTION_TILES) makes those large blocks take
    _flash_program instead: the same query blocks and grid, the key loop in two phases.
    """
    wait_for_predecessors(PDL)
    if (tokens >= LARGE_TOKENS) & (head_dim <= BLOCK_D):
        _large_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, LARGE_M, LARGE_N, BLOCK_D, MAX_ROWS, LARGE_FLASH,
                       PAGE_TOKENS)
    elif (tokens >= LARGE_TOKENS) & (head_dim <= LARGE_D):
        _large_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, LARGE_M, LARGE_N, LARGE_D, MAX_ROWS, LARGE_FLASH,
                       PAGE_TOKENS)
    elif (WIDE_D > BLOCK_D) and (head_dim > BLOCK_D):
        _paged_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, 0, False, BLOCK_M, WIDE_N, WIDE_D, MAX_ROWS)
    else:
        _paged_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, 0, False, BLOCK_M, BLOCK_N, BLOCK_D, MAX_ROWS)


@triton.jit
def _large_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                   tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                   scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   MAX_ROWS: tl.constexpr, FLASH: tl.constexpr, PAGE_TOKENS: tl.constexpr):
    """One large query block of paged_attention: _flash_program (FLASH), else the smaller
    blocks' key loop (_paged_program)."""
    if FLASH:
        _flash_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, BLOCK_M, BLOCK_N, BLOCK_D, MAX_ROWS, PAGE_TOKENS)
    else:
        _paged_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, 0, False, BLOCK_M, BLOCK_N, BLOCK_D, MAX_ROWS)


LOG2E = tl.constexpr(1.4426950408889634)     # exp(x) = exp2(x * LOG2E)


@triton.jit
def _flash_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                   tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                   scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   MAX_ROWS: tl.constexpr, PAGE_TOKENS: tl.constexpr):
    """One large query block the FlashAttention-2 way (paged_attention, LARGE_FLASH).

    The block's BLOCK_M query rows are _paged_program's (tokens x the GQA group, padding rows
    past a row's end or past group * (BLOCK_M // group)); what differs is the key loop:
      * q is scaled once by scale * log2(e), so the softmax runs in exp2 with no per-score
        multiply;
      * keys below the block's lowest query position are visible to every query: whole
        BLOCK_N blocks of them run without any mask (no compare, no select, no bounds), and
        only the blocks from there to the highest query position (the diagonal) are masked;
        the loop stops at the highest query's position as before;
      * key/value rows are addressed a page at a time (_key_offsets) where the launch's
        page_tokens is the PAGE_TOKENS the tiles were compiled for;
      * blocks run in reverse order, heaviest first (causal blocks' work grows with position).
    """
    group = q_heads // kv_heads
    # the blocks in reverse: a row's last blocks (the most keys) start first and the light
    # ones fill the tail of the last wave; the grid's surplus programs (x from the end) exit
    row, first, end = _query_block(geometry, rows, tokens, group, BLOCK_M, MAX_ROWS, True)
    if row < rows:
        kv_head = tl.program_id(1)
        q_tile, q_pos, mask, offsets, valid = _load_queries(q, positions, first, end, kv_head,
                                                            group, q_heads, head_dim, BLOCK_M,
                                                            BLOCK_D)
        q_tile = q_tile * (scale * LOG2E)
        table = page_table + tl.load(row_slot + row) * pages_per_row
        key_end = tl.max(q_pos, axis=0) + 1
        lowest = tl.min(tl.where(valid, q_pos, 0x7FFFFFFF), axis=0)
        unmasked_end = tl.minimum((lowest + 1) // BLOCK_N * BLOCK_N, key_end)
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        acc, m_i, l_i = _flash_keys(acc, m_i, l_i, q_tile, q_pos, table, k_cache, v_cache,
                                    kv_head, kv_heads, head_dim, page_tokens, page_stride, 0,
                                    unmasked_end, False, BLOCK_M, BLOCK_N, BLOCK_D,
                                    PAGE_TOKENS)
        acc, m_i, l_i = _flash_keys(acc, m_i, l_i, q_tile, q_pos, table, k_cache, v_cache,
                                    kv_head, kv_heads, head_dim, page_tokens, page_stride,
                                    unmasked_end, key_end, True, BLOCK_M, BLOCK_N,
                                    BLOCK_D, PAGE_TOKENS)
        tl.store(out + offsets, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=mask)


@triton.jit
def _flash_keys(acc, m_i, l_i, q_tile, q_pos, table, k_cache, v_cache, kv_head, kv_heads,
                head_dim, page_tokens, page_stride, key_begin, key_end, MASKED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                PAGE_TOKENS: tl.constexpr):
    """_attend's online softmax over keys [key_begin, key_end) (key_begin a multiple of
    BLOCK_N) for q pre-scaled into log2 units; MASKED: the causal compare and the key bound,
    else every key of the range is visible to every query row."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    for k0 in range(key_begin, key_end, BLOCK_N):
        k_pos = k0 + tl.arange(0, BLOCK_N)
        base = _key_offsets(table, k0, key_end, kv_head, kv_heads, head_dim, page_tokens,
                            page_stride, BLOCK_N, PAGE_TOKENS)
        if MASKED:
            kv_mask = (k_pos < key_end)[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]       # the dims only (broadcast over the keys)
        keys = tl.load(k_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        values = tl.load(v_cache + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tile_dot(q_tile, tl.trans(keys), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < key_end)[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, scores, values, True)
    return acc, m_i, l_i


@triton.jit
def _key_offsets(table, k0, key_end, kv_head, kv_heads, head_dim, page_tokens, page_stride,
                 BLOCK_N: tl.constexpr, PAGE_TOKENS: tl.constexpr):
    """Element offsets of keys k0 .. k0 + BLOCK_N - 1 of kv head kv_head in a cache plane.

    Where the launch's page_tokens is PAGE_TOKENS (compiled in, a power of two dividing
    BLOCK_N; k0 a multiple of BLOCK_N), the tile is BLOCK_N / PAGE_TOKENS whole pages: one
    page-table word a page, broadcast over its tokens, and the in-page slot a constant mask.
    Otherwise each key looks its page up (any page_tokens). Pages past key_end read entry 0
    (their keys are masked)."""
    tl.static_assert(BLOCK_N % PAGE_TOKENS == 0)
    if page_tokens == PAGE_TOKENS:
        index = k0 // PAGE_TOKENS + tl.arange(0, BLOCK_N // PAGE_TOKENS)
        pages = tl.load(table + index, mask=index * PAGE_TOKENS < key_end, other=0)
        page = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // PAGE_TOKENS, PAGE_TOKENS)),
                          (BLOCK_N,))
        slot = tl.arange(0, BLOCK_N) % PAGE_TOKENS
    else:
        page, slot = _key_pages(table, k0, key_end, page_tokens, BLOCK_N)
    return page.to(tl.int64) * page_stride + (slot * kv_heads + kv_head) * head_dim


@triton.jit
def _key_pages(table, k0, key_end, page_tokens, BLOCK_N: tl.constexpr):
    """(page, slot in the page) of keys k0 .. k0 + BLOCK_N - 1, one table lookup a key."""
    k_pos = k0 + tl.arange(0, BLOCK_N)
    page = tl.load(table + k_pos // page_tokens, mask=k_pos < key_end, other=0)
    return page, k_pos % page_tokens


@triton.jit
def paged_window_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                           rows, tokens, q_heads, kv_heads, head_dim, page_tokens,
                           pages_per_row, page_stride, scale, window,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           WIDE_N: tl.constexpr, WIDE_D: tl.constexpr, MAX_ROWS: tl.constexpr,
                           PDL: tl.constexpr):
    """paged_attention over a sliding window: a query at position p sees keys at positions
    max(0, p - window + 1) .. p. A query block walks keys from its lowest query's window start
    only, so a window costs `window` keys per block whatever the context (the cache region
    of a sliding-window layer holds no older keys anyway)."""
    wait_for_predecessors(PDL)
    if (WIDE_D > BLOCK_D) and (head_dim > BLOCK_D):
        _paged_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, window, True, BLOCK_M, WIDE_N, WIDE_D, MAX_ROWS)
    else:
        _paged_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                       tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                       page_stride, scale, window, True, BLOCK_M, BLOCK_N, BLOCK_D, MAX_ROWS)


@triton.jit
def _first_key(q_pos, valid, window, WINDOWED: tl.constexpr):
    """The first key any query of the block sees: 0, or (WINDOWED) the lowest query's window start."""
    if WINDOWED:
        lowest = tl.min(tl.where(valid, q_pos, 0x7FFFFFFF), axis=0)
        begin = tl.maximum(lowest - window + 1, 0)
    else:
        begin = 0
    return begin


@triton.jit
def _paged_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows,
                   tokens, q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride,
                   scale, window, WINDOWED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MAX_ROWS: tl.constexpr):
    """One query block of paged_attention / paged_window_attention (after the PDL wait)."""
    group = q_heads // kv_heads
    row, first, end = _query_block(geometry, rows, tokens, group, BLOCK_M, MAX_ROWS)
    if row < rows:
        kv_head = tl.program_id(1)
        q_tile, q_pos, mask, offsets, valid = _load_queries(q, positions, first, end, kv_head,
                                                            group, q_heads, head_dim, BLOCK_M,
                                                            BLOCK_D)
        table = page_table + tl.load(row_slot + row) * pages_per_row
        acc, _, l_i = _attend(q_tile, q_pos, table, k_cache, v_cache, kv_head, kv_heads,
                              head_dim, page_tokens, page_stride, scale,
                              _first_key(q_pos, valid, window, WINDOWED),
                              tl.max(q_pos, axis=0) + 1, window, WINDOWED, BLOCK_M, BLOCK_N,
                              BLOCK_D)
        tl.store(out + offsets, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=mask)


@triton.jit
def paged_attention_split(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                          partials, arrivals, rows, tokens, q_heads, kv_heads, head_dim,
                          page_tokens, pages_per_row, page_stride, scale, splits,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          WIDE_N: tl.constexpr, WIDE_D: tl.constexpr, MAX_ROWS: tl.constexpr,
                          MERGE_SPLITS: tl.constexpr, MERGE_GROUP: tl.constexpr, PDL: tl.constexpr):
    """paged_attention with the keys split over grid z (flash-decoding), merged in one node.

    Grid (cdiv(tokens, BLOCK_M // group) + rows, kv_heads, splits). Split z of a query block
    takes keys [z * chunk, (z + 1) * chunk) of its live context, chunk = cdiv(context, splits)
    rounded up to BLOCK_N, so the split length follows the live context. Each split writes
    its (acc, m, l) per query row to
        partials f32 [splits, tokens, q_heads, head_dim + 2]   (acc | m | l)
    then increments arrivals i32 [tokens, kv_heads] at (first token of the block, kv head);
    the last split to arrive merges the partials (deterministic: a fixed reduction order),
    writes out and resets the counter to 0 for the next launch. arrivals must be zero at
    allocation. The merge reads every split's (m, l) in one [MERGE_SPLITS, BLOCK_M] load
    (splits <= MERGE_SPLITS) and the accumulators MERGE_GROUP splits a load, so it costs
    1 + splits / MERGE_GROUP dependent round trips, not three a split.
    When one key block (chunk >= context) holds the whole context, split 0 writes the output
    directly and no split touches partials or arrivals: a short decode context costs no
    merge round trips. Heads wider than BLOCK_D take the [WIDE_N, WIDE_D] instantiation.

    Before the PDL wait a program reads only step state (geometry, positions, row_slot: its
    query block, positions and slot), which no node writes between the step's start and the
    attention: the chain of dependent loads that finds the block overlaps the previous node
    (specs.KernelBuild.early_reads; preparation checks that the preceding node writes none).
    """
    if (WIDE_D > BLOCK_D) and (head_dim > BLOCK_D):
        _split_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                       partials, arrivals, rows, tokens, q_heads, kv_heads, head_dim,
                       page_tokens, pages_per_row, page_stride, scale, splits, BLOCK_M, WIDE_N,
                       WIDE_D, MAX_ROWS, MERGE_SPLITS, MERGE_GROUP, PDL)
    else:
        _split_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                       partials, arrivals, rows, tokens, q_heads, kv_heads, head_dim,
                       page_tokens, pages_per_row, page_stride, scale, splits, BLOCK_M, BLOCK_N,
                       BLOCK_D, MAX_ROWS, MERGE_SPLITS, MERGE_GROUP, PDL)


@triton.jit
def _split_program(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry,
                   partials, arrivals, rows, tokens, q_heads, kv_heads, head_dim, page_tokens,
                   pages_per_row, page_stride, scale, splits, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MAX_ROWS: tl.constexpr,
                   MERGE_SPLITS: tl.constexpr, MERGE_GROUP: tl.constexpr, PDL: tl.constexpr):
    """One (query block, split) of paged_attention_split: its step state, the PDL wait, the rest."""
    group = q_heads // kv_heads
    row, first, end = _query_block(geometry, rows, tokens, group, BLOCK_M, MAX_ROWS)
    if row < rows:
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_pos, mask, offsets, valid = _query_rows(positions, first, end, kv_head, group, q_heads,
                                                  head_dim, BLOCK_M, BLOCK_D)
        table = page_table + tl.load(row_slot + row) * pages_per_row
        wait_for_predecessors(PDL)
        q_tile = tl.load(q + offsets, mask=mask, other=0.0)
        context = tl.max(q_pos, axis=0) + 1
        chunk = tl.cdiv(tl.cdiv(context, splits), BLOCK_N) * BLOCK_N
        if chunk >= context:
            # one key block holds the whole context: split 0 attends and writes the output,
            # the other splits leave at once (no partials, no arrival, no merge round trips)
            if split == 0:
                acc, _, l_i = _attend(q_tile, q_pos, table, k_cache, v_cache, kv_head, kv_heads,
                                      head_dim, page_tokens, page_stride, scale, 0, context, 0,
                                      False, BLOCK_M, BLOCK_N, BLOCK_D)
                tl.store(out + offsets, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=mask)
        else:
            _attend_split(out, q_tile, q_pos, mask, offsets, valid, table, k_cache, v_cache,
                          partials, arrivals, first, kv_head, split, splits, context, chunk,
                          group, tokens, q_heads, kv_heads, head_dim, page_tokens, page_stride,
                          scale, BLOCK_M, BLOCK_N, BLOCK_D, MERGE_SPLITS, MERGE_GROUP)


@triton.jit
def _attend_split(out, q_tile, q_pos, mask, offsets, valid, table, k_cache, v_cache, partials,
                  arrivals, first, kv_head, split, splits, context, chunk, group, tokens,
                  q_heads, kv_heads, head_dim, page_tokens, page_stride, scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  MERGE_SPLITS: tl.constexpr, MERGE_GROUP: tl.constexpr):
    """One split's partial, and the merge by the split that arrives last (see
    paged_attention_split)."""
    key_begin = tl.minimum(split * chunk, context)
    key_end = tl.minimum(key_begin + chunk, context)
    acc, m_i, l_i = _attend(q_tile, q_pos, table, k_cache, v_cache, kv_head, kv_heads,
                            head_dim, page_tokens, page_stride, scale, key_begin, key_end, 0,
                            False, BLOCK_M, BLOCK_N, BLOCK_D)
    # partial rows: [split][token][q head][head_dim + 2]
    width = head_dim + 2
    m_idx = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    unit = ((first + m_idx // group) * q_heads + kv_head * group + m_idx % group) * width
    span = tokens * q_heads * width
    mine = partials + split.to(tl.int64) * span
    tl.store(mine + unit[:, None] + d[None, :], acc, mask=mask)
    tl.store(mine + unit + head_dim, m_i, mask=valid)
    tl.store(mine + unit + head_dim + 1, l_i, mask=valid)
    tl.debug_barrier()          # every thread's partial stores precede the release below
    counter = arrivals + first * kv_heads + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1:
        tl.debug_barrier()
        held = tl.cdiv(context, chunk)                   # splits that held keys
        # every split's (m, l) at once, then its weight exp(m_s - m_all): no rescaling chain
        s_all = tl.arange(0, MERGE_SPLITS)
        stats = partials + s_all[:, None].to(tl.int64) * span + unit[None, :] + head_dim
        live = (s_all < held)[:, None] & valid[None, :]
        m_s = tl.load(stats, mask=live, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(stats + 1, mask=live, other=0.0, cache_modifier=".cg")
        m_all = tl.max(m_s, axis=0)
        l_all = tl.sum(l_s * tl.exp(m_s - m_all[None, :]), axis=0)
        merged = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        group_ids = tl.arange(0, MERGE_GROUP)
        for s0 in range(0, held, MERGE_GROUP):
            s_g = s0 + group_ids
            live_g = (s_g < held)[:, None] & valid[None, :]
            theirs = partials + s_g[:, None].to(tl.int64) * span + unit[None, :]
            m_g = tl.load(theirs + head_dim, mask=live_g, other=-1.0e30, cache_modifier=".cg")
            acc_g = tl.load(theirs[:, :, None] + d[None, None, :],
                            mask=live_g[:, :, None] & mask[None, :, :], other=0.0,
                            cache_modifier=".cg")
            merged += tl.sum(acc_g * tl.exp(m_g - m_all[None, :])[:, :, None], axis=0)
        tl.store(out + offsets, merged / tl.where(l_all > 0, l_all, 1.0)[:, None], mask=mask)
        tl.store(counter, 0)
