"""Per-token kernels of the CPU executor, compiled: RMS norm, embedding gather, SiLU gate, RoPE and
the store of keys and values into the cache pages, and the product path's f16 forms of the norm and
the gate and its f16 <-> f32 conversions. Serial and without the GIL, writing into arrays they are
given; f16 weights, cache planes and activations as their uint16 bits (elements.py). Each token's
values depend on that token alone (the same loop per token, whatever the range a call covers), so
kernels.py may split a call's tokens over threads.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from helios_backend.executors.cpu.elements import exp_nonpositive, f16_bits_to_f32, f32_to_f16_bits, plane_value


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _inverse_rms(src: np.ndarray, k: int, eps: float) -> np.float32:
    total = np.float32(0.0)
    for i in range(k):
        total += src[i] * src[i]
    return np.float32(1.0) / np.sqrt(total / np.float32(k) + np.float32(eps))


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm(out: np.ndarray, x: np.ndarray, rows: np.ndarray, weight: np.ndarray, k: int, eps: float) -> None:
    """out[j] = x[rows[j]] * rsqrt(mean(x^2) + eps) * weight, weight f16 bits [k]; out [len(rows), k]."""
    for j in range(rows.size):
        src = x[rows[j] * k:(rows[j] + 1) * k]
        inverse = _inverse_rms(src, k, eps)
        for i in range(k):
            out[j * k + i] = (src[i] * inverse) * f16_bits_to_f32(weight[i])


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm_f16(out: np.ndarray, x: np.ndarray, first: int, end: int, weight: np.ndarray, k: int,
                 eps: float) -> None:
    """out[t] = f16(x[t] * rsqrt(mean(x^2) + eps) * weight) for first <= t < end; x f32 [.., k], weight
    and out f16 bits (kernel_abi/products.py rms_norm_f16)."""
    for t in range(first, end):
        src = x[t * k:(t + 1) * k]
        inverse = _inverse_rms(src, k, eps)
        for i in range(k):
            out[t * k + i] = f32_to_f16_bits((src[i] * inverse) * f16_bits_to_f32(weight[i]))


@njit(cache=True, fastmath=True, nogil=True)
def narrow(out: np.ndarray, x: np.ndarray, first: int, end: int) -> None:
    """out[first:end] = f16(x[first:end]) (round to nearest even; past the f16 range inf, as numpy's
    cast); out f16 bits."""
    for i in range(first, end):
        out[i] = f32_to_f16_bits(x[i])


@njit(cache=True, fastmath=True, nogil=True)
def gather_rows(out: np.ndarray, table: np.ndarray, ids: np.ndarray, n: int, k: int) -> None:
    """out[t] = f32(table[ids[t]]) for t < n; table f16 bits [vocab, k]."""
    for t in range(n):
        row = table[ids[t] * k:(ids[t] + 1) * k]
        target = out[t * k:(t + 1) * k]
        for i in range(k):
            target[i] = f16_bits_to_f32(row[i])


@njit(inline="always", cache=True, fastmath=False, nogil=True, error_model="numpy")
def _silu(g: np.float32) -> np.float32:
    """g / (1 + e^-g), e^-g from the exp that vectorizes (elements.exp_nonpositive: numba's np.exp
    is one scalar expf call an element, ~2-4 ms of a batch-8 decode step and 130 ms of a 512-token
    prefill's gate on SmolLM2): e^-|g|, inverted where g < 0. Where e^-g exceeds the f32 range
    (g < -87) it is ~1e38 here, inf in the reference: both give g / (1 + e^-g) = -0 after
    rounding to f16, and below 1e-36 in f32. Compiled as its callers, with numpy's error model (with
    numba's default a division checks its divisor for zero, to raise, which kept the loop scalar: 5
    ms against 0.8 for a 512-token gate of SmolLM2, one thread; 1 + e^-g is never zero) and without
    fast-math, so the loop's vector body and its scalar tail round alike: a token's gate is then the
    same bits in a tile of gate columns (a prefill's gate/up product) as in a whole row (decode),
    where with fast-math LLVM divided by a reciprocal estimate in the vector body only."""
    small = exp_nonpositive(-abs(g))
    e = small if g >= np.float32(0.0) else np.float32(1.0) / small
    return g / (np.float32(1.0) + e)


@njit(cache=True, fastmath=False, nogil=True, error_model="numpy")
def silu_gate(out: np.ndarray, projected: np.ndarray, n: int, ffn: int, out_width: int, out_at: int) -> None:
    """out[t, out_at:out_at + ffn] = silu(gate) * up with projected[t] = [gate | up] ([n, 2 * ffn]),
    out [n, out_width] (out_width > ffn: one tile of gate columns, kernels._gate_up_tiles)."""
    for t in range(n):
        base = t * 2 * ffn
        target = out[t * out_width + out_at:t * out_width + out_at + ffn]
        for i in range(ffn):
            target[i] = _silu(projected[base + i]) * projected[base + ffn + i]


@njit(cache=True, fastmath=False, nogil=True, error_model="numpy")
def silu_gate_f16(out: np.ndarray, projected: np.ndarray, first: int, end: int, ffn: int) -> None:
    """out[t] = f16(silu(gate) * up) with projected[t] = [gate | up] for first <= t < end; projected
    f16 bits [.., 2 * ffn], out f16 bits [.., ffn] (kernel_abi/products.py gate_activation_f16, SiLU)."""
    for t in range(first, end):
        gate = projected[t * 2 * ffn:t * 2 * ffn + ffn]
        up = projected[t * 2 * ffn + ffn:(t + 1) * 2 * ffn]
        target = out[t * ffn:(t + 1) * ffn]
        for i in range(ffn):
            target[i] = f32_to_f16_bits(_silu(f16_bits_to_f32(gate[i])) * f16_bits_to_f32(up[i]))


@njit(inline="always", cache=True, fastmath=True, nogil=True)
def _rotate(target: np.ndarray, source: np.ndarray, table: np.ndarray, half: int, pairing: int) -> None:
    """One head's RoPE: source (f32) rotated into target (f32, or an f16 plane's uint16 bits)."""
    for i in range(half):
        cos = table[2 * i]
        sin = table[2 * i + 1]
        if pairing == 0:
            a, b = 2 * i, 2 * i + 1
        else:
            a, b = i, i + half
        first = source[a]
        second = source[b]
        target[a] = plane_value(target, first * cos - second * sin)
        target[b] = plane_value(target, first * sin + second * cos)


@njit(cache=True, fastmath=True, nogil=True)
def rope_store(q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, projected: np.ndarray,
               rope_table: np.ndarray, positions: np.ndarray, token_row: np.ndarray, row_slot: np.ndarray,
               page_table: np.ndarray,
               n: int, q_heads: int, kv_heads: int, head_dim: int, page_tokens: int, pages_per_row: int,
               page_stride: int, pairing: int) -> None:
    """RoPE on q and k of projected [n, (q_heads + 2 kv_heads) * head_dim]; q -> q_out, k, v -> cache pages
    (f32 planes, or f16 planes as uint16 bits: q_out is f32 either way, so the query is not rounded).

    pairing 0 rotates (2i, 2i+1), 1 rotates (i, i + head_dim/2) (kernel_abi/rope.py); the cache
    element of (page p, token slot s, kv head h, dim d) is p*page_stride + (s*kv_heads + h)*head_dim + d.
    """
    half = head_dim // 2
    q_width = q_heads * head_dim
    kv_width = kv_heads * head_dim
    width = q_width + 2 * kv_width
    for t in range(n):
        position = positions[t]
        table = rope_table[position * head_dim:(position + 1) * head_dim]   # [half, (cos, sin)]
        row = projected[t * width:(t + 1) * width]
        page = page_table[row_slot[token_row[t]] * pages_per_row + position // page_tokens]
        cache_base = page * page_stride + (position % page_tokens) * kv_width
        for head in range(q_heads):
            _rotate(q_out[t * q_width + head * head_dim:t * q_width + (head + 1) * head_dim],
                    row[head * head_dim:(head + 1) * head_dim], table, half, pairing)
        for head in range(kv_heads):
            start = cache_base + head * head_dim
            _rotate(k_cache[start:start + head_dim], row[q_width + head * head_dim:q_width + (head + 1) * head_dim],
                    table, half, pairing)
        values = row[q_width + kv_width:]
        v_target = v_cache[cache_base:cache_base + kv_width]
        for i in range(kv_width):
            v_target[i] = plane_value(v_target, values[i])
