"""GPU tests of the CUDA executor (skipped without a GPU; see tests/conftest.py).

The toy manifest (toy_manifest.py) exercises every executor mechanism; conformance on the
real model is tests/gpu/conformance.py (a script: it needs the model bundle)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import toy_manifest as toy

pytestmark = pytest.mark.gpu
N = 1000
LAYERS = 6


@pytest.fixture(scope="module")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    try:
        return toy.compile_cubin(tmp_path_factory.mktemp("toy"))
    except FileNotFoundError:
        pytest.skip("nvcc is needed to build the toy kernels")


def _executor(cubin: bytes, world_size: int = 1, driver=None, **options):
    from helios_backend.executors.cuda_executor import CudaExecutor, CudaExecutorOptions

    manifest = toy.build(n=N, world_size=world_size, chains={"chain": LAYERS}, pdl=options.pop("pdl", True))
    return CudaExecutor(manifest, toy.resources(cubin, N, world_size).__getitem__,
                        CudaExecutorOptions(cache_pages=8, **options), driver=driver)


def _run_steps(executor, steps: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two frames in flight; returns (x, completion words) per step."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(steps)]
    done = []
    for step, x in enumerate(xs):
        frame = step % 2
        if step >= 2:
            done.append(executor.wait(frame))
        toy.pack(executor.staging(frame), x)
        executor.launch("chain", frame)
    done += [executor.wait(s % 2) for s in (steps - 2, steps - 1)]
    return list(zip(xs, done))


@pytest.mark.parametrize("transport", ["kernel", "memcpy"])
@pytest.mark.parametrize("pdl", [True, False])
def test_steps_match_reference(cubin: bytes, transport: str, pdl: bool) -> None:
    executor = _executor(cubin, transport=transport, pdl=pdl)
    try:
        for step, (x, words) in enumerate(_run_steps(executor)):
            assert words[:2].tolist() == [step, step % 2]                # executor-owned header
            got = words[2:2 + N].view(np.float32)
            np.testing.assert_allclose(got, toy.reference(x, LAYERS), rtol=1e-5)
        cache = executor.read_buffer("cache").view(np.float32).reshape(-1, N)
        np.testing.assert_allclose(cache[toy.CACHE_PAGE], toy.reference(x, LAYERS), rtol=1e-5)
        np.testing.assert_allclose(executor.read_buffer("tuned").view(np.float32), 0.5 * np.arange(N))
    finally:
        executor.close()


# spec: OWN-18
def test_serving_allocates_loads_and_captures_nothing(cubin: bytes) -> None:
    from helios_backend.executors.cuda.driver import CountingDriver, load_driver

    counting = CountingDriver(load_driver())
    executor = _executor(cubin, driver=counting)
    try:
        counting.counting = True
        _run_steps(executor)
        counting.counting = False
        assert counting.forbidden_calls() == {}
        assert set(counting.calls) == {"cuGraphLaunch", "cuEventSynchronize"}
    finally:
        executor.close()


def test_tensor_parallel_all_reduce_sums_ranks(cubin: bytes) -> None:
    from helios_backend.executors.cuda.driver import check, load_driver

    driver = load_driver()
    check(driver.cuInit(0))
    if check(driver.cuDeviceGetCount()) < 2:
        pytest.skip("needs two GPUs")
    executor = _executor(cubin, world_size=2)
    try:
        for x, words in _run_steps(executor, steps=4):
            np.testing.assert_allclose(words[2:2 + N].view(np.float32), toy.reference(x, LAYERS, 2), rtol=1e-5)
        assert np.array_equal(executor.read_buffer("cache", 0), executor.read_buffer("cache", 1))
    finally:
        executor.close()
