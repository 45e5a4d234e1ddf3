"""Resource descriptions shared by the writer and the reader."""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Iterator

from helios_proto import core_pb2

from .constants import READ_NBYTES
from .errors import CoreError

ResourceKind = core_pb2.ResourceKind


@dataclasses.dataclass(frozen=True)
class ResourceInput:
    """One executable resource to store: its id, kind and decoded bytes.

    `data` is either the bytes themselves or a path whose file is streamed in
    1 MiB pieces (never read whole), so resources larger than memory can be written.
    """

    id: str
    kind: core_pb2.ResourceKind.ValueType  # nonzero
    data: bytes | pathlib.Path

    def decoded_nbytes(self) -> int:
        if isinstance(self.data, (bytes, bytearray, memoryview)):
            return len(self.data)
        return os.stat(self.data).st_size

    def iter_pieces(self, piece_nbytes: int = READ_NBYTES) -> Iterator[bytes]:
        """The decoded bytes in pieces of at most piece_nbytes."""
        if isinstance(self.data, (bytes, bytearray, memoryview)):
            view = memoryview(self.data)
            for start in range(0, len(view), piece_nbytes):
                yield bytes(view[start : start + piece_nbytes])
            return
        with open(self.data, "rb") as source:
            while piece := source.read(piece_nbytes):
                yield piece


@dataclasses.dataclass(frozen=True)
class ResourceInfo:
    """What a core says about one resource (signed metadata, no bytes).

    `chunks` is the number of chunk commitments (zstd carriers) or AES-GCM chunks (v4).
    """

    id: str
    kind: core_pb2.ResourceKind.ValueType
    decoded_nbytes: int
    stored_nbytes: int
    chunks: int

    @property
    def kind_name(self) -> str:
        try:
            return ResourceKind.Name(self.kind)
        except ValueError:
            return str(self.kind)


def check_resource_inputs(resources: "list[ResourceInput] | tuple[ResourceInput, ...]") -> None:
    """Writer-side checks: unique nonempty ids, known nonzero kinds."""
    seen: set[str] = set()
    for resource in resources:
        if not isinstance(resource.id, str) or not resource.id:
            raise CoreError("resource id must be a nonempty string")
        if resource.id in seen:
            raise CoreError(f"duplicate resource id {resource.id!r}")
        seen.add(resource.id)
        if resource.kind not in ResourceKind.values() or resource.kind == ResourceKind.RESOURCE_KIND_UNSPECIFIED:
            raise CoreError(f"resource {resource.id!r}: kind {resource.kind} is not a known nonzero ResourceKind")
