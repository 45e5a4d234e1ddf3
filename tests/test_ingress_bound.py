"""The native ingress channel holds at most queue_capacity submissions (HTTP-4).

The real EngineLoop and Scheduler over the simulated executor; the round in flight is held open
so that submissions pile up in the channel in front of the scheduler."""
from __future__ import annotations

import threading

from helios_proto import transport_pb2 as tp

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


def test_ingress_channel_rejects_beyond_queue_capacity_while_a_round_runs():
    # spec: HTTP-4, HTTP-17, HTTP-21
    sched, engine = make()
    capacity = 4
    runner = HeldRunner(engine)
    hub = ResponseHub(on_cancel=lambda s: None, metrics=Updates())
    worker = EngineLoop(sched, SynchronousRunner(runner.run), hub, Updates(), two_frames=False, ingress_capacity=capacity)
    hub.start()
    worker.start()
    senders = {serial: Recorder() for serial in range(1, capacity + 5)}
    for serial, sender in senders.items():
        hub.register(Stream(serial, sender))
    try:
        worker.enqueue(1, spec(prompt_of(1, 6), max_tokens=3))
        assert runner.started.wait(10)               # request 1 is inside a held round
        for serial in range(2, capacity + 5):        # capacity + 3 more while the worker is busy
            worker.enqueue(serial, spec(prompt_of(serial, 6), max_tokens=3))
        rejected_now = [s for s in range(2, capacity + 5) if senders[s].done.wait(2)]
        assert rejected_now == [capacity + 2, capacity + 3, capacity + 4]
        for serial in rejected_now:
            [final] = senders[serial].finals
            assert final.terminal.WhichOneof("outcome") == "rejected"
            assert final.terminal.rejected.reason == tp.REJECTION_REASON_QUEUE_FULL
        runner.release.set()
        for serial in range(1, capacity + 2):        # the admitted ones all finish
            assert senders[serial].done.wait(20)
            [final] = senders[serial].finals
            assert final.terminal.WhichOneof("outcome") == "finished"
    finally:
        runner.release.set()
        worker.stop()
        hub.stop()
