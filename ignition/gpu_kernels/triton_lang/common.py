"""Device helpers shared by the kernel sources."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

L2_LINE_BYTES = tl.constexpr(128)
# Tensor-core precision of every dot: tf32 (10-bit mantissa like f16, f32 range; f16 weights
# and cache widen exactly). H200 conformance passed at this precision (logits within ~1e-3,
# greedy tokens equal). "tf32x3" (~f32 products) triples every MMA and the dependent MMA
# chain that bounds decode latency, so it is not the default.
DOT_PRECISION = tl.constexpr("tf32")
# The tensor-core tiles' operands: 0 = tf32 x tf32 (f16 weights widened), 1 = f16 x f16 with
# f32 accumulation (activations rounded to f16 after RMSNorm's 1/rms is applied, so they
# stay near unit scale; same 10-bit mantissa as tf32, half the MMA steps per K and no
# widening of the weight tile). Measured on the H200 (random weights, same run): f16 gave
# batch-64 decode 46.9k vs 39.9k tokens/s, batch 128 73.6k vs 61.1k, prefill of 512 tokens
# 149k vs 119k; conformance against the numpy executor passed with logits within 4e-4.
DOT_F16 = tl.constexpr(1)


@triton.jit
def tile_dot(a, w, acc):
    """acc + a @ w on tensor cores; a f32 activations, w an f16 weight tile (DOT_F16)."""
    if DOT_F16:
        return tl.dot(a.to(tl.float16), w, acc)
    else:
        return tl.dot(a, w.to(tl.float32), acc, input_precision=DOT_PRECISION)


@triton.jit
def prefetch_l2(base, nbytes, LINES: tl.constexpr):
    """Prefetch the byte range [base, base + nbytes) into L2, one 128-byte line per lane.

    Issued before griddepcontrol.wait for data no earlier node writes (weights), so under
    programmatic dependent launch the weight stream of node N+1 overlaps node N and the
    main loop then reads L2 instead of DRAM. Compiled path only (no interpreter form).
    """
    for first in range(0, nbytes, LINES * L2_LINE_BYTES):
        offsets = tl.minimum(first + tl.arange(0, LINES) * L2_LINE_BYTES, nbytes - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base.to(tl.pointer_type(tl.int8)) + offsets],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_predecessors(PDL: tl.constexpr):
    """Programmatic dependent launch: wait until the previous node's writes are visible, then
    let the next node launch (it only runs its own pre-wait prologue until we finish)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def live_lane(row_slot, live_rows, rows, r):
    """(live rows, slot of row r or -1 past them) for per-row kernels."""
    live = tl.minimum(tl.load(live_rows), rows)
    return live, tl.load(row_slot + r, mask=r < live, other=-1)


@triton.jit
def scaled_rows(x_ptr, norm_ptr, rows, row_mask, k0, K, BLOCK_K: tl.constexpr):
    """(x * norm_weight) f32 [BLOCK_M, BLOCK_K] and its per-row sum of x^2 (for the rstd).

    RMSNorm's 1/rms is a per-row scalar, so it factors out of the GEMM: the kernels multiply
    x * g by the weights and scale the accumulator rows at the end. One pass over x, and the
    weight stream starts at once instead of after a separate norm pass.
    """
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < K
    x = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    g = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    return x * g[None, :], tl.sum(x * x, axis=1)


@triton.jit
def gemv_tiles(ptr, rows, row_mask, k_dim, k_begin, k_end, BN: tl.constexpr, BK: tl.constexpr,
               K_STEPS: tl.constexpr):
    """K_STEPS f16 tiles [1, BN, BK] of rows `rows` (row stride k_dim) covering k in
    [k_begin, min(k_begin + K_STEPS * BK, k_end)); zero outside. Rows may repeat (BN copies of
    one vector): a load of the weight tile's shape gets its register layout.

    Decode kernels load their weight (and norm weight) tiles with this BEFORE the PDL wait:
    weights are never written by a node, so their latency overlaps the previous node and
    only the activations are read after the wait."""
    tiles = ()
    for step in tl.static_range(K_STEPS):
        k = k_begin + step * BK + tl.arange(0, BK)
        # 4 f16 (8 bytes) per lane, like the f32 activation loads (16 bytes): both then get
        # the same register layout and nothing is exchanged through shared memory
        # static_range unrolls at compile time: the tuple gains one tile per step (a Triton
        # idiom; the annotation Python's checker would need is not Triton syntax)
        tiles = tiles + (tl.load(ptr + rows[None, :, None].to(tl.int64) * k_dim  # type: ignore[assignment]
                                 + tl.max_contiguous(k, 4)[None, None, :],
                                 mask=row_mask[None, :, None] & (k < k_end)[None, None, :],
                                 other=0.0),)
    return tiles


@triton.jit
def gemv_rows(weights, norms, x_ptr, rows, row_mask, k_dim, k_begin, k_end,
              NORM: tl.constexpr, M_T: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              K_STEPS: tl.constexpr):
    """Decode-shaped product without tensor cores: acc f32 [M_T, BN],
    acc[m, j] = sum over k of x[rows[m], k] (* norm[k] when NORM) * weight[j, k]
    for the K_STEPS tiles of `weights` / `norms` (gemv_tiles, same k range); x f32, row
    stride k_dim.

    For a few rows a [16, N] tensor-core tile wastes most of its work and serializes the K
    loop through one MMA chain; here every step is unrolled, so all of a program's loads
    are in flight at once, and the products accumulate per lane with one reduction at the
    end. x is loaded as [M_T, BN, BK] (the same row for every column: L1 hits) so that it
    has the weight tile's register layout."""
    acc = tl.zeros((M_T, BN, BK), dtype=tl.float32)
    x_rows = rows[:, None, None].to(tl.int64) * k_dim + tl.zeros((1, BN, 1), dtype=tl.int64)
    for step in tl.static_range(K_STEPS):
        k = k_begin + step * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + x_rows + k[None, None, :],
                    mask=row_mask[:, None, None] & (k < k_end)[None, None, :], other=0.0)
        if NORM:
            x = x * norms[step].to(tl.float32)
        acc += x * weights[step].to(tl.float32)
    return tl.sum(acc, axis=2)


@triton.jit
def gemv_span(first_w, second_w, norms, w_ptr, first_rows, second_rows, w_mask, norm_ptr, x_ptr,
              rows, row_mask, k_dim, NORM: tl.constexpr, PAIR: tl.constexpr, M_T: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, K_STEPS: tl.constexpr, SPANS: tl.constexpr):
    """gemv_rows over the whole of K for the weight rows `first_rows` and, with PAIR, `second_rows`
    of one matrix against the same x (gate and up; a rotation pair's two dims): (acc_first,
    acc_second), f32 [M_T, BN] each (acc_second zero without PAIR). The first K_STEPS x BK
    columns come from `first_w` / `second_w` / `norms` (gemv_tiles of the rows / the norm vector,
    loaded before the PDL wait); with SPANS the rest of k_dim follows one span of K_STEPS tiles
    at a time.

    The spans are software-pipelined: the next span's loads (both row sets and the norm tiles)
    leave before this span's products, so a program keeps two spans of weights in registers and
    its loads never wait for its own arithmetic. With one span in flight a program stalled once
    per span on DRAM latency: 8 columns x 640 K of f16 are 10 KB, and the Llama-3.1-8B layout's
    batch-1 gate/up and down products stayed near 0.72 of their bandwidth floor (H100, 9809c66).
    The sums keep their order (span 0, 1, ...), so the products' bits do not change.

    SPANS is a constexpr: the kernels compile the loop only into their 1-row instantiation and
    only where the table lets K exceed one span (GEMV_MAX_K), because a kernel's registers are
    its largest instantiation's and every other path pays for them. For K within one span
    (SmolLM2's 576, Gemma 3 270M's 640) the loop never runs: the same products as gemv_rows.
    Wider K (896-4096: the 0.5B-8B layouts) otherwise leaves batch-1 decode to the 16-row
    tensor-core tiles, whose serial MMA chain over K bounds them (Qwen2.5-1.5B's qkv at 0.15 of
    its bandwidth floor, H100 at c1017d8)."""
    acc_first = tl.zeros((M_T, BN), dtype=tl.float32)
    acc_second = tl.zeros((M_T, BN), dtype=tl.float32)
    k_here = k_dim * 0                      # a tensor, as the loop below carries it
    if SPANS:
        same = tl.zeros((BN,), dtype=tl.int32)
        for k_next in range(K_STEPS * BK, k_dim, K_STEPS * BK):
            first_next = gemv_tiles(w_ptr, first_rows, w_mask, k_dim, k_next, k_dim, BN, BK, K_STEPS)
            second_next = first_next
            if PAIR:
                second_next = gemv_tiles(w_ptr, second_rows, w_mask, k_dim, k_next, k_dim, BN, BK,
                                         K_STEPS)
            norms_next = first_next
            if NORM:
                norms_next = gemv_tiles(norm_ptr, same, same == 0, 0, k_next, k_dim, BN, BK, K_STEPS)
            acc_first += gemv_rows(first_w, norms, x_ptr, rows, row_mask, k_dim, k_here, k_dim, NORM,
                                   M_T, BN, BK, K_STEPS)
            if PAIR:
                acc_second += gemv_rows(second_w, norms, x_ptr, rows, row_mask, k_dim, k_here, k_dim,
                                        NORM, M_T, BN, BK, K_STEPS)
            first_w = first_next
            second_w = second_next
            norms = norms_next
            k_here = k_next
    acc_first += gemv_rows(first_w, norms, x_ptr, rows, row_mask, k_dim, k_here, k_dim, NORM, M_T,
                           BN, BK, K_STEPS)
    if PAIR:
        acc_second += gemv_rows(second_w, norms, x_ptr, rows, row_mask, k_dim, k_here, k_dim, NORM,
                                M_T, BN, BK, K_STEPS)
    return acc_first, acc_second


@triton.jit
def row_sum_squares(x_ptr, rows, row_mask, k_dim, M_T: tl.constexpr, BK: tl.constexpr):
    """sum over k of x[rows[m], k]^2, f32 [M_T] (the RMSNorm statistic of a few rows)."""
    sq = tl.zeros((M_T, BK), dtype=tl.float32)
    for k0 in range(0, k_dim, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * k_dim + k[None, :],
                    mask=row_mask[:, None] & (k < k_dim)[None, :], other=0.0)
        sq += x * x
    return tl.sum(sq, axis=1)


@triton.jit
def inverse_rms(sum_sq, K, eps):
    """RMSNorm's per-row scale 1 / sqrt(mean(x^2) + eps) from the row's sum of squares."""
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def norm_scales(x_ptr, rows, row_mask, dim, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scale a tile path applies to x * g before its products: 1/rms for f16 operands,
    which must be near unit scale (a separate sum of squares of the tile's rows); 1 for tf32,
    whose f32 range lets 1/rms factor out of the product (accumulator_scale applies it)."""
    if DOT_F16:
        scale = inverse_rms(row_sum_squares(x_ptr, rows, row_mask, dim, BLOCK_M, BLOCK_K), dim, eps)
    else:
        scale = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    return scale


@triton.jit
def accumulator_scale(pre_scale, sum_sq, dim, eps):
    """The scale a tile path applies to its accumulator: the other half of norm_scales."""
    if DOT_F16:
        return tl.full(pre_scale.shape, 1.0, dtype=tl.float32)
    else:
        return inverse_rms(sum_sq, dim, eps)
