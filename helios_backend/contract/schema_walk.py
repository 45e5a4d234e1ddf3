"""Generic checks over a parsed message tree, driven by the descriptors.

One walk enforces, for every message present in the tree:
  * no unknown fields (a newer writer's field is an unknown identifier, CON-12);
  * every enum field is nonzero (CON-11) and a known number (CON-12), repeated ones too;
  * fields and enum values introduced after the contract's version are absent (CON-12).
Subtrees listed in `skip` (the rebuild manifest) are not walked: they never select
serving behaviour, so nothing in them may reject a core (SRV-18..20).
"""
from __future__ import annotations

from typing import Iterable, Mapping

from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message
import google.protobuf.unknown_fields as unknown_fields

from .errors import ContractError


def _child_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def walk(
    msg: pb_message.Message,
    path: str,
    *,
    version: int | None = None,
    field_since: Mapping[tuple[str, str], int] | None = None,
    enum_since: Mapping[tuple[str, int], int] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """Raise ContractError at the first violation, naming its field path."""
    skip = frozenset(skip)
    field_since = field_since or {}
    enum_since = enum_since or {}
    _walk(msg, path, version, field_since, enum_since, skip)


def _walk(msg, path, version, field_since, enum_since, skip) -> None:
    unknown = unknown_fields.UnknownFieldSet(msg)
    if len(unknown):
        raise ContractError(_child_path(path, f"<field {unknown[0].field_number}>"), "unknown field")
    descriptor: pb_descriptor.Descriptor = msg.DESCRIPTOR
    present = {field.name for field, _ in msg.ListFields()}
    for field in descriptor.fields:
        field_path = _child_path(path, field.name)
        if field_path in skip:
            continue
        is_repeated = field.is_repeated
        since = field_since.get((descriptor.full_name, field.name))
        if since is not None and version is not None and version < since and field.name in present:
            raise ContractError(field_path, f"unknown in contract version {version} (introduced in version {since})")
        if field.enum_type is not None:
            values = list(getattr(msg, field.name)) if is_repeated else [getattr(msg, field.name)]
            if not is_repeated and field.containing_oneof is not None and field.name not in present:
                continue
            for index, value in enumerate(values):
                item_path = f"{field_path}[{index}]" if is_repeated else field_path
                _check_enum(field.enum_type, value, item_path, version, enum_since)
        elif field.message_type is not None and field.name in present:
            if is_repeated:
                for index, item in enumerate(getattr(msg, field.name)):
                    _walk(item, f"{field_path}[{index}]", version, field_since, enum_since, skip)
            else:
                _walk(getattr(msg, field.name), field_path, version, field_since, enum_since, skip)


def _check_enum(enum_type, value: int, path: str, version, enum_since) -> None:
    if value == 0:
        raise ContractError(path, f"{enum_type.values_by_number[0].name} (zero) cannot select an implementation")
    if value not in enum_type.values_by_number:
        raise ContractError(path, f"unknown {enum_type.name} identifier {value}")
    since = enum_since.get((enum_type.full_name, value))
    if since is not None and version is not None and version < since:
        name = enum_type.values_by_number[value].name
        raise ContractError(path, f"{name} is unknown in contract version {version} (introduced in version {since})")
