"""Rebuild the golden cores under tests/fixtures/cores/.

The golden cores are committed once and loaded by tests/test_core_golden.py forever:
every future engine must keep loading them (FMT-8). Rebuild them only when a new
contract version or carrier is added: existing files are kept (history), only missing
ones are written; --force rewrites all (only for formats never released). The output is deterministic: a fixed test
signing key, fixed resource bytes, deterministic Protobuf serialization.

    .venv/bin/python tools/make_golden_cores.py [--out tests/fixtures/cores]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from helios_backend.core import ResourceInput, ResourceKind, write_logical_core, write_payload_core  # noqa: E402
from tests.contract_samples import sample_contract, sample_manifest  # noqa: E402

GOLDEN_NAMESPACE = "golden.helios.test"
# A published test key: golden cores prove format stability, not trust.
GOLDEN_KEY_SEED = hashlib.sha256(b"helios golden core signing key").digest()


def golden_resources() -> list[ResourceInput]:
    weights = b"".join(hashlib.sha256(b"w%d" % i).digest() for i in range(64))  # 2 KiB
    return [
        ResourceInput("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, weights),
        ResourceInput("kernels", ResourceKind.RESOURCE_KIND_KERNEL_MODULE, b"\x7fELF golden kernels " * 8),
        ResourceInput("tokenizer", ResourceKind.RESOURCE_KIND_TOKENIZER, b'{"version": "1.0", "model": {}}'),
        ResourceInput("chat_template", ResourceKind.RESOURCE_KIND_CHAT_TEMPLATE, b"{% for m in messages %}{{ m.content }}{% endfor %}"),
    ]


def _write(path: pathlib.Path, force: bool, writer) -> bool:
    """Write one golden core unless it exists (existing goldens are history)."""
    if path.exists() and not force:
        return False
    writer(path)
    return True


def build(out: pathlib.Path, force: bool = False) -> dict:
    """Write the missing golden cores (all of them with `force`) and the index."""
    out.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.from_private_bytes(GOLDEN_KEY_SEED)
    resources = golden_resources()
    index_path = out / "golden.json"
    previous = json.loads(index_path.read_text())["cores"] if index_path.exists() and not force else {}
    cores = dict(previous)
    for version in (1, 2, 3):
        name = f"payload-contract-v{version}.core"
        if _write(out / name, force or name not in previous, lambda path, version=version: write_payload_core(
            path, contract=sample_contract(version), manifest=sample_manifest(version),
            resources=resources, namespace=GOLDEN_NAMESPACE, signing_key=key,
        )):
            cores[name] = {"format": "payload", "payload_format": 2, "contract_version": version}
    name = "logical-v6-contract-v3.core"
    if _write(out / name, force or name not in previous, lambda path: write_logical_core(
        path, version=6, contract=sample_contract(3), manifest=sample_manifest(3),
        resources=resources, namespace=GOLDEN_NAMESPACE, signing_key=key,
    )):
        cores[name] = {"format": "logical", "payload_format": 6, "contract_version": 3}
    for name, entry in cores.items():
        entry["sha256"] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    index = {
        "namespace": GOLDEN_NAMESPACE,
        "resources": {r.id: hashlib.sha256(r.data).hexdigest() for r in resources},
        "cores": cores,
    }
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "tests" / "fixtures" / "cores")
    parser.add_argument("--force", action="store_true", help="rewrite existing golden cores (only for unreleased formats)")
    args = parser.parse_args()
    for name in build(args.out, args.force)["cores"]:
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
