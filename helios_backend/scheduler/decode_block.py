"""The decode steady state as columns: a round's plain decode lanes held as arrays.

A round planned behind the one in flight (Scheduler.pipeline_next) is mostly the same
requests again, each one position further: one query token read from the slot's
device-owned pending token, sampling, no host values. `DecodeBlock` holds those lanes as
columns (requests, slots, generations, starts, output limits, token limits, page counts,
...) followed by a short list of explicit `Lane`s (the host-fed lanes a MIXED round
admits), so that planning, packing, validation and completion of such a round are a few
numpy operations over all lanes, with per-lane Python only for the lanes that open a page,
complete a page, finish or are new (docs/scheduler.md, host work per round).

It is a `Sequence[Lane]`: any code that reads it lane by lane gets `Lane` objects, built on
first access and kept, the same values the per-lane path builds (tests/test_decode_block.py
drives both paths and compares their plans and events). A block lane is plain
(`Request.columnar`): no grammar, mask or logit bias, no top logprobs, no host stops; its
request reads its pending token, is not fresh, and never restores or writes a snapshot.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain
from operator import attrgetter
from typing import overload

import numpy as np

from helios_backend.scheduler.plan import PENDING_TOKEN, Lane
from helios_backend.scheduler.request import Request

_SLOT, _GENERATION = attrgetter("slot"), attrgetter("generation")


# the rows of DecodeBlock.columns (int64 [COLUMNS, lanes])
SERIAL, SLOT, GENERATION, START, LIMIT, ROOM, PAGE_COUNT, OBSERVED, IGNORE_EOS = range(9)
COLUMNS = 9
ADVANCE = np.zeros((COLUMNS, 1), np.int64)       # a round further: START + 1, LIMIT and ROOM - 1, in one add
ADVANCE[START], ADVANCE[LIMIT], ADVANCE[ROOM] = 1, -1, -1
ADVANCE.flags.writeable = False


class DecodeBlock(Sequence[Lane]):
    """`count` plain decode lanes as columns, then `extra` explicit lanes (host-fed, admitted
    behind the round in flight). The columns are one int64 array [COLUMNS, count], so a round
    derives the next one's with a few numpy calls whatever its lanes:

        SERIAL, SLOT, GENERATION   the request and its slot assignment
        START                      first query position = consumed endpoint before the round
        LIMIT                      Lane.output_limit: tokens the request may still emit
        ROOM                       Request.token_limit - START: the round's token ends the request
                                   by length where ROOM <= 2 (it makes len(tokens) START + 2)
        PAGE_COUNT                 len(request.pages) once the round's pages are reserved
        OBSERVED, IGNORE_EOS       spec.observe_timestamps, spec.ignore_eos (0 / 1)

    Each row is also an attribute, a view of `columns` named in lower case: `serials`, `slots`,
    `generations`, `starts`, `limits`, `rooms`, `page_counts`, `observed`, `ignore_eos`.
    """

    __slots__ = ("requests", "columns", "extra", "_lanes", "serials", "slots", "generations", "starts", "limits",
                 "rooms", "page_counts", "observed", "ignore_eos", "source", "kept", "carried", "handed",
                 "settled")
    serials: np.ndarray
    slots: np.ndarray
    generations: np.ndarray
    starts: np.ndarray
    limits: np.ndarray
    rooms: np.ndarray
    page_counts: np.ndarray
    observed: np.ndarray
    ignore_eos: np.ndarray

    def __init__(self, requests: list[Request], columns: np.ndarray) -> None:
        self.requests = requests
        self.columns = columns
        # the rows as views, made once: a round reads them ~15 times (a view per read cost ~8 us a
        # round at 256 lanes); `columns` is never replaced, and writes into a view are its writes
        (self.serials, self.slots, self.generations, self.starts, self.limits, self.rooms,
         self.page_counts, self.observed, self.ignore_eos) = columns
        self.extra: list[Lane] = []
        self._lanes: list[Lane | None] = []
        # the fence by round (Scheduler._book, complete, fail): a request whose lane continues from
        # one block round into the next keeps the fence the first round took, so neither round
        # touches it; `source` the block this one advanced (`kept`: which of its lanes continue,
        # the first `carried` of this one), `handed` (on the source, once this one is booked):
        # its lanes whose fence the next round holds, `settled`: completed or failed
        self.source: DecodeBlock | None = None
        self.kept: np.ndarray | None = None
        self.carried = 0
        self.handed: np.ndarray | None = None
        self.settled = False

    @classmethod
    def of(cls, requests: list[Request], starts: Sequence[int], limits: Sequence[int]) -> "DecodeBlock":
        """Plain decode lanes of `requests` at `starts` with output limits `limits`: the columns
        gathered once (a round that follows a block derives its columns from it: `advance`)."""
        n = len(requests)
        # one int64 read per value (np.array of the rows' tuples first works out their shape and type)
        columns = np.fromiter(chain.from_iterable(
            (r.serial, r.slot, r.generation, start, limit, r.token_limit - start, len(r.pages),
             r.spec.observe_timestamps, r.spec.ignore_eos) for r, start, limit in zip(requests, starts, limits)),
            np.int64, COLUMNS * n)
        return cls(requests, columns.reshape(n, COLUMNS).T.copy())

    def advance(self, keep: np.ndarray) -> "DecodeBlock":
        """The next round of the lanes where `keep` (bool [count]) is true: one position further,
        one output token fewer; page counts as they are (the caller reserves opening pages)."""
        dropped = (~keep).nonzero()[0].tolist()
        if not dropped:
            block = DecodeBlock(list(self.requests), self.columns + ADVANCE)
        else:                                     # a few lanes emit their last token: delete those
            columns = self.columns.take(keep.nonzero()[0], axis=1)    # (a boolean index: twice the time)
            columns += ADVANCE
            requests = list(self.requests)
            for i in reversed(dropped):
                del requests[i]
            block = DecodeBlock(requests, columns)
        block.source, block.kept, block.carried = self, keep, len(block.requests)
        return block

    def joined(self, other: "DecodeBlock") -> "DecodeBlock":
        """This block's lanes, then `other`'s (neither has explicit lanes)."""
        if not other.requests:
            return self
        block = DecodeBlock(self.requests + other.requests, np.concatenate((self.columns, other.columns), axis=1))
        block.source, block.kept, block.carried = self.source, self.kept, self.carried
        return block

    def take_fence(self) -> list[Request]:
        """Booking this round: the requests whose fence it takes. A lane carried from its source
        round, still in flight, holds that round's fence (the source hands it over); the others,
        and every lane once the source has settled, take one each."""
        source = self.source
        if source is None or not self.carried or source.settled:
            return self.requests
        source.handed = self.kept
        return self.requests[self.carried:]

    def release_fence(self) -> list[Request]:
        """This round completes or fails: the requests whose fence it releases, those of the lanes
        it did not hand to the next round. A failed round hands back what its source handed it
        while the source is still in flight (the source then releases those itself)."""
        self.settled = True
        source = self.source
        if source is not None and self.carried and not source.settled and source.handed is self.kept:
            source.handed = None
            kept = self.requests[self.carried:]
        else:
            kept = self.requests
        self.source = None                        # settled: no chain of every block since the first
        handed = self.handed
        if handed is None:
            return kept
        if kept is not self.requests:
            raise RuntimeError("a round completed before the round it follows")
        return [self.requests[i] for i in (~handed).nonzero()[0].tolist()]

    @property
    def size(self) -> int:
        """The lanes held as columns (the first `count` of the sequence)."""
        return len(self.requests)

    def append(self, lane: Lane) -> None:
        """An explicit lane after the columns (RoundBuilder.add)."""
        self.extra.append(lane)

    def __len__(self) -> int:
        return len(self.requests) + len(self.extra)

    @overload
    def __getitem__(self, index: int) -> Lane: ...
    @overload
    def __getitem__(self, index: slice) -> list[Lane]: ...

    def __getitem__(self, index: int | slice) -> Lane | list[Lane]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("lane index out of range")
        k = len(self.requests)
        if index >= k:
            return self.extra[index - k]
        if not self._lanes:
            self._lanes = [None] * k
        lane = self._lanes[index]
        if lane is None:
            lane = self._lanes[index] = Lane(self.requests[index], int(self.slots[index]),
                                             int(self.generations[index]), int(self.starts[index]),
                                             [PENDING_TOKEN], True, int(self.limits[index]))
        return lane

    def __iter__(self) -> Iterator[Lane]:
        for i in range(len(self)):
            yield self[i]


def explicit_lanes(lanes: Sequence[Lane]) -> Sequence[Lane]:
    """The lanes not held as columns: a block's explicit tail, or every lane of a list."""
    return lanes.extra if isinstance(lanes, DecodeBlock) else lanes


_ENDS = attrgetter("end")
_SAMPLE = attrgetter("sample")


def lane_columns(lanes: Sequence[Lane]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(slots, generations, consumed endpoints after the round, sampling decisions) as int64
    arrays [lanes]: what a completion is checked against, from the columns where a block has them."""
    if isinstance(lanes, DecodeBlock):
        k, extra = lanes.size, lanes.extra
        cols = (lanes.slots, lanes.generations, lanes.starts + 1, np.ones(k, np.int64))
        if not extra:
            return cols
        rest = lane_columns(extra)
        return (np.concatenate((cols[0], rest[0])), np.concatenate((cols[1], rest[1])),
                np.concatenate((cols[2], rest[2])), np.concatenate((cols[3], rest[3])))
    n = len(lanes)
    return (np.fromiter(map(_SLOT, lanes), np.int64, n), np.fromiter(map(_GENERATION, lanes), np.int64, n),
            np.fromiter(map(_ENDS, lanes), np.int64, n), np.fromiter(map(_SAMPLE, lanes), np.int64, n))


def lane_requests(lanes: Sequence[Lane]) -> list[Request]:
    """The lanes' requests in lane order, without making a Lane of each column."""
    if isinstance(lanes, DecodeBlock):
        return [*lanes.requests, *(lane.request for lane in lanes.extra)]
    return [lane.request for lane in lanes]
