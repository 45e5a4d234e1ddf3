"""Compressed-chunk commitments: sha256 over each 4 MiB of stored bytes.

A resource of `stored_nbytes` has ceil(stored_nbytes / 4 MiB) digests; the last
chunk is short. Digests are over the stored (compressed) bytes, so a reader can
check each chunk before the decoder touches it.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterator, Sequence

from .constants import CHUNK_NBYTES
from .errors import IntegrityError


def chunk_count(stored_nbytes: int, chunk_nbytes: int = CHUNK_NBYTES) -> int:
    """ceil(stored_nbytes / chunk_nbytes)."""
    return -(-stored_nbytes // chunk_nbytes)


class ChunkCommitter:
    """Accumulates chunk digests over stored bytes written in arbitrary pieces."""

    def __init__(self, chunk_nbytes: int = CHUNK_NBYTES) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.digests: list[bytes] = []
        self.stored_nbytes = 0
        self._hash = hashlib.sha256()
        self._filled = 0              # bytes in the current chunk

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(self.chunk_nbytes - self._filled, len(view))
            self._hash.update(view[:take])
            self._filled += take
            self.stored_nbytes += take
            view = view[take:]
            if self._filled == self.chunk_nbytes:
                self.digests.append(self._hash.digest())
                self._hash = hashlib.sha256()
                self._filled = 0

    def finish(self) -> list[bytes]:
        if self._filled:
            self.digests.append(self._hash.digest())
            self._hash = hashlib.sha256()
            self._filled = 0
        return self.digests


def iter_verified_chunks(
    fd: int, offset: int, stored_nbytes: int, chunk_nbytes: int, digests: Sequence[bytes], what: str
) -> Iterator[bytes]:
    """Read a stored region chunk by chunk (pread), yielding each chunk only after
    its digest matched. Raises IntegrityError naming the resource and chunk."""
    if chunk_nbytes <= 0:
        raise IntegrityError(f"{what}: chunk_nbytes must be positive")
    expected = chunk_count(stored_nbytes, chunk_nbytes)
    if len(digests) != expected:
        raise IntegrityError(f"{what}: {len(digests)} chunk digests, expected {expected}")
    for index, digest in enumerate(digests):
        start = index * chunk_nbytes
        size = min(chunk_nbytes, stored_nbytes - start)
        chunk = os.pread(fd, size, offset + start)
        if len(chunk) != size:
            raise IntegrityError(f"{what}: file ends inside chunk {index}")
        if hashlib.sha256(chunk).digest() != digest:
            raise IntegrityError(f"{what}: chunk {index} does not match its sha256 commitment")
        yield chunk
