"""Compiled (numba) primitives of the CPU executor: f16 weights read in place.

Weights stay in their declared F16 layout (row-major [out, in], as the manifest places them):
numba has no float16 type, so they are passed as their uint16 bit patterns and widened in
registers by `f16_bits_to_f32`, an LLVM `fpext half -> float` that the loop vectorizer turns
into vcvtph2ps (F16C / AVX-512). Nothing streams an f32 copy of a weight per step: a decode
step reads each weight byte once.

Every primitive is serial and releases the GIL (nogil): the products take a range of output
rows and attention a range of (token, kv head) pairs, so kernels.py shares one call's ranges
over threads (sharing.py). Every function writes into arrays it is given, so the hot path
allocates nothing. The functions mirror kernel_abi/ references (the conformance
oracle); only the summation order differs.
"""
from __future__ import annotations

from typing import Any, Callable, cast

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic, overload



def _widen_half(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def _narrow_to_half(typingctx: Any, value: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


# typed as plain callables: numba's intrinsic objects confuse static checkers
def _bits_to_float(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


f16_bits_to_f32 = cast(Callable[[Any], Any], intrinsic(_widen_half))
"""The float32 value of an IEEE half given as its uint16 bits (exact, subnormals included)."""
f32_to_f16_bits = cast(Callable[[Any], Any], intrinsic(_narrow_to_half))
"""The uint16 bits of a float32 rounded to the nearest half (round to nearest even)."""
i32_bits_to_f32 = cast(Callable[[Any], Any], intrinsic(_bits_to_float))
"""The float32 whose bits are the given int32 (a bitcast)."""


# ---- waiting without the GIL (sharing.py): a helper thread polls a job counter between calls ---------
def _load_acquire(typingctx: Any, flags: Any, index: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(pointer, "acquire", 8)
    return types.int64(flags, types.intp), codegen


def _spin_pause(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        module = builder.module
        name = "llvm.x86.sse2.pause"
        function = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), []), name)
        builder.call(function, [])
        return context.get_dummy_value()
    return types.none(), codegen


def _fetch_add(typingctx: Any, flags: Any, index: Any, value: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", pointer, args[2], "seq_cst")
    return types.int64(flags, types.intp, types.int64), codegen


fetch_add = cast(Callable[..., Any], intrinsic(_fetch_add))
"""flags[index] += value atomically (an int64 array); the value before. Sequentially consistent:
what the thread wrote before it (a chunk's outputs) is visible to a thread that reads the sum."""
load_acquire = cast(Callable[..., Any], intrinsic(_load_acquire))
"""flags[index] of an int64 array as an atomic acquire load: re-read on every call (a plain load in
a loop would be hoisted out of it), and what the writer stored before it is visible after it."""
spin_pause = cast(Callable[..., Any], intrinsic(_spin_pause))
"""The x86 PAUSE instruction: a spin-wait hint (yields the core's pipeline to its sibling, saves power)."""


@njit(cache=True, nogil=True)
def wait_for_change(flags: np.ndarray, seen: int, spins: int) -> int:
    """flags[0] once it differs from `seen`, polling at most `spins` times (PAUSE between polls); then
    flags[0] whatever it is. Without the GIL, so the thread that changes flags[0] keeps running."""
    for _ in range(spins):
        value = load_acquire(flags, 0)
        if value != seen:
            return value
        spin_pause()
    return load_acquire(flags, 0)


# A shared call's counters (sharing.WorkSharing.run_claimed): [next chunk, chunks done, failed]. Every
# thread of the call claims chunks with fetch_add until none is left; no chunk needs the GIL.
NEXT, DONE, FAILED = 0, 1, 2


@njit(cache=True, nogil=True)
def wait_done(counters: np.ndarray, chunks: int) -> None:
    """Until every claimed chunk of the call is done (or a thread failed): the caller's wait for
    the chunks helpers hold, polling without the GIL."""
    while True:
        claimed = min(load_acquire(counters, NEXT), chunks)
        if load_acquire(counters, DONE) >= claimed or load_acquire(counters, FAILED) != 0:
            return
        spin_pause()


@njit(inline="always", cache=True, nogil=True)
def _share_begin(calls: np.ndarray, caller: bool) -> None:
    """The caller of a shared call announces it here, once it holds no GIL: a polling helper that
    sees the count change takes the GIL at once, where announced from Python it found the caller
    still holding the GIL, slept on it, and woke 10-80 us later (a futex wake on this VM)."""
    if caller:
        fetch_add(calls, 0, 1)


@njit(inline="always", cache=True, nogil=True)
def _share_end(counters: np.ndarray, chunks: int, caller: bool) -> None:
    """The caller waits here, without the GIL, for the chunks helpers hold, so it does not come
    back to Python (and want the GIL) while a helper's Python is about to start its part."""
    if caller:
        wait_done(counters, chunks)


@njit(inline="always", cache=True, nogil=True)
def _chunk_rows(index: int, chunks: int, m: int) -> tuple[int, int]:
    """Output rows [first, last) of chunk `index`: whole row quads (the loops group rows by 2 and 4)."""
    quads = m // 4
    first = 4 * (index * quads // chunks)
    last = m if index == chunks - 1 else 4 * ((index + 1) * quads // chunks)
    return first, last


# ---- block weights (kernel_abi/blocks.py): one block of 32 weights as one LLVM vector ------------------
# Layout codes (BlockLayout.code): 0 Q8_0 (34-byte blocks: f16 d, 32 int8), 1 Q4_1 (20-byte blocks:
# f16 d, f16 m, 16 bytes of nibbles: low nibble weight j, high nibble weight j + 16).
# Written as LLVM vector code because numba's loops over a 32-weight block do not vectorize: the
# constant 32-trip loop is unrolled into scalar conversions, and numba promotes the 8-bit integer
# arithmetic to int64 (measured 15-25x slower than the f16 loop per weight).
BLOCK_Q8_0 = 0
BLOCK_Q4_1 = 1
# Block products of Q8_0, or of 4 and more tokens, prefetch each row's bytes this far ahead: out of
# cache (a decode step streams every weight from memory) the LM head of one token (Q8_0, 30 MB) took
# 5.0 ms on one thread without, 2.1 ms with; [3072, 576] Q4_1 x 8 tokens 325 -> 219 us. A Q4_1 product
# of one token is bound by its arithmetic: prefetching there cost 82 -> 163 us (measured 512 / 1024 /
# 2048 bytes ahead: 1024 the best but for the head of 8 tokens).
PREFETCH_BYTES = 1024
_LANES = 32
_F32X32 = ir.VectorType(ir.FloatType(), _LANES)


def _block_weights(builder: Any, code: int, block: Any) -> Any:
    """<32 x float> weights of the block at i8* `block` (kernel_abi/blocks.expand's values)."""
    def half(offset: int) -> Any:
        pointer = builder.bitcast(builder.gep(block, [ir.Constant(ir.IntType(64), offset)]), ir.IntType(16).as_pointer())
        return builder.fpext(builder.bitcast(builder.load(pointer, align=1), ir.HalfType()), ir.FloatType())

    def splat(value: Any) -> Any:
        vector = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined), value,
                                        ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(vector, ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * _LANES))

    def load(offset: int, lanes: int) -> Any:
        vector = ir.VectorType(ir.IntType(8), lanes)
        pointer = builder.gep(block, [ir.Constant(ir.IntType(64), offset)])
        return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=1)

    if code == BLOCK_Q8_0:
        return builder.fmul(builder.sitofp(load(2, _LANES), _F32X32), splat(half(0)))
    packed = load(4, _LANES // 2)
    low = builder.and_(packed, ir.Constant(packed.type, [15] * (_LANES // 2)))
    high = builder.lshr(packed, ir.Constant(packed.type, [4] * (_LANES // 2)))
    quants = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), _LANES), list(range(_LANES))))
    return _fma(builder, builder.uitofp(quants, _F32X32), splat(half(0)), splat(half(2)))


def _element_pointer(context: Any, builder: Any, array_type: Any, array: Any, index: Any) -> Any:
    return builder.gep(context.make_array(array_type)(context, builder, value=array).data, [index])


def _fma(builder: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c as one fused multiply-add per lane (llvm.fma.vNf32)."""
    module = builder.module
    name = f"llvm.fma.v{a.type.count}f32"
    function = module.globals.get(name) or ir.Function(module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(function, [a, b, c])


def _horizontal_sum(builder: Any, total: Any) -> Any:
    """The sum of a float vector's lanes (a power of two): a tree of halves (a few shuffles and adds)."""
    lanes = total.type.count
    while lanes > 1:
        lanes //= 2
        undefined = ir.Constant(ir.VectorType(ir.FloatType(), 2 * lanes), ir.Undefined)
        first = builder.shuffle_vector(total, undefined, ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                                    list(range(lanes))))
        second = builder.shuffle_vector(total, undefined, ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                                     list(range(lanes, 2 * lanes))))
        total = builder.fadd(first, second)
    return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))


def _load_head(context: Any, builder: Any, array_type: Any, array: Any, at: Any, width: int) -> Any:
    """<width x float> from element `at` of a float32 array, or of an f16 plane held as uint16 bits."""
    pointer = _element_pointer(context, builder, array_type, array, at)
    if array_type.dtype == types.uint16:
        bits = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), width).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), width)),
                             ir.VectorType(ir.FloatType(), width))
    return builder.load(builder.bitcast(pointer, ir.VectorType(ir.FloatType(), width).as_pointer()), align=4)


def _head_dot_intrinsic(width: int) -> Callable[..., Any]:
    """sum(a[a_at:a_at + width] * b[b_at:b_at + width]) as one vector product and a tree sum."""
    def typer(typingctx: Any, a: Any, a_at: Any, b: Any, b_at: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            first = _load_head(context, builder, signature.args[0], args[0], args[1], width)
            second = _load_head(context, builder, signature.args[2], args[2], args[3], width)
            return _horizontal_sum(builder, builder.fmul(first, second))
        return types.float32(a, types.intp, b, types.intp), codegen
    return typer


def _head_axpy_intrinsic(width: int) -> Callable[..., Any]:
    """target[t_at:t_at + width] += weight * value[v_at:v_at + width] (target float32)."""
    def typer(typingctx: Any, target: Any, t_at: Any, weight: Any, value: Any, v_at: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            vector = ir.VectorType(ir.FloatType(), width)
            pointer = builder.bitcast(_element_pointer(context, builder, signature.args[0], args[0], args[1]),
                                      vector.as_pointer())
            values = _load_head(context, builder, signature.args[3], args[3], args[4], width)
            splat = builder.shuffle_vector(
                builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined), args[2],
                                       ir.Constant(ir.IntType(32), 0)),
                ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined),
                ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))
            total = builder.fadd(builder.load(pointer, align=4), builder.fmul(splat, values))
            builder.store(total, pointer, align=4)
            return context.get_dummy_value()
        return types.none(target, types.intp, types.float32, value, types.intp), codegen
    return typer


def _page_dots_intrinsic(width: int) -> Callable[..., Any]:
    """scores[s_at + s] = sum(q[q_at:q_at + width] * cache[base + s * stride:][:width]) * scale for
    s < count (one page's keys): the query stays in registers for the page, each key is loaded and
    widened once, the same products and tree sum as head_dot."""
    def typer(typingctx: Any, scores: Any, s_at: Any, q: Any, q_at: Any, cache: Any, base: Any, count: Any,
              stride: Any, scale: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            scores_, s_at_, q_, q_at_, cache_, base_, count_, stride_, scale_ = args
            query = _load_head(context, builder, signature.args[2], q_, q_at_, width)
            with cgutils.for_range(builder, count_) as loop:
                at = builder.add(base_, builder.mul(loop.index, stride_))
                key = _load_head(context, builder, signature.args[4], cache_, at, width)
                dot = _horizontal_sum(builder, builder.fmul(query, key))
                target = _element_pointer(context, builder, signature.args[0], scores_, builder.add(s_at_, loop.index))
                builder.store(builder.fmul(dot, scale_), target)
            return context.get_dummy_value()
        return types.none(scores, types.intp, q, types.intp, cache, types.intp, types.intp, types.intp,
                          types.float32), codegen
    return typer


def _page_axpy_intrinsic(width: int) -> Callable[..., Any]:
    """target[t_at:t_at + width] += sum over s < count of weights[w_at + s] * cache[base + s * stride:][:width]
    (one page's values), keys in order: the sum stays in registers for the page (one load and one
    store of the target a page, not a key), the same products and additions as head_axpy."""
    def typer(typingctx: Any, target: Any, t_at: Any, weights: Any, w_at: Any, cache: Any, base: Any, count: Any,
              stride: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            target_, t_at_, weights_, w_at_, cache_, base_, count_, stride_ = args
            vector = ir.VectorType(ir.FloatType(), width)
            pointer = builder.bitcast(_element_pointer(context, builder, signature.args[0], target_, t_at_),
                                      vector.as_pointer())
            total = cgutils.alloca_once_value(builder, builder.load(pointer, align=4))   # promoted to registers
            with cgutils.for_range(builder, count_) as loop:
                values = _load_head(context, builder, signature.args[4], cache_,
                                    builder.add(base_, builder.mul(loop.index, stride_)), width)
                weight = builder.load(_element_pointer(context, builder, signature.args[2], weights_,
                                                       builder.add(w_at_, loop.index)))
                splat = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined), weight,
                                           ir.Constant(ir.IntType(32), 0)),
                    ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined),
                    ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))
                builder.store(builder.fadd(builder.load(total), builder.fmul(splat, values)), total)
            builder.store(builder.load(total), pointer, align=4)
            return context.get_dummy_value()
        return types.none(target, types.intp, weights, types.intp, cache, types.intp, types.intp, types.intp), codegen
    return typer


page_dots64 = cast(Callable[..., Any], intrinsic(_page_dots_intrinsic(64)))
page_dots128 = cast(Callable[..., Any], intrinsic(_page_dots_intrinsic(128)))
page_axpy64 = cast(Callable[..., Any], intrinsic(_page_axpy_intrinsic(64)))
page_axpy128 = cast(Callable[..., Any], intrinsic(_page_axpy_intrinsic(128)))


# head widths with a vector form (attention_pairs falls back to a loop for others)
head_dot64 = cast(Callable[..., Any], intrinsic(_head_dot_intrinsic(64)))
head_dot128 = cast(Callable[..., Any], intrinsic(_head_dot_intrinsic(128)))
head_axpy64 = cast(Callable[..., Any], intrinsic(_head_axpy_intrinsic(64)))
head_axpy128 = cast(Callable[..., Any], intrinsic(_head_axpy_intrinsic(128)))


def _emit_block_dots(builder: Any, code: int, starts: list, inputs: list, blocks: Any, tokens: int, lanes: int,
                     target: Any) -> None:
    """The loop of _block_row_dots_intrinsic for one layout code, from the builder's position; the
    sums stored to `target` (float*), the builder left at the loop's exit."""
    i64 = ir.IntType(64)
    size = 34 if code == BLOCK_Q8_0 else 20
    accumulator_type = ir.VectorType(ir.FloatType(), lanes)
    halves = [ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(h * lanes, (h + 1) * lanes)))
              for h in range(_LANES // lanes)]
    entry = builder.block
    loop = builder.append_basic_block(f"block_loop_{code}")
    done = builder.append_basic_block(f"block_done_{code}")
    builder.branch(loop)
    builder.position_at_end(loop)
    index = builder.phi(i64)
    accumulators = [builder.phi(accumulator_type) for _ in range(len(starts) * tokens)]
    index.add_incoming(ir.Constant(i64, 0), entry)
    for accumulator in accumulators:
        accumulator.add_incoming(ir.Constant(accumulator_type, [0.0] * lanes), entry)
    block_at = builder.mul(index, ir.Constant(i64, size))
    prefetch = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32),
                                                        ir.IntType(32)]), "llvm.prefetch.p0i8")
    for start in (starts if code == BLOCK_Q8_0 or tokens >= 4 else ()):     # (PREFETCH_BYTES: why)
        builder.call(prefetch, [builder.gep(start, [builder.add(block_at, ir.Constant(i64, PREFETCH_BYTES))]),
                                ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 3),
                                ir.Constant(ir.IntType(32), 1)])
    weights = []
    for start in starts:
        widened = _block_weights(builder, code, builder.gep(start, [block_at]))
        weights.append([widened] if lanes == _LANES else
                       [builder.shuffle_vector(widened, widened, half) for half in halves])
    offset = builder.mul(index, ir.Constant(i64, _LANES))
    summed = list(accumulators)
    for t, token_inputs in enumerate(inputs):
        values = builder.load(builder.bitcast(builder.gep(token_inputs, [offset]), _F32X32.as_pointer()), align=4)
        parts = [values] if lanes == _LANES else [builder.shuffle_vector(values, values, h) for h in halves]
        for r in range(len(starts)):
            for w, part in zip(weights[r], parts):
                summed[r * tokens + t] = _fma(builder, w, part, summed[r * tokens + t])
    following = builder.add(index, ir.Constant(i64, 1))
    index.add_incoming(following, builder.block)
    for accumulator, value in zip(accumulators, summed):
        accumulator.add_incoming(value, builder.block)
    builder.cbranch(builder.icmp_signed("<", following, blocks), loop, done)
    builder.position_at_end(done)
    for j, value in enumerate(summed):
        builder.store(_horizontal_sum(builder, value), builder.gep(target, [ir.Constant(i64, j)]))


def _block_row_dots_intrinsic(rows: int, tokens: int) -> Callable[..., Any]:
    """sums[r * tokens + t] = sum over `blocks` consecutive blocks from byte at + r * row_bytes of
    w . x[x_at + t * x_stride:] for r < rows, t < tokens, blocks of layout `code` (BLOCK_*): each
    block widened once into registers and multiplied into one vector accumulator per (row,
    token), so every loaded input feeds `rows` products and every widened block `tokens`; one
    horizontal sum each at the end. One loop per layout code, chosen once per call.

    Up to 8 (row, token) pairs keep <32 x float> accumulators (one FMA chain of 4 cycles per
    block); more fold each block's two halves into one <16 x float> accumulator, so 2 rows x 8
    tokens (16 accumulators) stay in AVX-512's 32 vector registers with the widened blocks."""
    lanes = _LANES if rows * tokens <= 8 else _LANES // 2

    def typer(typingctx: Any, data: Any, code: Any, at: Any, row_bytes: Any, x: Any, x_at: Any, x_stride: Any,
              blocks: Any, sums: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i64 = ir.IntType(64)
            starts = [_element_pointer(context, builder, signature.args[0], args[0],
                                       builder.add(args[2], builder.mul(args[3], ir.Constant(i64, r))))
                      for r in range(rows)]
            inputs = [_element_pointer(context, builder, signature.args[4], args[4],
                                       builder.add(args[5], builder.mul(args[6], ir.Constant(i64, t))))
                      for t in range(tokens)]
            target = context.make_array(signature.args[8])(context, builder, value=args[8]).data
            with builder.if_else(builder.icmp_signed("==", args[1], ir.Constant(args[1].type, BLOCK_Q8_0))) as (
                    q8_0, q4_1):
                with q8_0:
                    _emit_block_dots(builder, BLOCK_Q8_0, starts, inputs, args[7], tokens, lanes, target)
                with q4_1:
                    _emit_block_dots(builder, BLOCK_Q4_1, starts, inputs, args[7], tokens, lanes, target)
            return context.get_dummy_value()
        return types.none(data, types.intp, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                          sums), codegen
    return typer


def _block_store_intrinsic(code: int) -> Callable[..., Any]:
    def typer(typingctx: Any, out: Any, out_at: Any, data: Any, at: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            weights = _block_weights(builder, code, _element_pointer(context, builder, signature.args[2], args[2], args[3]))
            target = _element_pointer(context, builder, signature.args[0], args[0], args[1])
            builder.store(weights, builder.bitcast(target, _F32X32.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(out, types.intp, data, types.intp), codegen
    return typer


# (rows, tokens) shapes of one pass over blocks (block_linear_rows: 2 rows x 8 / 4 tokens, 4 rows x 1 token, and
# 2 or 1 rows for the rows left over)
dots1x1, dots2x1, dots4x1, dots1x4, dots2x4, dots1x8, dots2x8 = (
    cast(Callable[..., Any], intrinsic(_block_row_dots_intrinsic(r, t)))
    for r, t in ((1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (1, 8), (2, 8)))
"""dotsRxT(data, code, at, row_bytes, x, x_at, x_stride, blocks, sums): sums[r * T + t] = row r . x[x_at + t *
x_stride:] for r < R, t < T over the `blocks` (>= 1) blocks of each row (no bounds checks: the callers check)."""
q8_0_store = cast(Callable[..., Any], intrinsic(_block_store_intrinsic(BLOCK_Q8_0)))
"""out[out_at:out_at + 32] = the weights of the Q8_0 block at data[at:] (no bounds checks)."""
q4_1_store = cast(Callable[..., Any], intrinsic(_block_store_intrinsic(BLOCK_Q4_1)))


def as_f32(value: Any) -> Any:
    """A weight element as float32: f16 bits (uint16) widened, f32 as is (a dequantized row)."""
    raise NotImplementedError("compiled code only")


@overload(as_f32, inline="always")
def _as_f32(value):  # unannotated: numba compares its signature with the lambdas'
    if value == types.uint16:
        return lambda value: f16_bits_to_f32(value)
    if value == types.float32:
        return lambda value: value
    return None


def plane_value(plane: Any, value: Any) -> Any:
    """A float32 as an element of `plane`: f16 bits (rounded to nearest even) for an f16 cache plane
    passed as uint16, the value itself for an f32 one."""
    raise NotImplementedError("compiled code only")


@overload(plane_value, inline="always")
def _plane_value(plane, value):  # unannotated, as _as_f32
    if plane.dtype == types.uint16:
        return lambda plane, value: f32_to_f16_bits(np.float32(value))
    return lambda plane, value: value


@njit(cache=True, fastmath=True, nogil=True)
def widen(out: np.ndarray, bits: np.ndarray, count: int) -> None:
    """out[:count] = f32(bits[:count]) (a weight tile for a BLAS product). Serial and without the
    GIL: the product's worker threads each widen their own tiles."""
    for i in range(count):
        out[i] = f16_bits_to_f32(bits[i])


@njit(cache=True, fastmath=True, nogil=True)
def linear_rows(out: np.ndarray, x: np.ndarray, weight: np.ndarray, n: int, k: int, m: int, accumulate: bool,
                first: int, last: int, row_base: int) -> None:
    """out[t, o] (+)= sum_i x[t, i] * weight[o - row_base, i] for t < n and first <= o < last; out [n, m],
    x [n, k], weight [m, k] f16 bits (or f32 rows row_base.. of a matrix: block_linear_rows). Serial: a small product runs on the calling thread, as the
    cost of waking a worker (~10 us) exceeds the work (docs/cpu-executor.md).

    Output rows go in pairs: each weight half is widened once per token block of 8 (then 4, then
    1) and multiplied into both rows' accumulators, so the weight is read once per call whatever n
    is and each loaded input feeds two products (an 8-token product is bound by loads: 2 rows x 8
    tokens measured 1.7x one row x 8 tokens, docs/cpu-executor.md).
    """
    o = first
    while o < last:
        if o + 1 < last:
            rows = weight[(o - row_base) * k:(o - row_base + 2) * k]
            t = 0
            while t + 8 <= n:
                _dot8x2(out, x, rows, t, k, m, o, accumulate)
                t += 8
            while t + 4 <= n:
                _dot4x2(out, x, rows, t, k, m, o, accumulate)
                t += 4
            for r in range(2):
                for u in range(t, n):
                    _dot1(out, x, rows[r * k:(r + 1) * k], u, k, m, o + r, accumulate)
            o += 2
        else:                           # an odd last row
            row = weight[(o - row_base) * k:(o - row_base + 1) * k]
            t = 0
            while t + 8 <= n:
                _dot8(out, x, row, t, k, m, o, accumulate)
                t += 8
            while t + 4 <= n:
                _dot4(out, x, row, t, k, m, o, accumulate)
                t += 4
            for u in range(t, n):
                _dot1(out, x, row, u, k, m, o, accumulate)
            o += 1


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _store(out: np.ndarray, index: int, value: np.float32, accumulate: bool) -> None:
    if accumulate:
        out[index] += value
    else:
        out[index] = value


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot1(out: np.ndarray, x: np.ndarray, row: np.ndarray, t: int, k: int, m: int, o: int,
          accumulate: bool) -> None:
    xs = x[t * k:(t + 1) * k]
    acc = np.float32(0.0)
    for i in range(k):
        acc += as_f32(row[i]) * xs[i]
    _store(out, t * m + o, acc, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot4x2(out: np.ndarray, x: np.ndarray, rows: np.ndarray, t: int, k: int, m: int, o: int,
            accumulate: bool) -> None:
    """Tokens t..t+3 against weight rows o and o+1 (rows: their 2k halves)."""
    r0 = rows[:k]
    r1 = rows[k:2 * k]
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for i in range(k):
        u = as_f32(r0[i])
        v = as_f32(r1[i])
        a0 += u * x0[i]
        b0 += v * x0[i]
        a1 += u * x1[i]
        b1 += v * x1[i]
        a2 += u * x2[i]
        b2 += v * x2[i]
        a3 += u * x3[i]
        b3 += v * x3[i]
    for j, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
        _store(out, (t + j) * m + o, a, accumulate)
        _store(out, (t + j) * m + o + 1, b, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot8x2(out: np.ndarray, x: np.ndarray, rows: np.ndarray, t: int, k: int, m: int, o: int,
            accumulate: bool) -> None:
    """Tokens t..t+7 against weight rows o and o+1: sixteen accumulators, two widened halves."""
    r0 = rows[:k]
    r1 = rows[k:2 * k]
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    x4 = x[(t + 4) * k:(t + 5) * k]
    x5 = x[(t + 5) * k:(t + 6) * k]
    x6 = x[(t + 6) * k:(t + 7) * k]
    x7 = x[(t + 7) * k:(t + 8) * k]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
    for i in range(k):
        u = as_f32(r0[i])
        v = as_f32(r1[i])
        a0 += u * x0[i]
        b0 += v * x0[i]
        a1 += u * x1[i]
        b1 += v * x1[i]
        a2 += u * x2[i]
        b2 += v * x2[i]
        a3 += u * x3[i]
        b3 += v * x3[i]
        a4 += u * x4[i]
        b4 += v * x4[i]
        a5 += u * x5[i]
        b5 += v * x5[i]
        a6 += u * x6[i]
        b6 += v * x6[i]
        a7 += u * x7[i]
        b7 += v * x7[i]
    for j, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3), (a4, b4), (a5, b5), (a6, b6), (a7, b7))):
        _store(out, (t + j) * m + o, a, accumulate)
        _store(out, (t + j) * m + o + 1, b, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot4(out: np.ndarray, x: np.ndarray, row: np.ndarray, t: int, k: int, m: int, o: int,
          accumulate: bool) -> None:
    """Tokens t..t+3 against one weight row: each half widened once, four accumulators."""
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(k):
        w = as_f32(row[i])
        a0 += w * x0[i]
        a1 += w * x1[i]
        a2 += w * x2[i]
        a3 += w * x3[i]
    _store(out, t * m + o, a0, accumulate)
    _store(out, (t + 1) * m + o, a1, accumulate)
    _store(out, (t + 2) * m + o, a2, accumulate)
    _store(out, (t + 3) * m + o, a3, accumulate)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _dot8(out: np.ndarray, x: np.ndarray, row: np.ndarray, t: int, k: int, m: int, o: int,
          accumulate: bool) -> None:
    """Tokens t..t+7 against one weight row (a decode step of 8 rows: one pass over the weight).
    _dot4's shape with eight accumulators: measured 0.56 ms vs 0.68 ms for two _dot4 blocks on a
    [3072, 576] product of 8 tokens, one thread."""
    x0 = x[t * k:(t + 1) * k]
    x1 = x[(t + 1) * k:(t + 2) * k]
    x2 = x[(t + 2) * k:(t + 3) * k]
    x3 = x[(t + 3) * k:(t + 4) * k]
    x4 = x[(t + 4) * k:(t + 5) * k]
    x5 = x[(t + 5) * k:(t + 6) * k]
    x6 = x[(t + 6) * k:(t + 7) * k]
    x7 = x[(t + 7) * k:(t + 8) * k]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(k):
        w = as_f32(row[i])
        a0 += w * x0[i]
        a1 += w * x1[i]
        a2 += w * x2[i]
        a3 += w * x3[i]
        a4 += w * x4[i]
        a5 += w * x5[i]
        a6 += w * x6[i]
        a7 += w * x7[i]
    _store(out, t * m + o, a0, accumulate)
    _store(out, (t + 1) * m + o, a1, accumulate)
    _store(out, (t + 2) * m + o, a2, accumulate)
    _store(out, (t + 3) * m + o, a3, accumulate)
    _store(out, (t + 4) * m + o, a4, accumulate)
    _store(out, (t + 5) * m + o, a5, accumulate)
    _store(out, (t + 6) * m + o, a6, accumulate)
    _store(out, (t + 7) * m + o, a7, accumulate)


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm(out: np.ndarray, x: np.ndarray, rows: np.ndarray, weight: np.ndarray, k: int, eps: float) -> None:
    """out[j] = x[rows[j]] * rsqrt(mean(x^2) + eps) * weight, weight f16 bits [k]; out [len(rows), k]."""
    for j in range(rows.size):
        src = x[rows[j] * k:(rows[j] + 1) * k]
        total = np.float32(0.0)
        for i in range(k):
            total += src[i] * src[i]
        inverse = np.float32(1.0) / np.sqrt(total / np.float32(k) + np.float32(eps))
        for i in range(k):
            out[j * k + i] = (src[i] * inverse) * f16_bits_to_f32(weight[i])


@njit(cache=True, fastmath=True, nogil=True)
def gather_rows(out: np.ndarray, table: np.ndarray, ids: np.ndarray, n: int, k: int) -> None:
    """out[t] = f32(table[ids[t]]) for t < n; table f16 bits [vocab, k]."""
    for t in range(n):
        row = table[ids[t] * k:(ids[t] + 1) * k]
        target = out[t * k:(t + 1) * k]
        for i in range(k):
            target[i] = f16_bits_to_f32(row[i])


@njit(cache=True, fastmath=True, nogil=True)
def silu_gate(out: np.ndarray, projected: np.ndarray, n: int, ffn: int, out_width: int, out_at: int) -> None:
    """out[t, out_at:out_at + ffn] = silu(gate) * up with projected[t] = [gate | up] ([n, 2 * ffn]),
    out [n, out_width] (out_width > ffn: one tile of gate columns, kernels._gate_up_tiles)."""
    for t in range(n):
        base = t * 2 * ffn
        target = out[t * out_width + out_at:t * out_width + out_at + ffn]
        for i in range(ffn):
            g = projected[base + i]
            target[i] = g / (np.float32(1.0) + np.exp(-g)) * projected[base + ffn + i]


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _rotate(target: np.ndarray, source: np.ndarray, table: np.ndarray, half: int, pairing: int) -> None:
    """One head's RoPE: source (f32) rotated into target (f32, or an f16 plane's uint16 bits)."""
    for i in range(half):
        cos = table[2 * i]
        sin = table[2 * i + 1]
        if pairing == 0:
            a, b = 2 * i, 2 * i + 1
        else:
            a, b = i, i + half
        first = source[a]
        second = source[b]
        target[a] = plane_value(target, first * cos - second * sin)
        target[b] = plane_value(target, first * sin + second * cos)


@njit(cache=True, fastmath=True, nogil=True)
def rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, projected: np.ndarray,
               rope_table: np.ndarray, positions: np.ndarray, token_row: np.ndarray, row_slot: np.ndarray,
               page_table: np.ndarray,
               n: int, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int,
               page_stride: int, pairing: int) -> None:
    """RoPE on q and k of projected [n, (q_heads + 2 kv_heads) * head_dim]; q -> q_out, k, v -> cache pages
    (f32 planes, or f16 planes as uint16 bits: q_out is f32 either way, so the query is not rounded).

    pairing 0 rotates (2i, 2i+1), 1 rotates (i, i + head_dim/2) (kernel_abi/rope.py); the cache
    element of (page p, token slot s, kv head h, dim d) is p*page_stride + (s*kv_heads + h)*head_dim + d.
    """
    half = head_dim // 2
    q_width = q_heads * head_dim
    kv_width = kv_heads * head_dim
    width = q_width + 2 * kv_width
    for t in range(n):
        position = positions[t]
        table = rope_table[position * head_dim:(position + 1) * head_dim]   # [half, (cos, sin)]
        row = projected[t * width:(t + 1) * width]
        page = page_table[row_slot[token_row[t]] * pages_per_row + position // page_tokens]
        cache_base = page * page_stride + (position % page_tokens) * kv_width
        for head in range(q_heads):
            _rotate(q_out[t * q_width + head * head_dim:t * q_width + (head + 1) * head_dim],
                    row[head * head_dim:(head + 1) * head_dim], table, half, pairing)
        for head in range(kv_heads):
            start = cache_base + head * head_dim
            _rotate(k_cache[start:start + head_dim], row[q_width + head * head_dim:q_width + (head + 1) * head_dim],
                    table, half, pairing)
        values = row[q_width + kv_width:]
        v_target = v_cache[cache_base:cache_base + kv_width]
        for i in range(kv_width):
            v_target[i] = plane_value(v_target, values[i])


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _exp(x: np.float32) -> np.float32:
    """exp(x) for x <= 0 (a softmax's shifted scores) without a library call, so a loop of them
    vectorizes (numba's np.exp is one scalar expf call per element: without a vector math library
    the softmax of 8 decode rows was most of their attention). Cody-Waite reduction x = n ln2 + r,
    |r| <= ln2 / 2, Cephes' degree-6 polynomial for e^r (relative error ~2e-7), 2^n from the
    exponent bits; x below -87 gives 2^-126 times e^r, as good as 0 beside the maximum's 1."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * i32_bits_to_f32((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _head_dot(a: np.ndarray, a_at: int, b: np.ndarray, b_at: int, head_dim: int) -> np.float32:
    """sum(a[a_at:][:head_dim] * b[b_at:][:head_dim]). Widths 64 and 128 as one vector product
    (head_dot64/128): the numba loop over slices of the cache cost a slice (and the reference
    counting numba keeps for it) per cached key, 4-6x the arithmetic."""
    if head_dim == 64:
        return head_dot64(a, a_at, b, b_at)
    if head_dim == 128:
        return head_dot128(a, a_at, b, b_at)
    total = np.float32(0.0)
    for d in range(head_dim):
        total += a[a_at + d] * as_f32(b[b_at + d])
    return total


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _head_axpy(target: np.ndarray, t_at: int, weight: np.float32, value: np.ndarray, v_at: int,
               head_dim: int) -> None:
    """target[t_at:][:head_dim] += weight * value[v_at:][:head_dim] (vector forms as in _head_dot)."""
    if head_dim == 64:
        head_axpy64(target, t_at, weight, value, v_at)
    elif head_dim == 128:
        head_axpy128(target, t_at, weight, value, v_at)
    else:
        for d in range(head_dim):
            target[t_at + d] += weight * as_f32(value[v_at + d])


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _page_dots(scores: np.ndarray, s_at: int, q: np.ndarray, q_at: int, cache: np.ndarray, base: int, count: int,
               stride: int, scale: np.float32, head_dim: int) -> None:
    """One head's scores against one page's `count` keys (page_dots64/128, else head by head)."""
    if head_dim == 64:
        page_dots64(scores, s_at, q, q_at, cache, base, count, stride, scale)
    elif head_dim == 128:
        page_dots128(scores, s_at, q, q_at, cache, base, count, stride, scale)
    else:
        for s in range(count):
            scores[s_at + s] = _head_dot(q, q_at, cache, base + s * stride, head_dim) * scale


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _page_axpy(target: np.ndarray, t_at: int, weights: np.ndarray, w_at: int, cache: np.ndarray, base: int,
               count: int, stride: int, head_dim: int) -> None:
    """One head's weighted sum of one page's `count` values into target (page_axpy64/128, else a loop)."""
    if head_dim == 64:
        page_axpy64(target, t_at, weights, w_at, cache, base, count, stride)
    elif head_dim == 128:
        page_axpy128(target, t_at, weights, w_at, cache, base, count, stride)
    else:
        for s in range(count):
            _head_axpy(target, t_at, weights[w_at + s], cache, base + s * stride, head_dim)


@njit(cache=True, fastmath=True, nogil=True)
def attention_pairs(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    positions: np.ndarray, token_row: np.ndarray, row_slot: np.ndarray, page_table: np.ndarray,
                    chosen: np.ndarray, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int,
                    page_stride: int, scale: float, scores: np.ndarray, first: int, last: int) -> None:
    """out[t] = softmax(q[t] k^T * scale) v over positions 0..positions[t] of token t's slot, for the
    (token, kv head) pairs first <= pair < last (pair = j * kv_heads + kv head, token t = chosen[j]). Serial.

    Every live token alike, decode rows and prefill chunks (the step's keys are already in the
    cache). A pair serves the kv head's group of q_heads / kv_heads query heads, so each cached
    key and value is read once per group. Three passes per pair (scores, exp and normalize,
    weighted values) over `scores` (>= group * context floats, preallocated); one exp per key,
    pages walked in order (no division per key).
    """
    group = q_heads // kv_heads
    kv_width = kv_heads * head_dim
    q_width = q_heads * head_dim
    for pair in range(first, last):
        t = chosen[pair // kv_heads]
        kv = pair % kv_heads
        slot = row_slot[token_row[t]]
        context = positions[t] + 1
        start = t * q_width + kv * group * head_dim
        pages = (context + page_tokens - 1) // page_tokens
        for p in range(pages):
            base = page_table[slot * pages_per_row + p] * page_stride + kv * head_dim
            count = min(page_tokens, context - p * page_tokens)
            for h in range(group):
                _page_dots(scores, h * context + p * page_tokens, q, start + h * head_dim, k_cache, base, count,
                           kv_width, np.float32(scale), head_dim)
        for h in range(group):
            weights = scores[h * context:(h + 1) * context]
            best = weights[0]
            for j in range(context):
                best = max(best, weights[j])
            norm = np.float32(0.0)
            for j in range(context):
                weight = _exp(weights[j] - best)
                weights[j] = weight
                norm += weight
            inverse = np.float32(1.0) / norm
            for j in range(context):
                weights[j] *= inverse
        out[start:start + group * head_dim] = 0.0
        for p in range(pages):
            base = page_table[slot * pages_per_row + p] * page_stride + kv * head_dim
            count = min(page_tokens, context - p * page_tokens)
            for h in range(group):
                _page_axpy(out, start + h * head_dim, scores, h * context + p * page_tokens, v_cache, base, count,
                           kv_width, head_dim)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _block_bytes(code: int) -> int:
    return 34 if code == BLOCK_Q8_0 else 20


@njit(cache=True, fastmath=True, nogil=True)
def dequantize_rows(out: np.ndarray, data: np.ndarray, code: int, first: int, rows: int, k: int) -> None:
    """out[:rows * k] = the f32 weights of rows first .. first + rows - 1 of a [m, k] block matrix."""
    size = _block_bytes(code)
    blocks = k // 32
    if out.size < rows * k or data.size < (first + rows) * blocks * size:
        raise IndexError("dequantize_rows: arrays smaller than the rows")
    for block in range(rows * blocks):
        at = (first * blocks + block) * size
        if code == BLOCK_Q8_0:
            q8_0_store(out, block * 32, data, at)
        else:
            q4_1_store(out, block * 32, data, at)


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _block_dots(data: np.ndarray, code: int, at: int, row_bytes: int, x: np.ndarray, x_at: int, k: int, blocks: int,
                rows: int, tokens: int, sums: np.ndarray) -> None:
    if tokens == 8:
        if rows == 2:
            dots2x8(data, code, at, row_bytes, x, x_at, k, blocks, sums)
        else:
            dots1x8(data, code, at, row_bytes, x, x_at, k, blocks, sums)
    elif tokens == 4:
        if rows == 2:
            dots2x4(data, code, at, row_bytes, x, x_at, k, blocks, sums)
        else:
            dots1x4(data, code, at, row_bytes, x, x_at, k, blocks, sums)
    elif rows == 4:
        dots4x1(data, code, at, row_bytes, x, x_at, k, blocks, sums)
    elif rows == 2:
        dots2x1(data, code, at, row_bytes, x, x_at, k, blocks, sums)
    else:
        dots1x1(data, code, at, row_bytes, x, x_at, k, blocks, sums)


@njit(cache=True, fastmath=True, nogil=True)
def block_linear_rows(out: np.ndarray, x: np.ndarray, data: np.ndarray, code: int, n: int, k: int, m: int,
                      accumulate: bool, first: int, last: int, sums: np.ndarray) -> None:
    """linear_rows over a [m, k] block matrix (code: BLOCK_*): out[t, o] (+)= sum_i x[t, i] * w[o, i]
    for t < n, first <= o < last. `sums` >= 16 floats of scratch.

    Output rows in groups (4 for up to 3 tokens, else 2; then 2 or 1 for the rows left over), tokens in
    groups of 8 (then 4, then 1): each block is widened in registers once per token group and
    multiplied into one accumulator per (row, token), and each loaded input feeds every row of
    the group (nothing of the weight is written to memory; an 8-token group reads the row once for
    8 tokens). Measured one thread, weights in cache, [3072, 576] Q4_1: docs/cpu-executor.md.
    """
    size = _block_bytes(code)
    blocks = k // 32
    row_bytes = blocks * size
    if x.size < n * k or out.size < n * m or data.size < last * row_bytes or sums.size < 16 or k % 32:
        raise IndexError("block_linear_rows: arrays smaller than the product")
    step = 2 if n < 4 else 2
    o = first
    while o < last:
        rows = step if o + step <= last else (2 if o + 2 <= last else 1)
        at = o * row_bytes
        t = 0
        while t < n:
            group = 8 if t + 8 <= n else (4 if t + 4 <= n else 1)
            _block_dots(data, code, at, row_bytes, x, t * k, k, blocks, rows, group, sums)
            for r in range(rows):
                for j in range(group):
                    _store(out, (t + j) * m + o + r, sums[r * group + j], accumulate)
            t += group
        o += rows


@njit(cache=True, fastmath=True, nogil=True)
def block_linear_claimed(out: np.ndarray, x: np.ndarray, data: np.ndarray, code: int, n: int, k: int, m: int,
                         accumulate: bool, chunks: int, counters: np.ndarray, sums: np.ndarray, calls: np.ndarray,
                         caller: bool) -> None:
    """block_linear_rows over the chunks of `chunks` row ranges that this thread claims (counters:
    NEXT / DONE), until none is left: every thread of a shared call runs it with its own `sums`.
    The caller announces the call and waits for the helpers' chunks in here (_share_begin / _end)."""
    _share_begin(calls, caller)
    while True:
        index = fetch_add(counters, NEXT, 1)
        if index >= chunks:
            break
        first, last = _chunk_rows(index, chunks, m)
        block_linear_rows(out, x, data, code, n, k, m, accumulate, first, last, sums)
        fetch_add(counters, DONE, 1)
    _share_end(counters, chunks, caller)


@njit(cache=True, fastmath=True, nogil=True)
def linear_claimed(out: np.ndarray, x: np.ndarray, weight: np.ndarray, n: int, k: int, m: int, accumulate: bool,
                   chunks: int, counters: np.ndarray, calls: np.ndarray, caller: bool) -> None:
    """linear_rows (f16 bits) over the row chunks this thread claims, as block_linear_claimed."""
    _share_begin(calls, caller)
    while True:
        index = fetch_add(counters, NEXT, 1)
        if index >= chunks:
            break
        first, last = _chunk_rows(index, chunks, m)
        linear_rows(out, x, weight, n, k, m, accumulate, first, last, 0)
        fetch_add(counters, DONE, 1)
    _share_end(counters, chunks, caller)


@njit(cache=True, fastmath=True, nogil=True)
def attention_claimed(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      positions: np.ndarray, token_row: np.ndarray, row_slot: np.ndarray, page_table: np.ndarray,
                      chosen: np.ndarray, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int,
                      pages_per_row: int, page_stride: int, scale: float, scores: np.ndarray, pairs: int,
                      chunks: int, counters: np.ndarray, calls: np.ndarray, caller: bool) -> None:
    """attention_pairs over the chunks of (token, kv head) pairs this thread claims (`scores`: its own)."""
    _share_begin(calls, caller)
    while True:
        index = fetch_add(counters, NEXT, 1)
        if index >= chunks:
            break
        attention_pairs(out, q, k_cache, v_cache, positions, token_row, row_slot, page_table, chosen, q_heads,
                        kv_heads, head_dim, page_tokens, pages_per_row, page_stride, scale, scores,
                        index * pairs // chunks, (index + 1) * pairs // chunks)
        fetch_add(counters, DONE, 1)
    _share_end(counters, chunks, caller)


@njit(cache=True, fastmath=True, nogil=True)
def block_gather_rows(out: np.ndarray, data: np.ndarray, code: int, ids: np.ndarray, n: int, k: int) -> None:
    """out[t] = row ids[t] of a block table (its f32 weights) for t < n."""
    for t in range(n):
        dequantize_rows(out[t * k:(t + 1) * k], data, code, ids[t], 1, k)


def warm_up() -> None:
    """Compile every primitive for the argument types the kernels pass (numba caches the machine
    code on disk, so after the first load this only loads it), so no step pays compilation."""
    f32 = np.zeros(64, dtype=np.float32)
    bits = np.zeros(64, dtype=np.uint16)
    i32 = np.zeros(4, dtype=np.int32)
    i64 = np.zeros(4, dtype=np.int64)
    widen(f32, bits, 4)
    wait_for_change(i64, 1, 1)
    counters = np.zeros(3, dtype=np.int64)
    wait_done(counters, 1)
    linear_claimed(f32, f32, bits, 1, 4, 4, False, 1, counters, np.zeros(1, dtype=np.int64), True)
    linear_rows(f32, f32, bits, 1, 4, 4, False, 0, 4, 0)
    u8 = np.zeros(340, dtype=np.uint8)
    for code in (BLOCK_Q8_0, BLOCK_Q4_1):
        dequantize_rows(f32, u8, code, 0, 2, 32)
        for n in (1, 2):
            block_linear_rows(f32, f32, u8, code, n, 32, 2, False, 0, 2, f32)   # n: 1, 2 (groups of 1)
        block_linear_rows(np.zeros(16, dtype=np.float32), np.zeros(256, dtype=np.float32), u8, code, 8, 32, 2,
                          False, 0, 2, f32)                                              # groups of 8
        block_linear_rows(np.zeros(8, dtype=np.float32), np.zeros(128, dtype=np.float32), u8, code, 4, 32, 2,
                          False, 0, 2, f32)                                              # groups of 4
        block_gather_rows(f32, u8, code, i32, 1, 32)
    block_linear_claimed(np.zeros(16, dtype=np.float32), np.zeros(256, dtype=np.float32), u8, BLOCK_Q4_1, 8, 32, 2,
                         False, 1, np.zeros(3, dtype=np.int64), f32, np.zeros(1, dtype=np.int64), True)
    rms_norm(f32, f32, i64[:1], bits, 4, 1e-5)
    gather_rows(f32, bits, i32, 1, 4)
    silu_gate(f32, f32, 1, 4, 4, 0)
    for plane in (f32, bits):      # cache planes: f32, or f16 as uint16 bits
        rope_store(f32, plane, plane, f32, f32, i32, i32, i32, i32, 1, 1, 1, 2, 1, 1, 32, 0)
        attention_pairs(f32, f32, plane, plane, i32, i32, i32, i32, i64[:1], 1, 1, 2, 1, 1, 32, 1.0, f32, 0, 1)
        attention_claimed(f32, f32, plane, plane, i32, i32, i32, i32, i64[:1], 1, 1, 2, 1, 1, 32, 1.0, f32, 1, 1,
                          np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.int64), True)
