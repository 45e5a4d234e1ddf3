"""Turning launch plans into CUDA graphs by stream capture (startup only).

One serving graph per (program, frame):

    staging copy: host frame f -> staging buffer (a kernel or memcpy nodes: staging_copy.py)
    kernel nodes in program order (PDL edge where the kernel waits with griddepcontrol)
    NCCL all-reduce kernels for ALL_REDUCE nodes
    completion copy: completion buffer -> host completion frame f
    event record node (external): the host's wait for frame f

Capture, rather than explicit node building, records NCCL's own kernels and the
programmatic (PDL) edges exactly as a stream launch would make them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

from .driver import check
from .nccl import Nccl
from .plan import AllReduceLaunch, KernelLaunch, Launch
from .vendor_products import ProductLaunch, VendorProducts


@dataclasses.dataclass(frozen=True)
class Copy:
    """A memcpy node: host -> device (to_device) or device -> host."""
    dst: int
    src: int
    nbytes: int
    to_device: bool


@dataclasses.dataclass(frozen=True)
class RankResources:
    """What capture needs from one rank: its stream, kernel handles and communicator."""
    stream: Any
    functions: Mapping[str, Any]       # kernel id -> CUfunction
    nccl: Optional[Nccl] = None
    comm: int = 0
    products: Optional[VendorProducts] = None    # cuBLASLt, where the product path's ids go to it


def _launch_config(driver: Any, launch: KernelLaunch, stream: Any) -> Any:
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = launch.grid
    config.blockDimX, config.blockDimY, config.blockDimZ = launch.block
    config.sharedMemBytes = launch.shared_bytes
    config.hStream = stream
    if launch.pdl:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attribute]
        config.numAttrs = 1
    else:
        config.numAttrs = 0
    return config


def record_launches(driver: Any, rank: RankResources, launches: Sequence[Union[Launch, Copy]],
                    events_between: Optional[Sequence[Any]] = None) -> None:
    """Issue the launches on the rank's stream (which is capturing).

    events_between: for profiling graphs, an event recorded (as a node) before the first
    launch and after each launch, so per-node GPU time can be read with cuEventElapsedTime.
    """
    record = driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
    if events_between is not None:
        check(driver.cuEventRecordWithFlags(events_between[0], rank.stream, record), "cuEventRecordWithFlags")
    for index, launch in enumerate(launches):
        if isinstance(launch, Copy):
            if launch.to_device:
                check(driver.cuMemcpyHtoDAsync(launch.dst, launch.src, launch.nbytes, rank.stream),
                      "cuMemcpyHtoDAsync")
            else:
                check(driver.cuMemcpyDtoHAsync(launch.dst, launch.src, launch.nbytes, rank.stream),
                      "cuMemcpyDtoHAsync")
        elif isinstance(launch, KernelLaunch):
            config = _launch_config(driver, launch, rank.stream)
            check(driver.cuLaunchKernelEx(config, rank.functions[launch.kernel_id],
                                          launch.params.argv.ctypes.data, 0),
                  f"cuLaunchKernelEx {launch.label or launch.kernel_id}")
        elif isinstance(launch, ProductLaunch):
            if rank.products is None:
                raise RuntimeError("a vendor product node needs the rank's cuBLASLt")
            rank.products.record(launch, rank.stream)
        elif isinstance(launch, AllReduceLaunch):
            if rank.nccl is None:
                raise RuntimeError("an all-reduce node needs a communicator (world_size > 1)")
            rank.nccl.all_reduce(launch.address, launch.count, launch.dtype, rank.comm, rank.stream)
        if events_between is not None:
            check(driver.cuEventRecordWithFlags(events_between[index + 1], rank.stream, record),
                  "cuEventRecordWithFlags")


def capture_graph(driver: Any, rank: RankResources, launches: Sequence[Union[Launch, Copy]],
                  done_event: Optional[Any], events_between: Optional[Sequence[Any]] = None
                  ) -> tuple[Any, Any, int]:
    """Capture one graph (transport steps included in `launches`) and instantiate it.

    Returns (graph, graph exec, node count).
    """
    stream = rank.stream
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
    try:
        record_launches(driver, rank, launches, events_between)
        if done_event is not None:
            check(driver.cuEventRecordWithFlags(
                done_event, stream, driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL),
                "cuEventRecordWithFlags")
    except BaseException:
        driver.cuStreamEndCapture(stream)      # leave the stream usable; the error propagates
        raise
    graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
    # with numNodes=0 the driver returns (result, nodes=None, count)
    node_count = int(check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[-1])
    graph_exec = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    check(driver.cuGraphUpload(graph_exec, stream), "cuGraphUpload")
    return graph, graph_exec, node_count
