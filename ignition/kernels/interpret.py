"""Run the kernel sources on the CPU through Triton's interpreter, over a numpy arena.

Test/oracle support only: the serving path never interprets. Pointer arguments are byte
offsets into one uint8 numpy arena (the numpy executor's convention), turned into typed raw
addresses; immediates are wrapped in the exact scalar types of the compiled signature, so the
interpreter sees the same ABI as the cubin. The source module is loaded a second time with
the interpreter switched on (triton.jit decides at decoration time), and PDL is off
(griddepcontrol has no interpreter form).

Relies on triton.runtime.interpreter internals (checked against triton 3.9).
"""
from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Mapping, Sequence

import numpy as np

from ignition.kernels import compiler
from ignition.kernels.specs import SPECS_BY_ID, Grid

_SCALARS = {"i32": np.int32, "i64": np.int64, "u64": np.uint64, "fp32": np.float32,
            "u32": np.uint32}
_interpreted_modules: dict[str, ModuleType] = {}


def _interpreted_module(name: str) -> ModuleType:
    from triton import knobs
    if name not in _interpreted_modules:
        spec = importlib.util.find_spec(f"{compiler.SOURCE_PACKAGE}.{name}")
        loader_spec = importlib.util.spec_from_file_location(f"_interpreted_{name}", spec.origin)
        module = importlib.util.module_from_spec(loader_spec)
        previous = knobs.runtime.interpret
        knobs.runtime.interpret = True
        try:
            loader_spec.loader.exec_module(module)
        finally:
            knobs.runtime.interpret = previous
        _interpreted_modules[name] = module
    return _interpreted_modules[name]


def _wrap(triton_type: str, value, arena: np.ndarray):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle
    if triton_type.startswith("*"):
        ty = tl.pointer_type(tl.str_to_ty(triton_type[1:], None))
        address = arena.ctypes.data + int(value)
        return tl.tensor(TensorHandle(np.array([address], np.uint64), ty), ty)
    ty = tl.str_to_ty(triton_type, None)
    return tl.tensor(TensorHandle(np.array([value], _SCALARS[triton_type]), ty), ty)


def run_interpreted(kernel_id: str, signature: Sequence[tuple[str, str]], grid: Grid,
                    arena: np.ndarray, args: Sequence, constexprs: Mapping[str, int] | None = None,
                    ) -> None:
    """Launch `kernel_id` on `grid` with ABI-ordered args (pointers = arena byte offsets)."""
    from triton.runtime import interpreter
    if arena.dtype != np.uint8 or not arena.flags.c_contiguous:
        raise ValueError("arena must be a contiguous uint8 array")
    spec = SPECS_BY_ID[kernel_id]
    fn = getattr(_interpreted_module(spec.module), spec.function).rewrite()
    kwargs = {name: _wrap(kind, value, arena) for (name, kind), value in zip(signature, args)}
    kwargs.update(constexprs if constexprs is not None else spec.constexprs)
    kwargs["PDL"] = False
    scope = interpreter._patch_lang(fn)
    try:
        interpreter.interpreter_builder.set_grid_dim(*grid)
        for x in range(grid[0]):
            for y in range(grid[1]):
                for z in range(grid[2]):
                    interpreter.interpreter_builder.set_grid_idx(x, y, z)
                    fn(**kwargs)
    finally:
        scope.restore()
