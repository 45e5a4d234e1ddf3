"""open_core(path) -> Core: the reader of both carriers.

Opening reads only the header: it checks the magic, the carrier version, the
Ed25519 signature over the signed envelope, and that the (unsigned) locations
tile the data section exactly. Resource bytes are read lazily: iter_resource()
streams one resource, checking each 4 MiB chunk against its signed digest (or
AES-GCM tag) before the decoder sees it, so a core larger than memory can be
verified. verify() streams every resource.

Errors (all CoreError subclasses, helios_backend.core.errors): CoreFormatError,
UnsupportedFormatError, SignatureError, IntegrityError and its FrameError family,
AuthorizationError, ResourceNotFoundError, ContentKeyError.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Callable, Iterator

from google.protobuf.message import DecodeError

from helios_proto import contract_pb2, core_pb2, manifest_pb2

from . import gcm
from .authorization import authorize_namespace
from .chunks import chunk_count, iter_verified_chunks
from .constants import (
    CHUNK_NBYTES,
    GCM_NONCE_PREFIX_NBYTES,
    LOGICAL_AES_GCM_VERSION,
    LOGICAL_MAGIC,
    LOGICAL_VERSIONS,
    PAYLOAD_FORMAT_VERSION,
    PAYLOAD_MAGIC,
    PAYLOAD_SIGNING_TAG,
    logical_signing_tag,
)
from .errors import CoreFormatError, IntegrityError, ResourceNotFoundError, UnsupportedFormatError
from .frames import decode_frame
from .layout import check_tiling, parse_message, read_header
from .prefetch import prefetched
from .resources import ResourceInfo, ResourceKind
from .signing import verify_signature

_DIGEST_NBYTES = 32


@dataclasses.dataclass(frozen=True)
class _Entry:
    info: ResourceInfo
    offset: int                      # absolute file offset of the stored bytes
    chunk_nbytes: int
    chunk_sha256: tuple[bytes, ...]
    nonce_prefix: bytes


class Core:
    """An opened core. Attributes:

    format          "payload" or "logical"
    payload_format  CoreBody.format_version (2) or ProtectedIndex.version (4, 6)
    namespace       the signed publisher namespace
    contract        ServingContract (DeploymentBody.contract / ModelIndex.contract)
    manifest        ExecutionManifest
    versions        VersionDomains (execution ABI label, contract version, payload format)
    resources       tuple[ResourceInfo, ...] in stored order
    public_key      raw Ed25519 public key that signed the envelope
    """

    def __init__(self, path: str | os.PathLike[str], *, content_key: bytes | None = None) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._load(content_key)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    # -- opening --------------------------------------------------------------
    def _load(self, content_key: bytes | None) -> None:
        file_nbytes = os.fstat(self._fd).st_size
        magic, header, data_offset = read_header(self._fd, file_nbytes)
        self._data_offset = data_offset
        self._data_nbytes = file_nbytes - data_offset
        self._aead: gcm.AESGCM | None = None
        if magic == PAYLOAD_MAGIC:
            self._load_payload(header)
        elif magic == LOGICAL_MAGIC:
            self._load_logical(header, content_key)
        else:
            raise CoreFormatError("not a Helios core (unknown magic)")
        if self.versions.payload_format != self.payload_format:
            raise CoreFormatError(
                f"signed payload_format {self.versions.payload_format} differs from the carrier's {self.payload_format}"
            )
        if self.versions.contract_version != self.contract.model.version:
            raise CoreFormatError(
                f"signed contract_version {self.versions.contract_version} differs from "
                f"ModelContract.version {self.contract.model.version}"
            )
        check_tiling(
            [(e.info.id, e.offset - self._data_offset, e.info.stored_nbytes) for e in self._entries.values()],
            self._data_nbytes,
        )
        self.resources = tuple(entry.info for entry in self._entries.values())

    def _load_payload(self, header: bytes) -> None:
        core_body = parse_message(core_pb2.CoreBody, header, "CoreBody")
        if core_body.format_version != PAYLOAD_FORMAT_VERSION:
            raise UnsupportedFormatError(f"CoreBody.format_version {core_body.format_version} is not supported")
        envelope = core_body.payload
        verify_signature(envelope.public_key, envelope.signature, PAYLOAD_SIGNING_TAG, envelope.body)
        body = core_pb2.DeploymentBody()
        try:
            body.ParseFromString(envelope.body)
        except DecodeError as exc:  # signed but unparsable: the signer wrote garbage
            raise CoreFormatError(f"signed DeploymentBody does not parse: {exc}") from exc
        self.format = "payload"
        self.payload_format = core_body.format_version
        self.public_key = bytes(envelope.public_key)
        self._set_common(body)
        locations: dict[str, core_pb2.Location] = {}
        for location in core_body.locations.locations:
            if location.resource in locations:
                raise CoreFormatError(f"two locations for resource {location.resource!r}")
            locations[location.resource] = location
        entries: dict[str, _Entry] = {}
        for resource in body.resources:
            self._check_identity(resource.id, resource.kind, entries)
            located = locations.pop(resource.id, None)
            if located is None:
                raise CoreFormatError(f"resource {resource.id!r} has no location")
            location = located
            if location.nbytes != resource.stored_nbytes:
                raise CoreFormatError(
                    f"resource {resource.id!r}: location says {location.nbytes} bytes, signed {resource.stored_nbytes}"
                )
            self._check_commitments(resource.id, resource.stored_nbytes, resource.chunk_nbytes, resource.chunk_sha256)
            entries[resource.id] = _Entry(
                ResourceInfo(resource.id, resource.kind, resource.decoded_nbytes, resource.stored_nbytes,
                             len(resource.chunk_sha256)),
                self._data_offset + location.offset,
                resource.chunk_nbytes,
                tuple(resource.chunk_sha256),
                b"",
            )
        if locations:
            raise CoreFormatError(f"locations name unknown resources: {sorted(locations)}")
        self._entries = entries

    def _load_logical(self, header: bytes, content_key: bytes | None) -> None:
        protected = parse_message(core_pb2.ProtectedIndex, header, "ProtectedIndex")
        if protected.version not in LOGICAL_VERSIONS:
            raise UnsupportedFormatError(f"ProtectedIndex.version {protected.version} is not supported")
        verify_signature(protected.public_key, protected.signature, logical_signing_tag(protected.version), protected.index)
        index = core_pb2.ModelIndex()
        try:
            index.ParseFromString(protected.index)
        except DecodeError as exc:
            raise CoreFormatError(f"signed ModelIndex does not parse: {exc}") from exc
        self.format = "logical"
        self.payload_format = protected.version
        self.public_key = bytes(protected.public_key)
        self._set_common(index)
        sealed = protected.version == LOGICAL_AES_GCM_VERSION
        self._key_id = bytes(index.key_id)
        self._content_key = content_key
        entries: dict[str, _Entry] = {}
        for resource in index.resources:
            self._check_identity(resource.id, resource.kind, entries)
            if sealed:
                self._check_sealed(resource)
                chunks = gcm.gcm_chunk_count(resource.decoded_nbytes, resource.chunk_nbytes)
            else:
                self._check_commitments(resource.id, resource.stored_nbytes, resource.chunk_nbytes, resource.chunk_sha256)
                chunks = len(resource.chunk_sha256)
            entries[resource.id] = _Entry(
                ResourceInfo(resource.id, resource.kind, resource.decoded_nbytes, resource.stored_nbytes, chunks),
                self._data_offset + resource.offset,
                resource.chunk_nbytes,
                tuple(resource.chunk_sha256),
                bytes(resource.nonce_prefix),
            )
        self._entries = entries

    def _set_common(self, body: core_pb2.DeploymentBody | core_pb2.ModelIndex) -> None:
        self.namespace: str = body.publisher_namespace
        self.contract: contract_pb2.ServingContract = body.contract
        self.manifest: manifest_pb2.ExecutionManifest = body.manifest
        self.versions: core_pb2.VersionDomains = body.versions
        if not self.namespace:
            raise CoreFormatError("signed publisher namespace is empty")

    @staticmethod
    def _check_identity(resource_id: str, kind: int, entries: dict) -> None:
        """Resource ids are nonempty and unique; kinds known and nonzero."""
        if not resource_id:
            raise CoreFormatError("a resource has an empty id")
        if resource_id in entries:
            raise CoreFormatError(f"duplicate resource id {resource_id!r}")
        if kind == ResourceKind.RESOURCE_KIND_UNSPECIFIED or kind not in ResourceKind.values():
            raise CoreFormatError(f"resource {resource_id!r}: kind {kind} is not a known nonzero ResourceKind")

    @staticmethod
    def _check_commitments(resource_id: str, stored_nbytes: int, chunk_nbytes: int, digests) -> None:
        if chunk_nbytes != CHUNK_NBYTES:
            raise CoreFormatError(f"resource {resource_id!r}: chunk_nbytes {chunk_nbytes}, expected {CHUNK_NBYTES}")
        expected = chunk_count(stored_nbytes, chunk_nbytes)
        if len(digests) != expected:
            raise CoreFormatError(f"resource {resource_id!r}: {len(digests)} chunk digests, expected {expected}")
        if any(len(d) != _DIGEST_NBYTES for d in digests):
            raise CoreFormatError(f"resource {resource_id!r}: a chunk digest is not 32 bytes")

    @staticmethod
    def _check_sealed(resource: core_pb2.LogicalResource) -> None:
        if resource.chunk_nbytes != CHUNK_NBYTES:
            raise CoreFormatError(f"resource {resource.id!r}: chunk_nbytes {resource.chunk_nbytes}, expected {CHUNK_NBYTES}")
        if len(resource.nonce_prefix) != GCM_NONCE_PREFIX_NBYTES:
            raise CoreFormatError(f"resource {resource.id!r}: AES-GCM nonce prefix is not {GCM_NONCE_PREFIX_NBYTES} bytes")
        if resource.stored_nbytes != gcm.gcm_stored_nbytes(resource.decoded_nbytes, resource.chunk_nbytes):
            raise CoreFormatError(f"resource {resource.id!r}: stored length disagrees with its AES-GCM chunks")

    # -- reading --------------------------------------------------------------
    def _entry(self, resource_id: str) -> _Entry:
        if self._fd < 0:
            raise ValueError("core is closed")
        try:
            return self._entries[resource_id]
        except KeyError:
            raise ResourceNotFoundError(f"no resource {resource_id!r} in this core") from None

    def resource(self, resource_id: str) -> ResourceInfo:
        """The signed metadata of one resource."""
        return self._entry(resource_id).info

    def iter_resource(self, resource_id: str) -> Iterator[bytes]:
        """Stream one resource's decoded bytes, each piece verified before it is yielded.

        The whole resource is authentic only once the iterator is exhausted: a
        failure at the end (trailing bytes, length mismatch) raises from the last
        next(). Pieces are at most 4 MiB (AES-GCM) or 1 MiB (zstd).
        """
        entry = self._entry(resource_id)
        info = entry.info
        what = f"resource {info.id!r}"
        if self.payload_format == LOGICAL_AES_GCM_VERSION:
            if self._aead is None:
                self._aead = gcm.check_content_key(self._content_key, self._key_id)
            yield from gcm.open_stream(
                self._fd, entry.offset, self._aead, self._key_id, entry.nonce_prefix,
                info.id, info.kind, info.decoded_nbytes, entry.chunk_nbytes,
            )
            return
        chunks = prefetched(iter_verified_chunks(
            self._fd, entry.offset, info.stored_nbytes, entry.chunk_nbytes, entry.chunk_sha256, what
        ))
        try:
            yield from decode_frame(chunks, info.decoded_nbytes)
        except IntegrityError as exc:
            if what in str(exc):
                raise
            raise type(exc)(f"{what}: {exc}") from exc

    def read_resource(self, resource_id: str) -> bytes:
        """One resource's decoded bytes, fully verified (held in memory: small resources)."""
        out = bytearray()
        for piece in self.iter_resource(resource_id):
            out += piece
        return bytes(out)

    def verify(
        self,
        progress: Callable[[int, int], None] | None = None,
        on_resource: Callable[[ResourceInfo], None] | None = None,
    ) -> None:
        """Check every resource against its signed commitments, streaming.

        The envelope signature was checked at open. Raises the first CoreError found.
        `progress(done, total)` counts decoded bytes; `on_resource(info)` follows each
        resource that verified.
        """
        total = sum(info.decoded_nbytes for info in self.resources)
        done = 0
        for info in self.resources:
            for piece in self.iter_resource(info.id):
                done += len(piece)
                if progress is not None:
                    progress(done, total)
            if on_resource is not None:
                on_resource(info)

    def verify_stored(self) -> None:
        """Check every resource's stored bytes against their signed chunk digests, without
        decoding them: sha256 only, a fraction of verify()'s cost, so a supervisor can refuse a
        tampered core before it starts a server. Sealed cores are authenticated by decryption,
        which needs the content key: verify() is their check."""
        if self.payload_format == LOGICAL_AES_GCM_VERSION:
            return
        for entry in self._entries.values():
            for _ in iter_verified_chunks(self._fd, entry.offset, entry.info.stored_nbytes, entry.chunk_nbytes,
                                          entry.chunk_sha256, f"resource {entry.info.id!r}"):
                pass

    def prepared_contract(self):
        """Decode and validate the carried contract against the manifest and this core's
        resource ids: PreparedContract.decode (raises ContractError)."""
        from helios_backend.contract import PreparedContract  # the contract layer sits above the core

        return PreparedContract.decode(
            self.contract, self.manifest, resource_ids=frozenset(info.id for info in self.resources)
        )

    def authorize(self, acceptance: str) -> None:
        """Raise AuthorizationError unless `acceptance` is exactly the signed namespace."""
        authorize_namespace(self.namespace, acceptance)

    # -- lifetime -------------------------------------------------------------
    def content_digest(self) -> str:
        """sha256 over the execution manifest and every resource's signed chunk digests: two
        cores share it only when they hold the same programs and bytes (rank rendezvous)."""
        digest = hashlib.sha256(self.manifest.SerializeToString(deterministic=True))
        for resource_id in sorted(self._entries):
            entry = self._entries[resource_id]
            digest.update(resource_id.encode() + b"\0" + entry.info.decoded_nbytes.to_bytes(8, "little"))
            for chunk in entry.chunk_sha256:
                digest.update(chunk)
        return digest.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "Core":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)


def open_core(path: str | os.PathLike[str], *, content_key: bytes | None = None) -> Core:
    """Open a core of either carrier; `content_key` is needed only to read v4 resources."""
    return Core(path, content_key=content_key)
