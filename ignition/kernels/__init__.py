"""Ahead-of-time kernel library: Triton sources compiled to sm_90a cubins without a GPU."""
from ignition.kernels.library import KernelLibrary

__all__ = ["KernelLibrary"]
