"""Ahead-of-time compilation of one Triton kernel into a cubin and its PTX, with an on-disk cache.

Runs without a GPU: triton.compile with an explicit GPUTarget. Compilation happens in worker
processes (spawned, so the parent's Triton knobs and environment stay untouched) whose
environment pins the settings that change the code: FP fusion explicit, no line info.

The requests are independent and compile in parallel, one pool of up to one worker per usable
CPU. That is safe: each worker is its own process (no Triton state is shared), Triton's own
cache (~/.triton/cache, triton/runtime/cache.py) writes each file into a per-process temporary
directory and renames it into place, and CubinCache below writes then renames too, so workers
and concurrent preparations never see half a file.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import multiprocessing
import os
import re
from pathlib import Path
from typing import Callable, Mapping, Sequence

# Settings that change the generated code; fixed here so cubins are reproducible and small.
COMPILE_ENVIRONMENT: Mapping[str, str] = {
    "TRITON_DEFAULT_FP_FUSION": "1",
    "TRITON_DISABLE_LINE_INFO": "1",
}
SOURCE_PACKAGE = "ignition.gpu_kernels.triton_lang"


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """Everything that determines one cubin (and so its cache key)."""
    kernel_id: str
    module: str                       # module under ignition.gpu_kernels.triton_lang
    function: str                     # @triton.jit function name (the cubin's symbol)
    signature: tuple[tuple[str, str], ...]   # (param name, Triton type: "*fp16", "i32", ...)
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int
    pdl: bool
    capability: int                   # 90 for sm_90a, 80 for sm_80 (and its PTX, compute_80)
    # indices of params Triton may assume divisible by 16 (pointers: their byte address)
    divisible_by_16: tuple[int, ...] = ()

    def source_text(self) -> str:
        """Every kernel source file (a kernel may call helpers from a sibling module)."""
        found = importlib.util.find_spec(SOURCE_PACKAGE)
        if found is None or found.origin is None:
            raise FileNotFoundError(f"kernel sources {SOURCE_PACKAGE} not found")
        package = Path(found.origin).parent
        return "".join(path.read_text() for path in sorted(package.glob("*.py")))

    def cache_key(self, triton_version: str) -> str:
        # the metadata's field names too: checkouts whose CompiledKernel differs never share an entry
        text = json.dumps({"request": dataclasses.asdict(self), "source": self.source_text(),
                           "triton": triton_version, "env": dict(COMPILE_ENVIRONMENT),
                           "metadata": sorted(f.name for f in dataclasses.fields(CompiledKernel))},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    kernel_id: str
    symbol: str
    cubin: bytes
    ptx: bytes                        # the PTX the cubin was assembled from (the portable image)
    num_warps: int
    num_stages: int
    shared_bytes: int                 # dynamic shared memory to pass at launch
    pdl: bool
    trailing_null_pointers: int       # Triton's global + profile scratch slots
    ptx_params: int                   # .param count in the PTX entry (ABI params + trailing)
    toolchain: str

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        fields.pop("cubin")
        fields.pop("ptx")
        return fields


def _ptxas_version(capability: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas_version
    text = get_ptxas_version(capability)
    found = re.search(r"release (\d+\.\d+)", text)
    return found.group(1) if found else "unknown"


def _compile_in_worker(request: CompileRequest) -> CompiledKernel:
    """Compile one kernel; runs inside a worker whose environment is COMPILE_ENVIRONMENT."""
    import triton
    from triton.backends.compiler import GPUTarget

    module = importlib.import_module(f"{SOURCE_PACKAGE}.{request.module}")
    fn = getattr(module, request.function)
    declared = [p for p in inspect.signature(fn.fn).parameters]
    expected = [name for name, _ in request.signature] + [name for name, _ in request.constexprs]
    if declared != expected:
        raise ValueError(f"{request.kernel_id}: kernel parameters {declared} != ABI {expected}")
    signature = dict(request.signature)
    signature.update({name: "constexpr" for name, _ in request.constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature,
                                       constexprs=dict(request.constexprs),
                                       attrs={(i,): [["tt.divisibility", 16]]
                                              for i in request.divisible_by_16})
    compiled = triton.compile(source, target=GPUTarget("cuda", request.capability, 32),
                              options={"num_warps": request.num_warps,
                                       "num_stages": request.num_stages,
                                       "launch_pdl": request.pdl})
    md = compiled.metadata
    if md.num_ctas != 1 or md.launch_cooperative_grid:
        raise ValueError(f"{request.kernel_id}: clusters/cooperative launch are not supported")
    if md.global_scratch_size or md.profile_scratch_size:
        raise ValueError(f"{request.kernel_id}: kernel needs global scratch memory")
    ptx_params = len(re.findall(r"\.param\s", compiled.asm["ptx"].split(")")[0]))
    return CompiledKernel(
        kernel_id=request.kernel_id, symbol=md.name, cubin=compiled.asm["cubin"],
        ptx=compiled.asm["ptx"].encode(), num_warps=md.num_warps, num_stages=md.num_stages,
        shared_bytes=md.shared, pdl=bool(md.launch_pdl),
        trailing_null_pointers=2, ptx_params=ptx_params,
        toolchain=f"triton {triton.__version__} / ptxas {_ptxas_version(request.capability)}")


def _worker_init() -> None:
    os.environ.update(COMPILE_ENVIRONMENT)


class CubinCache:
    """cubin + PTX + metadata files under one directory, keyed by CompileRequest.cache_key
    (whose metadata field names keep other CompiledKernel layouts apart)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def load(self, key: str) -> CompiledKernel | None:
        paths = [self.root / f"{key}{suffix}" for suffix in (".json", ".cubin", ".ptx")]
        if not all(path.exists() for path in paths):
            return None
        meta, cubin, ptx = paths
        return CompiledKernel(cubin=cubin.read_bytes(), ptx=ptx.read_bytes(), **json.loads(meta.read_text()))

    def store(self, key: str, kernel: CompiledKernel) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # write-then-rename so a concurrent reader never sees half a file; metadata last
        for suffix, data in ((".cubin", kernel.cubin), (".ptx", kernel.ptx),
                             (".json", json.dumps(kernel.to_json()).encode())):
            tmp = self.root / f"{key}{suffix}.tmp{os.getpid()}"
            tmp.write_bytes(data)
            tmp.replace(self.root / f"{key}{suffix}")


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_all(requests: Sequence[CompileRequest], cache: CubinCache,
                progress: Callable[[int, int], None] | None = None,
                workers: int | None = None) -> list[CompiledKernel]:
    """Compile (or load from cache) every request, all in one pool of worker processes;
    returns one CompiledKernel per request, in request order. progress(done, total) as each
    request is found in the cache or compiled."""
    import triton
    results: dict[CompileRequest, CompiledKernel] = {}
    pending: dict[CompileRequest, str] = {}

    def report() -> None:
        if progress is not None:
            progress(len(results), len(requests))

    for request in requests:
        key = request.cache_key(triton.__version__)
        cached = cache.load(key)
        if cached is not None:
            results[request] = cached
        else:
            pending[request] = key
    report()
    if pending:
        count = workers or max(1, min(len(pending), usable_cpus()))
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(count, mp_context=context,
                                                    initializer=_worker_init) as pool:
            futures = {pool.submit(_compile_in_worker, request): (request, key)
                       for request, key in pending.items()}
            for future in concurrent.futures.as_completed(futures):
                request, key = futures[future]
                kernel = future.result()
                cache.store(key, kernel)
                results[request] = kernel
                report()
    return [results[request] for request in requests]
