"""Record every field and enum value number of proto/ in tests/fixtures/schema_numbers.json.

tests/test_proto_bindings.py checks that each recorded name keeps its number, and that
a name which disappeared left its number (and name) `reserved` (CON-15, CON-16). Run
this after adding fields or values; it only ever adds entries, so history is kept.

    .venv/bin/python tools/schema_snapshot.py
"""
from __future__ import annotations

import importlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SNAPSHOT = ROOT / "tests" / "fixtures" / "schema_numbers.json"


def schema_modules() -> list:
    names = sorted(p.stem for p in (ROOT / "proto" / "helios_proto").glob("*.proto"))
    return [importlib.import_module(f"helios_proto.{name}_pb2") for name in names]


def current_numbers() -> dict[str, int]:
    """'message Full.Name.field' / 'enum Full.Name.VALUE' -> number, for every schema file."""
    out: dict[str, int] = {}
    for module in schema_modules():
        stack = list(module.DESCRIPTOR.message_types_by_name.values())
        enums = list(module.DESCRIPTOR.enum_types_by_name.values())
        while stack:
            message = stack.pop()
            for field in message.fields:
                out[f"message {message.full_name}.{field.name}"] = field.number
            stack.extend(message.nested_types)
            enums.extend(message.enum_types)
        for enum in enums:
            for value in enum.values:
                out[f"enum {enum.full_name}.{value.name}"] = value.number
    return out


def main() -> int:
    recorded = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    merged = {**current_numbers(), **recorded}  # recorded numbers win: history is never rewritten
    SNAPSHOT.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
    print(f"{SNAPSHOT.relative_to(ROOT)}: {len(merged)} entries ({len(merged) - len(recorded)} new)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
