"""Run the kernel sources on the CPU through Triton's interpreter, over a numpy arena.

Test/oracle support only: the serving path never interprets. Pointer arguments are byte
offsets into one uint8 numpy arena (the numpy executor's convention), turned into typed raw
addresses; immediates are wrapped in the exact scalar types of the compiled signature, so the
interpreter sees the same ABI as the cubin. PDL is off (griddepcontrol has no interpreter form).

Triton decides at import time whether its own library functions (tl.zeros, ...) are
interpreted, so kernels run in a spawned worker process whose environment has
TRITON_INTERPRET=1 before triton is imported; the caller's process stays in compile mode.
Relies on triton.runtime.interpreter internals (checked against triton 3.9).
"""
from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import traceback
from typing import IO, Mapping, Sequence

import numpy as np

_SCALARS = {"i32": np.int32, "i64": np.int64, "u64": np.uint64, "fp32": np.float32,
            "u32": np.uint32}


def _wrap(triton_type: str, value, arena: np.ndarray):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle
    if triton_type.startswith("*"):
        ty = tl.pointer_type(tl.str_to_ty(triton_type[1:], None))
        address = arena.ctypes.data + int(value)
        return tl.tensor(TensorHandle(np.array([address], np.uint64), ty), ty)
    ty = tl.str_to_ty(triton_type, None)
    return tl.tensor(TensorHandle(np.array([value], _SCALARS[triton_type]), ty), ty)


def _run_in_worker(module: str, function: str, signature: Sequence[tuple[str, str]],
                   grid: tuple[int, int, int], arena: np.ndarray, args: Sequence,
                   constexprs: Mapping[str, int]) -> np.ndarray:
    from triton.runtime import interpreter
    from ignition.gpu_kernels.compiler import SOURCE_PACKAGE
    kernel = getattr(importlib.import_module(f"{SOURCE_PACKAGE}.{module}"), function)
    if not isinstance(kernel, interpreter.InterpretedFunction):
        raise RuntimeError("worker was not started with TRITON_INTERPRET=1")
    fn = kernel.rewrite()
    kwargs = {name: _wrap(kind, value, arena) for (name, kind), value in zip(signature, args)}
    kwargs.update(constexprs)
    if "PDL" in kernel.arg_names:
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
    return arena


class InterpreterError(RuntimeError):
    """A kernel failed inside the interpreter worker; carries the worker's traceback."""


class Interpreter:
    """One interpreter worker process; use as a context manager (closes the worker).

    Requests and replies are pickles over the worker's stdin/stdout.
    """

    def __init__(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
        self._worker = subprocess.Popen([sys.executable, "-m", __name__],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        if self._worker.stdin is None or self._worker.stdout is None:
            raise InterpreterError("the interpreter worker has no pipes")
        self._requests: IO[bytes] = self._worker.stdin
        self._replies: IO[bytes] = self._worker.stdout

    def __enter__(self) -> "Interpreter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._worker.poll() is None:
            self._requests.close()
            self._worker.wait(timeout=60)

    def run(self, module: str, function: str, signature: Sequence[tuple[str, str]],
            grid: tuple[int, int, int], arena: np.ndarray, args: Sequence,
            constexprs: Mapping[str, int]) -> None:
        """Launch a kernel on `grid`; `arena` (contiguous uint8) is updated in place."""
        if arena.dtype != np.uint8 or not arena.flags.c_contiguous:
            raise ValueError("arena must be a contiguous uint8 array")
        request = (module, function, tuple(signature), tuple(grid), arena, tuple(args),
                   dict(constexprs))
        pickle.dump(request, self._requests)
        self._requests.flush()
        status, payload = pickle.load(self._replies)
        if status != "ok":
            raise InterpreterError(payload)
        arena[...] = payload


def _serve() -> None:
    """Worker loop: requests on stdin, replies on the real stdout (print goes to stderr)."""
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        reply: tuple[str, np.ndarray | str]
        try:
            reply = ("ok", _run_in_worker(*request))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    _serve()
