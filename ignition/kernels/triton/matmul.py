"""GEMMs of the layer stack with their fused prologues and epilogues.

Layouts (row-major, contiguous):
  residual x  f32 [M, K]   (the residual stream; M = packed tokens)
  activation  f16 [M, K]
  weight      f16 [N, K]   (out x in, as stored in the core)
  norm weight f16 [K]
Accumulation is f32 (tensor cores through tl.dot). Every kernel is launched on the grid
(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), 1): one program owns one [BLOCK_M, BLOCK_N] output
tile, so no atomics and bit-stable results. BLOCK_M = 16 suits decode (M = rows) and
chunked prefill alike; weights stream once per M tile and stay L2-resident across tiles.

PDL: each kernel waits (griddepcontrol.wait) only before its first read of data written by
an earlier node; loads of weights are issued before it, so they overlap the tail of the
predecessor. It releases its dependents right after the wait.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _row_rstd(x_ptr, rows, row_mask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) for BLOCK_M rows of an f32 [*, K] matrix -> f32 [BLOCK_M]."""
    cols = tl.arange(0, BLOCK_K)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                    mask=row_mask[:, None] & (k[None, :] < K), other=0.0)
        sum_sq += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def _normed_tile(x_ptr, norm_ptr, rows, row_mask, rstd, k0, K, BLOCK_K: tl.constexpr):
    """RMS-normalized f16 tile [BLOCK_M, BLOCK_K] of the f32 residual (the GEMM's A operand)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < K
    x = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    g = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    return (x * rstd[:, None] * g[None, :]).to(tl.float16)


@triton.jit
def _weight_tile(w_ptr, cols, col_mask, k0, K, BLOCK_K: tl.constexpr):
    """Transposed weight tile [BLOCK_K, BLOCK_N] (f16) of a [N, K] weight (the B operand)."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + cols[None, :] * K + k[:, None],
                   mask=col_mask[None, :] & (k[:, None] < K), other=0.0)


@triton.jit
def rmsnorm_matmul(x, norm_weight, weight, out, M, N, K, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    """out f16 [M, N] = rmsnorm(x f32 [M, K]) * norm_weight @ weight[N, K]^T."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rstd = _row_rstd(x, rows, row_mask, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _normed_tile(x, norm_weight, rows, row_mask, rstd, k0, K, BLOCK_K)
        b = _weight_tile(weight, cols, col_mask, k0, K, BLOCK_K)
        acc = tl.dot(a, b, acc)
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(tl.float16),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def matmul_residual(x, weight, residual, M, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    """residual f32 [M, N] += x f16 [M, K] @ weight[N, K]^T (in place)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + rows[:, None] * K + k[None, :],
                    mask=row_mask[:, None] & (k[None, :] < K), other=0.0)
        b = _weight_tile(weight, cols, col_mask, k0, K, BLOCK_K)
        acc = tl.dot(a, b, acc)
    out_ptr = residual + rows[:, None] * N + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr, tl.load(out_ptr, mask=out_mask, other=0.0) + acc, mask=out_mask)


@triton.jit
def rmsnorm_matmul_swiglu(x, norm_weight, weight, out, M, F, K, eps,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr):
    """out f16 [M, F] = silu(h @ gate^T) * (h @ up^T), h = rmsnorm(x) * norm_weight.

    weight f16 [2F, K]: gate rows 0..F-1 then up rows F..2F-1 (one stacked buffer), so one
    program reads matching gate and up columns and the product never leaves registers.
    """
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < F
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rstd = _row_rstd(x, rows, row_mask, K, eps, BLOCK_M, BLOCK_K)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _normed_tile(x, norm_weight, rows, row_mask, rstd, k0, K, BLOCK_K)
        acc_gate = tl.dot(a, _weight_tile(weight, cols, col_mask, k0, K, BLOCK_K), acc_gate)
        acc_up = tl.dot(a, _weight_tile(weight, cols + F, col_mask, k0, K, BLOCK_K), acc_up)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out + rows[:, None] * F + cols[None, :], act.to(tl.float16),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def rmsnorm_logits(x, row_token, norm_weight, weight, logits, B, V, K, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    """logits f32 [B, V] = rmsnorm(x[row_token[b]]) * norm_weight @ weight[V, K]^T.

    row_token i32 [B]: packed-token index of each row's sampled token; < 0 marks a padding
    row, whose logits row is written as zeros.
    """
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < V
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.load(row_token + rows, mask=rows < B, other=-1)
    token_mask = token >= 0
    token = tl.maximum(token, 0)
    rstd = _row_rstd(x, token, token_mask, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _normed_tile(x, norm_weight, token, token_mask, rstd, k0, K, BLOCK_K)
        acc = tl.dot(a, _weight_tile(weight, cols, col_mask, k0, K, BLOCK_K), acc)
    tl.store(logits + rows[:, None] * V + cols[None, :], acc,
             mask=(rows < B)[:, None] & col_mask[None, :])
