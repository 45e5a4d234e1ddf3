"""Reference kernels for the dense parts of a step: embedding, norms, projections.

Every function takes its arguments in the order of its ABI entry (abi.py):
pointers arrive as flat 1-D numpy arrays of the declared dtype starting at the
pointer's byte offset; integers and floats arrive as Python scalars. A weight
pointer declared f16 may arrive as an f32 copy (the numpy executor keeps f32
shadows of weight buffers because numpy has no f16 BLAS); results are the same.

Token-parallel kernels read the step geometry (state.py) and touch only the live
tokens: geometry[0] is the live token count n <= tokens.
"""
from __future__ import annotations

import numpy as np

from helios_backend.kernel_abi.state import live_tokens, row_starts


def _matrix(flat: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return flat[: rows * cols].reshape(rows, cols)


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [n, d] f32 * rsqrt(mean(x^2) + eps) * weight [d]; eps is a Python float (NEP 50)."""
    assert x.dtype == np.float32
    inverse_rms = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(eps))
    return (x * inverse_rms) * _f32(weight)


def embed_tokens(hidden: np.ndarray, table: np.ndarray, ids: np.ndarray, geometry: np.ndarray,
                 tokens: int, dim: int) -> None:
    """hidden[t] = table[ids[t]] for live tokens; hidden [tokens, dim] f32, table [vocab, dim]."""
    n = live_tokens(geometry)
    out = _matrix(hidden, tokens, dim)
    table_rows = table[: (table.size // dim) * dim].reshape(-1, dim)
    out[:n] = table_rows[ids[:n]]


def linear_residual(hidden: np.ndarray, x: np.ndarray, weight: np.ndarray, geometry: np.ndarray,
                    tokens: int, in_dim: int, out_dim: int) -> None:
    """hidden[:n] += x[:n] @ weight.T; hidden [tokens, out_dim], x [tokens, in_dim], weight [out_dim, in_dim]."""
    n = live_tokens(geometry)
    h = _matrix(hidden, tokens, out_dim)
    h[:n] += _matrix(x, tokens, in_dim)[:n] @ _matrix(weight, out_dim, in_dim).T


def linear_project(out: np.ndarray, x: np.ndarray, weight: np.ndarray, geometry: np.ndarray,
                   tokens: int, in_dim: int, out_dim: int) -> None:
    """out[:n] = x[:n] @ weight.T and out[n:tokens] = 0; out [tokens, out_dim], x [tokens, in_dim].

    A rank's partial product before an all-reduce sums it across ranks: rows past the live
    count are zeroed (not left stale) so the all-reduce of the whole capacity adds nothing there.
    """
    n = live_tokens(geometry)
    o = _matrix(out, tokens, out_dim)
    o[:n] = _matrix(x, tokens, in_dim)[:n] @ _matrix(weight, out_dim, in_dim).T
    o[n:] = 0.0


def norm_gate_up_silu(out: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray,
                      gate_up: np.ndarray, geometry: np.ndarray, tokens: int, dim: int,
                      ffn_dim: int, eps: float) -> None:
    """out[:n] = silu(g) * u with [g | u] = rms_norm(hidden) @ gate_up.T; gate_up [2*ffn, dim], gate rows first."""
    n = live_tokens(geometry)
    normed = rms_norm(_matrix(hidden, tokens, dim)[:n], norm_weight[:dim], eps)
    projected = normed @ _matrix(gate_up, 2 * ffn_dim, dim).T
    gate = projected[:, :ffn_dim]
    up = projected[:, ffn_dim:]
    with np.errstate(over="ignore"):
        # silu(g) = g / (1 + exp(-g)); exp overflows to inf for very negative g, giving -0.
        _matrix(out, tokens, ffn_dim)[:n] = gate / (np.float32(1.0) + np.exp(-gate)) * up


# the gate activation of mlp.norm_gate_up_activation.v1 (its `activation` immediate)
ACTIVATION_SILU = 0
ACTIVATION_GELU_TANH = 1           # GELU, tanh approximation (GeGLU feed-forward blocks)


def gate_activation(gate: np.ndarray, activation: int) -> np.ndarray:
    if activation == ACTIVATION_SILU:
        with np.errstate(over="ignore"):
            return gate / (np.float32(1.0) + np.exp(-gate))
    if activation == ACTIVATION_GELU_TANH:
        inner = np.float32(np.sqrt(2.0 / np.pi)) * (gate + np.float32(0.044715) * gate * gate * gate)
        return np.float32(0.5) * gate * (np.float32(1.0) + np.tanh(inner))
    raise ValueError(f"unknown gate activation {activation}")


def norm_gate_up_activation(out: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray,
                            gate_up: np.ndarray, geometry: np.ndarray, tokens: int, dim: int,
                            ffn_dim: int, eps: float, activation: int) -> None:
    """norm_gate_up_silu with the gate activation chosen by `activation` (ACTIVATION_*)."""
    n = live_tokens(geometry)
    normed = rms_norm(_matrix(hidden, tokens, dim)[:n], norm_weight[:dim], eps)
    projected = normed @ _matrix(gate_up, 2 * ffn_dim, dim).T
    _matrix(out, tokens, ffn_dim)[:n] = gate_activation(projected[:, :ffn_dim], activation) * projected[:, ffn_dim:]


def linear_norm_residual(hidden: np.ndarray, x: np.ndarray, weight: np.ndarray, norm_weight: np.ndarray,
                         geometry: np.ndarray, tokens: int, in_dim: int, out_dim: int, eps: float) -> None:
    """hidden[:n] += rms_norm(x[:n] @ weight.T) * norm_weight: a projection normed before the
    residual add (the "post" norm of a sandwich-norm block)."""
    n = live_tokens(geometry)
    h = _matrix(hidden, tokens, out_dim)
    projected = _matrix(x, tokens, in_dim)[:n] @ _matrix(weight, out_dim, in_dim).T
    h[:n] += rms_norm(projected.astype(np.float32, copy=False), norm_weight[:out_dim], eps)


def norm_residual(hidden: np.ndarray, accumulator: np.ndarray, norm_weight: np.ndarray, geometry: np.ndarray,
                  tokens: int, dim: int, eps: float) -> None:
    """hidden[:n] += rms_norm(accumulator[:n]) * norm_weight, then accumulator[:n] = 0.

    The second half of a post-normed projection: linear.residual.v1 adds x @ W^T into the
    zero `accumulator` (f32 [tokens, dim]), this norms it into the residual and leaves it zero
    for the next product. Rows past the live count are never written, so they stay zero too."""
    n = live_tokens(geometry)
    acc = _matrix(accumulator, tokens, dim)
    _matrix(hidden, tokens, dim)[:n] += rms_norm(acc[:n], norm_weight[:dim], eps)
    acc[:n] = 0.0


def norm_logits(logits: np.ndarray, hidden: np.ndarray, norm_weight: np.ndarray, head: np.ndarray,
                geometry: np.ndarray, rows: int, tokens: int, dim: int, vocab: int, eps: float) -> None:
    """logits[r] = rms_norm(hidden[last token of row r]) @ head.T; rows without tokens read 0.

    logits [rows, vocab] f32, head [vocab, dim] (tied to the embedding table for SmolLM2).
    """
    starts = row_starts(geometry, rows, tokens)
    out = _matrix(logits, rows, vocab)
    lengths = starts[1:] - starts[:-1]
    live = np.nonzero(lengths > 0)[0]
    out[lengths == 0] = 0.0
    if live.size == 0:
        return
    last = starts[live + 1] - 1
    normed = rms_norm(_matrix(hidden, tokens, dim)[last], norm_weight[:dim], eps)
    out[live] = normed @ _matrix(head, vocab, dim).T
