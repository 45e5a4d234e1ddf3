"""Ahead-of-time Triton kernel library: sm_90a cubins, ABI parameter counts, and numerical
agreement with the numpy references through Triton's CPU interpreter (no GPU needed)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from ignition.kernels.interpret import run_interpreted  # noqa: E402
from ignition.kernels.library import KernelLibrary  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> KernelLibrary:
    return KernelLibrary(cache_dir=tmp_path_factory.mktemp("cubins"))


@pytest.fixture(scope="module")
def modules(library: KernelLibrary):
    return library.build_modules("sm_90a")


# ---------------------------------------------------------------------------------------------
# compilation

def _elf_arch(cubin: bytes, tmp_path: Path) -> str:
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    header = subprocess.run([str(CUOBJDUMP), "-elf", str(path)], capture_output=True,
                            text=True, check=True).stdout
    return header.split("sm=")[1].split(",")[0]


def test_every_kernel_compiles_to_an_sm90a_cubin(library, modules, tmp_path):
    assert sorted(m.kernels[0].id for _, m in modules) == sorted(library.kernel_ids())
    for cubin, module in modules:
        assert cubin[:4] == b"\x7fELF"
        assert int.from_bytes(cubin[18:20], "little") == 190          # EM_CUDA
        assert module.arch == "sm_90a" and module.toolchain.startswith("triton ")
        if CUOBJDUMP.exists():
            assert _elf_arch(cubin, tmp_path) == "90a"
        kernel = module.kernels[0]
        assert kernel.symbol.encode() + b"\x00" in cubin
        assert kernel.num_warps in (1, 2, 4, 8, 16)
        assert kernel.trailing_null_pointers == 2
        assert kernel.programmatic_dependent_launch


def test_parameter_lists_match_the_abi_plus_two_scratch_pointers(library, modules):
    compiled = library.compile("sm_90a")
    for _, module in modules:
        kernel = module.kernels[0]
        assert len(kernel.params) == len(library.signature(kernel.id))
        assert compiled[kernel.id].ptx_params == len(kernel.params) + 2


def test_geometry_block_and_shared_memory_come_from_the_cubin(library, modules):
    for _, module in modules:
        kernel = module.kernels[0]
        args = [1] * len(library.signature(kernel.id))
        grid, block, shared = library.geometry(kernel.id, args)
        assert block == (32 * kernel.num_warps, 1, 1)
        assert shared == kernel.shared_bytes
        assert all(d >= 1 for d in grid)


def test_cached_cubins_are_reused_without_recompiling(library, modules, tmp_path_factory):
    files = sorted(library._cache.root.iterdir())
    stamps = {f: f.stat().st_mtime_ns for f in files}
    again = KernelLibrary(cache_dir=library._cache.root).build_modules("sm_90a")
    assert [c for c, _ in again] == [c for c, _ in modules]
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
