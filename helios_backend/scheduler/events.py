"""What the scheduler reports: token and terminal events, and its monotonic counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep


class Emitted(NamedTuple):
    """One sampled token of one request (one per lane per round: a tuple, cheap to build)."""
    serial: int
    token: int
    timestamp_ns: int                    # -1 for unobserved requests (no clock read)
    logprob: float
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None


@dataclass(frozen=True)
class Terminal:
    serial: int
    event: ep.TerminalEvent
    first_token: bool = False


Event = Emitted | Terminal


@dataclass
class SchedulerCounters:
    """Monotonic counters since startup; the server turns them into metrics."""
    admitted: int = 0
    preemptions: int = 0
    readmissions: int = 0
    lookup_tokens: int = 0               # prompt tokens looked up in the prefix cache
    reused_tokens: int = 0               # of which served from pages or snapshots
    launches: dict[cp.Operation.ValueType, int] = field(default_factory=dict)   # submissions
    finished: dict[ep.FinishReason.ValueType, int] = field(default_factory=dict)   # requests
    failed: int = 0
    mixed_grammar_decode_steps: int = 0
    constrained_max_inflight: int = 0
    generated_tokens: int = 0
    pipelined: int = 0                   # rounds submitted on the second frame
    # receipt stamps (monotonic ns) of requests first admitted by the last scheduling call; the
    # engine loop turns them into waits right after it (one clock read per admitting round)
    first_admission_receipts_ns: list[int] = field(default_factory=list)
    # receipt-to-admission waits (ns) since the metrics last drained them
    first_admission_waits_ns: list[int] = field(default_factory=list)
