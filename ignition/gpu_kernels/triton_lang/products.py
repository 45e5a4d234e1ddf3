"""The product path's cubins: plain f16 products and the pointwise nodes that feed them.

Layouts (row-major, contiguous; helios_backend/kernel_abi/products.py is the reference):
  hidden      f32 [tokens, dim]       the residual stream
  x           f16 [tokens, in_dim]    activations, zero in rows past the live count n
  weight      f16 [out_dim, in_dim]   as stored in the core
  out         f16 or f32 [tokens, out_dim]
  geometry    i32 step geometry; geometry[0] = live tokens n

These cubins are the portable implementation of the product ids; on devices where the vendor
library loads, the CUDA executor serves linear.product_* / linear.residual_f16 through cuBLASLt
instead (docs/kernels.md). The products are ordinary [BLOCK_M, BLOCK_N] tiles over the whole
of K with f16 operands loaded as stored (no widening, no norm prologue), so the K loop
pipelines into warpgroup MMAs; grid (cdiv(tokens, BLOCK_M), cdiv(out_dim, BLOCK_N)): the row
tiles of one weight slice are consecutive programs and share it through L2. Tiles past n
skip their K loop (their rows are zero products).
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import inverse_rms, wait_for_predecessors
from ignition.gpu_kernels.triton_lang.matmul import gate_activation


@triton.jit
def rms_norm_f16(out, hidden, norm_weight, geometry, tokens, dim, eps,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out = f16(rms_norm(hidden) * norm_weight) for live rows, zeros for rows n .. tokens.
    Grid (cdiv(tokens, BLOCK_M)): a program owns BLOCK_M whole rows, two passes over them."""
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < n
    in_capacity = rows < tokens
    offsets = rows[:, None].to(tl.int64) * dim
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(hidden + offsets + cols[None, :], mask=live[:, None] & (cols < dim)[None, :], other=0.0)
        sum_sq += tl.sum(x * x, axis=1)
    rstd = tl.where(live, inverse_rms(sum_sq, dim, eps), 0.0)[:, None]
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < dim
        x = tl.load(hidden + offsets + cols[None, :], mask=live[:, None] & col_mask[None, :], other=0.0)
        g = tl.load(norm_weight + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out + offsets + cols[None, :], (x * rstd * g[None, :]).to(tl.float16),
                 mask=in_capacity[:, None] & col_mask[None, :])


@triton.jit
def to_f16(out, x, geometry, tokens, dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out = f16(x) for live rows, zeros for rows n .. tokens; grid (cdiv(tokens, BLOCK_T),
    cdiv(dim, BLOCK_D))."""
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    offsets = rows[:, None].to(tl.int64) * dim + cols[None, :]
    values = tl.load(x + offsets, mask=(rows < n)[:, None] & col_mask[None, :], other=0.0)
    tl.store(out + offsets, values.to(tl.float16), mask=(rows < tokens)[:, None] & col_mask[None, :])


@triton.jit
def gate_activation_f16(out, projected, geometry, tokens, ffn_dim, activation,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out = f16(act(gate) * up) of projected [tokens, 2 * ffn_dim] (gate columns first) for
    live rows, zeros for rows n .. tokens; grid (cdiv(tokens, BLOCK_T), cdiv(ffn_dim, BLOCK_D))."""
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < ffn_dim
    live = (rows < n)[:, None] & col_mask[None, :]
    source = projected + rows[:, None].to(tl.int64) * (2 * ffn_dim) + cols[None, :]
    gate = tl.load(source, mask=live, other=0.0).to(tl.float32)
    up = tl.load(source + ffn_dim, mask=live, other=0.0).to(tl.float32)
    values = tl.where(live, gate_activation(gate, activation) * up, 0.0)
    tl.store(out + rows[:, None].to(tl.int64) * ffn_dim + cols[None, :], values.to(tl.float16),
             mask=(rows < tokens)[:, None] & col_mask[None, :])


@triton.jit
def _product_tile(x, weight, rows, cols, row_mask, col_mask, in_dim, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc f32 [BLOCK_M, BLOCK_N] = x[rows] @ weight[cols]^T over the whole of K (f16 operands)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x + rows[:, None].to(tl.int64) * in_dim
    w_cols = weight + cols[None, :].to(tl.int64) * in_dim
    for k0 in range(0, in_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_dim
        a = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _product(out, x, weight, geometry, tokens, in_dim, out_dim, ACCUMULATE: tl.constexpr,
             OUT_F16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile. A stored product (not ACCUMULATE) writes zeros in
    rows n .. tokens, as the library's product of zero rows does; a tile wholly past n skips
    its K loop."""
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n
    col_mask = cols < out_dim
    target = out + rows[:, None].to(tl.int64) * out_dim + cols[None, :]
    if tl.program_id(0) * BLOCK_M < n:
        acc = _product_tile(x, weight, rows, cols, row_mask, col_mask, in_dim, BLOCK_M, BLOCK_N, BLOCK_K)
        if ACCUMULATE:
            mask = row_mask[:, None] & col_mask[None, :]
            tl.store(target, tl.load(target, mask=mask, other=0.0) + acc, mask=mask)
        elif OUT_F16:
            tl.store(target, acc.to(tl.float16), mask=(rows < tokens)[:, None] & col_mask[None, :])
        else:
            tl.store(target, acc, mask=(rows < tokens)[:, None] & col_mask[None, :])
    elif not ACCUMULATE:
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        mask = (rows < tokens)[:, None] & col_mask[None, :]
        if OUT_F16:
            tl.store(target, zeros.to(tl.float16), mask=mask)
        else:
            tl.store(target, zeros, mask=mask)


@triton.jit
def product_f16(out, x, weight, geometry, tokens, in_dim, out_dim, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out f16 [tokens, out_dim] = x @ weight^T."""
    _product(out, x, weight, geometry, tokens, in_dim, out_dim, False, True, BLOCK_M, BLOCK_N, BLOCK_K, PDL)


@triton.jit
def product_f32(out, x, weight, geometry, tokens, in_dim, out_dim, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out f32 [tokens, out_dim] = x @ weight^T (a decode step's logits: one token per row)."""
    _product(out, x, weight, geometry, tokens, in_dim, out_dim, False, False, BLOCK_M, BLOCK_N, BLOCK_K, PDL)


@triton.jit
def residual_f16(hidden, x, weight, geometry, tokens, in_dim, out_dim, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """hidden f32 [tokens, out_dim] += x @ weight^T (live rows; one tile per output element,
    read-add-write: bit-stable)."""
    _product(hidden, x, weight, geometry, tokens, in_dim, out_dim, True, False, BLOCK_M, BLOCK_N, BLOCK_K, PDL)
