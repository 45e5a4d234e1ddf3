"""Golden cores committed under tests/fixtures/cores/: every future engine keeps loading them.

Never regenerate an existing golden core to make this test pass: a failure here means
a change broke previously exported cores (FMT-8). tools/make_golden_cores.py made them.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from helios_backend.core import open_core
from helios_proto import contract_pb2 as c

GOLDEN = pathlib.Path(__file__).resolve().parent / "fixtures" / "cores"
INDEX = json.loads((GOLDEN / "golden.json").read_text())


def test_every_contract_version_has_a_golden_core():
    # spec: CON-1, FMT-8
    versions = {entry["contract_version"] for entry in INDEX["cores"].values()}
    assert versions == {1, 2, 3}
    assert {entry["payload_format"] for entry in INDEX["cores"].values()} >= {2, 6}


@pytest.mark.parametrize("name", sorted(INDEX["cores"]))
def test_golden_core_loads_verifies_and_decodes(name):
    # spec: FMT-8, CON-1, FMT-3, FMT-10
    entry = INDEX["cores"][name]
    path = GOLDEN / name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], "golden core bytes changed"
    with open_core(path) as core:
        assert (core.format, core.payload_format) == (entry["format"], entry["payload_format"])
        assert core.versions.contract_version == entry["contract_version"]
        core.verify()
        core.authorize(INDEX["namespace"])
        for resource_id, digest in INDEX["resources"].items():
            assert hashlib.sha256(core.read_resource(resource_id)).hexdigest() == digest
        prepared = core.prepared_contract()
    assert prepared.versions.contract == entry["contract_version"]
    assert prepared.select(c.OPERATION_DECODE, rows=1) is not None
    has_speculative = c.OPERATION_SPECULATIVE in prepared.graphs_by_operation
    assert has_speculative == (entry["contract_version"] >= 3)
    assert (prepared.vision is not None) == (entry["contract_version"] >= 2)
