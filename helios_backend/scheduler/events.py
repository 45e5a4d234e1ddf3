"""What the scheduler reports: token and terminal events, and its monotonic counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple, Sequence

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


@dataclass(frozen=True, slots=True, eq=False)
class TokenBlock:
    """One sampled token of each of several requests, in lane order: the Emitted events of a
    round's columnar decode lanes (scheduler/decode_block.py) as arrays, so that building and
    sending them costs the worker a few numpy calls instead of a tuple per token. `emitted()`
    is the same events one by one; None timestamps mean -1 (unobserved), None logprobs 0.0."""
    serials: np.ndarray                  # int64 [n]
    tokens: np.ndarray                   # int32 [n]
    timestamps_ns: np.ndarray | None     # int64 [n], -1 for unobserved requests
    logprobs: np.ndarray | None          # float32 [n]

    def to_wire(self) -> list[bytes | None]:
        """Its arrays as bytes (a numpy array pickles ~20x slower than its bytes)."""
        return [self.serials.astype(np.int64, copy=False).tobytes(), self.tokens.astype(np.int32, copy=False).tobytes(),
                None if self.timestamps_ns is None else self.timestamps_ns.astype(np.int64, copy=False).tobytes(),
                None if self.logprobs is None else self.logprobs.astype(np.float32, copy=False).tobytes()]

    @classmethod
    def from_wire(cls, parts: list[bytes | None]) -> "TokenBlock":
        serials, tokens, stamps, logprobs = parts
        assert serials is not None and tokens is not None
        return cls(np.frombuffer(serials, np.int64), np.frombuffer(tokens, np.int32),
                   None if stamps is None else np.frombuffer(stamps, np.int64),
                   None if logprobs is None else np.frombuffer(logprobs, np.float32))

    def emitted(self) -> list[Emitted]:
        n = len(self.serials)
        stamps = self.timestamps_ns.tolist() if self.timestamps_ns is not None else repeat(-1, n)
        logprobs = self.logprobs.tolist() if self.logprobs is not None else repeat(0.0, n)
        return list(map(Emitted._make, zip(self.serials.tolist(), self.tokens.tolist(), stamps, logprobs,
                                            repeat(None, n), repeat(None, n))))


@dataclass(frozen=True)
class Terminal:
    serial: int
    event: ep.TerminalEvent
    first_token: bool = False


Event = Emitted | Terminal
WorkerEvent = Emitted | Terminal | TokenBlock     # what the worker delivers (Scheduler.take_events(token_blocks=True))


def expand(events: Sequence[WorkerEvent]) -> list[Event]:
    """`events` with every TokenBlock replaced by its Emitted events, in order."""
    if not any(type(ev) is TokenBlock for ev in events):
        return list(events)                  # type: ignore[arg-type]
    out: list[Event] = []
    for ev in events:
        if type(ev) is TokenBlock:
            out.extend(ev.emitted())
        else:
            out.append(ev)                   # type: ignore[arg-type]
    return out


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
    # receipt stamps (monotonic ns, read by Scheduler.add) of requests first admitted by the last
    # scheduling call; the engine loop turns them into waits right after it (one clock read per
    # admitting round: building a round reads none)
    first_admission_receipts_ns: list[int] = field(default_factory=list)
    # receipt-to-admission waits (ns) since the metrics last drained them
    first_admission_waits_ns: list[int] = field(default_factory=list)

    def launched(self, operation: "cp.Operation.ValueType", count: int = 1) -> None:
        """A submission of `operation` was planned (negative: one planned was replaced)."""
        self.launches[operation] = self.launches.get(operation, 0) + count
