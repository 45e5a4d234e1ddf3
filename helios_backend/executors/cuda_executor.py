"""The CUDA executor: replays recorded programs as CUDA graphs through the driver API.

Startup (constructor), once per rank on the rank's own thread:
  primary context -> the architecture the device runs (cuda/modules.py: its exact cubins, else
  a PTX copy the driver JIT-compiles here, else startup fails naming both sides) -> arena
  (fixed part backed, weights copied in) -> that architecture's kernel modules -> NCCL
  communicator (world_size > 1) -> every serving program captured as one graph per
  (program, frame) -> graphs uploaded. Then, for all ranks:
  cache windows backed with the pages the remaining memory holds -> tuning producers run
  once -> serving graphs exposed.

Serving (the hot path), per step and frame f:
  `staging(f)` -> host packs the pinned frame in place;
  `launch(name, f)` -> one cuGraphLaunch per rank (the graph copies the frame in, runs,
  copies the completion records out to pinned memory and records frame f's event);
  `wait(f)` -> cuEventSynchronize per rank, then the pinned completion words of rank 0.
Nothing is allocated, loaded, compiled or captured after startup (tests count the calls).

Rank processes (RankPeers::Processes, helios_backend/ranks/): `local_ranks` names the ranks
this process owns (one), `nccl_unique_id` is rank 0's id (sent at rendezvous) and
`agree_pages` turns the pages this process fits into the count every process backs.
Two frames let the host pack frame f+1 while frame f runs; one stream per rank orders the
graphs so the single device staging buffer is never overwritten while in use. A third host
frame (`auxiliary_frames`, index `frames`) holds only INITIALIZATION and RESTORATION graphs:
a round's slot initialization is packed and launched there while the round before it still
holds the other frame, and the stream runs it before the round's main step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from helios_proto import manifest_pb2

from helios_backend.executors.base import AUXILIARY_OPERATIONS
from helios_backend.kernel_abi import blocks

from .cuda.arena import DeviceArena, PinnedFrames
from .cuda.driver import check, load_driver
from .cuda import staging_copy as sc
from .cuda.errors import DeviceMemoryError, FrameStateError, ManifestError, MissingVariantError, UnknownProgramError
from .cuda.graphs import Copy, RankResources, capture_graph
from .cuda.modules import select
from .cuda.nccl import Nccl
from .cuda.plan import KernelLaunch, kernel_table, layout_arena, plan_program
from .cuda.rank import RankState
from .cuda.vendor_products import VENDOR_PRODUCTS, ProductLaunch, VendorProducts

ResourceReader = Callable[[str], "bytes | bytearray | memoryview | np.ndarray"]
STATIC_SHARED_LIMIT = 48 * 1024        # above this a kernel must opt in to dynamic shared memory
PDL_CAPABILITY = 90                    # programmatic dependent launch exists from sm_90 on


@dataclasses.dataclass(frozen=True)
class CudaExecutorOptions:
    """Load-time choices (frozen, validated once)."""
    cache_pages: Optional[int] = None      # exact page count; None: from memory left after graphs
    cache_memory_share: float = 0.90       # share of the free memory given to cache pages
    devices: Optional[Sequence[int]] = None  # device ordinal per local rank; default: the rank number
    local_ranks: Optional[Sequence[int]] = None  # ranks this process owns; default every rank (threads)
    programs: Optional[Iterable[str]] = None  # program names to load; default every program
    transport: str = "auto"                # "kernel", "memcpy", or "auto" (by bytes; staging_copy.py)
    pdl: bool = True                       # False: no node gets programmatic dependent launch
    kernel_arch: Optional[str] = None      # load this KernelModule.arch (e.g. "compute_80", the
                                           # portable path); default: chosen by the device (modules.py)
    vendor_products: bool = True           # the product path's ids through cuBLASLt where it loads
                                           # (cuda/vendor_products.py); False: their cubins

    def __post_init__(self) -> None:
        if self.transport not in ("kernel", "memcpy", "auto"):
            raise ValueError("transport must be 'kernel', 'memcpy' or 'auto'")
        if not 0.0 < self.cache_memory_share <= 1.0:
            raise ValueError("cache_memory_share must be in (0, 1]")
        if self.cache_pages is not None and self.cache_pages < 0:
            raise ValueError("cache_pages must be >= 0")


class CudaExecutor:
    """Executor protocol over CUDA graphs; see the module docstring for the step's shape."""

    def __init__(self, manifest: manifest_pb2.ExecutionManifest, read_resource: ResourceReader,
                 options: CudaExecutorOptions = CudaExecutorOptions(), driver: Any = None,
                 graphs: Optional[Sequence[Any]] = None, nccl_unique_id: Optional[bytes] = None,
                 agree_pages: Optional[Callable[[int], int]] = None) -> None:
        """graphs: the contract's GraphContracts of the loaded programs; with them, each program's
        staging copy covers only the bytes its bindings write (staging_copy.binding_extents).
        nccl_unique_id, agree_pages: rank processes (module docstring)."""
        self._d = driver if driver is not None else load_driver()
        # block weights (kernel_abi/blocks.py) are expanded to the F16 layout the kernels read, at load
        manifest, self._block_weights = blocks.expanded_manifest(manifest)
        self.manifest = manifest
        self.options = options
        self._extents = sc.binding_extents(graphs, manifest.transport) if graphs else {}
        self.world_size = max(1, manifest.world_size)
        transport = manifest.transport
        self.frames = max(1, transport.frames)
        # one more host frame for the submissions before a round's main step (INITIALIZATION,
        # RESTORATION): packed and launched without waiting for the frame the round takes, which
        # the round in flight may still hold; only those programs are captured on it
        self._auxiliary_programs = frozenset(
            g.program for g in graphs or () if g.operation in AUXILIARY_OPERATIONS)
        self.auxiliary_frames = 1 if self._auxiliary_programs else 0
        self._host_frames = self.frames + self.auxiliary_frames
        self._validate()
        local = tuple(options.local_ranks) if options.local_ranks is not None else tuple(range(self.world_size))
        self._ranks = [RankState(r) for r in local]
        self._ordinals = dict(zip(local, options.devices or local))
        self._agree_pages = agree_pages
        self._nccl: Optional[Nccl] = Nccl() if self.world_size > 1 else None
        self._pinned_staging: Optional[PinnedFrames] = None
        self._launch_plan: dict[str, tuple[tuple[Any, ...], ...]] = {}
        self.startup_seconds: dict[str, float] = {}
        check(self._d.cuInit(0), "cuInit")
        self._enter(self._ranks[0])            # pinned memory needs a current context
        self._staging = self._pinned_staging = PinnedFrames(self._d, self._host_frames, transport.frame_nbytes)
        resources = _ResourceCache(read_resource)
        uid = None
        if self._nccl is not None:
            uid = self._nccl.unique_id_from(nccl_unique_id) if nccl_unique_id is not None else self._nccl.unique_id()
        started = time.perf_counter()
        try:
            self._on_ranks(lambda rank: self._start_rank(rank, resources, uid))
            resources.clear()
            self.startup_seconds["modules"] = max(rank.module_seconds for rank in self._ranks)
            self.startup_seconds["graphs"] = time.perf_counter() - started
            self.cache_pages = self._choose_pages()
            self._on_ranks(lambda rank: self._back_cache(rank))
            self._on_ranks(self._run_tuning)
            self.startup_seconds["total"] = time.perf_counter() - started
        except BaseException:
            self.close()
            raise
        # the hot path's table: name -> per frame (the auxiliary one for its programs), per rank
        # (graph exec, stream)
        self._launch_plan = {
            name: tuple(tuple((rank.execs[name][f], rank.stream) for rank in self._ranks)
                        for f in range(len(execs)))
            for name, execs in self._ranks[0].execs.items()}
        self._events = tuple(tuple(rank.events[f] for rank in self._ranks) for f in range(self._host_frames))
        self._completion_words = self._ranks[0].completion.words
        header = sc.header_window(transport)
        self._headers = tuple(words[header.word_offset:header.word_offset + 2] for words in self._staging.words) \
            if header is not None else None
        self._in_flight = [False] * self._host_frames
        self._sequence = 0

    # ---- startup -------------------------------------------------------------------------

    def _validate(self) -> None:
        m = self.manifest
        t = m.transport
        names = {(b.rank, b.name): b for b in m.buffers}
        for rank in range(self.world_size):
            for name, need in ((t.staging_buffer, t.frame_nbytes), (t.completion_buffer, t.completion_nbytes)):
                buffer = names.get((rank, name))
                if buffer is None:
                    raise ManifestError(f"rank {rank}: transport buffer {name!r} missing")
                if buffer.nbytes < need:
                    raise ManifestError(f"rank {rank}: {name} holds {buffer.nbytes} < {need} bytes")
        for program in list(m.programs) + list(m.tuning):
            if program.rank >= self.world_size:
                raise ManifestError(f"program {program.name}: rank {program.rank} >= world size")
        wanted = set(self.options.programs or ())
        present = {p.name for p in m.programs}
        if wanted - present:
            raise MissingVariantError(f"missing graph variants: {sorted(wanted - present)}")
        for rank in range(self.world_size):
            mine = {p.name for p in m.programs if p.rank == rank}
            if mine != present:
                raise ManifestError(f"rank {rank} lacks programs {sorted(present - mine)}")
        local = self.options.local_ranks
        # one process owns every rank (threads) or exactly one (rank processes)
        if local is not None and (len(local) not in (1, self.world_size) or len(set(local)) != len(local)
                                  or any(not 0 <= r < self.world_size for r in local)):
            raise ManifestError(f"local ranks {list(local)} do not fit a world of {self.world_size}")
        devices = self.options.devices
        if devices is not None and len(devices) != (self.world_size if local is None else len(local)):
            raise ManifestError("one device ordinal per local rank is needed")

    def _on_ranks(self, work: Callable[[RankState], None]) -> None:
        """Run `work` for every local rank, each on its own thread (NCCL init blocks per rank)."""
        if len(self._ranks) == 1:
            self._enter(self._ranks[0])
            work(self._ranks[0])
            return

        def run(rank: RankState) -> None:
            self._enter(rank)
            work(rank)

        with concurrent.futures.ThreadPoolExecutor(len(self._ranks)) as pool:
            for future in [pool.submit(run, rank) for rank in self._ranks]:
                future.result()

    def _enter(self, rank: RankState) -> None:
        d = self._d
        if rank.context is None:
            rank.device = check(d.cuDeviceGet(self._ordinals[rank.rank]), "cuDeviceGet")
            rank.context = check(d.cuDevicePrimaryCtxRetain(rank.device), "cuDevicePrimaryCtxRetain")
        check(d.cuCtxSetCurrent(rank.context), "cuCtxSetCurrent")

    def _start_rank(self, rank: RankState, resources: "_ResourceCache", uid: Any) -> None:
        d, m = self._d, self.manifest
        ordinal = self._ordinals[rank.rank]
        layout = layout_arena(m.buffers, rank.rank)
        # a core with nothing for this device fails before any memory is taken
        rank.capability = self._capability(rank)
        rank.architecture_or_none = select(m.modules, rank.capability, self.options.kernel_arch)
        rank.arena_or_none = DeviceArena(d, rank.device, ordinal, layout)
        rank.addresses_or_none = rank.arena.addresses()
        self._fill_weights(rank, resources)
        self._load_modules(rank, resources)
        rank.stream = check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        t = m.transport
        if self._nccl is not None:
            rank.comm = self._nccl.init_rank(self.world_size, uid, rank.rank)
            # one eager all-reduce first: NCCL connects its channels on first use, which must
            # not happen under capture (one word of the staging buffer, rewritten every step)
            self._nccl.all_reduce(rank.addresses.base[t.staging_buffer], 1, sc.contract_pb2.DTYPE_F32,
                                  rank.comm, rank.stream)
            check(d.cuStreamSynchronize(rank.stream), "cuStreamSynchronize")
        flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        rank.events = [check(d.cuEventCreate(flags), "cuEventCreate") for _ in range(self._host_frames)]
        rank.completion_or_none = PinnedFrames(d, self._host_frames, t.completion_nbytes)
        kernels = kernel_table(rank.architecture.modules)
        wanted = set(self.options.programs) if self.options.programs is not None else None
        mine = [p for p in m.programs if p.rank == rank.rank and (wanted is None or p.name in wanted)]
        if self.options.vendor_products and any(n.kernel in VENDOR_PRODUCTS for p in mine for n in p.nodes):
            rank.products = VendorProducts.load(d)     # None: the product ids run their cubins
        vendor = rank.products is not None
        resources_of_rank = RankResources(rank.stream, rank.functions, self._nccl, rank.comm, rank.products)
        for program in mine:
            launches = plan_program(program, kernels, rank.addresses, vendor)
            if not self.options.pdl:
                launches = [dataclasses.replace(l, pdl=False) if isinstance(l, KernelLaunch) else l for l in launches]
            rank.plans[program.name] = launches
            runs = sc.staging_runs(program, t, self._extents.get(program.name))
            per_frame = []
            captured = self._host_frames if program.name in self._auxiliary_programs else self.frames
            for frame in range(captured):
                steps = self._transport_in(rank, runs, frame) + list(launches) + self._transport_out(rank, frame)
                graph, graph_exec, nodes = capture_graph(d, resources_of_rank, steps, rank.events[frame])
                rank.graphs.append(graph)
                per_frame.append(graph_exec)
                rank.node_counts[program.name] = nodes
            rank.execs[program.name] = per_frame
        for program in (p for p in m.tuning if p.rank == rank.rank):
            launches = plan_program(program, kernels, rank.addresses, vendor)
            graph, graph_exec, _ = capture_graph(d, resources_of_rank, launches, None)
            rank.tuning.append((graph, graph_exec))
        check(d.cuStreamSynchronize(rank.stream), "cuStreamSynchronize")

    def _transport_in(self, rank: RankState, runs: list[tuple[int, int]], frame: int) -> list[Any]:
        staging = rank.addresses.base[self.manifest.transport.staging_buffer]
        if not runs:
            return []
        if sc.copy_kernel_suits(self.options.transport, runs):
            return [sc.stage_in_launch(staging, self._staging.device_address(frame), runs)]
        host = self._staging.frame_address(frame)
        return [Copy(staging + offset, host + offset, nbytes, True) for offset, nbytes in runs]

    def _transport_out(self, rank: RankState, frame: int) -> list[Any]:
        t = self.manifest.transport
        completion = rank.addresses.base[t.completion_buffer]
        if self.options.transport != "memcpy":           # completion records are small
            return [sc.complete_out_launch(rank.completion.device_address(frame), completion,
                                           int(t.completion_nbytes), pdl=rank.capability >= PDL_CAPABILITY)]
        return [Copy(rank.completion.frame_address(frame), completion, int(t.completion_nbytes), False)]

    def _fill_weights(self, rank: RankState, resources: "_ResourceCache") -> None:
        for buffer in rank.arena.layout.buffers.values():
            if buffer.kind != manifest_pb2.BUFFER_KIND_WEIGHT:
                continue
            data = resources.get(buffer.weight.resource)
            stored = self._block_weights.get((rank.rank, buffer.name), buffer)
            start, end = int(stored.weight.byte_offset), int(stored.weight.byte_offset + stored.nbytes)
            if end > data.nbytes:
                raise ManifestError(f"weight {buffer.name}: resource {buffer.weight.resource} "
                                    f"has {data.nbytes} bytes, needs {end}")
            piece = np.ascontiguousarray(data[start:end])
            if stored is not buffer:
                piece = blocks.expand_f16(stored.dtype, piece, blocks.matrix_shape(stored)).view(np.uint8).reshape(-1)
            check(self._d.cuMemcpyHtoD(rank.addresses.base[buffer.name], piece.ctypes.data, piece.nbytes),
                  "cuMemcpyHtoD")

    def _capability(self, rank: RankState) -> int:
        """The rank's device compute capability as major * 10 + minor."""
        attribute = self._d.CUdevice_attribute
        major, minor = (check(self._d.cuDeviceGetAttribute(which, rank.device), "cuDeviceGetAttribute")
                        for which in (attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                      attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        return 10 * int(major) + int(minor)

    def _load_modules(self, rank: RankState, resources: "_ResourceCache") -> None:
        d = self._d
        started = time.perf_counter()
        for module in rank.architecture.modules:
            image = resources.get(module.resource).tobytes()   # cubin/fatbin image, as the driver reads it
            if module.portable and not image.endswith(b"\0"):
                image += b"\0"                                 # the driver reads PTX as a C string
            handle = check(d.cuModuleLoadData(image), f"cuModuleLoadData {module.resource}")
            rank.modules.append(handle)
            for kernel in module.kernels:
                function = check(d.cuModuleGetFunction(handle, kernel.symbol.encode()),
                                 f"cuModuleGetFunction {kernel.symbol}")
                if kernel.shared_bytes > STATIC_SHARED_LIMIT:
                    check(d.cuFuncSetAttribute(
                        function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        kernel.shared_bytes), "cuFuncSetAttribute")
                rank.functions[kernel.id] = function
        rank.module_seconds = time.perf_counter() - started
        copy_module = check(d.cuModuleLoadData(sc.IMAGE_PATH.read_bytes()), "cuModuleLoadData staging copy")
        rank.modules.append(copy_module)
        for symbol in (sc.STAGE_IN, sc.COMPLETE_OUT):
            rank.functions[symbol] = check(d.cuModuleGetFunction(copy_module, symbol.encode()),
                                           "cuModuleGetFunction")

    def _choose_pages(self) -> int:
        if self.options.cache_pages is not None:
            return self.options.cache_pages
        pages = []
        for rank in self._ranks:
            self._enter(rank)
            free, _total = check(self._d.cuMemGetInfo(), "cuMemGetInfo")
            pages.append(rank.arena.pages_that_fit(int(free), self.options.cache_memory_share))
        chosen = min(pages)
        if self._agree_pages is not None:       # rank processes: the fewest any process fits
            chosen = self._agree_pages(chosen)
        if chosen == 0 and any(r.arena.layout.bytes_per_page for r in self._ranks):
            raise DeviceMemoryError("no memory left for cache pages after graphs load")
        return chosen

    def _back_cache(self, rank: RankState) -> None:
        rank.arena.map_cache(self.cache_pages)

    def _run_tuning(self, rank: RankState) -> None:
        for _graph, graph_exec in rank.tuning:
            check(self._d.cuGraphLaunch(graph_exec, rank.stream), "cuGraphLaunch")
        check(self._d.cuStreamSynchronize(rank.stream), "cuStreamSynchronize")

    # ---- serving (hot path) --------------------------------------------------------------

    def staging(self, frame: int) -> np.ndarray:
        """Pinned host staging frame `frame` (uint8); pack it only while the frame is idle."""
        return self._staging.views[frame]

    def launch(self, program: str, frame: int) -> None:
        """One graph launch per rank: copy frame in, run, copy completion out, record event.

        Writes [sequence, frame] into the frame's transport header first (the executor owns
        both). FrameStateError if the frame's previous step was not waited for.
        """
        try:
            per_rank = self._launch_plan[program][frame]
        except KeyError:
            raise UnknownProgramError(program) from None
        except IndexError:
            raise FrameStateError(f"{program} is not captured on frame {frame}") from None
        if self._in_flight[frame]:
            raise FrameStateError(f"frame {frame} still in flight")
        if self._headers is not None:
            header = self._headers[frame]
            header[0] = self._sequence
            header[1] = frame
        self._sequence += 1
        self._in_flight[frame] = True
        graph_launch = self._d.cuGraphLaunch
        for graph_exec, stream in per_rank:
            result = graph_launch(graph_exec, stream)
            if int(result[0]):
                check(result, f"cuGraphLaunch {program}")

    def wait(self, frame: int) -> np.ndarray:
        """Block until frame `frame` completes; a copy of its completion words (int32, rank 0)."""
        if not self._in_flight[frame]:
            raise FrameStateError(f"nothing submitted on frame {frame}")
        self._in_flight[frame] = False
        synchronize = self._d.cuEventSynchronize
        for event in self._events[frame]:
            result = synchronize(event)
            if int(result[0]):
                check(result, "cuEventSynchronize")
        return self._completion_words[frame].copy()

    # ---- inspection (not for the hot path) ----------------------------------------------

    def _rank(self, rank: int) -> RankState:
        found = next((r for r in self._ranks if r.rank == rank), None)
        if found is None:
            raise KeyError(f"rank {rank} is not one of this process's ranks {[r.rank for r in self._ranks]}")
        return found

    def bind_thread(self) -> None:
        """Make this process's first rank's context current on the calling thread (a rank
        process waits for its frames on a thread of its own)."""
        self._enter(self._ranks[0])

    @property
    def programs(self) -> tuple[str, ...]:
        return tuple(self._launch_plan)

    def architecture(self, rank: int = 0) -> str:
        """The KernelModule.arch the rank's device loaded (e.g. "sm_90a", "compute_80")."""
        return self._rank(rank).architecture.name

    def product_library(self, rank: int = 0) -> Optional[str]:
        """"cuBLASLt <version>" where the rank serves the product path's ids through it, else None
        (no product nodes, vendor_products off, or no library: their cubins run)."""
        products = self._rank(rank).products
        return None if products is None else f"cuBLASLt {products.version()}"

    def buffer_offsets(self, rank: int = 0) -> dict[str, int]:
        """Byte offset of every buffer from the rank's arena base (CACHE: its window): the
        geometry loading produced, which NativeModel.manifests exposes (OWN-11)."""
        r = self._rank(rank)
        return {name: address - r.arena.base for name, address in r.addresses.base.items()}

    def arena_nbytes(self, rank: int = 0) -> int:
        """Bytes backed in the rank's arena: the fixed part plus the backed cache pages."""
        r = self._rank(rank)
        return r.arena.fixed_nbytes + sum(r.arena.buffer_nbytes(n) for n in r.arena.layout.cache_page_nbytes)

    def staging_nbytes(self, program: str) -> int:
        """Bytes of the frame that one step of `program` copies to the device."""
        found = next(p for p in self.manifest.programs if p.name == program)
        return sum(n for _, n in sc.staging_runs(found, self.manifest.transport, self._extents.get(program)))

    def node_count(self, program: str, rank: int = 0) -> int:
        """Graph nodes per step of `program` (copies and event included)."""
        return self._rank(rank).node_counts[program]

    def profile_nodes(self, program: str, frame: int = 0, repeats: int = 20,
                      rank: int = 0) -> list[tuple[str, str, float]]:
        """(label, kernel id, GPU µs) per node of `program` (median over `repeats`); profiles only.

        Builds a separate graph, transport included, with an event node between consecutive
        nodes (startup-like work: it allocates and captures, so never call it while serving).
        Pack `frame` for `program` first: the step reads it. The events serialize the nodes,
        so PDL overlap is lost: the sum exceeds the real step time.
        """
        d = self._d
        r = self._rank(rank)
        self._enter(r)
        runs = sc.staging_runs(next(p for p in self.manifest.programs if p.name == program), self.manifest.transport,
                               self._extents.get(program))
        launches = self._transport_in(r, runs, frame) + list(r.plans[program]) + self._transport_out(r, frame)
        if self.world_size > 1:
            raise ValueError("profile_nodes runs one rank alone; all-reduce nodes need every rank")
        events = [check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
                  for _ in range(len(launches) + 1)]
        resources = RankResources(r.stream, r.functions, self._nccl, r.comm, r.products)
        graph, graph_exec, _ = capture_graph(d, resources, launches, None, events)
        samples = np.zeros((repeats, len(launches)))
        try:
            for i in range(repeats + 2):
                check(d.cuGraphLaunch(graph_exec, r.stream), "cuGraphLaunch")
                check(d.cuStreamSynchronize(r.stream), "cuStreamSynchronize")
                if i >= 2:   # two warm-up launches
                    for j in range(len(launches)):
                        samples[i - 2, j] = check(d.cuEventElapsedTime(events[j], events[j + 1]),
                                                  "cuEventElapsedTime") * 1e3
        finally:
            d.cuGraphExecDestroy(graph_exec)
            d.cuGraphDestroy(graph)
            for event in events:
                d.cuEventDestroy(event)
        medians = np.median(samples, axis=0)
        def name(launch: Any) -> tuple[str, str]:
            if isinstance(launch, Copy):
                return "transport.memcpy", "memcpy"
            return launch.label, launch.kernel_id if isinstance(launch, (KernelLaunch, ProductLaunch)) else "all_reduce"

        return [(*name(launch), float(t)) for launch, t in zip(launches, medians)]

    def read_buffer(self, name: str, rank: int = 0) -> np.ndarray:
        """A host copy of one buffer's bytes (uint8; CACHE buffers: every backed page)."""
        r = self._rank(rank)
        if name not in r.arena.layout.buffers:
            raise KeyError(name)
        self._enter(r)
        check(self._d.cuStreamSynchronize(r.stream), "cuStreamSynchronize")
        nbytes = r.arena.buffer_nbytes(name)
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            check(self._d.cuMemcpyDtoH(out.ctypes.data, r.addresses.base[name], nbytes), "cuMemcpyDtoH")
        return out

    def context(self, rank: int = 0) -> tuple[Any, Any]:
        """(CUcontext, CUstream) of a rank, for tests and benchmarks that time on its stream."""
        r = self._rank(rank)
        return r.context, r.stream

    # ---- teardown ------------------------------------------------------------------------

    def abort(self) -> None:
        """A rank process is gone: abort this process's communicators, so that the graphs in
        flight (their all-reduces wait for the lost rank) end and close() can drain the streams."""
        if self._nccl is None:
            return
        for rank in self._ranks:
            if rank.comm:
                self._enter(rank)
                try:
                    self._nccl.abort(rank.comm)
                finally:
                    rank.comm = 0

    def close(self) -> None:
        """Drain every rank, then free graphs, events, modules, NCCL, memory, contexts."""
        d = self._d
        self._launch_plan = {}
        for rank in self._ranks:
            rank.release(d, self._nccl)
        if self._pinned_staging is not None:
            self._pinned_staging.close()
            self._pinned_staging = None

    def __enter__(self) -> "CudaExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ResourceCache:
    """Decoded resources kept only during startup (a weight resource feeds many buffers)."""

    def __init__(self, read: ResourceReader) -> None:
        self._read = read
        self._cache: dict[str, np.ndarray] = {}

    def get(self, resource: str) -> np.ndarray:
        if resource not in self._cache:
            data = self._read(resource)
            self._cache[resource] = np.frombuffer(data, dtype=np.uint8) if not isinstance(
                data, np.ndarray) else data.view(np.uint8).reshape(-1)
        return self._cache[resource]

    def clear(self) -> None:
        self._cache.clear()
