"""Property test: randomly mutated contracts and manifests decode or raise ContractError,
never another exception."""
from __future__ import annotations

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_backend.contract import ContractError, PreparedContract
from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2 as m
from tests.contract_samples import SAMPLE_RESOURCE_IDS, sample_contract, sample_manifest

ORIGINAL = {
    version: (sample_contract(version).SerializeToString(), sample_manifest(version).SerializeToString())
    for version in (1, 2, 3)
}


def _mutate(data: bytes, anchors: list[float], xors: list[int]) -> bytes:
    out = bytearray(data)
    for anchor, xor in zip(anchors, xors):
        out[int(anchor * len(out))] ^= xor
    return bytes(out)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from([1, 2, 3]),
    target=st.sampled_from(["contract", "manifest"]),
    anchors=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=3),
    xors=st.lists(st.integers(1, 255), min_size=3, max_size=3),
)
def test_mutated_contracts_raise_only_contract_errors(version, target, anchors, xors):
    # spec: CON-11, CON-12, CON-13 (never a crash on a malformed contract)
    contract_bytes, manifest_bytes = ORIGINAL[version]
    if target == "contract":
        contract_bytes = _mutate(contract_bytes, anchors, xors)
    else:
        manifest_bytes = _mutate(manifest_bytes, anchors, xors)
    try:
        contract = c.ServingContract.FromString(contract_bytes)
        manifest = m.ExecutionManifest.FromString(manifest_bytes)
    except DecodeError:
        return  # not a message at all: the core layer rejects such bytes before decoding
    try:
        PreparedContract.decode(contract, manifest, resource_ids=SAMPLE_RESOURCE_IDS)
    except ContractError:
        pass
