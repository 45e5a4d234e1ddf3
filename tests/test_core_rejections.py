"""One test per rejection of the core format: each raises its typed CoreError."""
from __future__ import annotations

import pytest

from helios_backend.core import (
    ContentKeyError,
    CoreError,
    CoreFormatError,
    DecodedLengthError,
    ExtraFrameError,
    IntegrityError,
    PreEncodedFrame,
    ResourceKind,
    SignatureError,
    TrailingBytesError,
    TruncatedFrameError,
    UnsupportedFormatError,
    WindowTooLargeError,
    open_core,
    write_logical_core,
)
from helios_backend.core.constants import MiB
from tests.contract_samples import sample_contract, sample_manifest
from tests.core_helpers import (
    NAMESPACE,
    OTHER_KEY,
    SIGNING_KEY,
    big_window_frame,
    data_offset,
    flip_byte,
    frame_of,
    mutate_signed_body,
    random_bytes,
    rewrite_header,
    sample_resources,
    write_frames_core,
    write_sample_core,
)

PAYLOAD = b"weights " * 4000


def _frames_core(tmp_path, frame: bytes, decoded_nbytes: int = len(PAYLOAD)):
    return write_frames_core(
        tmp_path / "f.core", [PreEncodedFrame("weights", ResourceKind.RESOURCE_KIND_WEIGHTS, frame, decoded_nbytes)]
    )


def _verify(path, **kwargs):
    with open_core(path, **kwargs) as core:
        core.verify()


def test_well_formed_pre_encoded_frame_verifies(tmp_path):
    # spec: FMT-5
    # the control for the frame tests below: only the named defect makes them fail
    _verify(_frames_core(tmp_path, frame_of(PAYLOAD)))


def test_tampered_frame_byte_fails_its_chunk_commitment(tmp_path):
    # spec: FMT-5, FMT-14
    path = write_sample_core(tmp_path / "a.core")
    flip_byte(path, data_offset(path) + 7)
    with pytest.raises(IntegrityError, match="chunk 0"):
        _verify(path)


def test_tampered_later_chunk_of_a_multi_chunk_resource(tmp_path):
    # spec: FMT-13, FMT-14, FMT-15
    path = write_sample_core(tmp_path / "big.core", sample_resources(random_bytes(9 * MiB)))
    flip_byte(path, data_offset(path) + 4 * MiB + 123)  # weights is first: this is chunk 1
    with open_core(path) as core:
        with pytest.raises(IntegrityError, match="chunk 1"):
            core.read_resource("weights")
        assert core.read_resource("tokenizer")  # other resources are unaffected


def test_truncated_frame(tmp_path):
    # spec: FMT-17
    with pytest.raises(TruncatedFrameError):
        _verify(_frames_core(tmp_path, frame_of(PAYLOAD)[:-6]))


def test_extra_frame(tmp_path):
    # spec: FMT-18, FMT-9
    half = PAYLOAD[: len(PAYLOAD) // 2]
    frame = frame_of(half)
    with pytest.raises(ExtraFrameError):
        _verify(_frames_core(tmp_path, frame + frame, len(half)))


def test_extra_skippable_frame(tmp_path):
    # spec: FMT-18
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    with pytest.raises(ExtraFrameError):
        _verify(_frames_core(tmp_path, frame_of(PAYLOAD) + skippable))


def test_trailing_bytes_after_the_frame(tmp_path):
    # spec: FMT-19
    with pytest.raises(TrailingBytesError):
        _verify(_frames_core(tmp_path, frame_of(PAYLOAD) + b"junk"))


@pytest.mark.parametrize("delta", [-1, 1])
def test_decoded_length_mismatch(tmp_path, delta):
    # spec: FMT-20
    with pytest.raises(DecodedLengthError):
        _verify(_frames_core(tmp_path, frame_of(PAYLOAD), len(PAYLOAD) + delta))


def test_decoded_length_mismatch_without_declared_content_size(tmp_path):
    # spec: FMT-20
    import zstandard

    cobj = zstandard.ZstdCompressor(level=3).compressobj()  # no size: header omits it
    frame = cobj.compress(PAYLOAD) + cobj.flush()
    with pytest.raises(DecodedLengthError):
        _verify(_frames_core(tmp_path, frame, len(PAYLOAD) + 10))


def test_window_over_8_mib_is_rejected(tmp_path):
    # spec: FMT-16
    with pytest.raises(WindowTooLargeError):
        _verify(_frames_core(tmp_path, big_window_frame(PAYLOAD)))


def test_not_a_zstd_frame(tmp_path):
    # spec: FMT-9: no uncompressed encoding
    with pytest.raises(CoreError):
        _verify(_frames_core(tmp_path, PAYLOAD))


def test_empty_stored_frame(tmp_path):
    # spec: FMT-9, FMT-17
    with pytest.raises(TruncatedFrameError):
        _verify(_frames_core(tmp_path, b"", 0))


def test_trailing_bytes_after_the_last_resource(tmp_path):
    # spec: FMT-19 at file level: the data section ends with the last resource
    path = write_sample_core(tmp_path / "a.core")
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(CoreFormatError):
        open_core(path)


def test_truncated_file(tmp_path):
    # spec: FMT-17
    path = write_sample_core(tmp_path / "a.core")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CoreFormatError):
        open_core(path)


def test_bad_magic(tmp_path):
    path = write_sample_core(tmp_path / "a.core")
    flip_byte(path, 0)
    with pytest.raises(CoreFormatError):
        open_core(path)


def test_unsupported_payload_format(tmp_path):
    # spec: FMT-3
    path = write_sample_core(tmp_path / "a.core")
    rewrite_header(path, lambda body: setattr(body, "format_version", 3))
    with pytest.raises(UnsupportedFormatError):
        open_core(path)


def test_bad_signature(tmp_path):
    # spec: FMT-22
    path = write_sample_core(tmp_path / "a.core")

    def corrupt(body):
        signature = bytearray(body.payload.signature)
        signature[0] ^= 1
        body.payload.signature = bytes(signature)

    rewrite_header(path, corrupt)
    with pytest.raises(SignatureError):
        open_core(path)


def test_signature_checked_against_the_carried_key(tmp_path):
    # spec: FMT-22: swapping in another public key does not verify
    from helios_backend.core import public_key_bytes

    path = write_sample_core(tmp_path / "a.core")
    rewrite_header(path, lambda body: setattr(body.payload, "public_key", public_key_bytes(OTHER_KEY)))
    with pytest.raises(SignatureError):
        open_core(path)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda r: setattr(r, "id", "weights2"), id="id"),
        pytest.param(lambda r: setattr(r, "kind", ResourceKind.RESOURCE_KIND_AUXILIARY), id="kind"),
        pytest.param(lambda r: setattr(r, "decoded_nbytes", r.decoded_nbytes + 1), id="decoded_nbytes"),
        pytest.param(lambda r: r.chunk_sha256.__setitem__(0, bytes(32)), id="chunk_sha256"),
    ],
)
def test_changing_signed_resource_metadata_breaks_the_signature(tmp_path, change):
    # spec: FMT-12, FMT-22
    path = write_sample_core(tmp_path / "a.core")
    mutate_signed_body(path, lambda body: change(body.resources[0]))
    with pytest.raises(SignatureError):
        open_core(path)


def test_changing_the_namespace_breaks_the_signature(tmp_path):
    # spec: FMT-21, FMT-22
    path = write_sample_core(tmp_path / "a.core")
    mutate_signed_body(path, lambda body: setattr(body, "publisher_namespace", "attacker.example"))
    with pytest.raises(SignatureError):
        open_core(path)


def test_resigned_wrong_chunk_size_is_rejected(tmp_path):
    # spec: FMT-13: chunk_nbytes is 4 MiB even in a validly signed body
    path = write_sample_core(tmp_path / "a.core")
    mutate_signed_body(path, lambda body: setattr(body.resources[0], "chunk_nbytes", 1 << 20), resign_with=SIGNING_KEY)
    with pytest.raises(CoreFormatError, match="chunk_nbytes"):
        open_core(path)


def test_resigned_wrong_chunk_count_is_rejected(tmp_path):
    # spec: FMT-15
    path = write_sample_core(tmp_path / "a.core")
    mutate_signed_body(path, lambda body: body.resources[0].chunk_sha256.append(bytes(32)), resign_with=SIGNING_KEY)
    with pytest.raises(CoreFormatError, match="chunk digests"):
        open_core(path)


def test_unsigned_location_moved(tmp_path):
    # spec: FMT-4: locations are unsigned, so moving one must still fail integrity or layout
    path = write_sample_core(tmp_path / "a.core")

    def swap(body):
        first, second = body.locations.locations[0], body.locations.locations[1]
        first.offset, second.offset = second.offset, first.offset

    rewrite_header(path, swap)
    with pytest.raises(CoreError):
        _verify(path)


def test_unknown_field_in_unsigned_header(tmp_path):
    # spec: FMT-4
    path = write_sample_core(tmp_path / "a.core")
    raw = path.read_bytes()
    length = int.from_bytes(raw[12:16], "little")
    header = raw[16 : 16 + length] + b"\x98\x06\x01"  # field 99, varint 1
    path.write_bytes(raw[:12] + len(header).to_bytes(4, "little") + header + raw[16 + length :])
    with pytest.raises(CoreFormatError):
        open_core(path)


def test_version_domains_must_agree_with_the_carrier(tmp_path):
    # spec: FMT-6: the signed domains name the carrier's payload format and the contract's version
    path = write_sample_core(tmp_path / "a.core")
    mutate_signed_body(path, lambda body: setattr(body.versions, "payload_format", 6), resign_with=SIGNING_KEY)
    with pytest.raises(CoreFormatError, match="payload_format"):
        open_core(path)


def _logical(tmp_path, version, key=None):
    path = tmp_path / f"v{version}.core"
    write_logical_core(
        path, version=version, contract=sample_contract(), manifest=sample_manifest(), resources=sample_resources(),
        namespace=NAMESPACE, signing_key=SIGNING_KEY, content_key=key,
    )
    return path


def test_v4_needs_the_right_content_key(tmp_path):
    # spec: FMT-11
    key = bytes(32)
    path = _logical(tmp_path, 4, key)
    with pytest.raises(ContentKeyError):
        _verify(path)
    with pytest.raises(ContentKeyError):
        _verify(path, content_key=bytes([1]) * 32)
    _verify(path, content_key=key)


def test_v4_tampered_chunk_fails_authentication(tmp_path):
    # spec: FMT-11
    key = bytes(32)
    path = _logical(tmp_path, 4, key)
    flip_byte(path, data_offset(path) + 3)
    with pytest.raises(IntegrityError, match="AES-GCM"):
        _verify(path, content_key=key)


def test_v6_tampered_frame(tmp_path):
    # spec: FMT-10
    path = _logical(tmp_path, 6)
    flip_byte(path, data_offset(path) + 3)
    with pytest.raises(IntegrityError):
        _verify(path)


def test_v6_index_version_is_bound_by_the_signature(tmp_path):
    # spec: FMT-10, FMT-11: relabelling a v6 index as v4 does not verify
    from helios_proto import core_pb2

    path = _logical(tmp_path, 6)
    raw = path.read_bytes()
    length = int.from_bytes(raw[12:16], "little")
    protected = core_pb2.ProtectedIndex.FromString(raw[16 : 16 + length])
    protected.version = 4
    header = protected.SerializeToString()
    path.write_bytes(raw[:12] + len(header).to_bytes(4, "little") + header + raw[16 + length :])
    with pytest.raises(SignatureError):
        open_core(path)


def test_unsupported_logical_version(tmp_path):
    # spec: FMT-10, FMT-11
    with pytest.raises(UnsupportedFormatError):
        _logical(tmp_path, 5)


def test_writer_rejects_bad_inputs(tmp_path):
    from helios_backend.core import ResourceInput, write_payload_core

    good = sample_resources()
    cases = [
        (good + [good[0]], "duplicate"),
        ([ResourceInput("x", 0, b"")], "kind"),
        ([ResourceInput("", 1, b"")], "id"),
    ]
    for resources, word in cases:
        with pytest.raises(CoreError, match=word):
            write_payload_core(tmp_path / "w.core", contract=sample_contract(), manifest=sample_manifest(),
                               resources=resources, namespace=NAMESPACE, signing_key=SIGNING_KEY)
    with pytest.raises(CoreError, match="namespace"):
        write_payload_core(tmp_path / "w.core", contract=sample_contract(), manifest=sample_manifest(),
                           resources=good, namespace="", signing_key=SIGNING_KEY)


def test_v4_chunks_are_bound_to_their_resource(tmp_path):
    # spec: FMT-11: sealed bytes moved from one resource to another fail authentication
    from helios_backend.core import ResourceInput

    key = bytes(32)
    path = tmp_path / "v4.core"
    resources = sample_resources() + [
        ResourceInput("aux_a", ResourceKind.RESOURCE_KIND_AUXILIARY, b"a" * 100),
        ResourceInput("aux_b", ResourceKind.RESOURCE_KIND_AUXILIARY, b"b" * 100),
    ]
    write_logical_core(path, version=4, contract=sample_contract(), manifest=sample_manifest(), resources=resources,
                       namespace=NAMESPACE, signing_key=SIGNING_KEY, content_key=key)
    raw = bytearray(path.read_bytes())
    sealed = 100 + 16
    b_start = len(raw) - sealed       # aux_b is last, aux_a just before it
    a_start = b_start - sealed
    raw[b_start:] = raw[a_start:b_start]
    path.write_bytes(bytes(raw))
    with open_core(path, content_key=key) as core:
        assert core.read_resource("aux_a") == b"a" * 100
        with pytest.raises(IntegrityError):
            core.read_resource("aux_b")


@pytest.mark.parametrize(
    "change, word",
    [
        pytest.param(lambda body: setattr(body.resources[1], "id", body.resources[0].id), "duplicate", id="duplicate id"),
        pytest.param(lambda body: setattr(body.resources[0], "kind", 0), "kind", id="zero kind"),
        pytest.param(lambda body: setattr(body.resources[0], "kind", 99), "kind", id="unknown kind"),
        pytest.param(lambda body: setattr(body.resources[0], "id", ""), "empty id", id="empty id"),
        pytest.param(lambda body: setattr(body, "publisher_namespace", ""), "namespace", id="empty namespace"),
    ],
)
def test_validly_signed_but_malformed_resource_tables(tmp_path, change, word):
    # spec: FMT-12, CON-11: even a correct signature does not make a malformed table loadable
    path = write_sample_core(tmp_path / "a.core")
    mutate_signed_body(path, change, resign_with=SIGNING_KEY)
    with pytest.raises(CoreFormatError, match=word):
        open_core(path)
