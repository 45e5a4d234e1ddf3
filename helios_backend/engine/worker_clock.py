"""Where the scheduler worker's time goes, by phase (flare_worker_seconds_total{phase}).

The served rate is the engine's round rate times its lanes, and a round's wall time is the
worker's: building the next plan, packing and launching it, waiting for the executor,
applying the completion, handing the events on. The device time alone (bench/gpu_decode.py)
cannot say which of them stretches a round under load; these counters can, on the running
server, as seconds per second of each phase (rate over the metrics endpoint). `collect` is
blocked on the executor (the device, or the numpy executor computing): a worker that spends
most of a round there is device-bound, one that spends little is host-bound.

The clock is a few monotonic reads per round (~0.1 us each), far below a round's
cost; the metrics thread sees its totals at the loop's metrics cadence, not per round.
"""
from __future__ import annotations

import enum
import time

from helios_backend.engine.metrics import WORKER_PHASES, Op, Update, update


class Phase(enum.IntEnum):
    SCHEDULE = 0       # schedule() or pipeline_next(): the next round's plan
    LAUNCH = 1         # packing and launching a plan's submissions
    COLLECT = 2        # waiting for a round's main completion and validating it
    COMPLETE = 3       # Scheduler.complete: tokens, finishes, page publication
    DELIVER = 4        # handing the round's events to the sink (the response hub or the wire)


PHASE_LABEL = dict(zip(Phase, WORKER_PHASES))
assert all(label == p.name.lower() for p, label in PHASE_LABEL.items()), "metrics.WORKER_PHASES follows Phase"


class WorkerClock:
    """Nanoseconds per phase, owned by the worker thread; `updates()` gives the deltas since
    the last call as counter increments."""

    def __init__(self) -> None:
        self.ns = [0] * len(Phase)
        self._reported = [0] * len(Phase)
        self._mark = time.perf_counter_ns()

    def start(self) -> None:
        """Begin timing from now (after an idle wait, which belongs to no phase)."""
        self._mark = time.perf_counter_ns()

    def lap(self, phase: Phase) -> None:
        """The time since the last mark belongs to `phase`."""
        now = time.perf_counter_ns()
        self.ns[phase] += now - self._mark
        self._mark = now

    def updates(self) -> list[Update]:
        out: list[Update] = []
        for phase in Phase:
            delta = self.ns[phase] - self._reported[phase]
            if delta:
                self._reported[phase] = self.ns[phase]
                out.append(update("flare_worker_seconds_total", Op.ADD, delta / 1e9, phase=PHASE_LABEL[phase]))
        return out
