"""Row norms between nodes: the post norm of a sandwich-norm block.

Layouts (row-major, contiguous):
  hidden       f32 [tokens, dim]   the residual stream
  accumulator  f32 [tokens, dim]   a projection's product, summed into it by linear.residual.v1
  norm weight  f16 [dim]
  geometry     i32 step geometry; geometry[0] = live tokens n

A post-normed projection (`hidden += rms_norm(x W^T) * w`) is two nodes: linear.residual.v1
adds x W^T into the zero accumulator with its column-parallel grids (GEMV and split-K at decode),
then norm_residual norms each live row into the residual and stores zeros back, so the
accumulator is zero again for the next product (it is zero at allocation: the arena's fixed
part is cleared once). Rows past n are never written by either node, so they stay zero.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import inverse_rms, wait_for_predecessors


@triton.jit
def norm_residual(hidden, accumulator, norm_weight, geometry, tokens, dim, eps,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """hidden[:n] += rms_norm(accumulator[:n]) * norm_weight; accumulator[:n] = 0.

    Grid (cdiv(tokens, BLOCK_M)): a program owns BLOCK_M whole rows and makes two passes over
    their BLOCK_D column tiles: the sum of squares, then the normed add (its second read of a
    row hits L1/L2; at Gemma-like widths a row is one tile).
    """
    wait_for_predecessors(PDL)
    n = tl.load(geometry)
    if tl.program_id(0) * BLOCK_M < n:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n
        offsets = rows[:, None].to(tl.int64) * dim
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            acc = tl.load(accumulator + offsets + cols[None, :],
                          mask=row_mask[:, None] & (cols < dim)[None, :], other=0.0)
            sum_sq += tl.sum(acc * acc, axis=1)
        rstd = inverse_rms(sum_sq, dim, eps)[:, None]
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_mask = cols < dim
            mask = row_mask[:, None] & col_mask[None, :]
            g = tl.load(norm_weight + cols, mask=col_mask, other=0.0).to(tl.float32)
            source = accumulator + offsets + cols[None, :]
            target = hidden + offsets + cols[None, :]
            acc = tl.load(source, mask=mask, other=0.0)
            tl.store(target, tl.load(target, mask=mask, other=0.0) + acc * rstd * g[None, :],
                     mask=mask)
            tl.store(source, tl.zeros_like(acc), mask=mask)
