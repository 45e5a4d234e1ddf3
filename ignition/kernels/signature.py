"""Kernel parameter lists (name, Triton type) in ABI order, derived from the ABI table
(helios_backend/kernels/abi.py), which is the single source of truth."""
from __future__ import annotations

from helios_backend.kernels import abi
from helios_proto import contract_pb2

_POINTEE = {contract_pb2.DTYPE_F16: "*fp16", contract_pb2.DTYPE_F32: "*fp32",
            contract_pb2.DTYPE_I32: "*i32", contract_pb2.DTYPE_U32: "*u32"}
_SCALAR = {abi.I32: "i32", abi.I64: "i64", abi.F32: "fp32"}


def triton_type(param: abi.Param) -> str:
    if param.is_pointer:
        return _POINTEE[param.dtype]
    return _SCALAR[param.kind]


# Parameter lists proposed for ids abi.py does not define yet (docs/kernels.md).
PROPOSED: dict[str, tuple[tuple[str, str], ...]] = {
    "attention.paged_split.v1": (
        ("out", "*fp32"), ("q", "*fp32"), ("k_cache", "*fp16"), ("v_cache", "*fp16"),
        ("positions", "*i32"), ("page_table", "*i32"), ("row_slot", "*i32"),
        ("geometry", "*i32"), ("partials", "*fp32"), ("arrivals", "*i32"),
        ("rows", "i32"), ("tokens", "i32"), ("q_heads", "i32"), ("kv_heads", "i32"),
        ("head_dim", "i32"), ("page_tokens", "i32"), ("pages_per_row", "i32"),
        ("page_stride", "i64"), ("scale", "fp32"), ("splits", "i32")),
}


def triton_signature(kernel_id: str) -> tuple[tuple[str, str], ...]:
    if kernel_id not in abi.KERNELS and kernel_id in PROPOSED:
        return PROPOSED[kernel_id]
    return tuple((p.name, triton_type(p)) for p in abi.kernel(kernel_id).params)
