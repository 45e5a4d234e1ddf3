"""The strict frame walker and decoder: any chunking of the stored bytes gives the same
answer as one piece (the walker's state survives every boundary)."""
from __future__ import annotations

import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_backend.core.frames import FrameWalker, decode_frame, new_compressor
from tests.core_helpers import random_bytes

# raw blocks (random), RLE blocks (runs), compressed blocks (text), over several 128 KiB blocks
PAYLOAD = random_bytes(200_000, seed=1) + bytes(300_000) + b"helios core frames " * 20_000
FRAME = new_compressor().compress(PAYLOAD)


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def test_walker_finds_the_exact_frame_end_byte_by_byte():
    # spec: FMT-17, FMT-18, FMT-19
    walker = FrameWalker()
    for index in range(len(FRAME)):
        walker.feed(FRAME[index : index + 1])
    walker.finish()
    assert walker.frame_end == len(FRAME)
    assert walker.header.content_nbytes == len(PAYLOAD) and walker.header.has_checksum


def test_payload_spans_raw_rle_and_compressed_blocks():
    # the control for the property below: all three block types really occur
    kinds = set()
    position = zstandard.frame_header_size(FRAME)
    while True:
        word = int.from_bytes(FRAME[position : position + 3], "little")
        kind, size = (word >> 1) & 3, word >> 3
        kinds.add(kind)
        position += 3 + (1 if kind == 1 else size)
        if word & 1:
            break
    assert kinds == {0, 1, 2}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(FRAME)), max_size=40))
def test_any_chunking_decodes_the_same(cuts):
    # spec: FMT-5, FMT-20 (streaming equals one-shot for every chunking)
    assert b"".join(decode_frame(_pieces(FRAME, cuts), len(PAYLOAD))) == PAYLOAD
