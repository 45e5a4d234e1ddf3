"""One zstd frame per resource: the encoder and a strict, streaming frame walker.

The walker follows the frame's block headers (RFC 8878) over the bytes as they
stream past, so it knows exactly where the one frame ends without buffering it:

    magic(4) | frame header(2..14) | block header(3) + block body ... last block | [checksum(4)]

Anything after the last block (and its checksum) is an extra frame or trailing
bytes; input that ends earlier is a truncated frame. The decoder itself runs
with its window capped at 8 MiB and never sees bytes beyond the frame end.
"""
from __future__ import annotations

import dataclasses
import os
from typing import IO, Callable, Iterable, Iterator, cast

import zstandard

from .constants import MAX_WINDOW_NBYTES, READ_NBYTES, ZSTD_LEVEL
from .errors import (
    DecodedLengthError,
    ExtraFrameError,
    FrameError,
    TrailingBytesError,
    TruncatedFrameError,
    WindowTooLargeError,
)

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SKIPPABLE_MAGIC_LOW = 0x184D2A50         # 0x184D2A50..0x184D2A5F, little endian u32
_BLOCK_HEADER_NBYTES = 3
_CHECKSUM_NBYTES = 4
_MAX_FRAME_HEADER_NBYTES = 18             # magic + largest frame header
_BLOCK_RLE = 1
_BLOCK_RESERVED = 3


MAX_COMPRESS_WORKERS = 8  # bounds the compressor's job buffers (a few MiB per worker)


def new_compressor() -> zstandard.ZstdCompressor:
    """The writer's compressor: level 3, content size and checksum in the frame.

    Multi-threaded zstd still writes one frame, and its output is identical for any
    worker count >= 1, so cores stay byte-for-byte reproducible across machines.
    """
    workers = max(1, min(MAX_COMPRESS_WORKERS, os.cpu_count() or 1))
    return zstandard.ZstdCompressor(
        level=ZSTD_LEVEL, write_content_size=True, write_checksum=True, threads=workers
    )


class _SinkWriter:
    """The file-like end zstandard's stream writer pushes compressed bytes into."""

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self._sink = sink

    def write(self, data: bytes | memoryview) -> int:
        self._sink(bytes(data))
        return len(data)


def compress_stream(pieces: Iterable[bytes], decoded_nbytes: int, sink: Callable[[bytes], None]) -> None:
    """Compress `pieces` (exactly `decoded_nbytes` in all) into one frame, streaming to `sink`.

    The stream writer hands output on as each multi-threaded job completes (a
    compressobj would hold the whole frame until flush), so memory stays bounded.
    """
    # zstandard calls only write() on its writer: _SinkWriter is that much of an IO[bytes]
    writer = new_compressor().stream_writer(cast(IO[bytes], _SinkWriter(sink)), size=decoded_nbytes,
                                            closefd=False)
    for piece in pieces:
        writer.write(piece)
    writer.flush(zstandard.FLUSH_FRAME)


def _is_frame_magic(prefix: bytes) -> bool:
    if prefix[:4] == ZSTD_MAGIC:
        return True
    return len(prefix) >= 4 and (int.from_bytes(prefix[:4], "little") & 0xFFFFFFF0) == _SKIPPABLE_MAGIC_LOW


@dataclasses.dataclass
class FrameHeader:
    header_nbytes: int          # magic + frame header
    window_nbytes: int
    content_nbytes: int | None  # None when the frame does not declare it
    has_checksum: bool


def parse_frame_header(prefix: bytes) -> FrameHeader:
    """Parse the frame header from the first bytes of a frame (18 suffice)."""
    if prefix[:4] != ZSTD_MAGIC:
        raise FrameError("stored bytes do not start with a zstd frame")
    try:
        header_nbytes = zstandard.frame_header_size(prefix)
        params = zstandard.get_frame_parameters(prefix)
    except zstandard.ZstdError as exc:
        if len(prefix) < _MAX_FRAME_HEADER_NBYTES:
            raise TruncatedFrameError("zstd frame header is truncated") from exc
        raise FrameError(f"bad zstd frame header: {exc}") from exc
    if params.dict_id:
        raise FrameError("zstd frame needs a dictionary; resources are self-contained")
    content = params.content_size
    known = content not in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR)
    return FrameHeader(header_nbytes, params.window_size, content if known else None, bool(params.has_checksum))


class FrameWalker:
    """Tracks one zstd frame's block structure over streamed bytes.

    feed() every stored byte in order, then finish(). Raises TruncatedFrameError,
    ExtraFrameError, TrailingBytesError or WindowTooLargeError; `frame_end` is the
    frame's length once the last block (and checksum) has been seen.
    """

    def __init__(self) -> None:
        self._pending = bytearray()   # bytes of a header not yet complete
        self._position = 0            # stored bytes consumed
        self._skip = 0                # block body bytes still to pass
        self._state = "frame-header"  # frame-header | block-header | block-body | checksum | done
        self.header: FrameHeader | None = None
        self._last_block = False
        self.frame_end: int | None = None
        self._extra = bytearray()     # first bytes after the frame end, to name the error
        self.excess_nbytes = 0        # stored bytes after the frame end

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            if self._state == "done":
                self._extra += view[: 4 - len(self._extra)]
                self.excess_nbytes += len(view)
                return
            if self._state == "block-body":
                step = min(self._skip, len(view))
                self._skip -= step
                self._position += step
                view = view[step:]
                if self._skip == 0:
                    self._end_block()
                continue
            need = self._needed()
            take = min(need - len(self._pending), len(view))
            self._pending += view[:take]
            self._position += take
            view = view[take:]
            if len(self._pending) >= self._needed():
                self._consume_header()

    def _needed(self) -> int:
        if self._state == "frame-header":
            if len(self._pending) < 5:
                return 5
            try:
                return zstandard.frame_header_size(bytes(self._pending))
            except zstandard.ZstdError as exc:
                raise FrameError(f"bad zstd frame header: {exc}") from exc
        if self._state == "block-header":
            return _BLOCK_HEADER_NBYTES
        return _CHECKSUM_NBYTES

    def _consume_header(self) -> None:
        raw = bytes(self._pending)
        self._pending.clear()
        if self._state == "frame-header":
            self.header = parse_frame_header(raw)
            if self.header.window_nbytes > MAX_WINDOW_NBYTES:
                raise WindowTooLargeError(
                    f"zstd frame window {self.header.window_nbytes} bytes exceeds the {MAX_WINDOW_NBYTES}-byte cap"
                )
            self._state = "block-header"
        elif self._state == "block-header":
            word = int.from_bytes(raw, "little")
            self._last_block = bool(word & 1)
            block_type = (word >> 1) & 3
            size = word >> 3
            if block_type == _BLOCK_RESERVED:
                raise FrameError("zstd block of reserved type")
            self._skip = 1 if block_type == _BLOCK_RLE else size
            self._state = "block-body"
            if self._skip == 0:
                self._end_block()
        else:  # checksum
            self._finish_frame()

    def _end_block(self) -> None:
        if not self._last_block:
            self._state = "block-header"
        elif self.header is not None and self.header.has_checksum:
            self._state = "checksum"
        else:
            self._finish_frame()

    def _finish_frame(self) -> None:
        self._state = "done"
        self.frame_end = self._position

    def _raise_after_end(self) -> None:
        if _is_frame_magic(bytes(self._extra)) or ZSTD_MAGIC.startswith(bytes(self._extra)):
            raise ExtraFrameError(f"another frame follows the resource frame at byte {self.frame_end}")
        raise TrailingBytesError(
            f"{self.excess_nbytes} trailing bytes follow the resource frame at byte {self.frame_end}"
        )

    def finish(self) -> None:
        """Call after the last stored byte: the frame must have ended exactly there."""
        if self._state == "done":
            if self.excess_nbytes:
                self._raise_after_end()
            return
        if self._state == "frame-header" and self._position == 0:
            raise TruncatedFrameError("resource has no stored bytes (empty frame)")
        raise TruncatedFrameError(f"zstd frame truncated after {self._position} stored bytes")


class _ChunkSource:
    """A read()-able view over verified stored chunks for zstandard's stream reader."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = memoryview(b"")

    def has_unread(self) -> bool:
        return bool(self._buffer)

    def read(self, size: int = -1) -> bytes:
        while not self._buffer:
            nxt = next(self._chunks, None)
            if nxt is None:
                return b""
            self._buffer = memoryview(nxt)
        if size < 0 or size >= len(self._buffer):
            out, self._buffer = self._buffer, memoryview(b"")
        else:
            out, self._buffer = self._buffer[:size], self._buffer[size:]
        return bytes(out)


def decode_frame(stored_chunks: Iterable[bytes], decoded_nbytes: int) -> Iterator[bytes]:
    """Decode one strict zstd frame from verified stored chunks, yielding decoded pieces.

    `stored_chunks` yields the stored bytes in order, each already checked against its
    commitment. The walker cuts the stream at the frame end (rejecting anything after
    it) before the decoder sees it; the decoded total must equal `decoded_nbytes`.
    """
    walker = FrameWalker()

    def check_declared_length() -> None:
        if walker.header is not None and walker.header.content_nbytes not in (None, decoded_nbytes):
            raise DecodedLengthError(
                f"frame declares {walker.header.content_nbytes} decoded bytes, signed length is {decoded_nbytes}"
            )

    def walked() -> Iterator[bytes]:
        # the decoder sees only bytes up to the frame end; the excess is judged at finish()
        for chunk in stored_chunks:
            before = walker.excess_nbytes
            walker.feed(chunk)
            check_declared_length()  # before any decoding: the header is in the first chunk
            excess = walker.excess_nbytes - before
            in_frame = chunk[: len(chunk) - excess] if excess else chunk
            if in_frame:
                yield in_frame
        walker.finish()

    source_iter = walked()
    source = _ChunkSource(source_iter)
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_NBYTES)
    produced = 0
    try:
        # zstandard calls only read() on its source: _ChunkSource is that much of an IO[bytes]
        reader = dctx.stream_reader(cast(IO[bytes], source), read_size=READ_NBYTES, read_across_frames=False)
        while True:
            piece = reader.read(READ_NBYTES)
            if not piece:
                break
            produced += len(piece)
            if produced > decoded_nbytes:
                raise DecodedLengthError(f"frame decodes to more than the signed {decoded_nbytes} bytes")
            yield piece
    except zstandard.ZstdError as exc:
        message = str(exc)
        if "too much memory" in message or "window" in message.lower():
            raise WindowTooLargeError(f"zstd frame rejected by the {MAX_WINDOW_NBYTES}-byte window cap: {exc}") from exc
        raise FrameError(f"zstd frame does not decode: {exc}") from exc
    # the decoder and the walker must agree on where the frame ends: in-frame bytes the
    # decoder never asked for mean they disagree; bytes after the end raise from the walker
    if source.has_unread():
        raise FrameError("zstd decoder stopped before the end of the frame's blocks")
    for leftover in source_iter:
        if leftover:
            raise FrameError("zstd decoder stopped before the end of the frame's blocks")
    if produced != decoded_nbytes:
        raise DecodedLengthError(f"frame decodes to {produced} bytes, signed length is {decoded_nbytes}")
