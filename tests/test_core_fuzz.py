"""Property tests: mutated, truncated and extended cores never load silently and never
crash; the only outcomes are CoreError or ContractError."""
from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_backend.contract import ContractError
from helios_backend.core import CoreError, IntegrityError, ResourceInput, open_core, write_logical_core
from helios_backend.core.frames import decode_frame
from tests.contract_samples import sample_contract, sample_manifest
from tests.core_helpers import NAMESPACE, SIGNING_KEY, frame_of, random_bytes, sample_resources, write_sample_core

CONTENT_KEY = bytes(range(7, 39))


def _small_resources():
    return [ResourceInput(r.id, r.kind, r.data[:300]) for r in sample_resources(random_bytes(2000, seed=5))]


def _build(workdir: pathlib.Path, kind: str) -> bytes:
    path = workdir / f"{kind}.core"
    if kind == "payload":
        write_sample_core(path, _small_resources())
    else:
        version = 4 if kind == "v4" else 6
        write_logical_core(
            path, version=version, contract=sample_contract(), manifest=sample_manifest(),
            resources=_small_resources(), namespace=NAMESPACE, signing_key=SIGNING_KEY,
            content_key=CONTENT_KEY if version == 4 else None,
        )
    return path.read_bytes()


KINDS = ("payload", "v4", "v6")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("core-fuzz")


@pytest.fixture(scope="module")
def originals(workdir) -> dict[str, bytes]:
    return {kind: _build(workdir, kind) for kind in KINDS}


@st.composite
def mutations(draw):
    """A function applying one random mutation to a core's bytes."""
    operation = draw(st.sampled_from(["flip", "truncate", "extend", "insert", "delete"]))
    anchors = draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=3))
    xors = draw(st.lists(st.integers(1, 255), min_size=len(anchors), max_size=len(anchors)))
    blob = draw(st.binary(min_size=1, max_size=64))
    span = draw(st.integers(1, 16))

    def apply(original: bytes) -> bytes:
        data = bytearray(original)
        positions = [int(a * len(data)) for a in anchors]
        if operation == "flip":
            for position, xor in zip(positions, xors):
                data[position] ^= xor
        elif operation == "truncate":
            del data[positions[0] :]
        elif operation == "extend":
            data += blob
        elif operation == "insert":
            data[positions[0] : positions[0]] = blob[:16]
        else:
            del data[positions[0] : positions[0] + span]
        return bytes(data)

    return apply


def _load_fully(path: pathlib.Path) -> None:
    with open_core(path, content_key=CONTENT_KEY) as core:
        core.verify()
        core.prepared_contract()
        core.authorize(NAMESPACE)


def test_originals_load(workdir, originals):
    # spec: FMT-1, FMT-2
    for kind, data in originals.items():
        path = workdir / f"check-{kind}.core"
        path.write_bytes(data)
        _load_fully(path)


@settings(
    max_examples=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(kind=st.sampled_from(KINDS), mutate=mutations())
def test_mutated_cores_fail_with_typed_errors_only(workdir, originals, kind, mutate):
    # spec: FMT-5, FMT-12, FMT-17, FMT-18, FMT-19, FMT-20, FMT-22
    data = mutate(originals[kind])
    if data == originals[kind]:
        return
    path = workdir / "mutant.core"
    path.write_bytes(data)
    with pytest.raises((CoreError, ContractError)):
        _load_fully(path)


FRAME_PAYLOAD = random_bytes(3000, seed=9) + b"a" * 5000
FRAME = frame_of(FRAME_PAYLOAD)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_frame_decoder_never_crashes(data):
    # spec: FMT-16..20: the decoder itself (below the chunk digests) only raises FrameError
    frame = bytearray(FRAME)
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(1, len(frame)))
    frame = bytes(frame[:cut]) + data.draw(st.binary(max_size=8))
    pieces = [frame[i : i + 97] for i in range(0, len(frame), 97)]
    try:
        out = b"".join(decode_frame(pieces, len(FRAME_PAYLOAD)))
    except IntegrityError:
        return
    assert len(out) == len(FRAME_PAYLOAD)
