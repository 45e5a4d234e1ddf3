"""A pure-Python stand-in for cuda.bindings.driver, for CPU tests of the CUDA executor.

It implements the calls the executor makes with plausible results (addresses from a
counter, pinned memory as numpy buffers) and records every kernel launch with its
parameter words read back through the `void*[]` the executor packed, so tests can check
what a graph would launch without a GPU. Nothing executes: completion words stay zero.
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np

OK = (0,)


class _Struct:
    """A C struct: any attribute may be set; nested structs appear on first read."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _Struct()
        object.__setattr__(self, name, child)
        return child


class _Enum:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix

    def __getattr__(self, name: str) -> int:
        if name.startswith("__"):
            raise AttributeError(name)
        return hash(name) & 0xFFFF


class Launch:
    def __init__(self, config: Any, function: Any, argv_address: int) -> None:
        self.grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
        self.block = (config.blockDimX, config.blockDimY, config.blockDimZ)
        self.shared = config.sharedMemBytes
        self.pdl = bool(getattr(config, "numAttrs", 0))
        self.function = function
        self.argv_address = argv_address

    def word(self, index: int, nbytes: int = 8) -> int:
        """Parameter `index` as an unsigned little-endian integer of `nbytes` bytes."""
        pointer = ctypes.c_uint64.from_address(self.argv_address + 8 * index).value
        return int.from_bytes(ctypes.string_at(pointer, nbytes), "little")


class FakeDriver:
    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTALLOC_DEVICEMAP = 2

    def __init__(self, total_memory: int = 8 << 30, capability: tuple[int, int] = (9, 0)) -> None:
        self._addresses = itertools.count(1 << 40, 1 << 36)
        self._handles = itertools.count(1)
        self._host: dict[int, np.ndarray] = {}
        self.total_memory = total_memory
        self.capability = capability            # (major, minor) every device reports
        self.module_images: list[bytes] = []    # what cuModuleLoadData was given, in order
        self.capturing = False
        self.launches: list[Launch] = []        # recorded during capture
        self.graphs: list[list[Launch]] = []
        self.copies_to_device: list[tuple[int, bytes]] = []
        self.graph_launches = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("CU") and not name.startswith("CUDA"):
            if name in ("CUmemAllocationProp", "CUmemAccessDesc", "CUlaunchConfig", "CUlaunchAttribute"):
                return _Struct
            return _Enum(name)
        raise AttributeError(name)

    # ---- context, device, memory ------------------------------------------------------------
    def cuInit(self, flags): return OK
    def cuDeviceGet(self, ordinal): return (0, ordinal)
    def cuDeviceGetCount(self): return (0, 1)

    def cuDeviceGetAttribute(self, attribute, device):
        names = self.CUdevice_attribute
        values = {names.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.capability[0],
                  names.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.capability[1]}
        return (0, values[attribute])

    def cuDevicePrimaryCtxRetain(self, device): return (0, f"ctx{device}")
    def cuDevicePrimaryCtxRelease(self, device): return OK
    def cuCtxSetCurrent(self, context): return OK
    def cuDeviceTotalMem(self, device): return (0, self.total_memory)
    def cuMemGetInfo(self): return (0, self.total_memory // 2, self.total_memory)
    def cuMemGetAllocationGranularity(self, prop, flags): return (0, 2 << 20)
    def cuMemAddressReserve(self, size, alignment, address, flags): return (0, next(self._addresses))
    def cuMemAddressFree(self, address, size): return OK
    def cuMemCreate(self, size, prop, flags): return (0, next(self._handles))
    def cuMemMap(self, address, size, offset, handle, flags): return OK
    def cuMemSetAccess(self, address, size, descs, count): return OK
    def cuMemUnmap(self, address, size): return OK
    def cuMemRelease(self, handle): return OK
    def cuMemsetD8(self, address, value, count): return OK

    def cuMemHostAlloc(self, size, flags):
        buffer = np.zeros(size, dtype=np.uint8)
        self._host[buffer.ctypes.data] = buffer
        return (0, buffer.ctypes.data)

    def cuMemHostGetDevicePointer(self, address, flags): return (0, address)
    def cuMemFreeHost(self, address):
        self._host.pop(address, None)
        return OK

    def cuMemcpyHtoD(self, dst, src, nbytes):
        self.copies_to_device.append((dst, ctypes.string_at(src, nbytes)))
        return OK

    def cuMemcpyDtoH(self, dst, src, nbytes):
        ctypes.memset(dst, 0, nbytes)
        return OK

    # ---- modules, streams, events ---------------------------------------------------------
    def cuModuleLoadData(self, image):
        self.module_images.append(bytes(image))
        return (0, f"module{next(self._handles)}")
    def cuModuleGetFunction(self, module, symbol): return (0, symbol.decode())
    def cuModuleUnload(self, module): return OK
    def cuFuncSetAttribute(self, function, attribute, value): return OK
    def cuStreamCreate(self, flags): return (0, f"stream{next(self._handles)}")
    def cuStreamDestroy(self, stream): return OK
    def cuStreamSynchronize(self, stream): return OK
    def cuEventCreate(self, flags): return (0, f"event{next(self._handles)}")
    def cuEventDestroy(self, event): return OK
    def cuEventSynchronize(self, event): return OK
    def cuEventQuery(self, event): return OK
    def cuEventRecordWithFlags(self, event, stream, flags): return OK

    # ---- capture and graphs ---------------------------------------------------------------
    def cuStreamBeginCapture(self, stream, mode):
        self.capturing = True
        self.launches = []
        return OK

    def cuLaunchKernelEx(self, config, function, argv, extra):
        assert self.capturing, "kernels are only launched into graphs"
        self.launches.append(Launch(config, function, int(argv)))
        return OK

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream): return OK
    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream): return OK

    def cuStreamEndCapture(self, stream):
        self.capturing = False
        self.graphs.append(self.launches)
        return (0, len(self.graphs) - 1)

    def cuGraphGetNodes(self, graph, count=0): return (0, None, len(self.graphs[graph]))
    def cuGraphInstantiate(self, graph, flags): return (0, graph)
    def cuGraphUpload(self, graph_exec, stream): return OK
    def cuGraphLaunch(self, graph_exec, stream):
        self.graph_launches += 1
        return OK

    def cuGraphExecDestroy(self, graph_exec): return OK
    def cuGraphDestroy(self, graph): return OK
