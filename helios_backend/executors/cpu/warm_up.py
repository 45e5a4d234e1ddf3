"""Compile (or load from numba's disk cache) every compiled primitive before the first step."""
from __future__ import annotations

import numpy as np

from helios_backend.executors.cpu.attention import attention_claimed, attention_pairs, causal_softmax
from helios_backend.executors.cpu.block_codegen import BLOCK_Q4_1, BLOCK_Q8_0
from helios_backend.executors.cpu.block_products import (
    block_gather_rows, block_linear_claimed, block_linear_rows, dequantize_rows, quantize_rows)
from helios_backend.executors.cpu.claiming import wait_done, wait_for_change
from helios_backend.executors.cpu.f16_products import linear_claimed, linear_rows, widen
from helios_backend.executors.cpu.pointwise import (
    gather_rows, narrow, rms_norm, rms_norm_f16, rope_store, silu_gate, silu_gate_f16)
from helios_backend.kernel_abi.activations import Q8_BLOCK_BYTES


def warm_up(activations: str = "f32") -> None:
    """Compile every primitive for the argument types the kernels pass (numba caches the machine
    code on disk, so after the first load this only loads it), so no step pays compilation.
    `activations` q8: the block products of q8 activations too (kernel_abi/activations.py)."""
    f32 = np.zeros(64, dtype=np.float32)
    bits = np.zeros(64, dtype=np.uint16)
    i32 = np.zeros(4, dtype=np.int32)
    i64 = np.zeros(4, dtype=np.int64)
    widen(f32, bits, 4)
    wait_for_change(i64, 1, 1)
    counters = np.zeros(3, dtype=np.int64)
    wait_done(counters, 1)
    linear_claimed(f32, f32, bits, 1, 4, 4, False, 1, counters, np.zeros(1, dtype=np.int64), True)
    linear_rows(f32, f32, bits, 1, 4, 4, False, 0, 4, 0)
    u8 = np.zeros(340, dtype=np.uint8)
    for code in (BLOCK_Q8_0, BLOCK_Q4_1):
        dequantize_rows(f32, u8, code, 0, 2, 32)
        for n in (1, 2):
            block_linear_rows(f32, f32, u8, code, n, 32, 2, False, 0, 2, f32)   # n: 1, 2 (groups of 1)
        block_linear_rows(np.zeros(16, dtype=np.float32), np.zeros(256, dtype=np.float32), u8, code, 8, 32, 2,
                          False, 0, 2, f32)                                              # groups of 8
        block_linear_rows(np.zeros(8, dtype=np.float32), np.zeros(128, dtype=np.float32), u8, code, 4, 32, 2,
                          False, 0, 2, f32)                                              # groups of 4
        block_gather_rows(f32, u8, code, i32, 1, 32)
    block_linear_claimed(np.zeros(16, dtype=np.float32), np.zeros(256, dtype=np.float32), u8, BLOCK_Q4_1, 8, 32, 2,
                         False, 1, np.zeros(3, dtype=np.int64), f32, np.zeros(1, dtype=np.int64), True)
    if activations == "q8":
        quantized = np.zeros(8 * Q8_BLOCK_BYTES, dtype=np.int8)
        quantize_rows(quantized, np.zeros(256, dtype=np.float32), 8, 32)
        for code in (BLOCK_Q8_0, BLOCK_Q4_1):
            for n in (1, 2, 4, 8):        # groups of 1, 4 and 8
                block_linear_rows(np.zeros(2 * n, dtype=np.float32), quantized, u8, code, n, 32, 2, False, 0, 2, f32)
        block_linear_claimed(np.zeros(16, dtype=np.float32), quantized, u8, BLOCK_Q4_1, 8, 32, 2, False, 1,
                             np.zeros(3, dtype=np.int64), f32, np.zeros(1, dtype=np.int64), True)
    rms_norm(f32, f32, i64[:1], bits, 4, 1e-5)
    causal_softmax(f32, 2, 4, 1, i32, 0, 1.0)
    gather_rows(f32, bits, i32, 1, 4)
    silu_gate(f32, f32, 1, 4, 4, 0)
    rms_norm_f16(bits, f32, 0, 1, bits, 4, 1e-5)
    narrow(bits, f32, 0, 4)
    silu_gate_f16(bits, bits, 0, 1, 4)
    for plane in (f32, bits):      # cache planes: f32, or f16 as uint16 bits
        rope_store(f32, plane, plane, f32, f32, i32, i32, i32, i32, 1, 1, 1, 2, 1, 1, 32, 0)
        attention_pairs(f32, f32, plane, plane, i32, i32, i32, i32, i64[:1], 1, 1, 2, 1, 1, 32, 1.0, f32, 0, 1)
        attention_claimed(f32, f32, plane, plane, i32, i32, i32, i32, i64[:1], 1, 1, 2, 1, 1, 32, 1.0, f32, 1, 1,
                          np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.int64), True)
