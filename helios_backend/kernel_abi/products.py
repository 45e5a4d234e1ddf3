"""Reference kernels of the product path: plain f16 products and the pointwise nodes around them.

Large steps (prefill chunks, wide decode batches: the recipe's `product_path_tokens`) run a
layer's projections as plain products of f16 activations and f16 weights instead of the fused
norm+GEMM kernels. A plain product is what a vendor library (cuBLASLt) computes at its best, so
the CUDA executor may serve these ids through it (helios_backend/executors/cuda/library.py) or
through the prepared cubins (the portable path); docs/kernels.md says which shapes take which.

Layouts (row-major): activations `x` f16 [tokens, in_dim]; weights f16 [out_dim, in_dim];
products f16 or f32 [tokens, out_dim]. The activations feeding a product carry zeros in rows
past the live count n (every writer below stores them), because a library product runs over the
whole capacity: its rows past n then hold exact zeros, and a residual product adds zero there.
Products write rows past n only as such zeros (a cubin may skip them); nothing reads them.
"""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi.linear import gate_activation, _matrix, rms_norm
from helios_backend.kernel_abi.state import live_tokens


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32, copy=False)


def _store_f16(out: np.ndarray, values: np.ndarray, n: int, tokens: int, width: int) -> None:
    """out [tokens, width] f16: the values in rows :n, zeros in rows n:tokens."""
    matrix = _matrix(out, tokens, width)
    with np.errstate(over="ignore"):
        matrix[:n] = values.astype(np.float16)
    matrix[n:] = 0


def rms_norm_f16(out: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray, geometry: np.ndarray,
                 tokens: int, dim: int, eps: float) -> None:
    """out[:n] = f16(rms_norm(hidden[:n]) * norm_weight), rows n:tokens zero; out f16 [tokens, dim]."""
    n = live_tokens(geometry)
    _store_f16(out, rms_norm(_matrix(hidden, tokens, dim)[:n], norm_weight[:dim], eps), n, tokens, dim)


def to_f16(out: np.ndarray, x: np.ndarray, geometry: np.ndarray, tokens: int, dim: int) -> None:
    """out[:n] = f16(x[:n]), rows n:tokens zero; x f32 [tokens, dim], out f16 [tokens, dim]."""
    n = live_tokens(geometry)
    _store_f16(out, _matrix(x, tokens, dim)[:n], n, tokens, dim)


def gate_activation_f16(out: np.ndarray, projected: np.ndarray, geometry: np.ndarray, tokens: int,
                        ffn_dim: int, activation: int) -> None:
    """out[:n] = f16(act(g) * u) with [g | u] = projected[:n] (f16 [tokens, 2 * ffn_dim], gate
    columns first); rows n:tokens zero; out f16 [tokens, ffn_dim]; act by ACTIVATION_*."""
    n = live_tokens(geometry)
    both = _f32(_matrix(projected, tokens, 2 * ffn_dim)[:n])
    values = gate_activation(both[:, :ffn_dim], activation) * both[:, ffn_dim:]
    _store_f16(out, values, n, tokens, ffn_dim)


def _product(x: np.ndarray, weight: np.ndarray, n: int, tokens: int, in_dim: int, out_dim: int) -> np.ndarray:
    return _f32(_matrix(x, tokens, in_dim)[:n]) @ _f32(_matrix(weight, out_dim, in_dim)).T


def product_f16(out: np.ndarray, x: np.ndarray, weight: np.ndarray, geometry: np.ndarray, tokens: int,
                in_dim: int, out_dim: int) -> None:
    """out[:n] = f16(x[:n] @ weight.T), rows n:tokens zero; out f16 [tokens, out_dim]."""
    n = live_tokens(geometry)
    _store_f16(out, _product(x, weight, n, tokens, in_dim, out_dim), n, tokens, out_dim)


def product_f32(out: np.ndarray, x: np.ndarray, weight: np.ndarray, geometry: np.ndarray, tokens: int,
                in_dim: int, out_dim: int) -> None:
    """out[:n] = x[:n] @ weight.T, rows n:tokens zero; out f32 [tokens, out_dim] (a decode step's
    logits: one token per row)."""
    n = live_tokens(geometry)
    matrix = _matrix(out, tokens, out_dim)
    matrix[:n] = _product(x, weight, n, tokens, in_dim, out_dim)
    matrix[n:] = 0.0


def residual_f16(hidden: np.ndarray, x: np.ndarray, weight: np.ndarray, geometry: np.ndarray, tokens: int,
                 in_dim: int, out_dim: int) -> None:
    """hidden[:n] += x[:n] @ weight.T; hidden f32 [tokens, out_dim], x f16 [tokens, in_dim]."""
    n = live_tokens(geometry)
    _matrix(hidden, tokens, out_dim)[:n] += _product(x, weight, n, tokens, in_dim, out_dim)
