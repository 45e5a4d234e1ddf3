"""How the activations of a block-weight product are represented: f32, or 8-bit blocks (q8).

`f32`: a block-weight product (kernel_abi/blocks.py, Q8_0 / Q4_1) multiplies the f32 activations
by the weights' f32 values (blocks.expand), as every reference writes it (x @ W.T).

`q8`: the activations are first quantized per block of 32 elements of each token, as ggml's
Q8_0 / Q8_1 do for its integer dot products (llama.cpp's CPU kernels):

    d = max |x_j| / 127          q_j = round-to-nearest-even(x_j * (1 / d))  (0 where d == 0)
    s = d * sum_j q_j            (the Q8_1 sum term, which a Q4_1 weight's minimum multiplies)

kept as 40 bytes per 32 activations of a token (`Q8_BLOCK_BYTES`: f32 d, f32 s, 32 int8 q; ggml's
block_q8_1 with f32 fields: the activations never leave the process, so f16 scales would only
add error), and each 32-weight block's product is an integer dot product scaled once:

    Q8_0 weights (dw, qw):       dw * d * sum_j qw_j q_j
    Q4_1 weights (dw, mw, qw):   dw * d * sum_j qw_j q_j + mw * s

The tokens are laid out in groups (`TOKEN_GROUPS`: 8, else 4, else 1 tokens, the largest that
fits in the tokens left, as the compiled products group them), a group of T tokens as its
blocks one after another, each block 40 T bytes: the T tokens' d, their s, then their quants
in chunks of 4: chunk c (quants 4c .. 4c + 3) of token 0, of token 1, .. of token T - 1, then
chunk c + 1. So 32 bytes of a block hold 8 / T chunks of each of the T tokens, each 4-byte lane
one (chunk, token): an integer dot product of 4 bytes per lane (vpdpbusd, vpmaddubsw + vpmaddwd)
against the weight chunks repeated T times sums token t in the lanes l with l % T == t, the
tokens' T scales are one vector load, and token t still starts at byte t * (k / 32) * 40.

which is exactly sum_j w_j * (d * q_j) with w_j the weight's expanded value: the product of the
weights with the activations' q8 round trip (`round_trip`). The numpy executor (the oracle) with
`activations="q8"` computes it that way (`Q8Weight`: the expanded weight, whose products take
the round trip of their left operand), the CPU executor's compiled kernels the integer way
(executors/cpu/block_codegen.py); the two differ by the f32 summation order only.
`block_product` is the integer form in numpy, for the kernels' tests.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from helios_backend.kernel_abi import blocks

ACTIVATIONS = ("f32", "q8")          # the representations a block-weight product's activations may take
Q8_BLOCK_BYTES = 40                  # per token and block: f32 d, f32 s, 32 int8 quants
TOKEN_GROUPS = (8, 4, 1)             # tokens of a group: the largest of these that fits in the tokens left


def token_groups(n: int) -> list[tuple[int, int]]:
    """(first token, tokens) of each group of n tokens."""
    groups, t = [], 0
    while t < n:
        size = next(g for g in TOKEN_GROUPS if t + g <= n)
        groups.append((t, size))
        t += size
    return groups


def check(activations: str, field: str = "activations") -> str:
    """`activations` if it names a representation, else ValueError naming `field`."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"{field} must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    return activations


def quantize(x: np.ndarray) -> np.ndarray:
    """int8 [n * k / 32 * Q8_BLOCK_BYTES]: the q8 blocks of f32 x [n, k] (k % 32 == 0), grouped."""
    n, k = x.shape
    values = np.asarray(x, dtype=np.float32).reshape(n, k // blocks.BLOCK_WEIGHTS, blocks.BLOCK_WEIGHTS)
    d = np.abs(values).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    quants = np.rint(values * inverse[:, :, None]).astype(np.int8)
    s = d * quants.sum(axis=2, dtype=np.int32).astype(np.float32)
    parts = []
    for first, size in token_groups(n):           # per block: d [size], s [size], quants [size, 32]
        tokens = slice(first, first + size)
        chunks = quants[tokens].reshape(size, -1, 8, 4).transpose(1, 2, 0, 3)      # [block, chunk, token, 4]
        parts.append(np.concatenate([d[tokens].T.copy().view(np.int8).reshape(-1, 4 * size),
                                     s[tokens].T.copy().view(np.int8).reshape(-1, 4 * size),
                                     chunks.reshape(-1, 32 * size)], axis=1).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int8)


def fields(packed: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d [n, k/32] f32, s [n, k/32] f32, quants [n, k/32, 32] int8) of n tokens' q8 blocks."""
    count = k // blocks.BLOCK_WEIGHTS
    d = np.zeros((n, count), dtype=np.float32)
    s = np.zeros((n, count), dtype=np.float32)
    quants = np.zeros((n, count, blocks.BLOCK_WEIGHTS), dtype=np.int8)
    for first, size in token_groups(n):
        group = np.ascontiguousarray(packed[first * count * Q8_BLOCK_BYTES:(first + size) * count * Q8_BLOCK_BYTES])
        group = group.reshape(count, size * Q8_BLOCK_BYTES)
        d[first:first + size] = np.ascontiguousarray(group[:, :4 * size]).view(np.float32).T
        s[first:first + size] = np.ascontiguousarray(group[:, 4 * size:8 * size]).view(np.float32).T
        quants[first:first + size] = group[:, 8 * size:].reshape(count, 8, size, 4).transpose(2, 0, 1, 3).reshape(
            size, count, 32)
    return d, s, quants


def round_trip(x: np.ndarray) -> np.ndarray:
    """f32 x [n, k] as its q8 blocks represent it: d * q per element."""
    n, k = x.shape
    d, _, quants = fields(quantize(x), n, k)
    return (quants.astype(np.float32) * d[:, :, None]).reshape(n, k)


def block_product(x: np.ndarray, layout: blocks.BlockLayout, data: np.ndarray, m: int, k: int) -> np.ndarray:
    """f32 [n, m]: x [n, k] times the [m, k] block matrix `data` (its transpose) with q8 activations,
    the integer way, in the one order of f32 steps every compiled path follows bit for bit: per
    32-block an exact int32 dot product, term = f32(dot) * (dw * d) (+ mw * s for Q4_1), each a
    rounded f32 step (no fused multiply-add), and the terms summed block after block from zero."""
    n = x.shape[0]
    d, s, quants = fields(quantize(x), n, k)
    grouped = np.asarray(data, dtype=np.uint8)[:blocks.block_nbytes(layout.dtype, (m, k))].reshape(
        m, k // blocks.BLOCK_WEIGHTS, layout.block_bytes)
    dw = np.ascontiguousarray(grouped[:, :, 0:2]).view(np.float16)[:, :, 0].astype(np.float32)
    if layout is blocks.Q8_0:
        qw = grouped[:, :, 2:].view(np.int8).astype(np.int32)
    else:
        nibbles = grouped[:, :, 4:]
        qw = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.int32)
    dots = np.einsum("mbj,nbj->nmb", qw, quants.astype(np.int32))                     # exact
    terms = dots.astype(np.float32) * (dw[None, :, :] * d[:, None, :])
    if layout is blocks.Q4_1:
        mw = np.ascontiguousarray(grouped[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)
        terms += mw[None, :, :] * s[:, None, :]
    total = np.zeros((n, m), dtype=np.float32)
    for b in range(terms.shape[2]):           # block by block: the one summation order of every path
        total += terms[:, :, b]
    return total


class Q8Weight(np.ndarray):
    """A block weight's f32 expansion whose products with activations use their q8 round trip.

    The references multiply as `x @ W.T` (kernel_abi/linear.py and the others); given this
    array for W, numpy's matmul hands the product here, which replaces x by `round_trip(x)`
    (blocks of 32 along its last axis, the product's inner dimension) and multiplies the plain
    arrays. Every other operation (slicing, reshaping, gathering embedding rows) sees the
    expansion itself, so one reference per kernel id serves both representations."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        plain = [np.asarray(i).view(np.ndarray) if isinstance(i, Q8Weight) else i for i in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Q8Weight) else o for o in kwargs["out"])
        if ufunc is np.matmul and method == "__call__" and isinstance(inputs[1], Q8Weight) \
                and not isinstance(inputs[0], Q8Weight):
            x = np.asarray(plain[0], dtype=np.float32)
            shape = x.shape
            plain[0] = round_trip(x.reshape(-1, shape[-1])).reshape(shape)
        return getattr(ufunc, method)(*plain, **kwargs)
