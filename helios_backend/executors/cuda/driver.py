"""Checked access to the CUDA driver API (cuda.bindings.driver).

Every driver function returns `(CUresult, *outputs)`; `check` turns a nonzero result into
a typed `CudaCallError` and unwraps the outputs. The executor never imports the driver
module itself: it receives one (or a `CountingDriver` around it, for the test that counts
what serving calls), so the hot path stays a plain attribute lookup plus one call.
"""
from __future__ import annotations

import collections
from typing import Any

from .errors import CudaCallError, DriverUnavailableError


def load_driver() -> Any:
    """The cuda.bindings.driver module; DriverUnavailableError where it is not installed."""
    try:
        from cuda.bindings import driver  # deferred: CPU machines import this package too
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise DriverUnavailableError("cuda-bindings is not installed") from error
    return driver


def check(result: tuple, call: str = "cuda call") -> Any:
    """Raise CudaCallError on a nonzero CUresult; return None, the one output, or a tuple."""
    code = int(result[0])
    if code:
        raise CudaCallError(call, code, getattr(result[0], "name", str(result[0])))
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def gpu_available() -> bool:
    """True where cuda-bindings imports and the driver reports at least one device."""
    try:
        driver = load_driver()
        if int(driver.cuInit(0)[0]):
            return False
        code, count = driver.cuDeviceGetCount()
        return not int(code) and count > 0
    except (DriverUnavailableError, OSError, RuntimeError):
        return False


class CountingDriver:
    """A proxy over the driver module that counts calls by name while `counting` is on.

    Tests wrap the driver in one, turn counting on after startup, serve, and assert that
    no cuMemAlloc*/cuModuleLoad*/cuGraphInstantiate*/cuStreamBeginCapture call was made.
    """

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self.counting = False
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._driver, name)
        if not callable(value) or not name.startswith("cu"):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.calls[name] += 1
            return value(*args, **kwargs)

        return counted

    def forbidden_calls(self) -> dict[str, int]:
        """Counted calls that serving may not make: allocation, loading, compilation, capture."""
        prefixes = ("cuMemAlloc", "cuMemCreate", "cuMemMap", "cuMemHostAlloc", "cuModuleLoad",
                    "cuLibraryLoad", "cuGraphInstantiate", "cuStreamBeginCapture", "cuGraphCreate",
                    "cuGraphAdd", "cuLinkCreate", "cuMemAddressReserve", "cuStreamCreate",
                    "cuEventCreate")
        return {name: n for name, n in self.calls.items() if name.startswith(prefixes)}
