"""Block storage types of weight matrices: the contract-declared layouts and their exact expansion.

A WEIGHT buffer declared with a block dtype (contract.proto DTYPE_Q8_0, DTYPE_Q4_1) holds a
row-major [out, in] matrix as ggml/GGUF lays its blocks out: each row is `in / 32` blocks, a
block the 32 consecutive weights of that row (little-endian f16 fields):

    Q8_0  34 bytes  | d f16 | q[32] int8 |                 w[j] = d * q[j]
    Q4_1  20 bytes  | d f16 | m f16 | qs[16] uint8 |       w[j] = d * (qs[j] & 15) + m        j < 16
                                                           w[j] = d * (qs[j - 16] >> 4) + m   j >= 16

Preparation copies a GGUF tensor's blocks verbatim (ignition/recipes/llama_decoder.py), so the
core is lossless against its source. Every executor reads the layout: the numpy executor (the
oracle) expands it with `expand` into its f32 weight shadow at load; the CUDA executor expands it
to its F16 layout at load (`expand_f16`; the values are products of f16 numbers rounded once, the
same as dequantizing the GGUF to f16 at preparation); the CPU executor's compiled products read
the blocks in place (executors/cpu/compiled.py), with the same values as `expand`.
A kernel parameter that reads an F16 weight accepts a block buffer at byte offset 0
(ignition/recorder.py): what it reads is the matrix the blocks expand to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

BLOCK_WEIGHTS = 32      # weights per block, every layout


@dataclass(frozen=True)
class BlockLayout:
    dtype: int          # contract DType value
    name: str           # the GGUF / ggml type name
    block_bytes: int    # bytes of one block of BLOCK_WEIGHTS weights
    code: int           # the compiled kernels' layout argument (executors/cpu/compiled.py)


Q8_0 = BlockLayout(C.DTYPE_Q8_0, "Q8_0", 34, 0)
Q4_1 = BlockLayout(C.DTYPE_Q4_1, "Q4_1", 20, 1)
LAYOUTS: Mapping[int, BlockLayout] = {layout.dtype: layout for layout in (Q8_0, Q4_1)}
BY_NAME: Mapping[str, BlockLayout] = {layout.name: layout for layout in LAYOUTS.values()}


class BlockLayoutError(ValueError):
    """A block buffer whose shape or size does not fit its layout."""


def is_block(dtype: int) -> bool:
    return dtype in LAYOUTS


def block_nbytes(dtype: int, shape: Sequence[int]) -> int:
    """Bytes of a [out, in] matrix stored in the block layout `dtype` (in % 32 == 0)."""
    layout = LAYOUTS[dtype]
    if len(shape) != 2 or shape[1] % BLOCK_WEIGHTS:
        raise BlockLayoutError(f"{layout.name} stores [out, in] matrices with in % {BLOCK_WEIGHTS} == 0, "
                               f"not shape {list(shape)}")
    return int(shape[0]) * int(shape[1]) // BLOCK_WEIGHTS * layout.block_bytes


def matrix_shape(buffer: M.Buffer) -> tuple[int, int]:
    """(out, in) of a block buffer, checked against its declared nbytes."""
    shape = tuple(int(d) for d in buffer.shape)
    if block_nbytes(buffer.dtype, shape) != buffer.nbytes:
        raise BlockLayoutError(f"weight {buffer.name}: {buffer.nbytes} bytes, {LAYOUTS[buffer.dtype].name} "
                               f"{list(shape)} needs {block_nbytes(buffer.dtype, shape)}")
    return shape[0], shape[1]


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)[:, 0].astype(np.float32)


def expand(dtype: int, data: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """The f32 [out, in] matrix that `data` (the buffer's bytes) stores in layout `dtype`."""
    layout = LAYOUTS[dtype]
    rows, cols = int(shape[0]), int(shape[1])
    blocks = np.asarray(data, dtype=np.uint8)[:block_nbytes(dtype, shape)].reshape(-1, layout.block_bytes)
    d = _halves(blocks, 0)[:, None]
    if layout is Q8_0:
        weights = d * blocks[:, 2:].view(np.int8).astype(np.float32)
    else:
        nibbles = blocks[:, 4:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(np.float32)
        weights = d * q + _halves(blocks, 2)[:, None]
    return weights.reshape(rows, cols)


def expand_f16(dtype: int, data: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """`expand` rounded to f16 (the F16 layout an executor without block kernels keeps)."""
    return expand(dtype, data, shape).astype(np.float16)


def expanded_manifest(manifest: M.ExecutionManifest) -> tuple[M.ExecutionManifest, dict[tuple[int, str], M.Buffer]]:
    """A copy of the manifest with every block WEIGHT buffer declared as the F16 matrix it expands
    to (same resource and offset), and the original declarations by (rank, name): for an executor
    that keeps F16 weights and fills such a buffer with `expand_f16` of the original's bytes."""
    if not any(b.kind == M.BUFFER_KIND_WEIGHT and is_block(b.dtype) for b in manifest.buffers):
        return manifest, {}
    expanded = M.ExecutionManifest()
    expanded.CopyFrom(manifest)
    originals: dict[tuple[int, str], M.Buffer] = {}
    for buffer in expanded.buffers:
        if buffer.kind == M.BUFFER_KIND_WEIGHT and is_block(buffer.dtype):
            original = M.Buffer()
            original.CopyFrom(buffer)
            rows, cols = matrix_shape(original)
            originals[(buffer.rank, buffer.name)] = original
            buffer.dtype = C.DTYPE_F16
            buffer.nbytes = rows * cols * 2
    return expanded, originals


@dataclass(frozen=True)
class BlockMatrix:
    """A [out, in] matrix as blocks of `dtype` (preparation's view of a source tensor's blocks)."""

    dtype: int
    data: np.ndarray            # uint8 [out, in / 32 * block bytes], row-major

    @property
    def shape(self) -> tuple[int, int]:
        layout = LAYOUTS[self.dtype]
        return int(self.data.shape[0]), int(self.data.shape[1]) // layout.block_bytes * BLOCK_WEIGHTS

    def columns(self, start: int, stop: int) -> "BlockMatrix | None":
        """Columns start:stop (element indices), or None when they do not fall on block boundaries."""
        if start % BLOCK_WEIGHTS or stop % BLOCK_WEIGHTS:
            return None
        size = LAYOUTS[self.dtype].block_bytes
        return BlockMatrix(self.dtype, self.data[:, start // BLOCK_WEIGHTS * size:stop // BLOCK_WEIGHTS * size])

    def expand(self) -> np.ndarray:
        return expand(self.dtype, np.ascontiguousarray(self.data).reshape(-1), self.shape)


def stack_rows(parts: Sequence["BlockMatrix | None"]) -> "BlockMatrix | None":
    """The matrices one above the other when all are blocks of one layout and width, else None."""
    if not parts or any(p is None for p in parts):
        return None
    first = parts[0]
    assert first is not None
    if any(p.dtype != first.dtype or p.data.shape[1] != first.data.shape[1] for p in parts if p is not None):
        return None
    return BlockMatrix(first.dtype, np.concatenate([p.data for p in parts if p is not None]))


@dataclass(frozen=True)
class BlockWeight:
    """What a compiled kernel that reads blocks in place receives for a block weight pointer
    (executors/numpy_rank.py binds it; references get the expanded f32 matrix instead)."""

    layout: BlockLayout
    data: np.ndarray            # the buffer's bytes, uint8, in the arena
    rows: int
    cols: int
