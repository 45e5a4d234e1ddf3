"""Rotary position embedding: the precomputed table and the pairing conventions.

The table is computed once at preparation and stored as a weight buffer, so every
executor (numpy, CUDA) reads the very same cos/sin values instead of recomputing
them in different precisions.

    rope_table: [positions, head_dim // 2, 2] float32, last axis = (cos, sin)

Pairing says which two dimensions of a head rotate together:

    ROPE_ADJACENT_PAIRS  (2i, 2i+1)        llama.cpp "NORM" order; GGUF stores q/k permuted for it
    ROPE_HALF_PAIRS      (i, i + d/2)      NeoX / Hugging Face rotate_half order
"""
from __future__ import annotations

import numpy as np

ROPE_ADJACENT_PAIRS = 0
ROPE_HALF_PAIRS = 1


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i/head_dim) for i < head_dim / 2, float64: the unscaled RoPE frequencies."""
    return float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rope_table(positions: int, head_dim: int, theta: float,
               inverse_frequency: np.ndarray | None = None) -> np.ndarray:
    """cos/sin of position * theta^(-2i/head_dim), computed in float64, stored float32;
    `inverse_frequency` [head_dim / 2] replaces the frequencies (a checkpoint's RoPE scaling)."""
    if inverse_frequency is None:
        inverse_frequency = inverse_frequencies(head_dim, theta)
    angle = np.arange(positions, dtype=np.float64)[:, None] * inverse_frequency[None, :]
    return np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)


def _split_pairs(x: np.ndarray, pairing: int) -> tuple[np.ndarray, np.ndarray]:
    half = x.shape[-1] // 2
    if pairing == ROPE_ADJACENT_PAIRS:
        return x[..., 0::2], x[..., 1::2]
    if pairing == ROPE_HALF_PAIRS:
        return x[..., :half], x[..., half:]
    raise ValueError(f"unknown rope pairing {pairing}")


def apply_rope(x: np.ndarray, cos_sin: np.ndarray, pairing: int) -> np.ndarray:
    """Rotate x [tokens, heads, head_dim] float32 by cos_sin [tokens, head_dim // 2, 2]."""
    assert x.dtype == np.float32 and cos_sin.dtype == np.float32
    first, second = _split_pairs(x, pairing)
    cos = cos_sin[:, None, :, 0]
    sin = cos_sin[:, None, :, 1]
    rotated_first = first * cos - second * sin
    rotated_second = first * sin + second * cos
    out = np.empty_like(x)
    out_first, out_second = _split_pairs(out, pairing)
    out_first[...] = rotated_first
    out_second[...] = rotated_second
    return out
