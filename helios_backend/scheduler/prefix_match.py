"""Prefix lookup at (re)admission: complete published pages, then an exact-endpoint snapshot.

    tokens    |<- hit page ->|<- hit page ->|<- snapshot partial ->|<- computed ... ->|
    start   = len(pages) * page_tokens + len(snapshot.partial)

At least one token is always left to compute: its logits sample the next token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from helios_backend.scheduler.pages import PagePool
from helios_backend.scheduler.prefix_hash import chain_keys
from helios_backend.scheduler.snapshots import Snapshot, SnapshotStore


@dataclass(frozen=True)
class PrefixMatch:
    keys: list[bytes]                    # chain keys of every page that could have matched
    pages: list[int]                     # matched published pages (not yet referenced)
    snapshot: Snapshot | None            # continues exactly after `pages`

    def start(self, page_tokens: int) -> int:
        """The consumed endpoint the request resumes from."""
        return len(self.pages) * page_tokens + (len(self.snapshot.partial) if self.snapshot else 0)


def match_prefix(pool: PagePool, snapshots: SnapshotStore, seed: bytes, tokens: Sequence[int],
                 page_tokens: int) -> PrefixMatch:
    keys = chain_keys(seed, tokens, page_tokens, (len(tokens) - 1) // page_tokens)
    pages = pool.match(keys)
    snapshot = None
    if snapshots.capacity:
        after = keys[len(pages) - 1] if pages else seed
        snapshot = snapshots.match(after, tokens[len(pages) * page_tokens:len(tokens) - 1])
    return PrefixMatch(keys, pages, snapshot)
