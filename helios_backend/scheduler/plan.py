"""What one round submits: typed, executor-agnostic.

A round is one to three submissions, in order:

    [RESTORATION]  copy snapshot continuation rows into private writable pages
    [INITIALIZATION] reset the slots of (re)admitted lanes (histograms, pending token)
    main step      DECODE | PREFILL | MIXED, the chosen capacity variant

Each submission's lanes are in submission-row order; the completion records come back
in that order and are validated against it before any lane is retired.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.request import Request

PENDING_TOKEN = -1  # a query token the program takes from the slot's device-owned pending token


@dataclass(frozen=True)
class Variant:
    operation: "cp.Operation.ValueType"
    program: str
    rows: int                            # request rows (B)
    tokens: int                          # packed query tokens (T)
    # lanes that may be host-fed (prompt chunks): PREFILL all, DECODE none, MIXED one when the
    # program binds a mixed prefill row, else any (-1: derived from the operation by VariantTable)
    host_fed_rows: int = -1


@dataclass(frozen=True)
class RestoreCopy:
    source_row: int                      # snapshot continuation row
    page: int                            # destination private page
    page_index: int                      # its index in the lane's page table
    tokens: int                          # partial tokens copied (< page_tokens)


@dataclass(slots=True)
class Lane:
    request: Request
    slot: int
    generation: int
    start: int                           # consumed endpoint before the round = first query position
    tokens: list[int]                    # query ids; PENDING_TOKEN = device-owned pending token
    sample: bool                         # this lane samples after its last query token
    output_limit: int                    # tokens the request may still emit
    snapshot_row: int = -1               # continuation row written at the lane's endpoint
    restore: RestoreCopy | None = None
    initialize: bool = False             # first round since (re)admission

    @property
    def query_len(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Consumed endpoint after the round."""
        return self.start + len(self.tokens)

    @property
    def page_table(self) -> list[int]:
        """The request's page ids for positions [0, end): entry i covers
        [i * page_tokens, (i + 1) * page_tokens). Packing uploads only entries it has not
        sent for this (slot, generation) before (BND-33, BND-34)."""
        return self.request.pages


@dataclass
class Submission:
    variant: Variant
    lanes: Sequence[Lane]
    sequence: int = 0                    # assigned by the executor adapter (transport-owned)
    frame: int = 0
    frames_outstanding: int = 0          # executor frames in flight right after its launch (the runner counts)

    @property
    def operation(self) -> "cp.Operation.ValueType":
        return self.variant.operation


@dataclass
class RoundPlan:
    main: Submission
    restoration: Submission | None = None
    initialization: Submission | None = None
    preempted: list[Request] = field(default_factory=list)

    def submissions(self) -> list[Submission]:
        return [s for s in (self.restoration, self.initialization, self.main) if s is not None]
