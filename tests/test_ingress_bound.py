"""The native ingress channel holds at most queue_capacity submissions that must queue (HTTP-4),
on top of those the free active places take at the next round, so it agrees with HTTP
admission (queue_capacity + max_active, HTTP-1).

The real EngineLoop and Scheduler over the simulated executor; the round in flight is held open
so that submissions pile up in the channel in front of the scheduler."""
from __future__ import annotations

import threading

from helios_proto import exchange_pb2 as ep

from helios_backend.engine.responses import ResponseHub, Stream
from helios_backend.engine.loop import EngineLoop, SynchronousRunner
from tests.test_rules_observation import Recorder, Updates
from tests.test_rules_scheduler import make, prompt_of, spec


class HeldRunner:
    """Runs rounds on the simulated executor, but the first one waits for `release`."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine
        self.started = threading.Event()
        self.release = threading.Event()

    def run(self, plan):  # type: ignore[no-untyped-def]
        self.started.set()
        assert self.release.wait(30)
        return self.engine.run(plan)


def run_burst(capacity: int, extra: int) -> tuple[dict[int, Recorder], list[int], int]:
    """Request 1 inside a held round, then a burst of (capacity + free places + extra) more;
    returns the senders, the serials rejected before the round ended, and the free places."""
    sched, engine = make()
    runner = HeldRunner(engine)
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Updates())
    worker = EngineLoop(sched, SynchronousRunner(runner.run), hub, Updates(), two_frames=False, ingress_capacity=capacity)
    hub.start()
    worker.start()
    free = sched.max_active - 1                      # request 1 holds one active place
    last = 1 + capacity + free + extra
    senders = {serial: Recorder() for serial in range(1, last + 1)}
    for serial, sender in senders.items():
        hub.register(Stream(serial, sender))
    try:
        worker.enqueue(1, spec(prompt_of(1, 6), max_tokens=3))
        assert runner.started.wait(10)               # request 1 is inside a held round
        for serial in range(2, last + 1):            # the burst while the worker is busy
            worker.enqueue(serial, spec(prompt_of(serial, 6), max_tokens=3))
        rejected_now = [s for s in range(2, last + 1) if senders[s].done.wait(0.5 if extra else 1)]
        runner.release.set()
        for serial in range(1, last + 1):
            assert senders[serial].done.wait(30)
    finally:
        runner.release.set()
        worker.stop()
        hub.stop()
    return senders, rejected_now, free


def test_ingress_channel_rejects_beyond_queue_capacity_while_a_round_runs():
    # spec: HTTP-4, HTTP-17, HTTP-21
    capacity = 4
    senders, rejected_now, free = run_burst(capacity, extra=3)
    last = 1 + capacity + free + 3
    assert rejected_now == [last - 2, last - 1, last]
    for serial in rejected_now:
        [final] = senders[serial].finals
        assert final.terminal.WhichOneof("outcome") == "rejected"
        assert final.terminal.rejected.reason == ep.REJECTION_REASON_QUEUE_FULL
    for serial in range(1, last - 2):                # the admitted ones all finish
        [final] = senders[serial].finals
        assert final.terminal.WhichOneof("outcome") == "finished"


def test_a_burst_of_queue_capacity_plus_free_places_is_admitted_whole():
    # spec: HTTP-1, HTTP-4, HTTP-5
    senders, rejected_now, _ = run_burst(capacity=4, extra=0)
    assert rejected_now == []
    outcomes = {senders[s].finals[0].terminal.WhichOneof("outcome") for s in senders}
    assert outcomes == {"finished"}
