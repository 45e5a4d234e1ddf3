"""Round trips of both carriers: what is written is read back, verified and authorized."""
from __future__ import annotations

import math
import os

import pytest

from helios_backend.core import (
    ResourceInput,
    ResourceKind,
    ResourceNotFoundError,
    open_core,
    write_logical_core,
)
from helios_backend.core.constants import CHUNK_NBYTES, MiB
from helios_proto import core_pb2
from tests.contract_samples import sample_contract, sample_manifest
from tests.core_helpers import NAMESPACE, SIGNING_KEY, read_layout, random_bytes, sample_resources, write_sample_core


def test_payload_round_trip(tmp_path):
    # spec: FMT-1, FMT-3, FMT-4, FMT-5, FMT-6
    resources = sample_resources()
    path = write_sample_core(tmp_path / "a.core", resources)
    with open_core(path) as core:
        assert core.format == "payload"
        assert core.payload_format == 2
        assert core.namespace == NAMESPACE
        assert core.contract == sample_contract(3)
        assert core.manifest == sample_manifest(3)
        assert (core.versions.execution_abi, core.versions.contract_version, core.versions.payload_format) == (
            "helios-abi6", 3, 2)
        assert [r.id for r in core.resources] == [r.id for r in resources]
        core.verify()
        core.authorize(NAMESPACE)
        for resource in resources:
            assert core.read_resource(resource.id) == resource.data
            assert core.resource(resource.id).decoded_nbytes == len(resource.data)
        assert core.prepared_contract().served_id == "sample-model"


def test_payload_layout_has_signed_envelope_and_unsigned_locations(tmp_path):
    # spec: FMT-3, FMT-4, FMT-12
    path = write_sample_core(tmp_path / "a.core")
    magic, core_body, data = read_layout(path)
    assert magic == b"HELIOS-CORE\x00"
    assert core_body.format_version == 2
    body = core_pb2.DeploymentBody.FromString(core_body.payload.body)
    assert body.contract == sample_contract(3)  # FMT-1: the contract rides in DeploymentBody.contract
    assert len(core_body.payload.signature) == 64 and len(core_body.payload.public_key) == 32
    assert {loc.resource for loc in core_body.locations.locations} == {r.id for r in body.resources}
    assert sum(loc.nbytes for loc in core_body.locations.locations) == len(data)


def test_each_resource_is_one_level3_frame_with_decoded_length(tmp_path):
    # spec: FMT-5, FMT-9
    import zstandard

    path = write_sample_core(tmp_path / "a.core")
    _, core_body, data = read_layout(path)
    body = core_pb2.DeploymentBody.FromString(core_body.payload.body)
    for resource, location in zip(body.resources, core_body.locations.locations):
        frame = data[location.offset : location.offset + location.nbytes]
        assert zstandard.get_frame_parameters(frame).content_size == resource.decoded_nbytes
        # exactly one frame: decompressing as a single frame consumes every byte
        dobj = zstandard.ZstdDecompressor().decompressobj()
        assert len(dobj.decompress(frame)) == resource.decoded_nbytes
        assert dobj.eof and dobj.unused_data == b""


def test_chunk_commitments_over_stored_bytes_of_a_9_mib_resource(tmp_path):
    # spec: FMT-13, FMT-14, FMT-15
    import hashlib

    weights = random_bytes(9 * MiB)  # incompressible: stored > 8 MiB -> 3 chunks
    path = write_sample_core(tmp_path / "big.core", sample_resources(weights))
    _, core_body, data = read_layout(path)
    body = core_pb2.DeploymentBody.FromString(core_body.payload.body)
    entry = next(r for r in body.resources if r.id == "weights")
    location = next(l for l in core_body.locations.locations if l.resource == "weights")
    stored = data[location.offset : location.offset + location.nbytes]
    assert entry.chunk_nbytes == CHUNK_NBYTES == 4194304
    assert len(entry.chunk_sha256) == math.ceil(entry.stored_nbytes / CHUNK_NBYTES) == 3
    assert list(entry.chunk_sha256) == [
        hashlib.sha256(stored[i : i + CHUNK_NBYTES]).digest() for i in range(0, len(stored), CHUNK_NBYTES)
    ]
    with open_core(path) as core:
        core.verify()
        pieces = list(core.iter_resource("weights"))
        assert b"".join(pieces) == weights
        assert max(len(p) for p in pieces) <= MiB  # streamed, not whole


def test_path_resources_stream_and_progress_reports(tmp_path):
    # spec: FMT-5
    source = tmp_path / "weights.bin"
    source.write_bytes(random_bytes(3 * MiB + 5, seed=3))
    resources = [ResourceInput("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, source)] + sample_resources()[1:]
    seen = []
    from helios_backend.core import write_payload_core

    write_payload_core(
        tmp_path / "p.core", contract=sample_contract(), manifest=sample_manifest(), resources=resources,
        namespace=NAMESPACE, signing_key=SIGNING_KEY, progress=lambda done, total: seen.append((done, total)),
    )
    total = sum(r.decoded_nbytes() for r in resources)
    assert seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    with open_core(tmp_path / "p.core") as core:
        assert core.read_resource("weights") == source.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["p.core", "weights.bin"]  # no spool left behind


def test_empty_resource_round_trips(tmp_path):
    # spec: FMT-9
    resources = sample_resources() + [ResourceInput("empty", ResourceKind.RESOURCE_KIND_AUXILIARY, b"")]
    with open_core(write_sample_core(tmp_path / "e.core", resources)) as core:
        core.verify()
        assert core.read_resource("empty") == b""


@pytest.mark.parametrize("version", [4, 6])
def test_logical_round_trip(tmp_path, version):
    # spec: FMT-2, FMT-10, FMT-11
    key = bytes(range(100, 132)) if version == 4 else None
    resources = sample_resources(random_bytes(5 * MiB, seed=version))
    path = tmp_path / f"v{version}.core"
    write_logical_core(
        path, version=version, contract=sample_contract(), manifest=sample_manifest(), resources=resources,
        namespace=NAMESPACE, signing_key=SIGNING_KEY, content_key=key,
    )
    assert path.read_bytes()[:12] == b"HELIOS-INDX\x00"
    with open_core(path, content_key=key) as core:
        assert (core.format, core.payload_format) == ("logical", version)
        assert core.contract == sample_contract()  # FMT-2: ModelIndex.contract
        core.verify()
        core.authorize(NAMESPACE)
        for resource in resources:
            assert core.read_resource(resource.id) == resource.data


def test_unknown_resource_is_a_typed_error(tmp_path):
    with open_core(write_sample_core(tmp_path / "a.core")) as core:
        with pytest.raises(ResourceNotFoundError):
            core.read_resource("nope")


def test_closed_core_refuses_reads(tmp_path):
    core = open_core(write_sample_core(tmp_path / "a.core"))
    core.close()
    with pytest.raises(ValueError):
        core.read_resource("weights")


def test_writer_output_is_deterministic(tmp_path):
    # the golden cores rely on it: same inputs, same key -> same bytes
    first = write_sample_core(tmp_path / "one.core").read_bytes()
    second = write_sample_core(tmp_path / "two.core").read_bytes()
    assert first == second


def test_a_source_file_that_changes_size_is_a_typed_error(tmp_path):
    # a Path resource is streamed: its size is read first, then its bytes
    from helios_backend.core import CoreError, write_payload_core

    class Growing(ResourceInput):
        def decoded_nbytes(self) -> int:
            return super().decoded_nbytes() - 10  # as if the file grew after stat()

    source = tmp_path / "w.bin"
    source.write_bytes(random_bytes(100_000))
    resources = [Growing("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, source)] + sample_resources()[1:]
    with pytest.raises(CoreError, match="changed size"):
        write_payload_core(tmp_path / "x.core", contract=sample_contract(), manifest=sample_manifest(),
                           resources=resources, namespace=NAMESPACE, signing_key=SIGNING_KEY)
    assert not (tmp_path / "x.core").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]  # no spool left behind
