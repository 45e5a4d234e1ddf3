"""Elements as the CPU executor's compiled code reads and writes them.

Numba has no float16 type: f16 weights and f16 cache planes are passed as their uint16 bit
patterns and widened in registers by `f16_bits_to_f32`, an LLVM `fpext half -> float` that the
loop vectorizer turns into vcvtph2ps (F16C / AVX-512); nothing streams an f32 copy of a weight.
`as_f32` and `plane_value` let one compiled body serve f16 bits and f32 alike (numba picks the
form per argument type at compile time). `exp_nonpositive` is the exp that vectorizes (softmax, SiLU).
"""
from __future__ import annotations

from typing import Any, Callable, cast

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit
from numba.core import types
from numba.extending import intrinsic, overload


def _widen_half(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def _narrow_to_half(typingctx: Any, value: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


def _bits_to_float(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


# typed as plain callables: numba's intrinsic objects confuse static checkers
f16_bits_to_f32 = cast(Callable[[Any], Any], intrinsic(_widen_half))
"""The float32 value of an IEEE half given as its uint16 bits (exact, subnormals included)."""
f32_to_f16_bits = cast(Callable[[Any], Any], intrinsic(_narrow_to_half))
"""The uint16 bits of a float32 rounded to the nearest half (round to nearest even)."""
i32_bits_to_f32 = cast(Callable[[Any], Any], intrinsic(_bits_to_float))
"""The float32 whose bits are the given int32 (a bitcast)."""


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


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def store(out: np.ndarray, index: int, value: np.float32, accumulate: bool) -> None:
    """out[index] = value, or += value where the product accumulates into its output."""
    if accumulate:
        out[index] += value
    else:
        out[index] = value


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def exp_nonpositive(x: np.float32) -> np.float32:
    """exp(x) for x <= 0 (a softmax's shifted scores, a SiLU's e^-|g|) without a library call, so a
    loop of them vectorizes (numba's np.exp is one scalar expf call per element: without a vector
    math library the softmax of 8 decode rows was most of their attention). Cody-Waite reduction x = n ln2 + r,
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
