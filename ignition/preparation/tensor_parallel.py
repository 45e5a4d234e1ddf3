"""Tensor parallelism: which model dimensions ranks divide, how weights are cut, and the one
place a forward pass sums the ranks' partial products.

A recipe declares data only (no rank logic, no model-name dispatch here):

  * `tensor_parallel_dimensions(shape)` -> PartitionedDimension per divided dimension: its
    units and whether an uneven split is allowed (SmolLM2-135M: `kv_groups`, 3 KV heads with
    their query heads, uneven; `ffn`, 1536 columns, even);
  * a `Split` on each weight tensor that is cut (axis, dimension, part widths); tensors without
    one (embedding, norms, LM head, rope table) are replicated on every rank;
  * `rank_shape(shape, units)`: the shape one rank computes with (its heads, its ffn columns);
  * its forward pass adds row-parallel products to the residual through `add_to_residual`.

Partition of SmolLM2-135M over 2 ranks (units = KV-head groups, ffn columns):

    kv_groups  3     rank 0: groups [0, 2) -> q heads 0-5, kv heads 0-1    rank 1: [2, 3) -> q 6-8, kv 2
    ffn        1536  rank 0: columns [0, 768)                              rank 1: [768, 1536)

An uneven dimension gives the first `units % degree` ranks one unit more.

The residual stream is replicated. Each output projection (attention output, MLP down) is
row-parallel: every rank multiplies its slice of the activations by its columns of the weight,
giving a partial product of the full width. The residual must receive the sum of the partials
exactly once, so rank 0 adds its partial to the residual (linear.residual.v1) while every other
rank overwrites the residual buffer with its partial (linear.project.v1, rows past the live
count zeroed); one all-reduce then leaves residual + sum of partials on every rank:

    rank 0:  hidden  = hidden + x0 @ W0.T          rank r > 0:  hidden = xr @ Wr.T  (0 past n)
    all-reduce(hidden, tokens * dim)  ->  every rank: hidden + sum_r xr @ Wr.T

Two nodes per projection and no extra buffer; the residual enters the sum through rank 0 only.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping, Sequence

import numpy as np

from helios_backend.kernel_abi.blocks import BlockMatrix

from ignition.recorder import ForwardRecorder, Ref

OPTION = "tensor_parallel"   # the RecipeOptions field (and the helios-prepare flag) naming the degree


class TensorParallelError(ValueError):
    """A tensor-parallel degree the model cannot be divided into; names the option."""

    def __init__(self, degree: int, reason: str) -> None:
        super().__init__(f"{OPTION}={degree}: {reason}")
        self.option = OPTION
        self.degree = degree


@dataclass(frozen=True)
class PartitionedDimension:
    """A model dimension that ranks divide among themselves, in whole units."""

    name: str       # e.g. "kv_groups", "ffn"
    units: int      # e.g. 3 KV heads (each with its query heads), 1536 ffn columns
    uneven: bool    # may ranks hold different unit counts (heads: yes; kernel widths: no)


@dataclass(frozen=True)
class Split:
    """How one weight tensor is cut: along `axis`, in units of `dimension`.

    The axis is a concatenation of parts (a fused qkv weight: q, k, v rows); part i holds
    `units x parts[i]` entries, and a rank takes units [start, stop) of every part, in order.
    """

    axis: int
    dimension: str
    parts: tuple[int, ...]   # entries per unit in each part (q: group * head_dim, k and v: head_dim)


@dataclass(frozen=True)
class Partition:
    """Which units of every divided dimension each of `degree` ranks holds."""

    degree: int
    ranges: Mapping[str, tuple[tuple[int, int], ...]]   # dimension -> per rank [start, stop)

    @classmethod
    def plan(cls, dimensions: Sequence[PartitionedDimension], degree: int) -> "Partition":
        if degree < 1:
            raise TensorParallelError(degree, "the degree is a positive rank count")
        ranges: dict[str, tuple[tuple[int, int], ...]] = {}
        for dimension in dimensions:
            if dimension.units < degree:
                raise TensorParallelError(degree, f"more ranks than the {dimension.units} units of "
                                                  f"{dimension.name!r}")
            if not dimension.uneven and dimension.units % degree:
                raise TensorParallelError(degree, f"does not divide the {dimension.units} units of "
                                                  f"{dimension.name!r}")
            base, extra = divmod(dimension.units, degree)
            counts = [base + (rank < extra) for rank in range(degree)]
            starts = np.cumsum([0] + counts)
            ranges[dimension.name] = tuple((int(starts[r]), int(starts[r + 1])) for r in range(degree))
        return cls(degree, ranges)

    def units(self, rank: int) -> dict[str, int]:
        """Units of every divided dimension that `rank` holds."""
        return {name: stop - start for name, (start, stop) in ((n, r[rank]) for n, r in self.ranges.items())}

    def shard(self, array: np.ndarray | BlockMatrix, split: Split | None, rank: int) -> np.ndarray | BlockMatrix:
        """`rank`'s piece of a weight tensor (the tensor itself when it is replicated). A block
        matrix is cut between its blocks: rows anywhere, columns on 32-weight block boundaries
        (else its piece is expanded to f16)."""
        if split is None or self.degree == 1:
            return array
        if isinstance(array, BlockMatrix):
            return self._shard_blocks(array, split, rank)
        ranges = self.ranges.get(split.dimension)
        if ranges is None:
            raise TensorParallelError(self.degree, f"a weight is split along undeclared dimension "
                                                   f"{split.dimension!r}")
        total = ranges[-1][1]
        start, stop = ranges[rank]
        if sum(split.parts) * total != array.shape[split.axis]:
            raise TensorParallelError(self.degree, f"parts {split.parts} x {total} units do not cover axis "
                                                   f"{split.axis} of a {list(array.shape)} weight")
        pieces, offset = [], 0
        for width in split.parts:
            index = [slice(None)] * array.ndim
            index[split.axis] = slice(offset + start * width, offset + stop * width)
            pieces.append(array[tuple(index)])
            offset += width * total
        return np.ascontiguousarray(np.concatenate(pieces, axis=split.axis))

    def _shard_blocks(self, matrix: BlockMatrix, split: Split, rank: int) -> np.ndarray | BlockMatrix:
        ranges = self.ranges[split.dimension]
        total, (start, stop) = ranges[-1][1], ranges[rank]
        if split.axis == 0:
            rows = np.asarray(self.shard(np.arange(matrix.data.shape[0])[:, None], split, rank))[:, 0]
            return BlockMatrix(matrix.dtype, np.ascontiguousarray(matrix.data[rows]))
        pieces, offset = [], 0
        for width in split.parts:
            pieces.append(matrix.columns(offset + start * width, offset + stop * width))
            offset += width * total
        if any(piece is None for piece in pieces):
            return self.shard(matrix.expand().astype(np.float16), split, rank)
        return BlockMatrix(matrix.dtype, np.ascontiguousarray(np.concatenate([p.data for p in pieces if p], axis=1)))


def plan_for(recipe: ModuleType, shape: Any, degree: int) -> Partition:
    """The recipe's dimensions divided among `degree` ranks (degree 1: nothing is divided)."""
    if degree == 1:
        return Partition(1, {})
    declare = getattr(recipe, "tensor_parallel_dimensions", None)
    if declare is None:
        raise TensorParallelError(degree, f"recipe {recipe.NAME!r} declares no tensor-parallel dimensions")
    return Partition.plan(declare(shape), degree)


def rank_shape(recipe: ModuleType, shape: Any, partition: Partition, rank: int) -> Any:
    """The model shape `rank` computes with (the whole shape without tensor parallelism)."""
    return shape if partition.degree == 1 else recipe.rank_shape(shape, partition.units(rank))


def add_to_residual(rec: ForwardRecorder, label: str, *, hidden: str | Ref, x: str | Ref, weight: str | Ref,
                    geometry: Ref, tokens: int, in_dim: int, out_dim: int) -> None:
    """hidden [tokens, out_dim] += x @ weight.T, the product summed over ranks (row-parallel).

    One rank: linear.residual.v1. Several: rank 0 adds its partial, the others store theirs
    into `hidden`, then one all-reduce over the token capacity (module docstring)."""
    args = dict(x=x, weight=weight, geometry=geometry, tokens=tokens, in_dim=in_dim, out_dim=out_dim)
    if rec.rank == 0:
        rec.launch("linear.residual.v1", label, hidden=hidden, **args)
    else:
        rec.launch("linear.project.v1", label, out=hidden, **args)
    if rec.world_size > 1:
        region = hidden if isinstance(hidden, Ref) else rec.ref(hidden)
        rec.all_reduce(f"{label}.all_reduce", region, tokens * out_dim)
