"""The authenticated AES-GCM chunk reader (and writer) of ProtectedIndex version 4.

A v4 resource's decoded bytes are cut into 4 MiB plaintext chunks (an empty
resource is one empty chunk) and each is sealed with AES-256-GCM:

    stored = ct_0 || tag_0 || ct_1 || tag_1 || ...      (16-byte tags)
    nonce_i = nonce_prefix (8 bytes, per resource) || u32be(i)
    aad_i   = GCM_AAD_TAG || key_id || u32be(len(id)) || id || u32be(kind)
              || u64be(decoded_nbytes) || u32be(i) || u8(last)

The AAD binds every chunk to its resource, position and the total length, and the
`last` byte makes truncation after a full chunk detectable. v4 stores no zstd frame.
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable, Iterable, Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .constants import (
    CHUNK_NBYTES,
    CONTENT_KEY_ID_TAG,
    CONTENT_KEY_NBYTES,
    GCM_AAD_TAG,
    GCM_NONCE_PREFIX_NBYTES,
    GCM_TAG_NBYTES,
)
from .errors import ContentKeyError, IntegrityError

KEY_ID_NBYTES = 16


def content_key_id(content_key: bytes) -> bytes:
    """The public identifier of a content key (ModelIndex.key_id)."""
    return hashlib.sha256(CONTENT_KEY_ID_TAG + content_key).digest()[:KEY_ID_NBYTES]


def check_content_key(content_key: bytes | None, key_id: bytes) -> AESGCM:
    if content_key is None:
        raise ContentKeyError("this ProtectedIndex v4 core needs its content key to read resources")
    if len(content_key) != CONTENT_KEY_NBYTES:
        raise ContentKeyError(f"content key must be {CONTENT_KEY_NBYTES} bytes, got {len(content_key)}")
    if content_key_id(content_key) != key_id:
        raise ContentKeyError("content key does not match the core's key_id")
    return AESGCM(content_key)


def gcm_chunk_count(decoded_nbytes: int, chunk_nbytes: int = CHUNK_NBYTES) -> int:
    return max(1, -(-decoded_nbytes // chunk_nbytes))


def gcm_stored_nbytes(decoded_nbytes: int, chunk_nbytes: int = CHUNK_NBYTES) -> int:
    return decoded_nbytes + GCM_TAG_NBYTES * gcm_chunk_count(decoded_nbytes, chunk_nbytes)


def _aad(key_id: bytes, resource_id: str, kind: int, decoded_nbytes: int, index: int, last: bool) -> bytes:
    name = resource_id.encode()
    return b"".join(
        (
            GCM_AAD_TAG,
            key_id,
            len(name).to_bytes(4, "big"),
            name,
            kind.to_bytes(4, "big"),
            decoded_nbytes.to_bytes(8, "big"),
            index.to_bytes(4, "big"),
            b"\x01" if last else b"\x00",
        )
    )


def _nonce(prefix: bytes, index: int) -> bytes:
    return prefix + index.to_bytes(4, "big")


def new_nonce_prefix() -> bytes:
    return os.urandom(GCM_NONCE_PREFIX_NBYTES)


def seal_stream(
    aead: AESGCM,
    key_id: bytes,
    nonce_prefix: bytes,
    resource_id: str,
    kind: int,
    decoded_nbytes: int,
    pieces: Iterable[bytes],
    sink: Callable[[bytes], None],
) -> None:
    """Encrypt `pieces` (decoded_nbytes in all) chunk by chunk into `sink`."""
    count = gcm_chunk_count(decoded_nbytes)
    buffer = bytearray()
    index = 0

    def emit(plain: bytes) -> None:
        nonlocal index
        aad = _aad(key_id, resource_id, kind, decoded_nbytes, index, index == count - 1)
        sink(aead.encrypt(_nonce(nonce_prefix, index), plain, aad))
        index += 1

    for piece in pieces:
        buffer += piece
        while len(buffer) >= CHUNK_NBYTES and index < count - 1:
            emit(bytes(buffer[:CHUNK_NBYTES]))
            del buffer[:CHUNK_NBYTES]
    if index != count - 1 or len(buffer) != decoded_nbytes - index * CHUNK_NBYTES:
        raise IntegrityError(f"resource {resource_id!r} changed size while it was being written")
    emit(bytes(buffer))


def open_stream(
    fd: int,
    offset: int,
    aead: AESGCM,
    key_id: bytes,
    nonce_prefix: bytes,
    resource_id: str,
    kind: int,
    decoded_nbytes: int,
    chunk_nbytes: int,
) -> Iterator[bytes]:
    """Read and authenticate a v4 resource, yielding plaintext chunks in order."""
    count = gcm_chunk_count(decoded_nbytes, chunk_nbytes)
    position = offset
    for index in range(count):
        plain_nbytes = min(chunk_nbytes, decoded_nbytes - index * chunk_nbytes)
        sealed = os.pread(fd, plain_nbytes + GCM_TAG_NBYTES, position)
        if len(sealed) != plain_nbytes + GCM_TAG_NBYTES:
            raise IntegrityError(f"resource {resource_id!r}: file ends inside AES-GCM chunk {index}")
        position += len(sealed)
        aad = _aad(key_id, resource_id, kind, decoded_nbytes, index, index == count - 1)
        try:
            yield aead.decrypt(_nonce(nonce_prefix, index), sealed, aad)
        except InvalidTag as exc:
            raise IntegrityError(f"resource {resource_id!r}: AES-GCM chunk {index} fails authentication") from exc
