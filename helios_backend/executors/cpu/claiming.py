"""Chunks of one shared call claimed in compiled code, without the GIL (sharing.WorkSharing.run_claimed).

Every thread of a shared call (the caller and each helper that wakes in time) runs the same
compiled primitive, which claims the call's chunks with an atomic fetch-add until none is left
(`claim_chunks`): no chunk waits for the GIL. The caller announces the call from compiled code,
once it holds no GIL, and waits there for the chunks the helpers hold. An idle helper polls for
the next call without the GIL too (`wait_for_change`).

The atomics are LLVM instructions emitted by numba intrinsics (numba has no atomic operations).
"""
from __future__ import annotations

from typing import Any, Callable, cast

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from helios_backend.executors.cpu.codegen import element_pointer


def _load_acquire(typingctx: Any, flags: Any, index: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = element_pointer(context, builder, signature.args[0], args[0], args[1])
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
        pointer = element_pointer(context, builder, signature.args[0], args[0], args[1])
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
def chunk_rows(index: int, chunks: int, m: int) -> tuple[int, int]:
    """Output rows [first, last) of chunk `index` of a product's `m` rows: whole row quads, so each
    chunk starts on an even row (the products take output rows in pairs)."""
    quads = m // 4
    first = 4 * (index * quads // chunks)
    last = m if index == chunks - 1 else 4 * ((index + 1) * quads // chunks)
    return first, last


@njit(inline="always", cache=True, nogil=True)
def claim_chunks(work: Callable[..., None], args: Any, chunks: int, counters: np.ndarray, calls: np.ndarray,
                 caller: bool) -> None:
    """work(index, chunks, args) for each chunk of the call this thread claims (counters: NEXT /
    DONE), until none is left; `work` is a compiled function, `args` the tuple of its arguments.
    The caller announces the call and waits for the helpers' chunks in here (_share_begin /
    _share_end). Inlined into each caller, so `work` is a direct call to a function known when
    the caller compiles: a compiled function passed across a call boundary becomes a function
    pointer, whose address numba cannot cache (the caller would be compiled in every process)."""
    _share_begin(calls, caller)
    while True:
        index = fetch_add(counters, NEXT, 1)
        if index >= chunks:
            break
        work(index, chunks, args)
        fetch_add(counters, DONE, 1)
    _share_end(counters, chunks, caller)
