"""Typed errors of the CUDA executor.

Startup failures (a bad manifest, a missing kernel, too little memory) and execution
failures (a CUDA error while serving) are different classes so callers can fail startup
or mark the model unhealthy without reading message text.
"""
from __future__ import annotations

from helios_backend.executors.base import (ExecutorLoadError, FrameStateError, KernelArgumentError,
                                           MissingVariantError, UnknownProgramError)

__all__ = ["CudaExecutorError", "DriverUnavailableError", "CudaCallError", "ManifestError", "ProgramError",
           "ArchitectureError", "DeviceMemoryError", "MissingVariantError", "UnknownProgramError", "FrameStateError"]


class CudaExecutorError(RuntimeError):
    """Base class of every CUDA executor failure."""


class DriverUnavailableError(CudaExecutorError):
    """cuda-bindings is not installed or no CUDA device is present."""


class CudaCallError(CudaExecutorError):
    """A driver (or NCCL) call returned an error code."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class ManifestError(CudaExecutorError, ExecutorLoadError):
    """The execution manifest is inconsistent (startup fails)."""


class ProgramError(ManifestError, KernelArgumentError):
    """A recorded program does not match the kernel ABI or the buffer layout."""


class DeviceMemoryError(CudaExecutorError):
    """The device has too little memory for the manifest and the chosen capacities."""


class ArchitectureError(ManifestError):
    """No kernel module of the core runs on the device (startup fails, naming both sides)."""
