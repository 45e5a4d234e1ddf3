"""LLVM vector code for attention over one head of `width` (64 or 128) elements at a time.

A head's query, key or value row is loaded as one <width x float> vector (an f16 cache plane's
uint16 bits widened in registers), so a dot product is one vector multiply and a tree sum and a
weighted sum one multiply-add per lane: with numba loops over slices of the cache, each cached key
cost a slice and its reference counting, 4-6x the arithmetic (attention.py picks these for widths
64 and 128 and loops otherwise). No bounds checks: attention.py's loops stay inside the cache.
"""
from __future__ import annotations

from typing import Any, Callable, cast

from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils, types
from numba.extending import intrinsic

from helios_backend.executors.cpu.codegen import element_pointer, horizontal_sum, splat


def load_head(context: Any, builder: Any, array_type: Any, array: Any, at: Any, width: int) -> Any:
    """<width x float> from element `at` of a float32 array, or of an f16 plane held as uint16 bits."""
    pointer = element_pointer(context, builder, array_type, array, at)
    if array_type.dtype == types.uint16:
        bits = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), width).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), width)),
                             ir.VectorType(ir.FloatType(), width))
    return builder.load(builder.bitcast(pointer, ir.VectorType(ir.FloatType(), width).as_pointer()), align=4)



def _head_dot_intrinsic(width: int) -> Callable[..., Any]:
    """sum(a[a_at:a_at + width] * b[b_at:b_at + width]) as one vector product and a tree sum."""
    def typer(typingctx: Any, a: Any, a_at: Any, b: Any, b_at: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            first = load_head(context, builder, signature.args[0], args[0], args[1], width)
            second = load_head(context, builder, signature.args[2], args[2], args[3], width)
            return horizontal_sum(builder, builder.fmul(first, second))
        return types.float32(a, types.intp, b, types.intp), codegen
    return typer


def _head_axpy_intrinsic(width: int) -> Callable[..., Any]:
    """target[t_at:t_at + width] += weight * value[v_at:v_at + width] (target float32)."""
    def typer(typingctx: Any, target: Any, t_at: Any, weight: Any, value: Any, v_at: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            vector = ir.VectorType(ir.FloatType(), width)
            pointer = builder.bitcast(element_pointer(context, builder, signature.args[0], args[0], args[1]),
                                      vector.as_pointer())
            values = load_head(context, builder, signature.args[3], args[3], args[4], width)
            total = builder.fadd(builder.load(pointer, align=4), builder.fmul(splat(builder, args[2], width), values))
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
            query = load_head(context, builder, signature.args[2], q_, q_at_, width)
            with cgutils.for_range(builder, count_) as loop:
                at = builder.add(base_, builder.mul(loop.index, stride_))
                key = load_head(context, builder, signature.args[4], cache_, at, width)
                dot = horizontal_sum(builder, builder.fmul(query, key))
                target = element_pointer(context, builder, signature.args[0], scores_, builder.add(s_at_, loop.index))
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
            pointer = builder.bitcast(element_pointer(context, builder, signature.args[0], target_, t_at_),
                                      vector.as_pointer())
            total = cgutils.alloca_once_value(builder, builder.load(pointer, align=4))   # promoted to registers
            with cgutils.for_range(builder, count_) as loop:
                values = load_head(context, builder, signature.args[4], cache_,
                                    builder.add(base_, builder.mul(loop.index, stride_)), width)
                weight = builder.load(element_pointer(context, builder, signature.args[2], weights_,
                                                       builder.add(w_at_, loop.index)))
                weighted = builder.fmul(splat(builder, weight, width), values)
                builder.store(builder.fadd(builder.load(total), weighted), total)
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
