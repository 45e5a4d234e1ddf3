"""The generated bindings in helios_proto/ match proto/, and the schema keeps its wire rules."""
from __future__ import annotations

import importlib
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ROOT / "helios_proto"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bindings_are_not_stale(tmp_path):
    gen_proto = _gen_proto()
    fresh = {p.name: p.read_bytes() for p in gen_proto.generate(tmp_path)}
    current = {p.name: p.read_bytes() for p in GENERATED.iterdir() if p.suffix in (".py", ".pyi")}
    stale = sorted(name for name in fresh if current.get(name) != fresh[name])
    extra = sorted(set(current) - set(fresh))
    assert not stale and not extra, (
        f"helios_proto/ is stale (differs: {stale}, not generated: {extra}); run `make proto`"
    )


def _schema_modules():
    names = sorted(p.stem for p in (ROOT / "proto" / "helios_proto").glob("*.proto"))
    return [importlib.import_module(f"helios_proto.{name}_pb2") for name in names]


def _all_enums(module):
    file_descriptor = module.DESCRIPTOR
    enums = list(file_descriptor.enum_types_by_name.values())
    stack = list(file_descriptor.message_types_by_name.values())
    while stack:
        message = stack.pop()
        enums.extend(message.enum_types)
        stack.extend(message.nested_types)
    return enums


@pytest.mark.parametrize("module", _schema_modules(), ids=lambda m: m.__name__)
def test_every_enum_has_an_unspecified_zero(module):
    # spec: CON-10
    for enum in _all_enums(module):
        zero = enum.values_by_number.get(0)
        assert zero is not None and zero.name.endswith("_UNSPECIFIED"), f"{enum.full_name} lacks a zero UNSPECIFIED"


SNAPSHOT = ROOT / "tests" / "fixtures" / "schema_numbers.json"


def _reserved() -> dict[str, tuple[list[tuple[int, int]], set[str]]]:
    """full name -> (inclusive reserved number ranges, reserved names), messages and enums."""
    from google.protobuf import descriptor_pb2

    out: dict[str, tuple[list[tuple[int, int]], set[str]]] = {}
    for module in _schema_modules():
        proto = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        stack = [(f"{proto.package}.{m.name}", m) for m in proto.message_type]
        for enum in proto.enum_type:
            out[f"{proto.package}.{enum.name}"] = ([(r.start, r.end) for r in enum.reserved_range], set(enum.reserved_name))
        while stack:
            name, message = stack.pop()
            # message reserved ranges are end-exclusive, enum ones inclusive
            out[name] = ([(r.start, r.end - 1) for r in message.reserved_range], set(message.reserved_name))
            stack.extend((f"{name}.{nested.name}", nested) for nested in message.nested_type)
            for enum in message.enum_type:
                out[f"{name}.{enum.name}"] = ([(r.start, r.end) for r in enum.reserved_range], set(enum.reserved_name))
    return out


def test_numbers_are_stable_and_removed_ones_reserved():
    # spec: CON-15, CON-16
    import json
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from schema_snapshot import current_numbers

    recorded = json.loads(SNAPSHOT.read_text())
    current = current_numbers()
    reserved = _reserved()
    problems = []
    for key, number in recorded.items():
        if key in current:
            if current[key] != number:
                problems.append(f"{key}: number changed {number} -> {current[key]}")
            continue
        owner, _, name = key.split(" ", 1)[1].rpartition(".")
        ranges, names = reserved.get(owner, ([], set()))
        if not any(low <= number <= high for low, high in ranges) or name not in names:
            problems.append(f"{key} ({number}) was removed without `reserved {number};` and `reserved \"{name}\";`")
    assert not problems, "\n".join(problems)
