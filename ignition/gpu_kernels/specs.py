"""The kernel table: for each ABI kernel id, its Triton source, tile sizes and launch grid.

Tile sizes are constexprs fixed at preparation; everything shape-like arrives at launch as an
immediate, so one cubin serves every capacity variant. `grid` maps the launch's immediates
(ABI parameter name -> value) and the spec's constexprs to the CUDA grid; the block is
32 * num_warps threads. Grids depend only on immediates (capacities), never on live counts:
programs past the live work exit early, which keeps every launch graph-replayable.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from helios_backend.kernel_abi.sampling import partial_words

Grid = tuple[int, int, int]
Immediates = Mapping[str, int]     # a launch's integer immediates (grids depend on no float)
GridFunction = Callable[[Immediates, Mapping[str, int]], Grid]


# Every pointer param is assumed ALIGNMENT-byte aligned (buffers are 256-byte aligned; byte
# offsets are checked by the library); `divisible` integers are multiples of ALIGNMENT.
ALIGNMENT = 16


MAX_GRID_Y = 65535          # CUDA's limit on grid y and z (x goes to 2^31 - 1)


class GeometryError(ValueError):
    """A launch's immediates exceed what the compiled tile configuration supports."""


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@dataclasses.dataclass(frozen=True)
class Widening:
    """Tiles a kernel compiles only for the cores that need them: when a recorded launch's
    `immediate` exceeds the base constexpr `limit`, that core's cubin of the id is compiled with
    the constexprs of the narrowest level serving it (the kernel then carries a second
    instantiation behind a branch on the immediate). Cores whose launches all fit keep exactly
    the base kernel, so its registers and shared memory do not pay for shapes they never launch.

    `levels`: (widest immediate served, constexprs replacing the base ones), ascending; a core
    compiles the level of its widest launch, so 128-dim heads do not run on tiles sized (and
    half masked) for 256-dim ones."""
    immediate: str
    limit: str
    levels: tuple[tuple[int, Mapping[str, int]], ...]

    def level(self, value: int) -> Mapping[str, int]:
        """The constexprs of the narrowest level serving `value` (the widest one past them all:
        the grid rejects what it cannot serve)."""
        for widest, constexprs in self.levels:
            if value <= widest:
                return constexprs
        return self.levels[-1][1]


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    kernel_id: str                                # ABI id (helios_backend/kernel_abi/abi.py)
    module: str                                   # ignition.gpu_kernels.triton_lang.<module>
    function: str                                 # @triton.jit function = cubin symbol
    constexprs: Mapping[str, int]                 # tile sizes; PDL is appended by the library
    grid: GridFunction
    num_warps: int = 4
    num_stages: int = 2
    # Integer params the cubin assumes divisible by ALIGNMENT (row widths, strides): with
    # aligned pointers this lets Triton emit 16-byte vector and cp.async loads, without which
    # f16 streams degrade to 2-byte loads and loops do not pipeline. geometry() rejects
    # launches that break the assumption.
    divisible: tuple[str, ...] = ()
    widening: Widening | None = None
    # Pointer params (besides weights, which no node writes) the kernel reads BEFORE its PDL
    # wait, while the previous node may still run: safe only where the program's preceding node
    # writes none of them, which preparation checks (KernelLibrary.early_read_conflicts).
    early_reads: tuple[str, ...] = ()

    def widening_of(self, immediates: Immediates) -> int | None:
        """The immediate a launch needs widened tiles for (its `widening.immediate`), else None."""
        if self.widening is None:
            return None
        value = int(immediates[self.widening.immediate])
        return value if value > self.constexprs[self.widening.limit] else None

    def widened_tiles(self, width: int | None) -> Mapping[str, int]:
        """The constexprs of a cubin compiled for launches up to `width` (None: the base tiles)."""
        if self.widening is None or width is None:
            return self.constexprs
        return {**self.constexprs, **self.widening.level(width)}

    def tiles(self, immediates: Immediates) -> Mapping[str, int]:
        """The constexprs a launch with these immediates compiles with."""
        return self.widened_tiles(self.widening_of(immediates))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise GeometryError(message)


def _token_tiles(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (cdiv(a["tokens"], c["BLOCK_T"]), 1, 1)


def _token_dim_tiles(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (cdiv(a["tokens"], c["BLOCK_T"]), cdiv(a["dim"], c["BLOCK_D"]), 1)


def _step_geometry(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
    return _token_tiles(a, c)


def _gemm(n_name: str, m_name: str) -> GridFunction:
    """[BLOCK_M, BLOCK_N] output tiles: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), 1)."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        return (cdiv(a[n_name], c["BLOCK_N"]), cdiv(a[m_name], c["BLOCK_M"]), 1)
    return grid


def _gemm_tiles_first(n_name: str, m_name: str) -> GridFunction:
    """_gemm with the axes swapped, (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), 1): the M tiles of one
    column block are consecutive programs (they share its weight slice through L2)."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        blocks = cdiv(a[n_name], c["BLOCK_N"])
        _require(blocks <= MAX_GRID_Y, f"{n_name} {a[n_name]} needs {blocks} column blocks > {MAX_GRID_Y} (grid y)")
        return (cdiv(a[m_name], c["BLOCK_M"]), blocks, 1)
    return grid


def _split_k_gemm(n_name: str, m_name: str, k_name: str) -> GridFunction:
    """_gemm tiles times cdiv(K, K_SPLIT) K slices on grid z."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        x, y, _ = _gemm(n_name, m_name)(a, c)
        return (x, y, cdiv(a[k_name], c["K_SPLIT"]))
    return grid


def _qkv_rope_store(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["head_dim"] % 2 == 0, "head_dim must be even for RoPE")
    heads = a["q_heads"] + 2 * a["kv_heads"]
    if _gemv_fits(a, c, "tokens", "dim"):
        return (heads * cdiv(a["head_dim"] // 2, c["GEMV_P"]), 1, 1)
    return (heads * cdiv(a["head_dim"] // 2, c["BLOCK_P"]), cdiv(a["tokens"], c["BLOCK_M"]), 1)


def _gemv_fits(a: Immediates, c: Mapping[str, int], count: str, k_name: str | None) -> bool:
    """The kernel's own branch condition: few rows, and (when a program covers all of K) K
    within one span of GEMV_STEPS x GEMV_K, or for one row within GEMV_MAX_K (the 1-row
    instantiation walks K a span at a time: common.gemv_span)."""
    if k_name is None:
        return a[count] <= c["GEMV_TOKENS"]
    span = c["GEMV_K"] * c["GEMV_STEPS"]
    return (a[count] <= 1 and a[k_name] <= max(c["GEMV_MAX_K"], span)) or \
        (a[count] <= c["GEMV_TOKENS"] and a[k_name] <= span)


def _large_or(count: str, n_name: str, smaller: GridFunction) -> GridFunction:
    """From LARGE_TOKENS rows, [LARGE_M, LARGE_N] tiles over the whole of K:
    (cdiv(N, LARGE_N), cdiv(M, LARGE_M), 1); `smaller` below (the kernel's own branch)."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        if a[count] >= c["LARGE_TOKENS"]:
            return (cdiv(a[n_name], c["LARGE_N"]), cdiv(a[count], c["LARGE_M"]), 1)
        return smaller(a, c)
    return grid


def _gemv_or_tiles(count: str, n_name: str, tiles: GridFunction,
                   k_name: str | None = None, split_name: str | None = None) -> GridFunction:
    """Decode shapes (_gemv_fits) run GEMV_N output columns per program over every row of the
    capacity; larger ones use `tiles`. The GEMV grid keeps `tiles`' grid z (K slices), or for
    one row with `split_name` (the K immediate) has cdiv(K, GEMV_SPLIT) slices of its own."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        x, y, z = tiles(a, c)
        if _gemv_fits(a, c, count, k_name):
            slices = cdiv(a[split_name], c["GEMV_SPLIT"]) if split_name and a[count] <= 1 else z
            return (cdiv(a[n_name], c["GEMV_N"]), 1, slices)
        return (x, y, z)
    return grid


def _qkv_norm_rope_store(a: Immediates, c: Mapping[str, int]) -> Grid:
    """One program per (whole head, token tile): the q/k norm needs every dim of its head."""
    _require(a["head_dim"] % 2 == 0, "head_dim must be even for RoPE")
    _require(a["head_dim"] // 2 <= c["BLOCK_P"],
             f"head_dim {a['head_dim']} > 2 x BLOCK_P {c['BLOCK_P']} (a program holds a whole head)")
    return (a["q_heads"] + 2 * a["kv_heads"], cdiv(a["tokens"], c["BLOCK_M"]), 1)


def _large_attention(a: Immediates, c: Mapping[str, int]) -> bool:
    """The kernel's own branch: paged_attention's large-query-block instantiation."""
    return "LARGE_TOKENS" in c and a["tokens"] >= c["LARGE_TOKENS"] and a["head_dim"] <= c["LARGE_D"]


def _paged_attention(a: Immediates, c: Mapping[str, int]) -> Grid:
    group = a["q_heads"] // a["kv_heads"]
    _require(a["q_heads"] % a["kv_heads"] == 0, "q_heads must be a multiple of kv_heads")
    _require(group <= c["BLOCK_M"], f"GQA group {group} > BLOCK_M {c['BLOCK_M']}")
    if _large_attention(a, c):
        _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
        return (cdiv(a["tokens"], c["LARGE_M"] // group) + a["rows"], a["kv_heads"], 1)
    # heads up to BLOCK_D take the narrow tiles, wider ones up to WIDE_D the wide instantiation
    # (compiled for the cores that launch one: KernelBuild.tiles)
    widest = max(c["BLOCK_D"], c.get("WIDE_D", 0))
    _require(a["head_dim"] <= widest, f"head_dim {a['head_dim']} > {widest}")
    _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
    # every row may leave one partial query block: blocks <= cdiv(tokens, per_block) + rows
    per_block = c["BLOCK_M"] // group
    return (cdiv(a["tokens"], per_block) + a["rows"], a["kv_heads"], 1)


def _token_rows(a: Immediates, c: Mapping[str, int]) -> Grid:
    """(cdiv(tokens, BLOCK_M)): a program owns BLOCK_M whole rows."""
    return (cdiv(a["tokens"], c["BLOCK_M"]), 1, 1)


def _vocab_tiles(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (cdiv(a["vocab"], c["BLOCK_V"]), a["rows"], 1)


def _per_row(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (a["rows"], 1, 1)


def _per_token(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (a["tokens"], 1, 1)


def _per_row_over_vocab(a: Immediates, c: Mapping[str, int]) -> Grid:
    """One program per row streaming its vocabulary; it keeps MAX_CHUNKS chunk maxima, each
    covering cdiv(chunks, MAX_CHUNKS) BLOCK_V chunks, so every vocabulary size fits."""
    return (a["rows"], 1, 1)


def _vocab_chunks(keys: str) -> GridFunction:
    """(cdiv(vocab, BLOCK_V), rows) for the multi-program sampling kernels: each chunk leaves a
    record of 8 words + c[keys] int64 keys in its row of `partials` (partial_words(vocab) words),
    and the row's last program reads them MAX_CHUNKS at a time (no ceiling on the vocabulary)."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        chunks = cdiv(a["vocab"], c["BLOCK_V"])
        _require(chunks * (8 + 2 * c[keys]) <= partial_words(a["vocab"]),
                 f"{chunks} chunk records exceed partial_words({a['vocab']})")
        _require(a.get("top_n", 0) <= c.get("TOP_C", 0), f"top_n {a.get('top_n')} > TOP_C")
        return (chunks, a["rows"], 1)
    return grid


def _entry_tiles(count: str, block: str) -> GridFunction:
    """(cdiv(a[count], BLOCK), rows): per-row entry lists of a[count] entries."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        return (cdiv(a[count], c[block]), a["rows"], 1)
    return grid


def _one_program_over_rows(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
    return (1, 1, 1)


def _histogram_tiles(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (cdiv(a["histogram_bins"], c["BLOCK_H"]), a["rows"], 1)


def _page_chunks(a: Immediates, c: Mapping[str, int]) -> Grid:
    return (cdiv(a["page_stride"], c["BLOCK"]), a["rows"], 1)


def _one_program(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
    return (1, 1, 1)


def _token_tiles_over_rows(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
    return _token_tiles(a, c)


def _per_lane(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["rows"] <= c["MAX_ROWS"], f"rows {a['rows']} > MAX_ROWS {c['MAX_ROWS']}")
    return _per_row_over_vocab(a, c)


def _paged_window_attention(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["window"] >= 1, f"window {a['window']} < 1")
    return _paged_attention(a, c)


def _paged_attention_split(a: Immediates, c: Mapping[str, int]) -> Grid:
    x, y, _ = _paged_attention(a, c)
    _require(1 <= a["splits"] <= c["MERGE_SPLITS"], f"splits must be 1..MERGE_SPLITS ({c['MERGE_SPLITS']})")
    return (x, y, a["splits"])


# Decode is latency-bound weight streaming: by Little's law an H200 needs ~3 MB of loads in
# flight (4.8 TB/s x ~0.7 us) to reach its bandwidth, while one layer's projections are only
# 0.7-3.5 MB. So the layer GEMMs use the narrowest tensor-core tile (N = 16: many programs)
# and deep K tiles with 3 pipeline stages (many bytes in flight per program). The LM head
# (N = vocabulary, 56 MB) has programs to spare: wide N tiles, and BLOCK_M = 64 so up to 64
# rows read the head once.
# Up to GEMV_TOKENS rows (decode of a few sequences) the products run without tensor cores:
# GEMV_N output columns per program for all GEMV_TOKENS rows at once, K unrolled GEMV_STEPS x
# GEMV_K, weight tiles loaded into registers before the PDL wait; one layer's 1-4 MB spread
# over 100-400 programs. (Measured on the H200: at 8 rows this path and the tiles are equal,
# at 32+ rows the tiles are 2-7x faster.)
_GEMV = {"GEMV_TOKENS": 4, "GEMV_K": 128}
# the kernels whose GEMV program covers all of K (norm + gate/up, norm + head, norm + qkv + RoPE)
# take it for one row up to GEMV_MAX_K, walking K a span of GEMV_STEPS x GEMV_K at a time (2-4
# rows: K within one span); above it the tensor-core tiles serve every row count
GEMV_MAX_K = 8192
# Tiles (f16 operands, common.DOT_F16): [16, 32] measured best on the H200 against [32, 32]
# and [64, 32] for decode (batch 8 / 64 / 128: 9.1k / 48.9k / 80.0k tokens/s against 7.6k /
# 46.9k / 73.5k for [32, 32]); [64, 32] prefills 512 tokens faster (170k vs 152k tokens/s)
# but loses at every decode batch.
# M buckets: from LARGE_TOKENS rows (prefill chunks, the wide MIXED steps) a third instantiation
# in the same kernel, chosen by the token capacity as the GEMV path is: [LARGE_M, LARGE_N] tiles
# over the whole of K (no split), one accumulator per product, so the K loop pipelines and the
# products issue as warpgroup MMAs; 16-row tiles re-read each weight tile tokens / 16 times (8B
# layout prefill of 4,096 tokens at 0.06 of the fp16 peak on an H100, bench/results/h100-80gb-hbm3).
_LARGE = {"LARGE_TOKENS": 512, "LARGE_M": 64}
_LAYER_GEMM = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, **_GEMV, "GEMV_N": 8, "GEMV_STEPS": 5,
               "GEMV_MAX_K": GEMV_MAX_K,
               **_LARGE, "LARGE_N": 64, "LARGE_K": 32}   # two accumulators (gate, up): 64 columns each
# split-K for the residual GEMMs (o-proj K 576 -> 3 slices, down K 1536 -> 6); a GEMV program
# unrolls its whole slice: K_SPLIT at 2-4 rows, GEMV_SPLIT (a multiple of GEMV_K) at one row.
# One row, H100 at 1573554 (bench/results/h100-80gb-hbm3/kernels_ab_1573554_*): 1,024 against
# 256 took the 8B layout's batch-1 down products from 1,744 to 1,440 us a step and o-proj from
# 588 to 526 (1.5B: down 462 -> 412); applied to the 4-row program as well, it raised the kernel's
# registers to 255 (84 now) and its batch-16 steps, which share the cubin, lost 12-13 %
_RESIDUAL_GEMM = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "K_SPLIT": 256, **_GEMV,
                  "GEMV_N": 8, "GEMV_SPLIT": 1024, **_LARGE, "LARGE_N": 64, "LARGE_K": 32}
# the head's GEMV path stops at 2 rows: its 4-row instantiation needed 246 registers (one
# program per SM); at 2 rows and 8 columns per program it needs 78. Its tiles: [32, 128]
# measured a little ahead of [64, 64] (batch 4: 5.6k vs 5.3k tokens/s; batch 64 equal).
_HEAD_GEMM = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 32, **_GEMV, "GEMV_TOKENS": 2,
              "GEMV_N": 8, "GEMV_STEPS": 5, "GEMV_MAX_K": GEMV_MAX_K}
_QKV_GEMM = {"BLOCK_M": 16, "BLOCK_P": 16, "BLOCK_K": 64, **_GEMV, "GEMV_P": 4, "GEMV_STEPS": 5,
             "GEMV_MAX_K": GEMV_MAX_K}
# q/k norm: a program holds a whole head (up to 256 dims: 128 pairs) for its norm, tiles only
_QKV_NORM_GEMM = {"BLOCK_M": 16, "BLOCK_P": 128, "BLOCK_K": 32}
# attention tiles: [BLOCK_N keys, BLOCK_D dims] for heads up to 64 dims (WIDE_* equal to them:
# one instantiation); a core with wider heads compiles a second instantiation in the same
# kernel, [32 keys, 128 dims] or (up to 256: Gemma-style) [16 keys, 256 dims] tiles, fewer keys
# per block so its key and value tiles take the narrow one's shared memory (ATTENTION_WIDENING)
_ATTENTION = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 64, "WIDE_N": 64, "WIDE_D": 64,
              "MAX_ROWS": 256}
# split-KV decode: the merge reads up to MERGE_SPLITS splits' (m, l) in one load (a recording's
# `splits` may not exceed it: the recipes split a row's context at most 16 ways) and the
# accumulators MERGE_GROUP splits a load ([2, 16, 128] f32 for 128-dim heads: 32 registers a thread)
_SPLIT_ATTENTION = {**_ATTENTION, "MERGE_SPLITS": 16, "MERGE_GROUP": 2}
ATTENTION_WIDENING = Widening("head_dim", "BLOCK_D", (
    # 128-dim heads (Qwen2.5-1.5B and up, Llama): [32 keys, 128 dims], the narrow tiles' 16 KiB
    # of keys and values a stage, so decode occupancy stays; on the 256-dim level they ran
    # [16 keys, 256 dims] with half of every tile masked (the 8B layout's batch-1 attention at
    # 0.015 of its floor, H100 at c1017d8)
    (128, {"WIDE_N": 32, "WIDE_D": 128}),
    (256, {"WIDE_N": 16, "WIDE_D": 256})))
# prefill chunks and wide MIXED steps (from LARGE_TOKENS tokens): 64 query rows a block against
# [32 keys, up to 128 dims] tiles (16 KiB of keys and values a stage at 128 dims), the key loop
# of the smaller blocks (LARGE_FLASH 0; PAGE_TOKENS unused)
_LARGE_ATTENTION = {"LARGE_TOKENS": 512, "LARGE_M": 64, "LARGE_N": 32, "LARGE_D": 128,
                    "LARGE_FLASH": 0, "PAGE_TOKENS": 16}
# the FlashAttention-2-class large blocks (LARGE_FLASH 1: attention.py _flash_program): 128 query
# rows against [64 keys, 64 or 128 dims] tiles, the key loop split into unmasked blocks and the
# masked diagonal, exp2 with the scale folded into q, page-table words read a page at a time for
# pages of PAGE_TOKENS tokens (other page sizes gather per key); 8 warps, two warpgroups of 64
# rows (the 128 x 128 f32 accumulator is 64 registers a thread). The default: on an H100 it ran
# prefill attention x1.5-x2.5 faster at 512-4,096 tokens with every decode row within 1 %
# (docs/kernels.md, "Flash-class prefill attention").
_FLASH_ATTENTION = {"LARGE_TOKENS": 512, "LARGE_M": 128, "LARGE_N": 64, "LARGE_D": 128,
                    "LARGE_FLASH": 1, "PAGE_TOKENS": 16}
# post-norm residual: one program per 16 rows covers all out_dim columns (two passes); at decode
# that is one program streaming the whole weight, so its tiles are wide ([64, 128] f16 = 16 KB
# per stage, 8 warps) to keep many bytes in flight on its one SM (not tuned on a device yet)
_NORM_RESIDUAL_GEMM = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64}

# The product path (triton_lang/products.py): the portable cubins of the plain f16 products,
# [64, 128] tiles over the whole of K in [64]-deep steps, 3 stages (72 KiB of shared memory: fits
# every target's limit); where cuBLASLt loads, the CUDA executor serves these ids through it.
_PRODUCT = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}
# pointwise nodes feeding the products: [16 tokens, 256 columns] tiles (16-byte f16 stores)
_POINTWISE_F16 = {"BLOCK_T": 16, "BLOCK_D": 256}


def _rows_then_columns(n_name: str) -> GridFunction:
    """(cdiv(tokens, BLOCK_M), cdiv(N, BLOCK_N), 1): the row tiles of one weight slice consecutive."""
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        blocks = cdiv(a[n_name], c["BLOCK_N"])
        _require(blocks <= MAX_GRID_Y, f"{n_name} {a[n_name]} needs {blocks} column blocks > {MAX_GRID_Y} (grid y)")
        return (cdiv(a["tokens"], c["BLOCK_M"]), blocks, 1)
    return grid


def _rope_store_grid(a: Immediates, c: Mapping[str, int]) -> Grid:
    _require(a["head_dim"] % 2 == 0, "head_dim must be even for RoPE")
    heads = a["q_heads"] + 2 * a["kv_heads"]
    return (heads * cdiv(a["head_dim"] // 2, c["BLOCK_P"]), cdiv(a["tokens"], c["BLOCK_M"]), 1)


def _token_column_tiles(n_name: str) -> GridFunction:
    def grid(a: Immediates, c: Mapping[str, int]) -> Grid:
        return (cdiv(a["tokens"], c["BLOCK_T"]), cdiv(a[n_name], c["BLOCK_D"]), 1)
    return grid


def _paged_attention_build(large: Mapping[str, int], num_warps: int, num_stages: int) -> KernelBuild:
    return KernelBuild("attention.paged.v1", "attention", "paged_attention", {**_ATTENTION, **large},
                       _paged_attention, num_warps=num_warps, num_stages=num_stages,
                       divisible=("head_dim", "page_stride"), widening=ATTENTION_WIDENING)


# attention.paged.v1's large-step tiles, chosen when a library is made (KernelLibrary(attention_tiles=),
# `python -m bench.kernels build --attention-tiles`). num_warps is the whole cubin's, so "flash"
# also runs its decode and small-step blocks with 8 warps.
ATTENTION_TILES: Mapping[str, KernelBuild] = {
    "current": _paged_attention_build(_LARGE_ATTENTION, num_warps=4, num_stages=3),
    "flash": _paged_attention_build(_FLASH_ATTENTION, num_warps=8, num_stages=2),
}
DEFAULT_ATTENTION_TILES = "flash"

# Ids are compiled when abi.py defines them (the library filters), so a kernel can land here
# before its ABI entry does.
KERNEL_SPECS: tuple[KernelBuild, ...] = (
    # BLOCK_T x MAX_ROWS compare matrix per program: keep it small for decode (tokens = rows)
    KernelBuild("step.geometry.v1", "tokens", "step_geometry",
               {"BLOCK_T": 32, "MAX_ROWS": 256}, _step_geometry),
    KernelBuild("tokens.select_input.v1", "tokens", "select_input_ids",
               {"BLOCK_T": 256}, _token_tiles),
    KernelBuild("tokens.select_input.v2", "tokens", "select_input_ids_by_token",
               {"BLOCK_T": 256}, _token_tiles),
    # one [4 tokens, 256 dims] tile per program (16-byte f16 loads), no loop over dim
    KernelBuild("embedding.gather.v1", "tokens", "embed_tokens",
               {"BLOCK_T": 4, "BLOCK_D": 256}, _token_dim_tiles, divisible=("dim",)),
    KernelBuild("attention.qkv_rope_store.v1", "attention", "qkv_rope_store",
               _QKV_GEMM, _qkv_rope_store,
               num_stages=3, divisible=("dim", "head_dim", "page_stride")),
    KernelBuild("attention.qkv_bias_rope_store.v1", "attention", "qkv_bias_rope_store",
               _QKV_GEMM, _qkv_rope_store,
               num_stages=3, divisible=("dim", "head_dim", "page_stride")),
    KernelBuild("attention.qkv_norm_rope_store.v1", "attention", "qkv_norm_rope_store",
               _QKV_NORM_GEMM, _qkv_norm_rope_store,
               num_stages=2, divisible=("dim", "head_dim", "page_stride")),
    ATTENTION_TILES[DEFAULT_ATTENTION_TILES],
    KernelBuild("attention.paged_window.v1", "attention", "paged_window_attention", _ATTENTION,
               _paged_window_attention, num_stages=3, divisible=("head_dim", "page_stride"),
               widening=ATTENTION_WIDENING),
    KernelBuild("linear.residual.v1", "matmul", "linear_residual", _RESIDUAL_GEMM,
               _large_or("tokens", "out_dim",
                         _gemv_or_tiles("tokens", "out_dim", _split_k_gemm("out_dim", "tokens", "in_dim"),
                                        split_name="in_dim")),
               num_stages=3,
               divisible=("in_dim", "out_dim")),
    KernelBuild("linear.norm_residual.v1", "matmul", "linear_norm_residual", _NORM_RESIDUAL_GEMM,
               _token_rows, num_warps=8, num_stages=3, divisible=("in_dim", "out_dim")),
    # the post norm after a linear.residual.v1 product: one program per row, all its columns
    # ([1, 1024] f32 tiles, two passes; a 640-wide Gemma row is one tile)
    KernelBuild("norm.residual.v1", "norms", "norm_residual", {"BLOCK_M": 1, "BLOCK_D": 1024},
               _token_rows, divisible=("dim",)),
    KernelBuild("mlp.norm_gate_up_silu.v1", "matmul", "norm_gate_up_silu", _LAYER_GEMM,
               _large_or("tokens", "ffn_dim", _gemv_or_tiles("tokens", "ffn_dim", _gemm("ffn_dim", "tokens"), "dim")),
               num_stages=3,
               divisible=("dim", "ffn_dim")),
    KernelBuild("mlp.norm_gate_up_activation.v1", "matmul", "norm_gate_up_activation", _LAYER_GEMM,
               _large_or("tokens", "ffn_dim", _gemv_or_tiles("tokens", "ffn_dim", _gemm("ffn_dim", "tokens"), "dim")),
               num_stages=3,
               divisible=("dim", "ffn_dim")),
    KernelBuild("logits.norm_head.v1", "matmul", "norm_head", _HEAD_GEMM,
               _gemv_or_tiles("rows", "vocab", _gemm_tiles_first("vocab", "rows"), "dim"), num_warps=8,
               num_stages=2,
               divisible=("dim", "vocab")),
    KernelBuild("sampling.adjust.v1", "sampling", "adjust_logits", {"BLOCK_V": 1024},
               _vocab_tiles, divisible=("vocab", "histogram_bins")),
    KernelBuild("sampling.draw.v1", "sampling", "draw_tokens",
               {"BLOCK_V": 2048, "MAX_CHUNKS": 64}, _per_row_over_vocab,
               num_warps=8, divisible=("vocab",)),
    KernelBuild("sampling.keep_logits.v1", "logprobs", "keep_logits", {"BLOCK_V": 1024},
               _vocab_tiles, divisible=("vocab",)),
    KernelBuild("sampling.logprobs.v1", "logprobs", "sampled_logprobs",
               {"BLOCK_V": 2048, "MAX_CHUNKS": 64}, _per_row_over_vocab,
               num_warps=4, divisible=("vocab",)),
    # many programs per row (a 2048-token chunk each) and a last-arriving finisher;
    # sampling.draw.v2 also applies the penalties and grammar mask (no adjust node)
    KernelBuild("sampling.draw.v2", "sampling", "draw_adjusted_tokens",
               {"BLOCK_V": 2048, "CANDIDATES": 32, "MAX_CHUNKS": 32}, _vocab_chunks("CANDIDATES"),
               num_warps=8, divisible=("vocab", "histogram_bins")),
    KernelBuild("sampling.logprobs.v2", "logprobs", "requested_logprobs",
               {"BLOCK_V": 2048, "TOP_C": 32, "MAX_CHUNKS": 32}, _vocab_chunks("TOP_C"),
               num_warps=8, divisible=("vocab",)),
    # one program per row covers OpenAI's 300 entries
    KernelBuild("sampling.logit_bias.v1", "sampling", "add_logit_bias", {"BLOCK_K": 512},
               _entry_tiles("bias_capacity", "BLOCK_K")),
    KernelBuild("logits.score_targets.v1", "logprobs", "score_targets", {"BLOCK_V": 64, "BLOCK_K": 64},
               _per_token, num_warps=4, divisible=("dim",)),
    # 8 warps: one row per thread, so every per-row value shares one layout (no shared-memory
    # conversions between the loads and the scattered stores)
    KernelBuild("state.commit.v1", "slots", "commit_samples", {"MAX_ROWS": 256, "BLOCK_E": 8},
               _one_program_over_rows, num_warps=8),
    KernelBuild("state.admit.v1", "slots", "admit_requests", {"BLOCK_H": 2048, "BLOCK_E": 8},
               _histogram_tiles, divisible=("histogram_bins",)),
    KernelBuild("attention.paged_split.v1", "attention", "paged_attention_split", _SPLIT_ATTENTION,
               _paged_attention_split, num_stages=3, divisible=("head_dim", "page_stride"),
               early_reads=("geometry", "positions", "row_slot"),
               widening=ATTENTION_WIDENING),
    KernelBuild("cache.snapshot_partial.v1", "pages", "snapshot_partial_pages", {"BLOCK": 4096},
               _page_chunks, divisible=("page_stride", "row_stride")),
    KernelBuild("cache.restore_partial.v1", "pages", "restore_partial_pages", {"BLOCK": 4096},
               _page_chunks, divisible=("page_stride", "row_stride")),
    KernelBuild("speculative.copy_confidence.v1", "speculative", "copy_confidence",
               {"BLOCK_K": 16}, _per_row),
    KernelBuild("speculative.allocate.v1", "speculative", "allocate_prefixes", {"MAX_ROWS": 256},
               _one_program),
    KernelBuild("speculative.expand.v1", "speculative", "expand_block",
               {"BLOCK_T": 64, "MAX_ROWS": 256}, _token_tiles_over_rows),
    KernelBuild("speculative.verify_commit.v1", "speculative", "verify_commit",
               {"MAX_ROWS": 256, "BLOCK_V": 2048, "MAX_CHUNKS": 64, "BLOCK_E": 8, "BLOCK_X": 16},
               _per_lane,
               num_warps=8, divisible=("vocab", "histogram_bins")),
    KernelBuild("norm.rms_f16.v1", "products", "rms_norm_f16", {"BLOCK_M": 1, "BLOCK_D": 2048},
               _token_rows, divisible=("dim",)),
    KernelBuild("activation.to_f16.v1", "products", "to_f16", _POINTWISE_F16, _token_column_tiles("dim"),
               divisible=("dim",)),
    KernelBuild("mlp.gate_activation_f16.v1", "products", "gate_activation_f16", _POINTWISE_F16,
               _token_column_tiles("ffn_dim"), divisible=("ffn_dim",)),
    # [32 tokens, 32 pairs] of one head a program: the f32 projection read once, 16-byte stores
    KernelBuild("attention.rope_store.v1", "attention", "rope_store", {"BLOCK_M": 32, "BLOCK_P": 32},
               _rope_store_grid, divisible=("head_dim", "page_stride")),
    KernelBuild("attention.bias_rope_store.v1", "attention", "bias_rope_store", {"BLOCK_M": 32, "BLOCK_P": 32},
               _rope_store_grid, divisible=("head_dim", "page_stride")),
    KernelBuild("linear.product_f16.v1", "products", "product_f16", _PRODUCT, _rows_then_columns("out_dim"),
               num_stages=3, divisible=("in_dim", "out_dim")),
    KernelBuild("linear.product_f32.v1", "products", "product_f32", _PRODUCT, _rows_then_columns("out_dim"),
               num_stages=3, divisible=("in_dim", "out_dim")),
    KernelBuild("linear.residual_f16.v1", "products", "residual_f16", _PRODUCT, _rows_then_columns("out_dim"),
               num_stages=3, divisible=("in_dim", "out_dim")),
    # tensor parallelism: a rank's partial projection stored over the whole token capacity
    # (rows past the live count 0) before its all-reduce (ignition/preparation/tensor_parallel.py)
    KernelBuild("linear.project.v1", "projection", "linear_project",
               {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64}, _gemm("out_dim", "tokens"),
               num_stages=3, divisible=("in_dim", "out_dim")),
)

SPECS_BY_ID: Mapping[str, KernelBuild] = {spec.kernel_id: spec for spec in KERNEL_SPECS}


def kernel_specs(attention_tiles: str = DEFAULT_ATTENTION_TILES) -> tuple[KernelBuild, ...]:
    """KERNEL_SPECS with attention.paged.v1 built from ATTENTION_TILES[attention_tiles]."""
    if attention_tiles not in ATTENTION_TILES:
        raise ValueError(f"attention_tiles {attention_tiles!r}: expected one of {sorted(ATTENTION_TILES)}")
    chosen = ATTENTION_TILES[attention_tiles]
    return tuple(chosen if spec.kernel_id == chosen.kernel_id else spec for spec in KERNEL_SPECS)
