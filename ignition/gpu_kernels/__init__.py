"""Ahead-of-time kernel library: Triton sources compiled without a GPU, per architecture (targets.py)."""
from ignition.gpu_kernels.library import KernelLibrary

__all__ = ["KernelLibrary"]
