"""Generate the Python bindings of proto/ into a package directory.

`make proto` writes them to helios_proto/ in the repository root (ignored by git):
the bindings are build output, never edited by hand. tests/test_proto_bindings.py
regenerates them into a temporary directory and fails when the two differ.
The .pyi stubs come from mypy-protobuf's protoc plugin (installed beside grpcio-tools):
unlike protoc's own --pyi_out they type each enum's values (`Enum.ValueType`), which
the type checker needs to tell an enum field from a plain int.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import sysconfig

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "helios_proto"


def proto_files() -> list[pathlib.Path]:
    return sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))


def stub_plugin() -> pathlib.Path:
    """mypy-protobuf's protoc plugin, from the environment of this interpreter (its scripts
    folder: a venv's bin/, or /usr/local/bin for a system pip), else from PATH."""
    for folder in (sysconfig.get_path("scripts"), str(pathlib.Path(sys.executable).parent)):
        plugin = pathlib.Path(folder) / "protoc-gen-mypy"
        if plugin.exists():
            return plugin
    found = shutil.which("protoc-gen-mypy")
    if found is None:
        raise SystemExit("protoc-gen-mypy not found: install mypy-protobuf (see the Makefile's install step)")
    return pathlib.Path(found)


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc over every schema file; return the generated files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}",
            f"--plugin=protoc-gen-mypy={stub_plugin()}", f"--mypy_out=quiet:{out_dir}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package = out_dir / PACKAGE
    (package / "__init__.py").write_text('"""Generated from proto/helios_proto by tools/gen_proto.py; do not edit."""\n')
    return sorted(p for p in package.iterdir() if p.suffix in (".py", ".pyi"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
