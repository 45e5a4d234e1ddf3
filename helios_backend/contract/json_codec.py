"""contract_from_json: the JSON form of a ServingContract, strictly.

Protobuf's JSON parser reports an unknown field without a usable path, so the
document is first walked against the descriptors here: every unknown key, duplicate
key, unknown enum name or wrong JSON type raises ContractError naming the field
("model.graphs[0].bindngs"). The rebuild manifest is the exception: it never selects
serving behaviour, so unknown keys inside it are dropped, not rejected (SRV-20).
"""
from __future__ import annotations

import json
from typing import Any

from google.protobuf import descriptor as pb_descriptor
from google.protobuf import json_format

from helios_proto import contract_pb2

from .errors import ContractError

LENIENT_SUBTREES = frozenset({"rebuild"})


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ContractError(key, "duplicate JSON key")
        out[key] = value
    return out


def _path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _check_message(node: Any, descriptor: pb_descriptor.Descriptor, path: str, lenient: bool) -> Any:
    if not isinstance(node, dict):
        raise ContractError(path or "<root>", f"expected a JSON object for {descriptor.name}")
    by_key = {}
    for field in descriptor.fields:
        by_key[field.name] = field
        by_key[field.json_name] = field
    out = {}
    for key, value in node.items():
        known = by_key.get(key)
        key_path = _path(path, key)
        if known is None:
            if lenient:
                continue
            raise ContractError(key_path, f"unknown field of {descriptor.name}")
        child_lenient = lenient or (not path and known.name in LENIENT_SUBTREES)
        out[key] = _check_value(value, known, key_path, child_lenient)
    return out


def _check_value(value: Any, field: pb_descriptor.FieldDescriptor, path: str, lenient: bool) -> Any:
    if value is None:
        return value
    if field.is_repeated:
        if not isinstance(value, list):
            raise ContractError(path, "expected a JSON array")
        return [_check_single(item, field, f"{path}[{index}]", lenient) for index, item in enumerate(value)]
    return _check_single(value, field, path, lenient)


def _check_single(value: Any, field: pb_descriptor.FieldDescriptor, path: str, lenient: bool) -> Any:
    if field.message_type is not None:
        return _check_message(value, field.message_type, path, lenient)
    if field.enum_type is not None:
        if isinstance(value, str):
            if value not in field.enum_type.values_by_name:
                raise ContractError(path, f"unknown {field.enum_type.name} identifier {value!r}")
        elif isinstance(value, int) and not isinstance(value, bool):
            if value not in field.enum_type.values_by_number:
                raise ContractError(path, f"unknown {field.enum_type.name} identifier {value}")
        else:
            raise ContractError(path, f"expected a {field.enum_type.name} name")
    return value


def contract_from_json(text: str | bytes) -> contract_pb2.ServingContract:
    """Parse a ServingContract from its JSON form (proto3 JSON mapping).

    Raises ContractError naming the field for unknown fields (outside the rebuild
    manifest), duplicate keys, unknown enum identifiers and values of the wrong type.
    The result is parsed, not validated: pass it to PreparedContract.decode.
    """
    try:
        document = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ContractError("<json>", f"not valid JSON: {exc}") from exc
    cleaned = _check_message(document, contract_pb2.ServingContract.DESCRIPTOR, "", False)
    contract = contract_pb2.ServingContract()
    try:
        json_format.ParseDict(cleaned, contract, ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        raise ContractError("<json>", str(exc)) from exc
    return contract


def contract_to_json(contract: contract_pb2.ServingContract) -> str:
    """The JSON form contract_from_json reads (field names as in the .proto)."""
    return json_format.MessageToJson(contract, preserving_proto_field_name=True, sort_keys=True)
