"""Shared pytest setup: fixtures from each part's fixture module, GPU skipping."""
from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Each part contributes its fixtures in a module of its own; they are re-exported here so
# every test file sees them without importing.
for _module in ("tests.engine_fixtures", "tests.server_fixtures", "tests.variant_fixtures"):
    if importlib.util.find_spec(_module) is not None:
        _fixtures = importlib.import_module(_module)
        globals().update({k: v for k, v in vars(_fixtures).items() if not k.startswith("_")})


def _gpu_available() -> bool:
    # cuda-bindings raises (rather than returning an error code) when libcuda is absent.
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]

        err, = driver.cuInit(0)[:1]
        if int(err) != 0:
            return False
        err, count = driver.cuDeviceGetCount()
        return int(err) == 0 and count > 0
    except (ImportError, RuntimeError, OSError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and cuda-bindings")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
