"""The executor factory: the options a model is loaded with and one constructor per executor.

    executor = EXECUTORS[options.executor](contract, manifest, read_resource, options, graphs)

NativeModel.load (engine/model.py) builds rank 0's executor here, and a peer rank's process
(ranks/rank_process.py) builds its own with the same factory from the options rank 0 sends;
startup validation (engine/settings.py) and the command lines read the names from here.

The options arrive resolved against the core (engine/settings.py `layered`, SRV-15/16):
`cache_pages` None means that no option and no core default set it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.executors.base import Executor, RankPlacement, ResourceReader
from helios_backend.executors.numpy_executor import NumpyExecutor, NumpyExecutorOptions

# tensor-parallel ranks (OWN-14/15): every rank in this process, or rank 0 here and every other
# rank a helios-rank process (helios_backend/ranks/)
RANK_PEERS = ("threads", "processes")


@dataclass(frozen=True)
class ModelOptions:
    concurrency: Optional[int] = None   # request rows to serve; None = default_concurrency(executor, captured)
    cache_pages: Optional[int] = None   # physical pages per cache plane; None = core default
    cache_memory_share: Optional[float] = None   # cuda: share of free memory for pages; None = core default
    rank: int = 0
    widen_f16_cache: bool = True        # numpy executor: hold f16 cache planes as f32 (speed)
    executor: str = "numpy"             # a key of EXECUTORS: "numpy" (CPU oracle), "cpu" (CPU, compiled
                                        # kernels) or "cuda" (GPU, CUDA graphs)
    kernel_arch: Optional[str] = None   # cuda: KernelModule.arch to load; None: the device's own
    vendor_products: bool = True        # cuda: the product path's ids through cuBLASLt where it loads
    threads: int = 2                    # cpu executor: threads of its compiled kernels and product workers
    # cpu and numpy executors: block-weight products' activations, "f32" or "q8" (kernel_abi/activations.py);
    # None: the executor's default
    activations: Optional[str] = None
    rank_peers: str = "threads"         # a RANK_PEERS name
    rank_store: str = ""                # processes: HOST:PORT of the rendezvous store rank 0 listens on
    rank_timeout_s: float = 30.0        # processes: the bound on every answer of a peer
    rank_join_timeout_s: float = 600.0  # processes: how long rank 0 waits for every peer to join
    core_digest: str = ""               # processes: Core.content_digest(), which every rank must share
    speculative: bool = True            # load the SPECULATIVE variants; off where no round can use them
                                        # (history drafting off): none is bound or captured (SRV-11)


def host_pages(contract: C.ServingContract, options: ModelOptions) -> int:
    """Pages of an executor in host memory (numpy, cpu): the resolved option, else
    preparation's working-set count (SRV-9/10)."""
    return options.cache_pages if options.cache_pages is not None else contract.prepared_pages


def _local_ranks(placement: Optional[RankPlacement]) -> dict:
    """The keyword arguments binding only the placement's rank (none: every rank, threads)."""
    return {} if placement is None else {"local_ranks": (placement.rank,), "reduce": placement.reduce}


def _activations(options: ModelOptions) -> dict:
    """The activations keyword where the options set it (else the executor's own default applies)."""
    return {} if options.activations is None else {"activations": options.activations}


def _numpy_executor(contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                    options: ModelOptions, graphs: Sequence[C.GraphContract],
                    placement: Optional[RankPlacement] = None) -> Executor:
    return NumpyExecutor(manifest, read_resource, NumpyExecutorOptions(
        cache_pages=host_pages(contract, options), programs=frozenset(g.program for g in graphs),
        widen_f16_cache=options.widen_f16_cache, **_activations(options)), graphs=graphs, **_local_ranks(placement))


def _cpu_executor(contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                  options: ModelOptions, graphs: Sequence[C.GraphContract],
                  placement: Optional[RankPlacement] = None) -> Executor:
    """Compiled CPU kernels over the numpy executor's replay (F16 cache planes held as f32)."""
    # imported when chosen: numba and its compiled kernels take a quarter second to import
    from helios_backend.executors.cpu_executor import CpuExecutor, CpuExecutorOptions

    return CpuExecutor(manifest, read_resource, CpuExecutorOptions(
        cache_pages=host_pages(contract, options), programs=frozenset(g.program for g in graphs),
        threads=options.threads, **_activations(options)), graphs=graphs, **_local_ranks(placement))


def _cuda_executor(contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                   options: ModelOptions, graphs: Sequence[C.GraphContract],
                   placement: Optional[RankPlacement] = None) -> Executor:
    """CUDA graphs; without a page count the executor sizes the cache from the memory left
    after its graphs (SRV-9), at cache_memory_share. The graphs trim each program's staging
    copy to the bytes its bindings write."""
    from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions  # GPU builds only

    if options.cache_memory_share is None:
        raise ValueError("the cuda executor needs cache_memory_share resolved against the core")
    rank = options.rank if placement is None else placement.rank
    local = None if placement is None else (placement.rank,)
    devices = None if placement is None else (rank if placement.device is None else placement.device,)
    return CudaExecutor(manifest, read_resource,
                        CudaExecutorOptions(cache_pages=options.cache_pages, cache_memory_share=options.cache_memory_share,
                                            programs=frozenset(g.program for g in graphs),
                                            kernel_arch=options.kernel_arch, vendor_products=options.vendor_products,
                                            local_ranks=local, devices=devices),
                        graphs=[g for g in graphs if g.rank == rank],
                        nccl_unique_id=None if placement is None else placement.nccl_unique_id,
                        agree_pages=None if placement is None else placement.agree_pages)


class ExecutorFactory(Protocol):
    def __call__(self, contract: C.ServingContract, manifest: M.ExecutionManifest, read_resource: ResourceReader,
                 options: ModelOptions, graphs: Sequence[C.GraphContract],
                 placement: Optional[RankPlacement] = None) -> Executor: ...


# cpu: compiled CPU kernels; numpy: the CPU oracle; cuda: GPU
EXECUTORS: Mapping[str, ExecutorFactory] = {"cpu": _cpu_executor, "numpy": _numpy_executor, "cuda": _cuda_executor}
EXECUTOR_NAMES = tuple(EXECUTORS)

# Request rows an executor serves when no option sets the concurrency (load may only reduce the
# captured rows, SRV-7). The shipped recipes record decode steps to 256 rows, which the CUDA
# executor serves whole (None: every captured row). The host executors serve at most
# HOST_CONCURRENCY, the rows the shipped cores captured before they recorded a GPU server's: at
# 2 threads a CPU decode step of more rows gives few more tokens per second, and graphs above the
# concurrency are never loaded (NativeModel.load), so a CPU server binds the programs it bound before.
HOST_CONCURRENCY = 32
DEFAULT_CONCURRENCY: Mapping[str, Optional[int]] = {"cpu": HOST_CONCURRENCY, "numpy": HOST_CONCURRENCY,
                                                     "cuda": None}


def default_concurrency(executor: str, captured: int) -> int:
    """The request rows `executor` serves of a core that captured `captured` when no option says."""
    limit = DEFAULT_CONCURRENCY.get(executor)
    return captured if limit is None else min(captured, limit)
