"""The kernel table: for each kernel id, its Triton source, tile sizes and launch grid.

Tile sizes are constexprs fixed at preparation; everything shape-like arrives at launch as
an immediate, so one cubin serves every capacity variant. `grid` maps the launch's named
immediates (ABI parameter name -> value) to the CUDA grid; the block is 32 * num_warps.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

Grid = tuple[int, int, int]
Immediates = Mapping[str, int | float]


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // b)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    kernel_id: str
    module: str                                   # ignition.kernels.triton.<module>
    function: str                                 # @triton.jit function (cubin symbol)
    constexprs: Mapping[str, int]                 # tile sizes; PDL is appended by the compiler
    grid: Callable[[Immediates, Mapping[str, int]], Grid]   # (immediates, constexprs) -> grid
    num_warps: int = 4
    num_stages: int = 3


def _tiles_over_n_and_m(n_name: str, m_name: str) -> Callable[[Immediates, Mapping[str, int]], Grid]:
    """Grid of [BLOCK_M, BLOCK_N] output tiles: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), 1)."""
    def grid(args: Immediates, c: Mapping[str, int]) -> Grid:
        return (cdiv(args[n_name], c["BLOCK_N"]), cdiv(args[m_name], c["BLOCK_M"]), 1)
    return grid


# Small-N projections (N <= a few thousand) use narrow tiles so decode spreads over more SMs;
# the LM head (N = vocabulary) uses wide ones.
_NARROW = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}
_WIDE = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64}

KERNEL_SPECS: tuple[KernelSpec, ...] = (
    KernelSpec("rmsnorm_matmul", "matmul", "rmsnorm_matmul", _NARROW,
               _tiles_over_n_and_m("N", "M")),
    KernelSpec("matmul_residual", "matmul", "matmul_residual", _NARROW,
               _tiles_over_n_and_m("N", "M")),
    KernelSpec("rmsnorm_matmul_swiglu", "matmul", "rmsnorm_matmul_swiglu", _NARROW,
               _tiles_over_n_and_m("F", "M")),
    KernelSpec("rmsnorm_logits", "matmul", "rmsnorm_logits", _WIDE,
               _tiles_over_n_and_m("V", "B"), num_warps=8),
)

SPECS_BY_ID: Mapping[str, KernelSpec] = {spec.kernel_id: spec for spec in KERNEL_SPECS}
