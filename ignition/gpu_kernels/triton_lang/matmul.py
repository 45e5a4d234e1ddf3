"""GEMMs of the layer stack with their fused prologues and epilogues.

Layouts (row-major, contiguous, element strides = the row width):
  hidden      f32 [tokens, dim]    the residual stream
  x / out     f32 [tokens, width]  activations between nodes
  weight      f16 [out, in]        as stored in the core
  norm weight f16 [dim]
  geometry    i32 step geometry; geometry[0] = live tokens n (see helios_backend/kernel_abi/state.py)
Two implementations per kernel, chosen by the same immediate the grid function reads
(specs._gemv_or_tiles): up to GEMV_TOKENS rows a tensor-core-free product (common.gemv_tiles /
gemv_rows: a few output columns per program, weight tiles loaded before the PDL wait), above
it tensor-core tiles (common.tile_dot: f16 x f16 with f32 accumulation, activations scaled
by RMSNorm's 1/rms before they are rounded). Tile grids are (cdiv(N, BLOCK_N),
cdiv(M, BLOCK_M), K slices); M is the variant's token capacity; tiles past the live count n
return before touching a weight. The residual GEMMs split K over grid z and add their
partial sums with f32 atomics (last-bit summation order may vary run to run).

PDL: a kernel first prefetches its weight slice into L2 (weights are never written by a
node), then waits (griddepcontrol.wait) before its first read of data written by an earlier
node, and releases its dependents right after; so the next node launches early and its
weight stream overlaps the current node.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import (accumulator_scale, gemv_rows, gemv_span, gemv_tiles, inverse_rms,
                                             norm_scales, prefetch_l2, row_sum_squares,
                                             scaled_rows, tile_dot, wait_for_predecessors)


@triton.jit
def _weight_tile(w_ptr, out_rows, out_mask, k0, k_end, row_stride, BLOCK_K: tl.constexpr):
    """Transposed f16 tile [BLOCK_K, len(out_rows)] of an f16 [N, row_stride] weight (columns
    k0 .. min(k0 + BLOCK_K, k_end)), for tile_dot."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + out_rows[None, :].to(tl.int64) * row_stride + k[:, None],
                   mask=out_mask[None, :] & (k[:, None] < k_end), other=0.0)


@triton.jit
def _tile_index(n, out_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, cols, row mask, column mask) of this program's [BLOCK_M, BLOCK_N] output tile:
    grid x the column blocks, grid y the row blocks; rows past the live count n masked."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < n, cols < out_dim


@triton.jit
def linear_residual(hidden, x, weight, geometry, tokens, in_dim, out_dim,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    K_SPLIT: tl.constexpr, GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr,
                    GEMV_N: tl.constexpr, GEMV_SPLIT: tl.constexpr, LARGE_TOKENS: tl.constexpr,
                    LARGE_M: tl.constexpr, LARGE_N: tl.constexpr, LARGE_K: tl.constexpr,
                    PDL: tl.constexpr):
    """hidden f32 [tokens, out_dim] += x f32 [tokens, in_dim] @ weight[out_dim, in_dim]^T.

    Grid z splits K into K_SPLIT-wide slices (split-K): at decode this multiplies the
    programs streaming the weight, so each streams less and all of it is in flight at once.
    The output is an accumulation into the residual anyway, so slices add their partial sums
    with f32 atomics (summation order, hence the last bits, may vary run to run); with one
    slice (in_dim <= K_SPLIT) the tile is read, added and written: bit-stable. The 1-row GEMV
    program takes slices of its own width, GEMV_SPLIT (specs.py: the grid's z follows it): a
    wider slice keeps more of the weight in flight per program, and its unrolled loads stay in
    the 1-row instantiation, where registers are plenty; at GEMV_TOKENS rows the same width
    would raise the whole kernel's registers and slow its tile path (batch 16).
    """
    k_begin = tl.program_id(2) * K_SPLIT
    # one row (batch-1 decode) gets its own instantiation: a 1-row tile needs a quarter of
    # the registers and FMAs of the GEMV_TOKENS-row one
    if tokens <= 1:
        _linear_residual_gemv(hidden, x, weight, geometry, tokens, in_dim, out_dim,
                              tl.program_id(2) * GEMV_SPLIT, GEMV_SPLIT, 1, GEMV_K, GEMV_N, PDL)
    elif tokens <= GEMV_TOKENS:
        _linear_residual_gemv(hidden, x, weight, geometry, tokens, in_dim, out_dim, k_begin,
                              K_SPLIT, GEMV_TOKENS, GEMV_K, GEMV_N, PDL)
    elif tokens >= LARGE_TOKENS:
        _linear_residual_large(hidden, x, weight, geometry, in_dim, out_dim, LARGE_M, LARGE_N,
                               LARGE_K, PDL)
    else:
        _linear_residual_tiles(hidden, x, weight, geometry, in_dim, out_dim, k_begin,
                               BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, PDL)


@triton.jit
def _linear_residual_large(hidden, x, weight, geometry, in_dim, out_dim, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Large M (tokens >= LARGE_TOKENS: prefill chunks): grid (cdiv(out_dim, BLOCK_N),
    cdiv(tokens, BLOCK_M), 1), each program one [BLOCK_M, BLOCK_N] tile over the whole of K
    with one accumulator, a loop the compiler pipelines over num_stages (the decode tiles'
    16 rows re-read every weight tile tokens / 16 times); no K split: read, add, write."""
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(1) * BLOCK_M < n:
        rows, cols, row_mask, col_mask = _tile_index(n, out_dim, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, in_dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rows[:, None] * in_dim + k[None, :],
                        mask=row_mask[:, None] & (k[None, :] < in_dim), other=0.0)
            acc = tile_dot(a, _weight_tile(weight, cols, col_mask, k0, in_dim, in_dim, BLOCK_K), acc)
        _add_into(hidden + rows[:, None] * out_dim + cols[None, :], acc,
                  row_mask[:, None] & col_mask[None, :])


@triton.jit
def _linear_residual_gemv(hidden, x, weight, geometry, tokens, in_dim, out_dim, k_begin,
                          K_SPLIT: tl.constexpr, ROWS: tl.constexpr, GEMV_K: tl.constexpr,
                          GEMV_N: tl.constexpr, PDL: tl.constexpr):
    """Decode shape (tokens <= ROWS): grid (cdiv(out_dim, GEMV_N), 1, K slices); a program
    owns GEMV_N output columns of one K slice for every token of the capacity (rows past
    the live count are computed from stale scratch and never stored)."""
    cols = tl.program_id(0) * GEMV_N + tl.arange(0, GEMV_N)
    col_mask = cols < out_dim
    k_end = tl.minimum(k_begin + K_SPLIT, in_dim)
    weights = gemv_tiles(weight, cols, col_mask, in_dim, k_begin, k_end, GEMV_N, GEMV_K,
                         K_SPLIT // GEMV_K)
    wait_for_predecessors(PDL)
    rows = tl.arange(0, ROWS)
    acc = gemv_rows(weights, weights, x, rows, rows < tokens, in_dim, k_begin, k_end, False,
                    ROWS, GEMV_N, GEMV_K, K_SPLIT // GEMV_K)
    _add_into(hidden + rows[:, None] * out_dim + cols[None, :], acc,
              (rows < tl.load(geometry))[:, None] & col_mask[None, :])


@triton.jit
def _add_into(out, acc, mask):
    """out += acc: read-add-write with one K slice (bit-stable), f32 atomics with several."""
    if tl.num_programs(2) == 1:
        tl.store(out, tl.load(out, mask=mask, other=0.0) + acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


@triton.jit
def _linear_residual_tiles(hidden, x, weight, geometry, in_dim, out_dim, k_begin,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           K_SPLIT: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # one prefetch per contiguous [BLOCK_N, in_dim] weight slice (first M tile, first K
        # slice), not per program
        if (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            prefetch_l2(weight + tl.program_id(0) * BLOCK_N * in_dim,
                        tl.minimum(BLOCK_N, out_dim - tl.program_id(0) * BLOCK_N) * in_dim * 2,
                        256)
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(1) * BLOCK_M < n:
        rows, cols, row_mask, col_mask = _tile_index(n, out_dim, BLOCK_M, BLOCK_N)
        k_end = tl.minimum(k_begin + K_SPLIT, in_dim)
        # two K-interleaved accumulators: two independent MMA chains
        acc_even = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_odd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, 2 * BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a0 = tl.load(x + rows[:, None] * in_dim + k[None, :],
                         mask=row_mask[:, None] & (k[None, :] < k_end), other=0.0)
            a1 = tl.load(x + rows[:, None] * in_dim + (k + BLOCK_K)[None, :],
                         mask=row_mask[:, None] & ((k + BLOCK_K)[None, :] < k_end), other=0.0)
            acc_even = tile_dot(a0, _weight_tile(weight, cols, col_mask, k0, k_end, in_dim,
                                                 BLOCK_K), acc_even)
            acc_odd = tile_dot(a1, _weight_tile(weight, cols, col_mask, k0 + BLOCK_K, k_end,
                                                in_dim, BLOCK_K), acc_odd)
        acc = acc_even + acc_odd
        _add_into(hidden + rows[:, None] * out_dim + cols[None, :], acc,
                  row_mask[:, None] & col_mask[None, :])


@triton.jit
def linear_norm_residual(hidden, x, weight, norm_weight, geometry, tokens, in_dim, out_dim, eps,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """hidden f32 [tokens, out_dim] += rms_norm(x @ weight^T) * norm_weight (a post norm).

    Grid (cdiv(tokens, BLOCK_M), 1, 1): the norm needs every column of a row before the add,
    and the ABI has no scratch, so one program owns BLOCK_M whole rows: pass 1 computes the
    product column tile by column tile for its sum of squares only, pass 2 computes it again
    (the same tiles in the same order: the same values; the weight now mostly from L2) and adds
    the normed tile into the residual. The price is parallelism at decode (docs/kernels.md).
    """
    if PDL:
        if tl.program_id(0) == 0:
            prefetch_l2(weight, out_dim * in_dim * 2, 256)
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(0) * BLOCK_M < n:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, out_dim, BLOCK_N):
            acc = _product_tile(x, weight, rows, row_mask, n0, in_dim, out_dim, BLOCK_M, BLOCK_N,
                                BLOCK_K)
            sum_sq += tl.sum(acc * acc, axis=1)
        rstd = inverse_rms(sum_sq, out_dim, eps)[:, None]
        for n0 in range(0, out_dim, BLOCK_N):
            acc = _product_tile(x, weight, rows, row_mask, n0, in_dim, out_dim, BLOCK_M, BLOCK_N,
                                BLOCK_K)
            cols = n0 + tl.arange(0, BLOCK_N)
            col_mask = cols < out_dim
            g = tl.load(norm_weight + cols, mask=col_mask, other=0.0).to(tl.float32)
            target = hidden + rows[:, None] * out_dim + cols[None, :]
            mask = row_mask[:, None] & col_mask[None, :]
            tl.store(target, tl.load(target, mask=mask, other=0.0) + acc * rstd * g[None, :],
                     mask=mask)


@triton.jit
def _product_tile(x, weight, rows, row_mask, n0, in_dim, out_dim, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[rows] @ weight[n0 : n0 + BLOCK_N]^T, f32 [BLOCK_M, BLOCK_N] (0 past out_dim)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_mask = cols < out_dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + rows[:, None] * in_dim + k[None, :],
                    mask=row_mask[:, None] & (k[None, :] < in_dim), other=0.0)
        acc = tile_dot(a, _weight_tile(weight, cols, col_mask, k0, in_dim, in_dim, BLOCK_K), acc)
    return acc


# the gate activation of mlp.norm_gate_up_activation.v1 (helios_backend/kernel_abi/linear.py ACTIVATION_*)
ACTIVATION_SILU = tl.constexpr(0)
ACTIVATION_GELU_TANH = tl.constexpr(1)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def gate_activation(gate, activation):
    """act(gate): SiLU, or tanh-GELU written as gate * sigmoid(2 u), u = sqrt(2/pi) (g + 0.044715
    g^3), which is 0.5 g (1 + tanh(u)) exactly and needs no tanh (an exp that overflows for very
    negative g gives -0, as the reference does). `activation` is a constexpr (the SiLU kernel:
    one path compiled) or an immediate (a branch per program)."""
    if activation == ACTIVATION_GELU_TANH:
        inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return act


@triton.jit
def norm_gate_up_silu(out, hidden, norm_weight, gate_up, geometry, tokens, dim, ffn_dim, eps,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr, GEMV_N: tl.constexpr,
                      GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr, LARGE_TOKENS: tl.constexpr,
                      LARGE_M: tl.constexpr, LARGE_N: tl.constexpr, LARGE_K: tl.constexpr,
                      PDL: tl.constexpr):
    """out f32 [tokens, ffn_dim] = silu(h @ gate^T) * (h @ up^T), h = rms_norm(hidden) * norm_weight.

    gate_up f16 [2 ffn_dim, dim]: gate rows first, then up rows; one program reads matching
    gate and up rows, so the product never leaves registers. Decode shapes (tokens <=
    GEMV_TOKENS, dim <= GEMV_MAX_K) take the tensor-core-free path with GEMV_N columns per
    program.
    """
    _norm_gate_up(out, hidden, norm_weight, gate_up, geometry, tokens, dim, ffn_dim, eps,
                  ACTIVATION_SILU, BLOCK_M, BLOCK_N, BLOCK_K, GEMV_TOKENS, GEMV_K, GEMV_N,
                  GEMV_STEPS, GEMV_MAX_K, LARGE_TOKENS, LARGE_M, LARGE_N, LARGE_K, PDL)


@triton.jit
def norm_gate_up_activation(out, hidden, norm_weight, gate_up, geometry, tokens, dim, ffn_dim,
                            eps, activation,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr,
                            GEMV_N: tl.constexpr, GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr,
                            LARGE_TOKENS: tl.constexpr, LARGE_M: tl.constexpr, LARGE_N: tl.constexpr,
                            LARGE_K: tl.constexpr, PDL: tl.constexpr):
    """norm_gate_up_silu with the gate activation chosen by the `activation` immediate
    (gate_activation: SiLU or tanh-GELU, the GeGLU feed-forward block)."""
    _norm_gate_up(out, hidden, norm_weight, gate_up, geometry, tokens, dim, ffn_dim, eps,
                  activation, BLOCK_M, BLOCK_N, BLOCK_K, GEMV_TOKENS, GEMV_K, GEMV_N,
                  GEMV_STEPS, GEMV_MAX_K, LARGE_TOKENS, LARGE_M, LARGE_N, LARGE_K, PDL)


@triton.jit
def _norm_gate_up(out, hidden, norm_weight, gate_up, geometry, tokens, dim, ffn_dim, eps,
                  activation, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr,
                  GEMV_N: tl.constexpr, GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr,
                  LARGE_TOKENS: tl.constexpr, LARGE_M: tl.constexpr, LARGE_N: tl.constexpr,
                  LARGE_K: tl.constexpr, PDL: tl.constexpr):
    if (tokens <= 1) & (dim <= GEMV_MAX_K):
        _norm_gate_up_gemv(out, hidden, norm_weight, gate_up, geometry, tokens, dim,
                           ffn_dim, eps, activation, 1, GEMV_K, GEMV_N, GEMV_STEPS,
                           GEMV_MAX_K > GEMV_K * GEMV_STEPS, PDL)
    elif (tokens <= GEMV_TOKENS) & (dim <= GEMV_K * GEMV_STEPS):
        _norm_gate_up_gemv(out, hidden, norm_weight, gate_up, geometry, tokens, dim,
                           ffn_dim, eps, activation, GEMV_TOKENS, GEMV_K, GEMV_N,
                           GEMV_STEPS, False, PDL)
    elif tokens >= LARGE_TOKENS:
        _norm_gate_up_large(out, hidden, norm_weight, gate_up, geometry, dim, ffn_dim, eps,
                            activation, LARGE_M, LARGE_N, LARGE_K, PDL)
    else:
        _norm_gate_up_tiles(out, hidden, norm_weight, gate_up, geometry, dim, ffn_dim, eps,
                                 activation, BLOCK_M, BLOCK_N, BLOCK_K, PDL)


@triton.jit
def _norm_gate_up_large(out, hidden, norm_weight, gate_up, geometry, dim, ffn_dim, eps,
                        activation, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Large M (tokens >= LARGE_TOKENS): as _norm_gate_up_tiles, with one gate and one up
    accumulator and a plain K loop the compiler pipelines (num_stages) on wide tiles."""
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(1) * BLOCK_M < n:
        rows, cols, row_mask, col_mask, pre, sum_sq = _normed_tile(hidden, n, dim, ffn_dim, eps,
                                                                   BLOCK_M, BLOCK_N, BLOCK_K)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, dim, BLOCK_K):
            a, sq = scaled_rows(hidden, norm_weight, rows, row_mask, k0, dim, BLOCK_K)
            a = a * pre
            sum_sq += sq
            gate = tile_dot(a, _weight_tile(gate_up, cols, col_mask, k0, dim, dim, BLOCK_K), gate)
            up = tile_dot(a, _weight_tile(gate_up, cols + ffn_dim, col_mask, k0, dim, dim, BLOCK_K), up)
        _store_gated(out, gate, up, pre, sum_sq, rows, cols, row_mask, col_mask, dim, ffn_dim, eps,
                     activation)


@triton.jit
def _normed_tile(hidden, n, dim, ffn_dim, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """_tile_index of a gate/up tile, its rows' norm pre-scale and a zero sum of squares."""
    rows, cols, row_mask, col_mask = _tile_index(n, ffn_dim, BLOCK_M, BLOCK_N)
    pre = norm_scales(hidden, rows, row_mask, dim, eps, BLOCK_M, BLOCK_K)[:, None]
    return rows, cols, row_mask, col_mask, pre, tl.zeros((BLOCK_M,), dtype=tl.float32)


@triton.jit
def _store_gated(out, gate, up, pre, sum_sq, rows, cols, row_mask, col_mask, dim, ffn_dim, eps,
                 activation):
    """out[rows, cols] = act(gate * rstd) * (up * rstd), rstd the RMSNorm's accumulator half."""
    rstd = accumulator_scale(pre, sum_sq[:, None], dim, eps)
    act = gate_activation(gate * rstd, activation) * (up * rstd)
    tl.store(out + rows[:, None] * ffn_dim + cols[None, :], act,
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _norm_gate_up_gemv(out, hidden, norm_weight, gate_up, geometry, tokens, dim, ffn_dim,
                            eps, activation, ROWS: tl.constexpr, GEMV_K: tl.constexpr,
                            GEMV_N: tl.constexpr, GEMV_STEPS: tl.constexpr, SPANS: tl.constexpr,
                            PDL: tl.constexpr):
    """Grid (cdiv(ffn_dim, GEMV_N), 1, 1): GEMV_N gate columns and their up columns over
    the whole of dim (gemv_span)."""
    cols = tl.program_id(0) * GEMV_N + tl.arange(0, GEMV_N)
    col_mask = cols < ffn_dim
    gate_w = gemv_tiles(gate_up, cols, col_mask, dim, 0, dim, GEMV_N, GEMV_K, GEMV_STEPS)
    up_w = gemv_tiles(gate_up, cols + ffn_dim, col_mask, dim, 0, dim, GEMV_N, GEMV_K, GEMV_STEPS)
    same = tl.zeros((GEMV_N,), dtype=tl.int32)
    norms = gemv_tiles(norm_weight, same, same == 0, 0, 0, dim, GEMV_N, GEMV_K, GEMV_STEPS)
    wait_for_predecessors(PDL)
    rows = tl.arange(0, ROWS)
    live = rows < tokens
    gate, up = gemv_span(gate_w, up_w, norms, gate_up, cols, cols + ffn_dim, col_mask, norm_weight,
                         hidden, rows, live, dim, True, True, ROWS, GEMV_N, GEMV_K, GEMV_STEPS, SPANS)
    rstd = inverse_rms(row_sum_squares(hidden, rows, live, dim, ROWS, GEMV_K), dim, eps)[:, None]
    act = gate_activation(gate * rstd, activation) * (up * rstd)
    tl.store(out + rows[:, None] * ffn_dim + cols[None, :], act,
             mask=(rows < tl.load(geometry))[:, None] & col_mask[None, :])


@triton.jit
def _norm_gate_up_tiles(out, hidden, norm_weight, gate_up, geometry, dim, ffn_dim, eps,
                             activation, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PDL: tl.constexpr):
    if PDL:
        if tl.program_id(1) == 0:           # one prefetch per weight slice, not per M tile
            rows_here = tl.minimum(BLOCK_N, ffn_dim - tl.program_id(0) * BLOCK_N)
            prefetch_l2(gate_up + tl.program_id(0) * BLOCK_N * dim, rows_here * dim * 2, 256)
            prefetch_l2(gate_up + (ffn_dim + tl.program_id(0) * BLOCK_N) * dim,
                        rows_here * dim * 2, 256)
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(1) * BLOCK_M < n:
        rows, cols, row_mask, col_mask, pre, sum_sq = _normed_tile(hidden, n, dim, ffn_dim, eps,
                                                                   BLOCK_M, BLOCK_N, BLOCK_K)
        # two K-interleaved accumulator pairs: four independent MMA chains instead of two,
        # since at decode the dependent chain, not bandwidth, bounds the kernel
        gate_even = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        gate_odd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_even = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_odd = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, dim, 2 * BLOCK_K):
            k1 = k0 + BLOCK_K
            a0, sq0 = scaled_rows(hidden, norm_weight, rows, row_mask, k0, dim, BLOCK_K)
            a1, sq1 = scaled_rows(hidden, norm_weight, rows, row_mask, k1, dim, BLOCK_K)
            a0 = a0 * pre
            a1 = a1 * pre
            sum_sq += sq0 + sq1
            gate_even = tile_dot(a0, _weight_tile(gate_up, cols, col_mask, k0, dim, dim, BLOCK_K),
                                 gate_even)
            gate_odd = tile_dot(a1, _weight_tile(gate_up, cols, col_mask, k1, dim, dim, BLOCK_K),
                                gate_odd)
            up_even = tile_dot(a0, _weight_tile(gate_up, cols + ffn_dim, col_mask, k0, dim, dim,
                                                BLOCK_K), up_even)
            up_odd = tile_dot(a1, _weight_tile(gate_up, cols + ffn_dim, col_mask, k1, dim, dim,
                                               BLOCK_K), up_odd)
        _store_gated(out, gate_even + gate_odd, up_even + up_odd, pre, sum_sq, rows, cols, row_mask,
                     col_mask, dim, ffn_dim, eps, activation)


@triton.jit
def norm_head(logits, hidden, norm_weight, head, geometry, rows, tokens, dim, vocab, eps,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GEMV_TOKENS: tl.constexpr, GEMV_K: tl.constexpr, GEMV_N: tl.constexpr,
              GEMV_STEPS: tl.constexpr, GEMV_MAX_K: tl.constexpr, PDL: tl.constexpr):
    """logits f32 [rows, vocab] = rms_norm(hidden[last token of row r]) @ head[vocab, dim]^T.

    The last token of row r is row_start[r + 1] - 1 (geometry words 1 + tokens + r ...);
    rows without tokens get a zero logits row. Up to GEMV_TOKENS rows take the tensor-core-free
    path: GEMV_N vocabulary entries per program, so the 49k-row head spreads over every SM.
    """
    if (rows <= 1) & (dim <= GEMV_MAX_K):
        _norm_head_gemv(logits, hidden, norm_weight, head, geometry, rows, tokens, dim, vocab,
                        eps, 1, GEMV_K, GEMV_N, GEMV_STEPS, GEMV_MAX_K > GEMV_K * GEMV_STEPS, PDL)
    elif (rows <= GEMV_TOKENS) & (dim <= GEMV_K * GEMV_STEPS):
        _norm_head_gemv(logits, hidden, norm_weight, head, geometry, rows, tokens, dim, vocab,
                        eps, GEMV_TOKENS, GEMV_K, GEMV_N, GEMV_STEPS, False, PDL)
    else:
        _norm_head_tiles(logits, hidden, norm_weight, head, geometry, rows, tokens, dim, vocab,
                         eps, BLOCK_M, BLOCK_N, BLOCK_K, PDL)


@triton.jit
def _norm_head_gemv(logits, hidden, norm_weight, head, geometry, rows, tokens, dim, vocab, eps,
                    ROWS: tl.constexpr, GEMV_K: tl.constexpr, GEMV_N: tl.constexpr,
                    GEMV_STEPS: tl.constexpr, SPANS: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(vocab, GEMV_N), 1, 1): GEMV_N vocabulary entries per program, so the
    head (larger than L2) streams through every SM."""
    cols = tl.program_id(0) * GEMV_N + tl.arange(0, GEMV_N)
    col_mask = cols < vocab
    weights = gemv_tiles(head, cols, col_mask, dim, 0, dim, GEMV_N, GEMV_K, GEMV_STEPS)
    same = tl.zeros((GEMV_N,), dtype=tl.int32)
    norms = gemv_tiles(norm_weight, same, same == 0, 0, 0, dim, GEMV_N, GEMV_K, GEMV_STEPS)
    wait_for_predecessors(PDL)
    r = tl.arange(0, ROWS)
    r_mask = r < rows
    start = tl.load(geometry + 1 + tokens + r, mask=r_mask, other=0)
    end = tl.load(geometry + 2 + tokens + r, mask=r_mask, other=0)
    live = r_mask & (end > start)
    last = tl.where(live, end - 1, 0)
    acc, _ = gemv_span(weights, weights, norms, head, cols, cols, col_mask, norm_weight, hidden, last,
                       live, dim, True, False, ROWS, GEMV_N, GEMV_K, GEMV_STEPS, SPANS)
    rstd = inverse_rms(row_sum_squares(hidden, last, live, dim, ROWS, GEMV_K), dim, eps)
    acc = tl.where(live[:, None], acc * rstd[:, None], 0.0)
    tl.store(logits + r[:, None].to(tl.int64) * vocab + cols[None, :], acc,
             mask=r_mask[:, None] & col_mask[None, :])


@triton.jit
def _norm_head_tiles(logits, hidden, norm_weight, head, geometry, rows, tokens, dim, vocab, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
    """Grid (cdiv(rows, BLOCK_M), cdiv(vocab, BLOCK_N)): the M tiles of one head slice are
    consecutive programs, so they run together and all but the first read the slice from L2 (the
    head, 56-335 MB, is larger than L2: with the column blocks on x, the second M tile of a slice
    ran a whole pass over the head later and read it from memory again)."""
    block = tl.program_id(1)
    if PDL:
        if tl.program_id(0) == 0:           # one prefetch per head slice, not per M tile
            prefetch_l2(head + block.to(tl.int64) * BLOCK_N * dim,
                        tl.minimum(BLOCK_N, vocab - block * BLOCK_N) * dim * 2, 512)
    wait_for_predecessors(PDL)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = r < rows
    col_mask = cols < vocab
    start = tl.load(geometry + 1 + tokens + r, mask=r_mask, other=0)
    end = tl.load(geometry + 2 + tokens + r, mask=r_mask, other=0)
    live = r_mask & (end > start)
    last = tl.where(live, end - 1, 0)
    pre = norm_scales(hidden, last, live, dim, eps, BLOCK_M, BLOCK_K)[:, None]
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        a, row_sq = scaled_rows(hidden, norm_weight, last, live, k0, dim, BLOCK_K)
        sum_sq += row_sq
        acc = tile_dot(a * pre, _weight_tile(head, cols, col_mask, k0, dim, dim, BLOCK_K), acc)
    acc = tl.where(live[:, None], acc * accumulator_scale(pre, sum_sq[:, None], dim, eps), 0.0)
    tl.store(logits + r[:, None].to(tl.int64) * vocab + cols[None, :], acc,
             mask=r_mask[:, None] & col_mask[None, :])
