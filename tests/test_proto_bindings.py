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
