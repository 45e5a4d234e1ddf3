"""A rank's partial projection before an all-reduce (tensor parallelism).

Layouts (row-major, contiguous):
  out       f32 [tokens, out_dim]   the rank's partial product (the residual buffer on ranks > 0)
  x         f32 [tokens, in_dim]    the rank's slice of the activations (its heads / ffn columns)
  weight    f16 [out_dim, in_dim]   the rank's columns of the projection, as stored in the core
  geometry  i32 step geometry; geometry[0] = live tokens n

Unlike linear.residual.v1 the product is stored, not added, and every row of the capacity is
written: rows past n get 0. The all-reduce that follows sums the whole [tokens, out_dim]
region across ranks (its count is fixed at recording), so a stale row on one rank would be
added into every rank's copy, step after step; zero rows add nothing.

Grid (cdiv(out_dim, BLOCK_N), cdiv(tokens, BLOCK_M), 1): one program owns one output tile and
walks all of K (no split-K, no atomics: the store is bit-stable). Tiles past n only store zeros.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import prefetch_l2, tile_dot, wait_for_predecessors


@triton.jit
def linear_project(out, x, weight, geometry, tokens, in_dim, out_dim,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    """out[:n] = x[:n] @ weight^T; out[n:tokens] = 0."""
    if PDL:
        # weights are never written by a node: stream this program's [BLOCK_N, in_dim] slice
        # into L2 before waiting on the predecessor (once per column block: first M tile)
        if tl.program_id(1) == 0:
            prefetch_l2(weight + tl.program_id(0) * BLOCK_N * in_dim,
                        tl.minimum(BLOCK_N, out_dim - tl.program_id(0) * BLOCK_N) * in_dim * 2,
                        256)
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < n
    col_mask = cols < out_dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if tl.program_id(1) * BLOCK_M < n:
        for k0 in range(0, in_dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < in_dim
            a = tl.load(x + rows[:, None].to(tl.int64) * in_dim + k[None, :],
                        mask=live[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(weight + cols[None, :].to(tl.int64) * in_dim + k[:, None],
                        mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tile_dot(a, w, acc)     # the operand type of linear.residual's tiles
    # masked-off rows of `a` were 0, so acc rows past n are 0: one store covers both cases
    target = out + rows[:, None].to(tl.int64) * out_dim + cols[None, :]
    tl.store(target, acc, mask=(rows < tokens)[:, None] & col_mask[None, :])
