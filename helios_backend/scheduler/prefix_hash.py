"""The prefix hash chain over complete pages.

    page i's key = H(key of page i-1 || the page_tokens token ids of page i)

so equal keys mean equal token prefixes up to and including that page. The chain is
seeded with the core's cache identity so that pages of different cores never match.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16
_blake2b = hashlib.blake2b


def chain_seed(cache_fingerprint: bytes) -> bytes:
    return hashlib.blake2b(b"helios-prefix\0" + cache_fingerprint, digest_size=KEY_BYTES).digest()


_PACKERS: dict[int, struct.Struct] = {}


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """The ids as native int32 bytes: a Struct per count (a page's few ids: a fraction of
    numpy's conversion cost, and less than an array of C ints)."""
    packer = _PACKERS.get(len(ids))
    if packer is None:
        packer = _PACKERS[len(ids)] = struct.Struct(f"={len(ids)}i")
    return packer.pack(*ids)


def next_key(previous: bytes, page_tokens: Sequence[int]) -> bytes:
    """Key of one complete page given its predecessor's key (the ids as native int32 bytes)."""
    return _blake2b(previous + _ids_bytes(page_tokens), digest_size=KEY_BYTES).digest()


def chain_keys(seed: bytes, tokens: Sequence[int], page_tokens: int, pages: int) -> list[bytes]:
    """Keys of the first `pages` complete pages of `tokens`."""
    keys: list[bytes] = []
    key = seed
    for i in range(pages):
        key = next_key(key, tokens[i * page_tokens:(i + 1) * page_tokens])
        keys.append(key)
    return keys
