"""NCCL through ctypes on libnccl.so.2 (the nvidia-nccl-cu13 wheel), without torch.

Only what the executor needs: a unique id, one communicator per rank (each initialised on
its own rank thread, the rank's context current), an in-place all-reduce recorded into the
rank's graph during capture, and teardown. NVLink multicast stays off (NCCL_NVLS_ENABLE=0):
the shared GPU hosts require it.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

from helios_proto import contract_pb2

from .errors import CudaCallError, DriverUnavailableError

UNIQUE_ID_NBYTES = 128
NCCL_SUM = 0
# contract DType -> ncclDataType_t
NCCL_DTYPES = {
    contract_pb2.DTYPE_I8: 0, contract_pb2.DTYPE_U8: 1, contract_pb2.DTYPE_I32: 2,
    contract_pb2.DTYPE_U32: 3, contract_pb2.DTYPE_I64: 4, contract_pb2.DTYPE_U64: 5,
    contract_pb2.DTYPE_F16: 6, contract_pb2.DTYPE_F32: 7, contract_pb2.DTYPE_F64: 8,
    contract_pb2.DTYPE_BF16: 9,
}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_NBYTES)]


def _library_path() -> str:
    try:
        import nvidia.nccl  # the wheel's namespace package
        for root in list(getattr(nvidia.nccl, "__path__", [])):
            found = glob.glob(os.path.join(root, "lib", "libnccl.so*"))
            if found:
                return sorted(found)[0]
    except ImportError:
        pass
    return "libnccl.so.2"


class Nccl:
    """The loaded library; methods raise CudaCallError on a nonzero ncclResult_t."""

    def __init__(self) -> None:
        os.environ["NCCL_NVLS_ENABLE"] = "0"      # before the library reads its settings
        try:
            self._lib = ctypes.CDLL(_library_path())
        except OSError as error:
            raise DriverUnavailableError("libnccl.so.2 not found (install nvidia-nccl-cu13)") from error
        lib = self._lib
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]

    def _check(self, code: int, call: str) -> None:
        if code:
            raise CudaCallError(call, code, self._lib.ncclGetErrorString(code).decode())

    def unique_id(self) -> UniqueId:
        uid = UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def unique_id_bytes(self) -> bytes:
        """A unique id as the bytes rank 0 sends its rank processes at rendezvous."""
        return bytes(self.unique_id().internal)

    @staticmethod
    def unique_id_from(data: bytes) -> UniqueId:
        if len(data) != UNIQUE_ID_NBYTES:
            raise ValueError(f"an NCCL unique id holds {UNIQUE_ID_NBYTES} bytes, not {len(data)}")
        return UniqueId.from_buffer_copy(data)

    def init_rank(self, world_size: int, uid: UniqueId, rank: int) -> int:
        """Blocks until every rank has joined: call it on each rank's own thread."""
        comm = ctypes.c_void_p()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank),
                    "ncclCommInitRank")
        if comm.value is None:
            raise CudaCallError("ncclCommInitRank", 0, "returned success without a communicator")
        return comm.value

    def all_reduce(self, address: int, count: int, dtype: contract_pb2.DType.ValueType, comm: int, stream: Any) -> None:
        """In-place sum; during capture this records NCCL's kernels into the graph."""
        self._check(self._lib.ncclAllReduce(address, address, count, NCCL_DTYPES[dtype], NCCL_SUM,
                                            comm, int(stream)), "ncclAllReduce")

    def destroy(self, comm: int) -> None:
        self._check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def abort(self, comm: int) -> None:
        """Ends the communicator's uncompleted operations (a peer process is gone: its kernels
        would otherwise wait for it forever) and frees it."""
        self._check(self._lib.ncclCommAbort(comm), "ncclCommAbort")
