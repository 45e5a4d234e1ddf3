"""Kernel parameter lists (name, Triton type) in ABI order, derived from the ABI table
(helios_backend/kernel_abi/abi.py), which is the single source of truth."""
from __future__ import annotations

from helios_backend.kernel_abi import abi
from helios_proto import contract_pb2

_POINTEE = {contract_pb2.DTYPE_F16: "*fp16", contract_pb2.DTYPE_F32: "*fp32",
            contract_pb2.DTYPE_I32: "*i32", contract_pb2.DTYPE_U32: "*u32"}
_SCALAR = {abi.I32: "i32", abi.I64: "i64", abi.F32: "fp32"}


def triton_type(param: abi.Param) -> str:
    if param.is_pointer:
        return _POINTEE[param.dtype]
    return _SCALAR[param.kind]


def triton_signature(kernel_id: str) -> tuple[tuple[str, str], ...]:
    return tuple((p.name, triton_type(p)) for p in abi.kernel(kernel_id).params)
