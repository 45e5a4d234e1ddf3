"""Kernel parameter lists (name, Triton type) in ABI order.

PROVISIONAL until helios_backend/kernels/abi.py lands; then derived from it.
"""
from __future__ import annotations

_PROVISIONAL: dict[str, tuple[tuple[str, str], ...]] = {
    "rmsnorm_matmul": (("x", "*fp32"), ("norm_weight", "*fp16"), ("weight", "*fp16"),
                       ("out", "*fp16"), ("M", "i32"), ("N", "i32"), ("K", "i32"),
                       ("eps", "fp32")),
    "matmul_residual": (("x", "*fp16"), ("weight", "*fp16"), ("residual", "*fp32"),
                        ("M", "i32"), ("N", "i32"), ("K", "i32")),
    "rmsnorm_matmul_swiglu": (("x", "*fp32"), ("norm_weight", "*fp16"), ("weight", "*fp16"),
                              ("out", "*fp16"), ("M", "i32"), ("F", "i32"), ("K", "i32"),
                              ("eps", "fp32")),
    "rmsnorm_logits": (("x", "*fp32"), ("row_token", "*i32"), ("norm_weight", "*fp16"),
                       ("weight", "*fp16"), ("logits", "*fp32"), ("B", "i32"), ("V", "i32"),
                       ("K", "i32"), ("eps", "fp32")),
}


def triton_signature(kernel_id: str) -> tuple[tuple[str, str], ...]:
    return _PROVISIONAL[kernel_id]
