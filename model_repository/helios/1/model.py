"""Triton's entry point for the `helios` model: a thin adapter, nothing else.

Everything lives in helios_backend.triton and helios_backend.engine (docs/triton-backend.md). The stub finds the
project's environment because tritonserver runs with the venv's bin first on PATH.
"""
import triton_python_backend_utils as pb_utils

from helios_backend.triton.adapter import TritonHeliosModel
from helios_backend.triton.parent_watch import watch_parent


class TritonPythonModel(TritonHeliosModel):
    def __init__(self) -> None:
        # the stub ends within a second of tritonserver's death (Triton's own check can hang
        # in the stub's shutdown, and its engine process would outlive it holding the device)
        watch_parent()
        super().__init__(pb_utils)
