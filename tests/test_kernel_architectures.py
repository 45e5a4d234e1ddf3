"""Cores for several GPU architectures: which modules the CUDA executor loads for each device
capability (over the fake driver), what the preparation declares per architecture, and that
every architecture's copy of the default core's kernel sets agrees."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helios_backend.executors.cuda import staging_copy as sc
from helios_backend.executors.cuda.driver import CountingDriver
from helios_backend.executors.cuda.errors import ArchitectureError, ManifestError
from helios_backend.executors.cuda.modules import architectures, kernel_table_disagreements, select
from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions
from helios_proto import manifest_pb2 as M
from tests.gpu import toy_manifest as toy
from tests.gpu.fake_driver import FakeDriver

N = 64
ALL = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "compute_80")
CAPABILITY = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_100a": 100, "compute_80": 80}


def _shared(arch: str) -> int:
    """A per-architecture dynamic shared size, so a launch shows whose module it came from."""
    return 1024 * CAPABILITY[arch] + (7 if arch.startswith("compute") else 0)


def multi_arch_toy(archs=ALL) -> tuple[M.ExecutionManifest, dict[str, bytes]]:
    """The toy manifest with one module per architecture (PDL from sm_90 on, as preparation
    declares it) and a distinct image per architecture."""
    manifest = toy.build(n=N, chains={"chain": 3})
    (template,) = manifest.modules
    del manifest.modules[:]
    resources = toy.resources(b"", N)
    del resources["toy.cubin"]
    for arch in archs:
        portable = arch.startswith("compute_")
        module = M.KernelModule(resource=f"toy.{arch}", arch=arch, toolchain="test", kernel_set="toy",
                                capability=CAPABILITY[arch],
                                portable=portable)
        for kernel in template.kernels:
            copy = module.kernels.add()
            copy.CopyFrom(kernel)
            copy.programmatic_dependent_launch = kernel.programmatic_dependent_launch and CAPABILITY[arch] >= 90
            copy.shared_bytes = _shared(arch)
        manifest.modules.append(module)
        resources[module.resource] = (f"//\n.version 8.8\n.target sm_{CAPABILITY[arch]}\n" if portable
                                      else f"\x7fELF {arch}").encode()
    return manifest, resources


def _start(archs, capability: tuple[int, int], **options) -> tuple[CudaExecutor, FakeDriver]:
    manifest, resources = multi_arch_toy(archs)
    fake = FakeDriver(capability=capability)
    executor = CudaExecutor(manifest, resources.__getitem__, CudaExecutorOptions(cache_pages=2, **options),
                            driver=fake)
    return executor, fake


# spec: OWN-10
@pytest.mark.parametrize("capability, chosen", [
    ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"), ((10, 0), "sm_100a"),
    ((10, 3), "compute_80"), ((12, 0), "compute_80"), ((8, 7), "compute_80")])
def test_the_device_loads_its_exact_cubins_else_the_ptx_copy(capability, chosen) -> None:
    executor, fake = _start(ALL, capability)
    try:
        assert executor.architecture() == chosen
        copy_image = sc.IMAGE_PATH.read_bytes()
        (image,) = [image for image in fake.module_images if image != copy_image]   # one architecture's
        if chosen.startswith("compute_"):
            # PTX reaches the driver as a C string, JIT-compiled here at startup
            assert image.endswith(b"\0") and b".target sm_80" in image
        else:
            assert image == f"\x7fELF {chosen}".encode()
        chain = fake.graphs[1]                                     # after the tuning producer
        kernels = [launch for launch in chain if launch.function.startswith("toy_")]
        # launch attributes and shared memory follow the chosen module, not the recorded nodes
        assert {launch.shared for launch in kernels} == {_shared(chosen)}
        assert any(launch.pdl for launch in kernels) == (CAPABILITY[chosen] >= 90)
        # the staging copy's own fatbin: PDL where the device has it, whatever the kernels' path
        (complete_out,) = [launch for launch in chain if launch.function == sc.COMPLETE_OUT]
        assert complete_out.pdl == (capability >= (9, 0))
    finally:
        executor.close()


# spec: OWN-20
@pytest.mark.parametrize("archs, capability", [(ALL, (7, 5)), (("sm_90a", "sm_80"), (8, 6)),
                                               (("sm_90a",), (10, 0))])
def test_no_module_for_the_device_fails_startup_naming_both_sides(archs, capability) -> None:
    with pytest.raises(ArchitectureError) as error:
        _start(archs, capability)
    message = str(error.value)
    assert f"{capability[0]}.{capability[1]}" in message
    assert all(arch in message for arch in archs)


# spec: OWN-18
def test_a_forced_architecture_loads_the_ptx_path_on_a_newer_device() -> None:
    manifest, resources = multi_arch_toy()
    fake = FakeDriver(capability=(9, 0))
    counting = CountingDriver(fake)
    executor = CudaExecutor(manifest, resources.__getitem__,
                            CudaExecutorOptions(cache_pages=2, kernel_arch="compute_80"), driver=counting)
    try:
        assert executor.architecture() == "compute_80" and "modules" in executor.startup_seconds
        kernels = [launch for launch in fake.graphs[1] if launch.function.startswith("toy_")]
        assert kernels and not any(launch.pdl for launch in kernels)
        # the JIT happened at startup: serving loads and compiles nothing
        counting.counting = True
        executor.launch("chain", 0)
        executor.wait(0)
        counting.counting = False
        assert counting.forbidden_calls() == {} and counting.calls["cuGraphLaunch"] == 1
    finally:
        executor.close()
    for forced in ("sm_80", "sm_75"):          # another device's cubins; an absent architecture
        with pytest.raises(ArchitectureError, match=forced):
            _start(ALL, (9, 0), kernel_arch=forced)


# spec: FMT-8
def test_older_cores_without_capability_or_image_fields_still_select() -> None:
    old = toy.build(n=N).modules           # arch "sm_90a", no capability, no image kind
    assert select(old, 90).name == "sm_90a" and not select(old, 90).portable
    with pytest.raises(ArchitectureError, match="8.0"):
        select(old, 80)


def test_kernel_table_disagreements_are_reported() -> None:
    manifest, _ = multi_arch_toy()
    assert kernel_table_disagreements(manifest.modules) == []
    manifest.modules[2].kernels[1].num_warps = 8
    del manifest.modules[3].kernels[0]
    problems = kernel_table_disagreements(manifest.modules)
    assert any("sm_89" in p and "toy_axpb" in p for p in problems)
    assert any("toy_begin" in p and "sm_80 only" in p for p in problems)
    mixed = M.KernelModule(arch="sm_90a", capability=80)
    with pytest.raises(ManifestError):
        architectures(list(manifest.modules) + [mixed])


def test_preparation_rejects_a_kernel_over_its_targets_shared_memory() -> None:
    pytest.importorskip("triton")
    from ignition.gpu_kernels import compiler, targets
    from ignition.gpu_kernels.library import KernelLibrary, KernelTargetError

    kernel = compiler.CompiledKernel(kernel_id="tokens.select_input.v1", symbol="select_input_ids", cubin=b"",
                                     ptx=b"", num_warps=4, num_stages=2, shared_bytes=120 * 1024, pdl=False,
                                     trailing_null_pointers=2, ptx_params=0, toolchain="t")
    KernelLibrary._module(targets.target("sm_80"), "kernels.0", kernel)          # 163 KiB there
    for arch in ("sm_86", "compute_80"):
        with pytest.raises(KernelTargetError, match=arch):
            KernelLibrary._module(targets.target(arch), "kernels.0", kernel)


def test_an_unknown_architecture_is_a_usage_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "ignition.cli", "smollm2-135m-instruct", "--arch", "sm_75",
                             "--out", str(tmp_path / "x.core")], capture_output=True, text=True)
    assert result.returncode == 2 and "sm_75" in result.stderr and "sm_90a" in result.stderr
    assert not (tmp_path / "x.core").exists()


# ---------------------------------------------------------------------------------------------
# the default core, prepared for the full default set (server_fixtures.default_core)

@pytest.fixture(scope="module")
def default_manifest(default_core) -> M.ExecutionManifest:
    from helios_backend.core import open_core
    with open_core(default_core) as core:
        return core.manifest


def test_the_default_core_carries_every_architecture_and_their_tables_agree(default_manifest) -> None:
    pytest.importorskip("triton")
    from ignition.gpu_kernels.library import KernelLibrary
    from ignition.gpu_kernels.targets import default_archs

    found = {a.name: a for a in architectures(default_manifest.modules)}
    assert tuple(found) == default_archs() == ALL, "a stale default core? `make core` re-prepares it"
    kernel_sets = {m.kernel_set for m in default_manifest.modules}
    assert len(kernel_sets) == len(KernelLibrary(archs=["sm_90a"]).kernel_ids())
    for arch in found.values():
        assert sorted(m.kernel_set for m in arch.modules) == sorted(kernel_sets)     # one per (set, arch)
        assert all(m.resource == f"{m.kernel_set}.{arch.name}" for m in arch.modules)
        kernels = [k for m in arch.modules for k in m.kernels]
        # PDL where griddepcontrol exists (sm_90 on), plain launches elsewhere
        assert all(k.programmatic_dependent_launch == (arch.capability >= 90 and not arch.portable)
                   for k in kernels), arch.name
        assert all(k.num_stages >= 1 and k.shared_bytes <= 99 * 1024 for k in kernels)
    assert found["compute_80"].portable and found["compute_80"].capability == 80
    assert kernel_table_disagreements(default_manifest.modules) == []
    # the recorded nodes leave shared memory to the chosen module
    assert all(node.shared_bytes == 0 for p in default_manifest.programs for node in p.nodes)


def test_default_core_images_are_each_architectures_code(default_core, default_manifest, tmp_path) -> None:
    triton = pytest.importorskip("triton")
    from helios_backend.core import open_core

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    first = {}
    for module in default_manifest.modules:
        first.setdefault(module.arch, module)
    with open_core(default_core) as core:
        for arch, module in first.items():
            image = bytes(core.read_resource(module.resource))
            symbol = module.kernels[0].symbol
            if module.portable:
                assert b".target sm_80" in image and f".entry {symbol}".encode() in image
                assert b"griddepcontrol" not in image
                continue
            assert image[:4] == b"\x7fELF"
            if cuobjdump.exists():
                path = tmp_path / "k.cubin"
                path.write_bytes(image)
                header = subprocess.run([str(cuobjdump), "-elf", str(path)], capture_output=True, text=True,
                                        check=True).stdout
                assert header.split("sm=")[1].split(",")[0] == arch.removeprefix("sm_"), arch


def test_inspect_lists_the_architectures(default_core) -> None:
    result = subprocess.run([sys.executable, "-m", "helios_backend.cli.core", "inspect", str(default_core)],
                            capture_output=True, text=True)
    line = next(l for l in result.stdout.splitlines() if l.startswith("architectures"))
    assert line.split(None, 1)[1] == ", ".join(ALL)
    assert "PTX for >= 8.0 (sm_80), JIT at startup" in result.stdout
    assert np.all([f"  {arch} " in result.stdout for arch in ALL])


def test_inspect_lists_the_default_cores_serving_rows_and_speculative_programs(default_core) -> None:
    # spec: SPEC-6, SPEC-11
    listed = subprocess.run([sys.executable, "-m", "helios_backend.cli.core", "inspect", str(default_core)],
                            capture_output=True, text=True, check=True).stdout
    assert "concurrency 256" in listed and "decode.r256.t256" in listed and "mixed.r256.t1280" in listed
    assert "speculative widths [1, 4, 8]" in listed
    for b, w, p in ((64, 1, 64), (64, 4, 256), (32, 8, 256), (1, 8, 8)):
        assert f"speculative.r{b}.w{w}.t{p}" in listed and f"B={b} D={w - 1} W={w} P={p}" in listed
    # no program verifies more than 256 target rows, none past 64 request rows
    assert "speculative.r64.w8" not in listed and "speculative.r128" not in listed


def test_the_ptx_assembles_for_a_newer_architecture(default_manifest, default_core, tmp_path) -> None:
    """What the driver's JIT does at startup on a newer device, done by ptxas here (for two
    kernel sets: a weight-streaming GEMM and the sampler; all of them take ~20 s)."""
    triton = pytest.importorskip("triton")
    from helios_backend.core import open_core

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("ptxas not bundled with triton")
    wanted = {"linear.residual.v1", "sampling.draw.v2"}
    modules = [m for m in default_manifest.modules if m.portable and m.kernels[0].id in wanted]
    assert len(modules) == len(wanted)
    with open_core(default_core) as core:
        for module in modules:
            source = tmp_path / f"{module.kernel_set}.ptx"
            source.write_bytes(bytes(core.read_resource(module.resource)))
            result = subprocess.run([str(ptxas), "-arch=sm_90a", str(source), "-o", str(tmp_path / "out.cubin")],
                                    capture_output=True, text=True)
            assert result.returncode == 0, result.stderr
            assert module.kernels[0].symbol.encode() in (tmp_path / "out.cubin").read_bytes()
