"""The outer file layout shared by both carriers.

    offset 0   magic (12 bytes): "HELIOS-CORE\\0" payload | "HELIOS-INDX\\0" logical
    offset 12  header length H, u32 little endian
    offset 16  header (H bytes): CoreBody | ProtectedIndex
    offset 16+H  data section: resource stored bytes back to back, in location order;
               Location.offset / LogicalResource.offset count from here.
    the file ends exactly at the end of the last resource.
"""
from __future__ import annotations

import os
from typing import BinaryIO, Iterable, TypeVar

from google.protobuf import message as pb_message
import google.protobuf.unknown_fields as unknown_fields

from .constants import HEADER_LENGTH_NBYTES, MAGIC_NBYTES, MAX_HEADER_NBYTES
from .errors import CoreFormatError


def write_header(out: BinaryIO, magic: bytes, header: bytes) -> None:
    out.write(magic)
    out.write(len(header).to_bytes(HEADER_LENGTH_NBYTES, "little"))
    out.write(header)


def read_header(fd: int, file_nbytes: int) -> tuple[bytes, bytes, int]:
    """Return (magic, header bytes, data section offset)."""
    prefix = os.pread(fd, MAGIC_NBYTES + HEADER_LENGTH_NBYTES, 0)
    if len(prefix) < MAGIC_NBYTES + HEADER_LENGTH_NBYTES:
        raise CoreFormatError("file too short for a core header")
    magic = prefix[:MAGIC_NBYTES]
    length = int.from_bytes(prefix[MAGIC_NBYTES:], "little")
    data_offset = MAGIC_NBYTES + HEADER_LENGTH_NBYTES + length
    if length > MAX_HEADER_NBYTES or data_offset > file_nbytes:
        raise CoreFormatError(f"header length {length} does not fit the {file_nbytes}-byte file")
    header = os.pread(fd, length, MAGIC_NBYTES + HEADER_LENGTH_NBYTES)
    if len(header) != length:
        raise CoreFormatError("file ends inside the header")
    return magic, header, data_offset


ParsedMessage = TypeVar("ParsedMessage", bound=pb_message.Message)


def parse_message(cls: type[ParsedMessage], data: bytes, what: str) -> ParsedMessage:
    """Parse `data` as `cls`; a parse failure or unknown field is a CoreFormatError."""
    msg = cls()
    try:
        msg.ParseFromString(data)
    except pb_message.DecodeError as exc:
        raise CoreFormatError(f"{what} does not parse: {exc}") from exc
    if has_unknown_fields(msg):
        raise CoreFormatError(f"{what} holds fields this reader does not know")
    return msg


def has_unknown_fields(msg: pb_message.Message) -> bool:
    """True when `msg` or any nested message carries unknown fields."""
    if len(unknown_fields.UnknownFieldSet(msg)):
        return True
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            values: Iterable = value.values() if field.message_type.fields_by_name["value"].message_type else ()
        elif field.is_repeated:
            values = value
        else:
            values = (value,)
        if any(has_unknown_fields(v) for v in values):
            return True
    return False


def check_tiling(spans: list[tuple[str, int, int]], data_nbytes: int) -> None:
    """Stored regions (name, offset, nbytes) must tile the data section exactly:
    no gaps, no overlap, nothing after the last one."""
    position = 0
    for name, offset, nbytes in sorted(spans, key=lambda span: span[1]):
        if offset != position:
            raise CoreFormatError(f"resource {name!r} stored at {offset}, expected {position} (gap or overlap)")
        position = offset + nbytes
    if position != data_nbytes:
        raise CoreFormatError(
            f"data section is {data_nbytes} bytes but resources cover {position} (trailing or missing bytes)"
        )
