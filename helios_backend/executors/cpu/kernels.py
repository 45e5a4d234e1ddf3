"""The CPU executor's kernel implementations: the ABI's signatures (kernel_abi/abi.py), compiled bodies.

`CpuKernels(capacity).table` maps the kernel ids whose time dominates a step (the weight
products and attention) to methods taking exactly the reference's arguments; every other id
keeps its numpy reference (kernel_abi/), which the executor binds as the numpy executor does.

Arguments differ from the numpy executor's in one way: pointers into F16 WEIGHT buffers
arrive as the declared f16 arrays (no f32 shadow); the methods pass their uint16 bits to the
compiled primitives (f16_products.py, pointwise.py), which widen them in registers. Pointers
into block weights (Q8_0 / Q4_1, kernel_abi/blocks.py) arrive as BlockWeight (the blocks in the
arena): the products, the embedding gather and the LM head read them in place (block_products.py).

Products of many tokens (prefill, mixed steps: n > SMALL_PRODUCT_TOKENS) are compute-bound:
there a weight is widened tile by tile into preallocated f32 tiles and multiplied by BLAS
(sgemm beats a hand loop by several times), so a prefill step reads each weight once too. With
q8 activations (the default) a block weight's products are the integer ones at every token count
(`_integer`): faster than that sgemm, and a token's product the same bits as in decode.
The tiles are split over `threads` Python workers, each calling single-threaded BLAS (numpy
releases the GIL): OpenBLAS's own threads measured 7-20 GFLOP/s on the shared 2-core machine
where one thread gave 47-52.
Attention is one compiled kernel for every live token (decode rows and prefill chunks).

Workspace: one set of scratch arrays sized at load from the largest program (tokens, widths,
context), owned by the instance; the hot path allocates nothing but small index arrays.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import numpy as np
from numpy.lib.stride_tricks import as_strided

from helios_backend.executors.cpu import attention, block_products, f16_products, pointwise
from helios_backend.executors.cpu.sharing import WorkSharing
from helios_backend.kernel_abi.activations import Q8_BLOCK_BYTES
from helios_backend.kernel_abi.activations import check as activations_check
from helios_backend.kernel_abi.blocks import BlockWeight
from helios_backend.kernel_abi.linear import ACTIVATION_SILU
from helios_backend.kernel_abi.logprobs import log_softmax_row
from helios_backend.kernel_abi.products import gate_activation_f16 as reference_gate_activation_f16
from helios_backend.kernel_abi.state import live_tokens, row_starts, token_rows

# Up to this many tokens a product streams the f16 weight through the compiled GEMV-like loop
# (memory-bound); above it the widened-tile BLAS product wins (measured: docs/cpu-executor.md).
SMALL_PRODUCT_TOKENS = 32
# Below this many multiply-adds (tokens x out x in; attention: its score and mixing passes) work runs
# on the calling thread alone: a polling helper starts its part 10-30 us after the call begins (its
# Python and the dispatch; a 1-token [3072, 576] product 69-75 us shared, 82-94 us alone). SmolLM2 at
# b=1: the output projection (331K) stays alone, q/k/v (553K) and down (885K) are shared (b=1 steps
# 12.5 / 10.1 ms against 13.7 / 13.4 ms at 1M in two interleaved runs; docs/cpu-executor.md).
# Above it, up to CHUNKS_PER_THREAD chunks per thread.
SHARED_WORK_MACS = 3 << 17
CHUNKS_PER_THREAD = 4
# A row with at least this many queries (a prefill chunk) attends through BLAS products (_row_products).
ATTENTION_PRODUCT_TOKENS = 16
ATTENTION_QUERY_BLOCK = 128      # queries of one such row per score matrix (_row_products)
PASS_TOKENS = 128                # tokens of one pass of the product path's products (_f16_passes)
# f32 elements of one widened weight tile (1 MiB: a [512, 576] x [576, 455] sgemm keeps BLAS at its
# speed, and each thread's tile stays resident after the first prefill: 4 MiB tiles held 8 MiB)
TILE_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class Capacity:
    """The largest shapes any loaded program passes, which size the workspace."""

    tokens: int            # packed tokens of the largest program
    rows: int              # rows of the largest program
    width: int             # widest product output or input (elements per token, 2 * ffn_dim included)
    heads: int             # query heads
    context: int           # cache positions a row can attend to (pages_per_row * page_tokens)


Weight = Union[np.ndarray, BlockWeight]     # an F16 weight pointer's argument: f16, or blocks read in place


def _bits(weight: np.ndarray) -> np.ndarray:
    return weight.view(np.uint16)


def _plane(cache: np.ndarray) -> np.ndarray:
    """A cache plane as the compiled kernels take it: f32 as is, f16 as its uint16 bits."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


class CpuKernels:
    """Compiled implementations of the hot kernel ids over one workspace."""

    def __init__(self, capacity: Capacity, threads: int, share_above: int = SHARED_WORK_MACS,
                 activations: str = "f32") -> None:
        self.capacity = capacity
        self.threads = threads
        self.share_above = share_above     # multiply-adds from which a call is shared over the threads
        # block-weight products' activations (kernel_abi/activations.py): f32, or q8 blocks made once a
        # call into `_quantized` (every output row and thread reads them)
        self.activations = activations_check(activations)
        self._quantized = np.zeros(capacity.tokens * (capacity.width // 32 + 1) * Q8_BLOCK_BYTES
                                   if activations == "q8" else 0, dtype=np.int8)
        self.query_block = ATTENTION_QUERY_BLOCK    # queries per score matrix of a prefill chunk's attention
        # threads - 1 helpers share large products and attention with the calling thread (sharing.py);
        # each thread has its own scratch (`_own`): a tile it widens large products' weights into
        # (for a 1-thread BLAS) and attention scores (every query head of a group over the context)
        self.sharing = WorkSharing(threads - 1)
        self._scratch = threading.local()
        self._normed = np.zeros(capacity.tokens * capacity.width, dtype=np.float32)
        self._projected = np.zeros(capacity.tokens * capacity.width, dtype=np.float32)
        self._identity = np.arange(capacity.tokens, dtype=np.int64)

    @property
    def table(self) -> Mapping[str, Callable[..., None]]:
        return {
            "embedding.gather.v1": self.embed_tokens,
            "attention.qkv_rope_store.v1": self.qkv_rope_store,
            "attention.qkv_bias_rope_store.v1": self.qkv_bias_rope_store,
            "attention.paged.v1": self.paged_attention,
            "attention.paged_split.v1": self.paged_attention_split,
            "linear.residual.v1": self.linear_residual,
            "linear.project.v1": self.linear_project,
            # the product path's products (kernel_abi/products.py): f16 activations widened once into
            # the workspace, then the same compiled products
            "linear.product_f16.v1": self.product_f16,
            "linear.product_f32.v1": self.product_f32,
            "linear.residual_f16.v1": self.residual_f16,
            # and the pointwise kernels between them (a 512-token prefill of SmolLM2 spent 240 of its
            # 1430 ms of CPU time in their numpy references, one thread)
            "norm.rms_f16.v1": self.rms_norm_f16,
            "activation.to_f16.v1": self.to_f16,
            "mlp.gate_activation_f16.v1": self.gate_activation_f16,
            "attention.rope_store.v1": self.rope_store,
            "mlp.norm_gate_up_silu.v1": self.norm_gate_up_silu,
            "logits.norm_head.v1": self.norm_logits,
            "logits.score_targets.v1": self.score_targets,
        }

    # ---- shared -------------------------------------------------------------------------
    def _product(self, out: np.ndarray, x: np.ndarray, weight: Weight, n: int, k: int, m: int,
                 accumulate: bool) -> None:
        """out[:n] (+)= x[:n] @ weight.T; out [n, m] f32 flat, x [n, k] f32 flat, weight [m, k] f16 or
        a block matrix (kernel_abi/blocks.py) read in place."""
        if isinstance(weight, BlockWeight) and (weight.cols != k or weight.rows < m):
            raise ValueError(f"a [{weight.rows}, {weight.cols}] block weight read as [{m}, {k}]")
        activations = self._activations(x, weight, n, k)
        if n <= SMALL_PRODUCT_TOKENS or self._integer(weight):
            chunks = max(1, self._chunks(n * m * k, m // 4))    # whole row quads per chunk (claiming.chunk_rows)

            def rows(counters: np.ndarray, calls: np.ndarray, caller: bool) -> None:
                if isinstance(weight, BlockWeight):
                    block_products.block_linear_claimed(out, activations, weight.data, weight.layout.code, n, k, m,
                                                        accumulate, chunks, counters, self._own("sums", 16), calls,
                                                        caller)
                else:
                    f16_products.linear_claimed(out, x, _bits(weight), n, k, m, accumulate, chunks, counters, calls,
                                                caller)

            self.sharing.run_claimed(rows, chunks)
            return
        inputs = activations[:n * k].reshape(n, k)
        outputs = out[:n * m].reshape(n, m)
        tile_rows = max(1, min(-(-m // (2 * self.threads)), TILE_ELEMENTS // k))

        def tile(index: int) -> None:
            start = index * tile_rows
            rows = min(tile_rows, m - start)
            memory = self._own("tile", TILE_ELEMENTS)
            if isinstance(weight, BlockWeight):
                block_products.dequantize_rows(memory, weight.data, weight.layout.code, start, rows, k)
            else:
                f16_products.widen(memory, _bits(weight)[start * k:], rows * k)
            widened = memory[:rows * k].reshape(rows, k)
            if accumulate:
                outputs[:, start:start + rows] += inputs @ widened.T
            else:
                np.matmul(inputs, widened.T, out=outputs[:, start:start + rows])

        self.sharing.run(tile, -(-m // tile_rows))

    def _integer(self, weight: Weight) -> bool:
        """Whether products with `weight` multiply q8 activations with integer dot products: block
        weights with q8 activations, at every token count. A token's product is then the same bits
        whatever the tokens beside it (block_codegen._emit_q8_dots), in a decode batch, a
        verification step of drafted tokens or a prefill chunk (which a BLAS product of the
        activations' round trip would not give: another summation order), and for many tokens
        it is the faster product too (docs/cpu-executor.md)."""
        return self.activations == "q8" and isinstance(weight, BlockWeight)

    def _activations(self, x: np.ndarray, weight: Weight, n: int, k: int) -> np.ndarray:
        """What a product multiplies `weight` with: x, or for a block weight with q8 activations the
        q8 blocks of x[:n * k] (`_integer`: the integer products read them)."""
        if not self._integer(weight):
            return x
        block_products.quantize_rows(self._quantized, x, n, k)
        return self._quantized

    def _chunks(self, work: int, units: int) -> int:
        """How many chunks to share `work` multiply-adds over: one below `share_above` (the calling
        thread alone), else up to CHUNKS_PER_THREAD per thread (a quarter of `share_above` at
        least each), never more than `units`."""
        if self.sharing.helpers == 0 or work < self.share_above:
            return 1
        return max(1, min(units, CHUNKS_PER_THREAD * self.threads, work // max(1, self.share_above // 4)))

    def _own(self, name: str, size: int, dtype: type = np.float32) -> np.ndarray:
        """This thread's scratch `name` of at least `size` elements (allocated on the thread's first
        use, grown when a larger call needs more, then kept: the threads that run kernels are the
        caller and the helpers, so a few arrays each)."""
        memory: Optional[np.ndarray] = getattr(self._scratch, name, None)
        if memory is None or memory.size < size or memory.dtype != dtype:
            memory = np.zeros(size, dtype=dtype)
            setattr(self._scratch, name, memory)
        return memory

    def close(self) -> None:
        self.sharing.close()

    def _norm(self, hidden: np.ndarray, rows: np.ndarray, weight: np.ndarray, dim: int, eps: float) -> np.ndarray:
        pointwise.rms_norm(self._normed, hidden, rows, _bits(weight), dim, eps)
        return self._normed

    # ---- kernel ids ---------------------------------------------------------------------
    def embed_tokens(self, hidden: np.ndarray, table: Weight, ids: np.ndarray, geometry: np.ndarray,
                     tokens: int, dim: int) -> None:
        if isinstance(table, BlockWeight):
            block_products.block_gather_rows(hidden, table.data, table.layout.code, ids, live_tokens(geometry), dim)
        else:
            pointwise.gather_rows(hidden, _bits(table), ids, live_tokens(geometry), dim)

    def qkv_rope_store(self, q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, hidden: np.ndarray,
                       norm_weight: np.ndarray, qkv_weight: Weight, rope_table: np.ndarray,
                       positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                       geometry: np.ndarray, tokens: int, dim: int, q_heads: int, kv_heads: int,
                       head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                       eps: float, rope_pairing: int) -> None:
        self.qkv_bias_rope_store(q_out, k_cache, v_cache, hidden, norm_weight, qkv_weight, None, rope_table,
                                 positions, page_table, row_slot, geometry, tokens, dim, q_heads, kv_heads, head_dim,
                                 page_tokens, pages_per_row, page_stride, eps, rope_pairing)

    def qkv_bias_rope_store(self, q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, hidden: np.ndarray,
                            norm_weight: np.ndarray, qkv_weight: Weight, qkv_bias: Optional[np.ndarray],
                            rope_table: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                            row_slot: np.ndarray, geometry: np.ndarray, tokens: int, dim: int, q_heads: int,
                            kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                            eps: float, rope_pairing: int) -> None:
        """The projection plus an f32 bias (None: no bias) before RoPE, as the reference."""
        n = live_tokens(geometry)
        if n == 0:
            return
        width = (q_heads + 2 * kv_heads) * head_dim
        normed = self._norm(hidden, self._identity[:n], norm_weight, dim, eps)
        self._product(self._projected, normed, qkv_weight, n, dim, width, False)
        if qkv_bias is not None:
            projected = self._projected[:n * width].reshape(n, width)
            projected += qkv_bias[:width]
        pointwise.rope_store(q_out, _plane(k_cache), _plane(v_cache), self._projected, rope_table, positions,
                             token_rows(geometry, tokens), row_slot, page_table, n, q_heads, kv_heads, head_dim,
                             page_tokens, pages_per_row, page_stride, rope_pairing)

    def paged_attention(self, out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                        geometry: np.ndarray, rows: int, tokens: int, q_heads: int, kv_heads: int,
                        head_dim: int, page_tokens: int, pages_per_row: int, page_stride: int,
                        scale: float) -> None:
        n = live_tokens(geometry)
        if n == 0:
            return
        rows_of = token_rows(geometry, tokens)
        starts = row_starts(geometry, rows, tokens)
        lengths = starts[1:] - starts[:-1]
        long_rows = np.flatnonzero(lengths >= ATTENTION_PRODUCT_TOKENS)
        if long_rows.size:       # prefill chunks: BLAS products per (row, kv head); the other tokens compiled
            chosen = np.flatnonzero(lengths[rows_of[:n]] < ATTENTION_PRODUCT_TOKENS).astype(np.int64)
            self._row_products(out, q, k_cache, v_cache, positions, page_table, row_slot, starts, long_rows,
                               q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale)
        else:
            chosen = self._identity[:n]
        if chosen.size == 0:
            return
        # multiply-adds of the score and mixing passes, an upper bound (every token at the deepest position)
        work = 2 * int(chosen.size) * q_heads * head_dim * (int(positions[:n].max()) + 1)
        pairs = int(chosen.size) * kv_heads
        chunks = self._chunks(work, pairs)

        def heads(counters: np.ndarray, calls: np.ndarray, caller: bool) -> None:
            scores = self._own("scores", self.capacity.heads * self.capacity.context)
            attention.attention_claimed(out, q, _plane(k_cache), _plane(v_cache), positions, rows_of, row_slot,
                                        page_table, chosen, q_heads, kv_heads, head_dim, page_tokens, pages_per_row,
                                        page_stride, scale, scores, pairs, chunks, counters, calls, caller)

        self.sharing.run_claimed(heads, chunks)

    def _row_products(self, out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray, starts: np.ndarray,
                      long_rows: np.ndarray, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
                      pages_per_row: int, page_stride: int, scale: float) -> None:
        """Attention of rows with many queries (prefill chunks) as the reference computes it: per
        (row, kv head) the head's keys and values gathered from the pages, scores and mixing as
        two single-threaded BLAS products (the causal mask applied to the full score matrix),
        the (row, kv head) tasks shared over the threads. The compiled per-pair kernel ran a
        64-token chunk at a 512-token context in ~7 ms a layer: its dot products are per key."""
        group = q_heads // kv_heads
        kv_width = kv_heads * head_dim
        q_width = q_heads * head_dim
        page_elements = page_tokens * kv_width

        def pages_of(plane: np.ndarray) -> np.ndarray:   # [pages, page_tokens, kv_heads, head_dim], no copy
            count = (plane.size - page_elements) // page_stride + 1
            return as_strided(plane, shape=(count, page_tokens, kv_heads, head_dim),
                              strides=tuple(plane.itemsize * s for s in (page_stride, kv_width, head_dim, 1)))

        k_pages, v_pages = pages_of(k_cache), pages_of(v_cache)
        # (row, kv head, first query, end query): a row's queries in blocks of `query_block`,
        # so a task's score matrix is [block * group, context of its last query] (a 512-token chunk's
        # whole [512 * 3, 512] matrix was 3 MiB per thread, resident after the first prefill), and an
        # early block attends only to the keys before it
        block = self.query_block
        tasks = [(int(r), kv, first, min(first + block, int(starts[r + 1])))
                 for r in long_rows for kv in range(kv_heads) for first in range(int(starts[r]), int(starts[r + 1]), block)]
        # the last blocks of a row attend to the most keys: handed out first, so the threads finish together
        tasks.sort(key=lambda task: int(starts[task[0]]) - task[3])

        def task(index: int) -> None:
            r, kv, first, end = tasks[index]
            count = end - first
            context = int(positions[first:end].max()) + 1
            table = page_table[int(row_slot[r]) * pages_per_row:][:-(-context // page_tokens)]
            span = table.size * page_tokens
            # every array in this thread's scratch (grown to the largest block once): a prefill
            # step's score matrices would otherwise stay in the allocator's heap
            gathered = self._own("gathered", span * head_dim, k_cache.dtype)[:span * head_dim]
            keys = self._own("keys", span * head_dim)[:span * head_dim]
            values = self._own("values", span * head_dim)[:span * head_dim]
            for pages, target in ((k_pages, keys), (v_pages, values)):   # in the plane's dtype, then f32
                np.take(pages[:, :, kv, :], table, axis=0, out=gathered.reshape(table.size, page_tokens, head_dim))
                np.copyto(target, gathered)
            keys2, values2 = keys.reshape(span, head_dim)[:context], values.reshape(span, head_dim)[:context]
            queries = q[first * q_width:end * q_width].reshape(count, q_heads, head_dim)[:, kv * group:(kv + 1) * group]
            scores = self._own("row_scores", count * group * context)[:count * group * context]
            scores = scores.reshape(count * group, context)
            np.matmul(queries.reshape(count * group, head_dim), keys2.T, out=scores)
            attention.causal_softmax(scores.reshape(-1), count * group, context, group, positions, first, scale)
            mixed = self._own("mixed", count * group * head_dim)[:count * group * head_dim]
            np.matmul(scores, values2, out=mixed.reshape(count * group, head_dim))
            out[first * q_width:end * q_width].reshape(count, q_width)[:, kv * group * head_dim:
                                                                         (kv + 1) * group * head_dim] = \
                mixed.reshape(count, group * head_dim)

        self.sharing.run(task, len(tasks))

    def paged_attention_split(self, out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                              positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                              geometry: np.ndarray, partials: np.ndarray, arrivals: np.ndarray, rows: int,
                              tokens: int, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
                              pages_per_row: int, page_stride: int, scale: float, splits: int) -> None:
        """Same result as the unsplit kernel; the split scratch stays untouched (as in the reference)."""
        self.paged_attention(out, q, k_cache, v_cache, positions, page_table, row_slot, geometry, rows, tokens,
                             q_heads, kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale)

    def linear_residual(self, hidden: np.ndarray, x: np.ndarray, weight: Weight, geometry: np.ndarray,
                        tokens: int, in_dim: int, out_dim: int) -> None:
        self._product(hidden, x, weight, live_tokens(geometry), in_dim, out_dim, True)

    def linear_project(self, out: np.ndarray, x: np.ndarray, weight: Weight, geometry: np.ndarray,
                       tokens: int, in_dim: int, out_dim: int) -> None:
        n = live_tokens(geometry)
        self._product(out, x, weight, n, in_dim, out_dim, False)
        out[n * out_dim:tokens * out_dim] = 0.0

    def _widened(self, x: np.ndarray, n: int, k: int) -> np.ndarray:
        """The live rows of f16 activations x [n, k] as f32, in the workspace (flat)."""
        widened = self._normed[:n * k]
        f16_products.widen(widened, _bits(x), n * k)
        return widened

    def residual_f16(self, hidden: np.ndarray, x: np.ndarray, weight: Weight, geometry: np.ndarray,
                     tokens: int, in_dim: int, out_dim: int) -> None:
        self._f16_passes(hidden, x, weight, live_tokens(geometry), in_dim, out_dim, True)

    def _stored_product(self, out: np.ndarray, x: np.ndarray, weight: Weight, geometry: np.ndarray,
                        tokens: int, in_dim: int, out_dim: int) -> None:
        """out[:n] = x[:n] @ weight.T in out's dtype (f16 rounds), rows n .. tokens zero."""
        n = live_tokens(geometry)
        self._f16_passes(out, x, weight, n, in_dim, out_dim, False)
        out[n * out_dim:tokens * out_dim] = 0

    def _f16_passes(self, out: np.ndarray, x: np.ndarray, weight: Weight, n: int, k: int, m: int,
                    accumulate: bool) -> None:
        """out[:n] (+)= x[:n] @ weight.T for f16 activations x [n, k], out f32 (written or accumulated)
        or f16 (written, rounded: past its range inf, as on the GPU), PASS_TOKENS tokens a pass: each
        pass's activations widened into the workspace and an f16 output's f32 products narrowed from
        it, so what stays resident after a 512-token prefill is one pass's (SmolLM2's gate/up: 1.5
        MiB of f32 products, not 6). A token's q8 product does not depend on the pass it is in: q8
        products are the same bits in any group of tokens (block_codegen._emit_q8_dots); with f32
        activations a pass of <= SMALL_PRODUCT_TOKENS tokens (a prefill's tail) takes the compiled loop
        and the others BLAS, which differ in their f32 summation order only."""
        narrowed = out.dtype == np.float16
        for first in range(0, n, PASS_TOKENS):
            count = min(PASS_TOKENS, n - first)
            widened = self._widened(x[first * k:], count, k)
            if narrowed:
                self._product(self._projected, widened, weight, count, k, m, False)
                pointwise.narrow(_bits(out[first * m:]), self._projected, 0, count * m)
            else:
                self._product(out[first * m:], widened, weight, count, k, m, accumulate)

    product_f16 = _stored_product
    product_f32 = _stored_product

    def _over_tokens(self, kernel: Callable[[int, int], None], n: int, width: int) -> None:
        """kernel(first, end) over tokens [0, n): one range on the calling thread, or for a call of at
        least `share_above` elements one range per thread (sharing.run): a pointwise kernel's tokens
        are independent, and each token's values the same bits in any range (pointwise.py)."""
        chunks = self.threads if self.sharing.helpers and n * width >= self.share_above and n >= self.threads else 1
        size = -(-n // chunks)
        self.sharing.run(lambda index: kernel(index * size, min(n, (index + 1) * size)), chunks)

    def rms_norm_f16(self, out: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray, geometry: np.ndarray,
                     tokens: int, dim: int, eps: float) -> None:
        n = live_tokens(geometry)
        bits, weight = _bits(out), _bits(norm_weight)
        self._over_tokens(lambda first, end: pointwise.rms_norm_f16(bits, hidden, first, end, weight, dim, eps), n,
                          dim)
        out[n * dim:tokens * dim] = 0

    def to_f16(self, out: np.ndarray, x: np.ndarray, geometry: np.ndarray, tokens: int, dim: int) -> None:
        n = live_tokens(geometry)
        bits = _bits(out)
        self._over_tokens(lambda first, end: pointwise.narrow(bits, x, first * dim, end * dim), n, dim)
        out[n * dim:tokens * dim] = 0

    def gate_activation_f16(self, out: np.ndarray, projected: np.ndarray, geometry: np.ndarray, tokens: int,
                            ffn_dim: int, activation: int) -> None:
        """SiLU compiled; other activations (GELU) by the reference."""
        if activation != ACTIVATION_SILU:
            reference_gate_activation_f16(out, projected, geometry, tokens, ffn_dim, activation)
            return
        n = live_tokens(geometry)
        bits, both = _bits(out), _bits(projected)
        self._over_tokens(lambda first, end: pointwise.silu_gate_f16(bits, both, first, end, ffn_dim), n, 3 * ffn_dim)
        out[n * ffn_dim:tokens * ffn_dim] = 0

    def rope_store(self, q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, projected: np.ndarray,
                   rope_table: np.ndarray, positions: np.ndarray, page_table: np.ndarray, row_slot: np.ndarray,
                   geometry: np.ndarray, tokens: int, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
                   pages_per_row: int, page_stride: int, rope_pairing: int) -> None:
        """The product path's RoPE and cache store: qkv_rope_store's compiled second half."""
        n = live_tokens(geometry)
        if n == 0:
            return
        pointwise.rope_store(q_out, _plane(k_cache), _plane(v_cache), projected, rope_table, positions,
                             token_rows(geometry, tokens), row_slot, page_table, n, q_heads, kv_heads, head_dim,
                             page_tokens, pages_per_row, page_stride, rope_pairing)

    def norm_gate_up_silu(self, out: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray,
                          gate_up: Weight, geometry: np.ndarray, tokens: int, dim: int,
                          ffn_dim: int, eps: float) -> None:
        n = live_tokens(geometry)
        normed = self._norm(hidden, self._identity[:n], norm_weight, dim, eps)
        if n > SMALL_PRODUCT_TOKENS:
            self._gate_up_tiles(out, normed, gate_up, n, dim, ffn_dim)
            return
        self._product(self._projected, normed, gate_up, n, dim, 2 * ffn_dim, False)
        pointwise.silu_gate(out, self._projected, n, ffn_dim, ffn_dim, 0)

    def _gate_up_tiles(self, out: np.ndarray, x: np.ndarray, gate_up: Weight, n: int, k: int, ffn: int) -> None:
        """silu(gate) * up of many tokens tile by tile: a tile's gate rows [s, s + r) and the
        matching up rows [ffn + s, ffn + s + r) give those 2r columns of every token into this
        thread's scratch (widened into a tile for one BLAS product, or with q8 activations two
        integer products reading the blocks in place: `_integer`), and the gate is applied into
        out's columns [s, s + r). The [n, 2 ffn] projection is never held whole (6 MiB at a
        512-token prefill of SmolLM2, resident from the first prefill on)."""
        if isinstance(gate_up, BlockWeight) and (gate_up.cols != k or gate_up.rows < 2 * ffn):
            raise ValueError(f"a [{gate_up.rows}, {gate_up.cols}] block weight read as [{2 * ffn}, {k}]")
        activations = self._activations(x, gate_up, n, k)
        inputs = activations if self._integer(gate_up) else activations[:n * k].reshape(n, k)
        # as many tiles as the tile size needs, rounded up to a multiple of the threads (7 tiles of
        # SmolLM2's 1536 gate rows left one thread 4 and the other 3)
        tiles = max(2 * self.threads, -(-ffn // max(1, TILE_ELEMENTS // (2 * k))))
        tiles = -(-tiles // self.threads) * self.threads
        tile_rows = -(-ffn // tiles)

        def integer_tile(index: int) -> None:
            assert isinstance(gate_up, BlockWeight)
            start = index * tile_rows
            rows = min(tile_rows, ffn - start)
            row_bytes = k // 32 * gate_up.layout.block_bytes
            projected = self._own("gate_up", n * 2 * tile_rows + tile_rows)
            for half, first in enumerate((start, ffn + start)):     # gate, up: columns [half r, half r + r)
                block_products.block_linear_rows(projected[half * rows:], inputs, gate_up.data[first * row_bytes:],
                                                 gate_up.layout.code, n, k, 2 * rows, False, 0, rows,
                                                 self._own("sums", 16))
            pointwise.silu_gate(out, projected, n, rows, ffn, start)

        def tile(index: int) -> None:
            start = index * tile_rows
            rows = min(tile_rows, ffn - start)
            memory = self._own("tile", TILE_ELEMENTS)
            for half, first in enumerate((start, ffn + start)):
                if isinstance(gate_up, BlockWeight):
                    block_products.dequantize_rows(memory[half * rows * k:], gate_up.data, gate_up.layout.code, first,
                                                   rows, k)
                else:
                    f16_products.widen(memory[half * rows * k:], _bits(gate_up)[first * k:], rows * k)
            projected = self._own("gate_up", n * 2 * tile_rows)[:n * 2 * rows]
            np.matmul(inputs, memory[:2 * rows * k].reshape(2 * rows, k).T, out=projected.reshape(n, 2 * rows))
            pointwise.silu_gate(out, projected, n, rows, ffn, start)

        self.sharing.run(integer_tile if self._integer(gate_up) else tile, -(-ffn // tile_rows))

    def norm_logits(self, logits: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray, head: Weight,
                    geometry: np.ndarray, rows: int, tokens: int, dim: int, vocab: int, eps: float) -> None:
        starts = row_starts(geometry, rows, tokens)
        lengths = starts[1:] - starts[:-1]
        live = np.flatnonzero(lengths > 0)
        out = logits[:rows * vocab].reshape(rows, vocab)
        out[lengths == 0] = 0.0
        if live.size == 0:
            return
        normed = self._norm(hidden, (starts[live + 1] - 1).astype(np.int64), norm_weight, dim, eps)
        if live.size == rows:        # every row live (decode): straight into the logits
            self._product(logits, normed, head, rows, dim, vocab, False)
            return
        for j, row in enumerate(live):   # a few rows of a prefill or mixed step
            self._product(out[row], normed[j * dim:(j + 1) * dim], head, 1, dim, vocab, False)

    def score_targets(self, completion: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray, head: Weight,
                      targets: np.ndarray, geometry: np.ndarray, tokens: int, dim: int, vocab: int, eps: float,
                      record_base: int) -> None:
        """The reference's scores (SCORED_PREFILL) with the head read in place: a block head has no
        f16 array for the reference to read, and its f32 expansion would stay resident. Allocates
        the scored tokens' logits per call (a scored prefill, not a decode step)."""
        scores = np.zeros(tokens, dtype=np.float32)
        n = min(live_tokens(geometry), tokens)
        wanted = np.asarray(targets[:n], dtype=np.int64)
        live = np.flatnonzero((wanted >= 0) & (wanted < vocab))
        if live.size:
            normed = self._norm(hidden, live.astype(np.int64), norm_weight, dim, eps)
            logits = np.empty(live.size * vocab, dtype=np.float32)
            self._product(logits, normed, head, int(live.size), dim, vocab, False)
            for i, t in enumerate(live):
                scores[t] = np.float32(log_softmax_row(logits[i * vocab:(i + 1) * vocab])[wanted[t]])
        completion[record_base:record_base + tokens] = scores.view(np.int32)
