"""The numpy (and CPU) executor's all-reduce between rank processes: a star over the rank links.

At all-reduce i every peer sends rank 0 its region; rank 0 adds them to its own in rank
order (region += rank 1's, then rank 2's, ...) and sends the sum back to every peer, which
writes it over its region. The lockstep executor sums `rank 0 + rank 1 + ...` in the same
order and dtype, so a step of rank processes is bit-identical to the same step in one
process. Why a star of TCP messages and not a ring or shared memory: the regions are small
(tokens x hidden f32: 2 KiB per decode row), a step holds two per layer, and the ranks may
live on other hosts (OWN-15); no torch-free CPU collective library fits (NCCL needs GPUs,
gloo comes with torch, MPI needs its launcher). docs/rank-processes.md has the figures.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from helios_backend.ranks.wire import Kind, Link, RankLostError


class StarReduceRoot:
    """Rank 0's side: receive every peer's region, sum in rank order, send the sum back."""

    def __init__(self, links: Sequence[Link]) -> None:
        self.links = tuple(links)
        self._scratch: dict[tuple[int, str], np.ndarray] = {}

    def __call__(self, index: int, region: np.ndarray) -> None:
        key = (region.size, region.dtype.str)
        received = self._scratch.get(key)
        if received is None:
            received = self._scratch[key] = np.empty_like(region)
        for link in self.links:
            message = link.receive_into(Kind.REDUCE, received.data)
            if message.item != index:
                raise RankLostError(link.rank, f"sent all-reduce {message.item} during all-reduce {index} "
                                               "(the ranks are out of step)")
            region += received
        for link in self.links:
            link.send(Kind.REDUCE, item=index, payload=region.data)


class StarReduceLeaf:
    """A peer's side: send this rank's region, receive the sum in its place."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def __call__(self, index: int, region: np.ndarray) -> None:
        self.link.send(Kind.REDUCE, item=index, payload=region.data)
        message = self.link.receive_into(Kind.REDUCE, region.data)
        if message.item != index:
            raise RankLostError(0, f"sent all-reduce {message.item} during all-reduce {index}")


def root_page_agreement(links: Sequence[Link]) -> Callable[[int], int]:
    """Rank 0's agree_pages (CUDA): every rank backs the fewest pages any rank's memory fits."""
    def agree(mine: int) -> int:
        chosen = min([mine] + [link.receive(Kind.PAGES).value for link in links])
        for link in links:
            link.send(Kind.PAGES, value=chosen)
        return chosen
    return agree


def leaf_page_agreement(link: Link) -> Callable[[int], int]:
    """A peer's agree_pages: tell rank 0 what fits here, back what rank 0 chose."""
    def agree(mine: int) -> int:
        link.send(Kind.PAGES, value=mine)
        return link.receive(Kind.PAGES).value
    return agree
