"""Ahead-of-time kernel library: Triton sources compiled without a GPU, per architecture (targets.py)."""
from ignition.kernels.library import KernelLibrary

__all__ = ["KernelLibrary"]
