"""The round being built: one value passed through every call that adds a lane to it.

    round_ = RoundBuilder(row_limit)            # schedule(): planned from completion feedback
    round_ = RoundBuilder.decoding(row_limit, lanes, behind_inflight=True)   # pipeline_next
    n = round_.fit_chunk(variants, want, pending_one)       # the chunk of a request that fits
    round_.add(lane, pending)

It keeps the round's running sums (rows, packed tokens, host-fed lanes, lanes to initialize),
so fitting N lanes is O(N), not O(N^2), and says how the round is planned: `fit_chunk` is the
one place where planning behind a round in flight changes what fits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.decode_block import DecodeBlock
from helios_backend.scheduler.plan import Lane
from helios_backend.scheduler.request import Request
from helios_backend.scheduler.variants import VariantTable


def reads_pending(req: Request, n: int, device_pending_token: bool) -> bool:
    """A one-token decode whose input is the slot's device-owned pending token (not host-fed)."""
    return device_pending_token and n == 1 and req.device_pending and req.computed == len(req.tokens) - 1


@dataclass(slots=True)
class RoundBuilder:
    row_limit: int                       # lanes the round may take
    # planned behind a round in flight (the second execution frame): its decode lanes' inputs
    # are still on the device, so no PREFILL variant, and a second prompt goes in whole
    behind_inflight: bool = False
    lanes: list[Lane] | DecodeBlock = field(default_factory=list)   # a block: columnar decode lanes first
    tokens: int = 0                      # packed query tokens
    host_fed: int = 0                    # lanes that do not read their device-owned pending token
    initializing: int = 0                # lanes (re)admitted for this round (INITIALIZATION rows)

    @classmethod
    def decoding(cls, row_limit: int, lanes: list[Lane] | DecodeBlock, behind_inflight: bool) -> RoundBuilder:
        """A round that starts with `lanes`, each one query token read from its slot's
        device-owned pending token (none host-fed): the sums without a call per lane."""
        return cls(row_limit, behind_inflight, lanes, tokens=len(lanes))

    @property
    def rows(self) -> int:
        return len(self.lanes)

    @property
    def full(self) -> bool:
        return len(self.lanes) >= self.row_limit

    def add(self, lane: Lane, pending: bool) -> None:
        """Append `lane`; `pending`: it reads its device-owned pending token (not host-fed)."""
        self.lanes.append(lane)
        self.tokens += len(lane.tokens)
        if not pending:
            self.host_fed += 1
        if lane.initialize:
            self.initializing += 1

    def fit_chunk(self, variants: VariantTable, want: int, pending_one: bool) -> int:
        """The largest chunk <= want that keeps the round inside some prepared variant;
        `pending_one`: a one-token chunk of this request reads its device-owned pending token."""
        if want <= 0:
            return 0
        rows, used, host_fed = len(self.lanes), self.tokens, self.host_fed
        behind = self.behind_inflight
        # the whole chunk first (the largest candidate below): most admissions fit it, without
        # the candidates' set and sort
        variant = variants.choose_shape(rows + 1, used + want, host_fed if want == 1 and pending_one else host_fed + 1)
        if variant is not None and not (behind and variant.operation == cp.OPERATION_PREFILL):
            return want
        candidates = {want, 1}
        for v in variants.main_variants:
            if 0 < v.tokens - used < want:
                candidates.add(v.tokens - used)
        candidates.discard(want)
        for n in sorted(candidates, reverse=True):
            if behind and host_fed and n < want:
                # a second prompt of a round behind the one in flight goes in whole: a part
                # would need its next chunk by completion feedback, stopping the second frame
                continue
            fed = host_fed if n == 1 and pending_one else host_fed + 1
            variant = variants.choose_shape(rows + 1, used + n, fed)
            if variant is not None and not (behind and variant.operation == cp.OPERATION_PREFILL):
                return n
        return 0
