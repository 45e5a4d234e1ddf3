"""One rank's device arena (virtual memory management) and the pinned host frames.

The arena is one reserved virtual address range per rank:

    [ fixed part: weights, tuned, state, staging, completion, scratch | cache window 0 | window 1 ...]

The fixed part is backed right away. Each CACHE buffer gets a window wide enough for every
page the device could ever hold; graphs are captured with the windows' addresses, and only
after all graphs are instantiated and uploaded are the windows backed with the page count
chosen from the memory then left (`map_cache`). That is how cache pages take "the memory
left after graphs load" while every kernel argument is fixed before capture.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .driver import check
from .errors import DeviceMemoryError
from .plan import ArenaLayout, BufferAddresses, align_up


class DeviceArena:
    """Owns one rank's reserved range, its physical allocations and their mappings."""

    def __init__(self, driver: Any, device: Any, ordinal: int, layout: ArenaLayout) -> None:
        self._d = driver
        self._ordinal = ordinal
        self.layout = layout
        self._handles: list[tuple[int, int, Any]] = []     # (address, size, allocation handle)
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        self.granularity = int(check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        total = int(check(driver.cuDeviceTotalMem(device), "cuDeviceTotalMem"))
        self.fixed_nbytes = align_up(max(layout.fixed_nbytes, 1), self.granularity)
        # widest cache any page count could need: every byte of the device as pages
        self.max_pages = total // layout.bytes_per_page if layout.bytes_per_page else 0
        self._windows = {name: align_up(self.max_pages * page, self.granularity)
                         for name, page in layout.cache_page_nbytes.items()}
        self.reserved_nbytes = self.fixed_nbytes + sum(self._windows.values())
        self.base = int(check(driver.cuMemAddressReserve(self.reserved_nbytes, self.granularity, 0, 0),
                              "cuMemAddressReserve"))
        self.cache_pages = 0
        self._map(self.base, self.fixed_nbytes)
        check(driver.cuMemsetD8(self.base, 0, self.fixed_nbytes), "cuMemsetD8")

    def _map(self, address: int, size: int) -> None:
        d = self._d
        try:
            handle = check(d.cuMemCreate(size, self._prop, 0), "cuMemCreate")
        except Exception as error:
            raise DeviceMemoryError(f"rank {self.layout.rank}: cannot back {size} bytes") from error
        check(d.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self._ordinal
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(d.cuMemSetAccess(address, size, [access], 1), "cuMemSetAccess")
        self._handles.append((address, size, handle))

    def addresses(self) -> BufferAddresses:
        """Device address of every buffer; CACHE buffers span their whole window."""
        base = {name: self.base + offset for name, offset in self.layout.offsets.items()}
        nbytes = {name: int(self.layout.buffers[name].nbytes) for name in self.layout.offsets}
        cursor = self.base + self.fixed_nbytes
        for name, window in self._windows.items():
            base[name] = cursor
            nbytes[name] = max(window, 1)
            cursor += window
        return BufferAddresses(base, nbytes)

    def pages_that_fit(self, free_nbytes: int, share: float) -> int:
        """Pages that `share` of `free_nbytes` backs, after rounding each window up."""
        if not self.layout.bytes_per_page:
            return 0
        budget = int(free_nbytes * share) - self.granularity * len(self._windows)
        return max(0, min(self.max_pages, budget // self.layout.bytes_per_page))

    def map_cache(self, pages: int) -> None:
        """Back `pages` pages of every CACHE window (once, after graphs load)."""
        if self.cache_pages:
            raise DeviceMemoryError("cache already backed")
        if pages > self.max_pages:
            raise DeviceMemoryError(f"{pages} pages exceed the device ({self.max_pages})")
        addresses = self.addresses()
        for name, page_nbytes in self.layout.cache_page_nbytes.items():
            if pages:
                self._map(addresses.base[name], align_up(pages * page_nbytes, self.granularity))
        self.cache_pages = pages

    def buffer_nbytes(self, name: str) -> int:
        if name in self.layout.cache_page_nbytes:
            return self.cache_pages * self.layout.cache_page_nbytes[name]
        return int(self.layout.buffers[name].nbytes)

    def close(self) -> None:
        d = self._d
        for address, size, handle in reversed(self._handles):
            d.cuMemUnmap(address, size)
            d.cuMemRelease(handle)
        self._handles.clear()
        if self.base:
            d.cuMemAddressFree(self.base, self.reserved_nbytes)
            self.base = 0


class PinnedFrames:
    """`frames` equal pinned host frames of `frame_nbytes`, as numpy uint8 views.

    Portable pinned memory (visible to every rank's context), not write-combined: the host
    both writes staging and reads completion records, and write-combined reads are slow.
    """

    def __init__(self, driver: Any, frames: int, frame_nbytes: int) -> None:
        self._d = driver
        self.frame_nbytes = align_up(max(frame_nbytes, 1), 64)
        total = self.frame_nbytes * frames
        # mapped too: the staging-copy kernels read and write these frames over PCIe
        flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
        self.address = int(check(driver.cuMemHostAlloc(total, flags), "cuMemHostAlloc"))
        whole = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(self.address))
        whole[:] = 0
        self.views = tuple(whole[f * self.frame_nbytes:f * self.frame_nbytes + frame_nbytes]
                           for f in range(frames))
        self.words = tuple(v[: len(v) // 4 * 4].view(np.int32) for v in self.views)

    def frame_address(self, frame: int) -> int:
        return self.address + frame * self.frame_nbytes

    def device_address(self, frame: int) -> int:
        """The frame's address as the current context's kernels see it."""
        base = int(check(self._d.cuMemHostGetDevicePointer(self.address, 0), "cuMemHostGetDevicePointer"))
        return base + frame * self.frame_nbytes

    def close(self) -> None:
        if self.address:
            self.views = ()
            self.words = ()
            self._d.cuMemFreeHost(self.address)
            self.address = 0
