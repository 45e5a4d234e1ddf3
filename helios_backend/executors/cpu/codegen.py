"""LLVM IR building blocks shared by the CPU executor's numba intrinsics (claiming.py, block_codegen.py,
attention_codegen.py): array element addresses, fused multiply-adds, lane
splats and horizontal sums. Each takes an llvmlite IR builder positioned inside an intrinsic's
codegen; none emits a call to a library function (everything lowers to vector instructions)."""
from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]


def element_pointer(context: Any, builder: Any, array_type: Any, array: Any, index: Any) -> Any:
    """The address of array[index] (an array argument of an intrinsic, its numba type `array_type`)."""
    return builder.gep(context.make_array(array_type)(context, builder, value=array).data, [index])


def fma(builder: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c as one fused multiply-add per lane (llvm.fma.vNf32)."""
    module = builder.module
    name = f"llvm.fma.v{a.type.count}f32"
    function = module.globals.get(name) or ir.Function(module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(function, [a, b, c])


def horizontal_sum(builder: Any, total: Any) -> Any:
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


def splat(builder: Any, value: Any, lanes: int) -> Any:
    """<lanes x float> with every lane `value` (a float): an insert into lane 0 and a zero shuffle."""
    vector = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined), value,
                                    ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vector, ir.Constant(ir.VectorType(ir.FloatType(), 1), ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
