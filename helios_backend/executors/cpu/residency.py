"""Give back the resident code pages of LLVM, which the CPU executor needs only while it compiles.

numba links LLVM (llvmlite's libllvmlite.so, ~170 MB on disk) into the serving process. Importing
numba and loading the cached machine code makes ~100 MiB of that library's read-only pages
resident (measured: 78 of its 80 MiB of code, 23 MiB of read-only data), although after
`warm_up.warm_up()` no step runs a line of LLVM: the compiled primitives are called through
numba's dispatchers, and their machine code lives in memory LLVM allocated, not in the library.

`release_library_pages("libllvmlite")` unmaps those pages from this process with
madvise(MADV_DONTNEED) on every mapping of the library that is not writable and holds no dirty
page: the page cache keeps them (nothing is freed for the machine unless it needs the memory),
and a later compilation (a new argument type) faults them back from the file, unchanged, since
a clean private file page is the file's content. Mappings with dirty pages (relocated data)
are left alone: MADV_DONTNEED would revert them to the file's bytes.

`release_free_heap()` hands the C heap's free pages back after the load: Bootstrap and the load
free tens of MiB of small allocations (the tokenizer's construction, the manifest's decoding,
binding every program), which glibc keeps resident inside its heap, where only the top can
shrink by itself (measured on the default core: 27-29 MiB of RssAnon returned after the load).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from pathlib import Path

__all__ = ["release_free_heap", "release_library_pages"]

_MADV_DONTNEED = 4


def _clean_read_only_mappings(fragment: str) -> list[tuple[int, int]]:
    """(start, length) of this process's mappings of a file whose name holds `fragment`, not
    writable, with no dirty page (from /proc/self/smaps)."""
    found: list[tuple[int, int]] = []
    start = end = dirty = 0
    match = False
    for line in Path("/proc/self/smaps").read_text().splitlines() + ["0-0 ---p"]:   # a last header closes
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):          # a mapping's header: range perms offset dev inode [path]
            if match and dirty == 0:
                found.append((start, end - start))
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            match, dirty = fragment in Path(path).name and "w" not in fields[1], 0
        elif fields[0] in ("Private_Dirty:", "Shared_Dirty:"):
            dirty += int(fields[1])
    return found


def release_library_pages(fragment: str) -> int:
    """Unmap the resident clean read-only pages of the libraries named like `fragment`; the bytes
    of mappings released (0 where /proc or madvise is unavailable: the pages then stay)."""
    try:
        mappings = _clean_read_only_mappings(fragment)
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, ValueError):
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, length in mappings:
        if start % mmap.PAGESIZE == 0 and madvise(start, length, _MADV_DONTNEED) == 0:
            released += length
    return released


def release_free_heap() -> bool:
    """malloc_trim(0): glibc returns every whole free page of its heaps to the system (later
    allocations get fresh zero pages). False where the C library has no malloc_trim (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
