"""Convert q/k projection rows between the two RoPE pairings.

GGUF (llama.cpp "NORM" RoPE) rotates adjacent pairs (2i, 2i+1) of each head; HF Llama
("rotate_half", NeoX style) rotates (i, i + head_dim/2). The converter permuted HF weights into
the GGUF order with `reshape(n_head, 2, hd/2, in).swapaxes(1, 2)`; these functions apply that
permutation and its inverse. Shapes: `w` is [n_head * head_dim, in] (PyTorch (out, in) layout).
"""

from __future__ import annotations

import numpy as np


def adjacent_to_half_split(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF q/k rows -> HF rows, so rotate_half applies. Returns a new contiguous array."""
    rows, cols = w.shape
    hd = rows // n_head
    return np.ascontiguousarray(w.reshape(n_head, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def half_split_to_adjacent(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows -> GGUF rows (what llama.cpp's converter does)."""
    rows, cols = w.shape
    hd = rows // n_head
    return np.ascontiguousarray(w.reshape(n_head, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols))
