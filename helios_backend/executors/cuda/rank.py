"""What one rank of the CUDA executor owns (device, context, stream, arena, modules, graphs,
events, communicator), set by startup on the rank's thread and released by `release`.

cuda_executor.py builds and drives it; members that startup sets are read through properties
that fail loudly before startup has set them.
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar

from .arena import DeviceArena, PinnedFrames
from .modules import Architecture
from .nccl import Nccl
from .plan import BufferAddresses
from .vendor_products import VendorProducts


class RankState:
    """Everything one rank owns; built and torn down on that rank's thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.device: Any = None
        self.context: Any = None
        self.stream: Any = None
        # set once by startup (CudaExecutor._start_rank); None only before it and for teardown after a failure
        self.arena_or_none: Optional[DeviceArena] = None
        self.addresses_or_none: Optional[BufferAddresses] = None
        self.completion_or_none: Optional[PinnedFrames] = None
        self.capability = 0                      # the device's compute capability, major * 10 + minor
        self.architecture_or_none: Optional[Architecture] = None   # the kernel modules this device loads
        self.module_seconds = 0.0                # loading them (PTX: the JIT compile included)
        self.modules: list[Any] = []
        self.functions: dict[str, Any] = {}
        self.comm = 0
        self.events: list[Any] = []              # one per frame, recorded inside the graphs
        self.graphs: list[Any] = []
        self.execs: dict[str, list[Any]] = {}    # program name -> graph exec per frame
        self.node_counts: dict[str, int] = {}
        self.plans: dict[str, list[Any]] = {}    # program name -> launches (for profiling)
        self.tuning: list[tuple[Any, Any]] = []  # (graph, exec) of tuning producers
        self.products: Optional[VendorProducts] = None   # cuBLASLt for the product path's ids, where used

    @property
    def arena(self) -> DeviceArena:
        return _started(self.arena_or_none, self.rank, "arena")

    @property
    def addresses(self) -> BufferAddresses:
        return _started(self.addresses_or_none, self.rank, "buffer addresses")

    @property
    def completion(self) -> PinnedFrames:
        return _started(self.completion_or_none, self.rank, "completion frames")

    @property
    def architecture(self) -> Architecture:
        return _started(self.architecture_or_none, self.rank, "kernel architecture")


    def release(self, d: Any, nccl: Optional[Nccl]) -> None:
        """Drain the stream, then free graphs, events, the communicator, modules, memory and the
        context; a rank whose startup never retained a context holds nothing (a second call does
        nothing either)."""
        if self.context is None:
            return
        d.cuCtxSetCurrent(self.context)
        if self.stream is not None:
            d.cuStreamSynchronize(self.stream)
        for graph_exec in [e for execs in self.execs.values() for e in execs]:
            d.cuGraphExecDestroy(graph_exec)
        for graph, graph_exec in self.tuning:
            d.cuGraphExecDestroy(graph_exec)
            d.cuGraphDestroy(graph)
        for graph in self.graphs:
            d.cuGraphDestroy(graph)
        self.execs, self.tuning, self.graphs = {}, [], []
        for event in self.events:
            d.cuEventDestroy(event)
        self.events = []
        if self.comm and nccl is not None:
            nccl.destroy(self.comm)
            self.comm = 0
        if self.products is not None:
            self.products.close()
            self.products = None
        for module in self.modules:
            d.cuModuleUnload(module)
        self.modules = []
        if self.completion_or_none is not None:
            self.completion_or_none.close()
        if self.arena_or_none is not None:
            self.arena_or_none.close()
        if self.stream is not None:
            d.cuStreamDestroy(self.stream)
            self.stream = None
        d.cuDevicePrimaryCtxRelease(self.device)
        self.context = None

T = TypeVar("T")


def _started(member: Optional[T], rank: int, what: str) -> T:
    """A member startup sets; reading it before startup set it is a bug in this module."""
    if member is None:
        raise RuntimeError(f"rank {rank}: {what} read before startup set them")
    return member
