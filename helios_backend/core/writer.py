"""Writers of the two core carriers.

Both stream: each resource is read in 1 MiB pieces, encoded (one zstd level-3
frame, or AES-GCM chunks for ProtectedIndex v4) into a spool file beside the
target while its commitments accumulate; then the signed header is written and
the spool copied after it. Peak memory is one chunk, never a whole resource.
The target appears atomically (written as <path>.tmp, then renamed).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from typing import Callable, Sequence

import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helios_proto import contract_pb2, core_pb2, manifest_pb2

from . import gcm
from .chunks import ChunkCommitter
from .constants import (
    CHUNK_NBYTES,
    CONTENT_KEY_NBYTES,
    LOGICAL_AES_GCM_VERSION,
    LOGICAL_MAGIC,
    LOGICAL_VERSIONS,
    PAYLOAD_FORMAT_VERSION,
    PAYLOAD_MAGIC,
    PAYLOAD_SIGNING_TAG,
    logical_signing_tag,
)
from .errors import CoreError, UnsupportedFormatError
from .frames import compress_stream
from .layout import write_header
from .resources import ResourceInput, check_resource_inputs
from .signing import sign

Progress = Callable[[int, int], None]  # (decoded bytes done, decoded bytes total)


@dataclasses.dataclass(frozen=True)
class PreEncodedFrame:
    """A resource whose stored bytes are given as is (tools and tests that need
    exact frames, e.g. to prove the reader rejects a malformed but signed one)."""

    id: str
    kind: int
    frame: bytes
    decoded_nbytes: int


@dataclasses.dataclass
class _Stored:
    id: str
    kind: int
    decoded_nbytes: int
    stored_nbytes: int
    offset: int                      # inside the data section
    chunk_sha256: list[bytes]
    nonce_prefix: bytes = b""


class _Spool:
    """The data section under construction: a temporary file beside the target."""

    def __init__(self, target: pathlib.Path) -> None:
        self.path = target.with_name(target.name + ".frames.tmp")
        self.file = open(self.path, "wb")
        self.nbytes = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.nbytes += len(data)

    def discard(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def _versions(contract: contract_pb2.ServingContract, manifest: manifest_pb2.ExecutionManifest, payload_format: int):
    return core_pb2.VersionDomains(
        execution_abi=manifest.abi, contract_version=contract.model.version, payload_format=payload_format
    )


def _spool_resources(
    target: pathlib.Path,
    resources: Sequence[ResourceInput],
    progress: Progress | None,
    store: Callable[[ResourceInput, "_Spool", Callable[[int], None]], "_Stored"],
) -> tuple["_Spool", list["_Stored"]]:
    """Encode every resource into a spool beside `target`, reporting decoded progress."""
    total = sum(r.decoded_nbytes() for r in resources)
    done = 0

    def tick(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    spool = _Spool(target)
    try:
        return spool, [store(resource, spool, tick) for resource in resources]
    except BaseException:
        spool.discard()
        raise


def _store_zstd(resource: ResourceInput, spool: _Spool, tick: Callable[[int], None]) -> _Stored:
    decoded_nbytes = resource.decoded_nbytes()
    committer = ChunkCommitter()
    offset = spool.nbytes
    seen = 0

    def pieces():
        nonlocal seen
        for piece in resource.iter_pieces():
            seen += len(piece)
            tick(len(piece))
            yield piece

    def sink(data: bytes) -> None:
        committer.update(data)
        spool.write(data)

    try:
        compress_stream(pieces(), decoded_nbytes, sink)
    except zstandard.ZstdError as exc:  # the frame's declared size no longer matches the input
        raise CoreError(f"resource {resource.id!r} changed size while it was being written: {exc}") from exc
    if seen != decoded_nbytes:
        raise CoreError(f"resource {resource.id!r} changed size while it was being written")
    return _Stored(resource.id, resource.kind, decoded_nbytes, committer.stored_nbytes, offset, committer.finish())


def _store_frame(frame: PreEncodedFrame, spool: _Spool) -> _Stored:
    committer = ChunkCommitter()
    offset = spool.nbytes
    committer.update(frame.frame)
    spool.write(frame.frame)
    return _Stored(frame.id, frame.kind, frame.decoded_nbytes, len(frame.frame), offset, committer.finish())


def _store_gcm(resource: ResourceInput, spool: _Spool, aead, key_id: bytes, tick: Callable[[int], None]) -> _Stored:
    decoded_nbytes = resource.decoded_nbytes()
    offset = spool.nbytes
    prefix = gcm.new_nonce_prefix()

    def pieces():
        for piece in resource.iter_pieces():
            tick(len(piece))
            yield piece

    gcm.seal_stream(aead, key_id, prefix, resource.id, resource.kind, decoded_nbytes, pieces(), spool.write)
    return _Stored(resource.id, resource.kind, decoded_nbytes, spool.nbytes - offset, offset, [], prefix)


def _finish(path: pathlib.Path, spool: _Spool, magic: bytes, header: bytes) -> None:
    spool.file.close()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as out, open(spool.path, "rb") as data:
            write_header(out, magic, header)
            shutil.copyfileobj(data, out, CHUNK_NBYTES)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        spool.path.unlink(missing_ok=True)


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not namespace:
        raise CoreError("publisher namespace must be a nonempty string")


def _payload_header(
    stored: Sequence[_Stored],
    *,
    contract: contract_pb2.ServingContract,
    manifest: manifest_pb2.ExecutionManifest,
    namespace: str,
    signing_key: Ed25519PrivateKey,
) -> bytes:
    body = core_pb2.DeploymentBody(
        publisher_namespace=namespace,
        contract=contract,
        manifest=manifest,
        versions=_versions(contract, manifest, PAYLOAD_FORMAT_VERSION),
    )
    locations = core_pb2.LocationSet()
    for item in stored:
        body.resources.add(
            id=item.id,
            kind=item.kind,
            decoded_nbytes=item.decoded_nbytes,
            stored_nbytes=item.stored_nbytes,
            chunk_nbytes=CHUNK_NBYTES,
            chunk_sha256=item.chunk_sha256,
        )
        locations.locations.add(resource=item.id, offset=item.offset, nbytes=item.stored_nbytes)
    body_bytes = body.SerializeToString(deterministic=True)
    signature, public_key = sign(signing_key, PAYLOAD_SIGNING_TAG, body_bytes)
    core_body = core_pb2.CoreBody(
        format_version=PAYLOAD_FORMAT_VERSION,
        payload=core_pb2.SignedPayload(body=body_bytes, signature=signature, public_key=public_key),
        locations=locations,
    )
    return core_body.SerializeToString(deterministic=True)


def write_payload_core(
    path: str | os.PathLike[str],
    *,
    contract: contract_pb2.ServingContract,
    manifest: manifest_pb2.ExecutionManifest,
    resources: Sequence[ResourceInput],
    namespace: str,
    signing_key: Ed25519PrivateKey,
    progress: Progress | None = None,
) -> None:
    """Write a payload-format core (CoreBody.format_version 2).

    Each resource becomes one zstd level-3 frame with 4 MiB chunk commitments over
    its stored bytes; the DeploymentBody (namespace, contract, manifest, resource
    commitments, version domains) is signed with Ed25519 under a domain tag. The
    LocationSet saying where each frame lies is unsigned. `progress(done, total)`
    is called with decoded byte counts as resources stream. Raises CoreError on
    bad input (duplicate ids, zero kinds, empty namespace).
    """
    _check_namespace(namespace)
    check_resource_inputs(list(resources))
    target = pathlib.Path(path)
    spool, stored = _spool_resources(target, resources, progress, _store_zstd)
    header = _payload_header(stored, contract=contract, manifest=manifest, namespace=namespace, signing_key=signing_key)
    _finish(target, spool, PAYLOAD_MAGIC, header)


def write_payload_core_from_frames(
    path: str | os.PathLike[str],
    *,
    contract: contract_pb2.ServingContract,
    manifest: manifest_pb2.ExecutionManifest,
    frames: Sequence[PreEncodedFrame],
    namespace: str,
    signing_key: Ed25519PrivateKey,
) -> None:
    """Like write_payload_core, but stores the given bytes verbatim and signs them.

    For tests and tools only: nothing checks that a frame is a valid zstd frame,
    which is exactly what the reader's rejection tests need.
    """
    _check_namespace(namespace)
    target = pathlib.Path(path)
    spool = _Spool(target)
    stored = [_store_frame(frame, spool) for frame in frames]
    header = _payload_header(stored, contract=contract, manifest=manifest, namespace=namespace, signing_key=signing_key)
    _finish(target, spool, PAYLOAD_MAGIC, header)


def write_logical_core(
    path: str | os.PathLike[str],
    *,
    version: int,
    contract: contract_pb2.ServingContract,
    manifest: manifest_pb2.ExecutionManifest,
    resources: Sequence[ResourceInput],
    namespace: str,
    signing_key: Ed25519PrivateKey,
    content_key: bytes | None = None,
    progress: Progress | None = None,
) -> None:
    """Write a logical-resource core: a signed ProtectedIndex over a ModelIndex.

    version 6: each resource is one zstd level-3 frame with chunk commitments (as in
    payload cores). version 4: resources are sealed with AES-256-GCM in 4 MiB chunks
    under `content_key` (32 bytes, required); ModelIndex.key_id identifies the key.
    """
    if version not in LOGICAL_VERSIONS:
        raise UnsupportedFormatError(f"ProtectedIndex version {version} is not one of {LOGICAL_VERSIONS}")
    _check_namespace(namespace)
    check_resource_inputs(list(resources))
    aead = None
    key_id = b""
    if version == LOGICAL_AES_GCM_VERSION:
        if content_key is None or len(content_key) != CONTENT_KEY_NBYTES:
            raise CoreError(f"ProtectedIndex v4 needs a {CONTENT_KEY_NBYTES}-byte content_key")
        key_id = gcm.content_key_id(content_key)
        aead = gcm.check_content_key(content_key, key_id)
    elif content_key is not None:
        raise CoreError("content_key applies to ProtectedIndex v4 only")
    target = pathlib.Path(path)
    if aead is not None:
        spool, stored = _spool_resources(
            target, resources, progress, lambda resource, spool, tick: _store_gcm(resource, spool, aead, key_id, tick)
        )
    else:
        spool, stored = _spool_resources(target, resources, progress, _store_zstd)
    index = core_pb2.ModelIndex(
        publisher_namespace=namespace,
        contract=contract,
        manifest=manifest,
        versions=_versions(contract, manifest, version),
        key_id=key_id,
    )
    for item in stored:
        index.resources.add(
            id=item.id,
            kind=item.kind,
            decoded_nbytes=item.decoded_nbytes,
            stored_nbytes=item.stored_nbytes,
            offset=item.offset,
            chunk_nbytes=CHUNK_NBYTES,
            chunk_sha256=item.chunk_sha256,
            nonce_prefix=item.nonce_prefix,
        )
    index_bytes = index.SerializeToString(deterministic=True)
    signature, public_key = sign(signing_key, logical_signing_tag(version), index_bytes)
    header = core_pb2.ProtectedIndex(
        version=version, index=index_bytes, signature=signature, public_key=public_key
    ).SerializeToString(deterministic=True)
    _finish(target, spool, LOGICAL_MAGIC, header)
