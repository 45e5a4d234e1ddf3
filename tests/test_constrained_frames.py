"""flare_constrained_max_inflight is measured where frames are launched (the program runner).

Served through the real engine (numpy executor, both execution frames): the gauge is the
most executor frames the runner had in flight right after a successful constrained
submission, exported by RoundMetrics. A round that put two constrained frames in flight
is reported as two, so MET-10's "never above one" is a measurement that can fail.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from helios_proto import exchange_pb2 as ep

from helios_backend.engine.responses import Stream
from helios_backend.engine.round_metrics import RoundMetrics
from helios_backend.scheduler.request import RequestSpec, SamplingSettings

PROMPT = (1, 9690, 253, 28, 17)
ANY_TEXT = "start: /(.|\\n)*/"                 # a Lark grammar every output satisfies


class _Final:
    """A response sender that only tells when the final response went out."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


@pytest.fixture()
def engine(smollm2_core):  # type: ignore[no-untyped-def]
    from helios_backend.engine.engine import Engine
    from helios_backend.engine.settings import StartupOptions
    from tests.engine_fixtures import ACCEPTANCE

    runtime = Engine.start(StartupOptions(smollm2_core, ACCEPTANCE))
    yield runtime
    runtime.stop()


def _serve(runtime, serial: int, spec: RequestSpec, grammar: object = None) -> None:  # type: ignore[no-untyped-def]
    sender = _Final()
    runtime.add_request(spec, Stream(serial, sender), grammar)
    assert sender.done.wait(60)


def _exported(runtime) -> float:  # type: ignore[no-untyped-def]
    """The gauge's value as RoundMetrics exports it (startup value, then the last update)."""
    metrics = RoundMetrics(runtime.scheduler)
    value = 0.0
    for name, _labels, _op, level in metrics.capacity() + metrics.collect():
        if name == "flare_constrained_max_inflight":
            value = level
    return value


def test_constrained_rounds_keep_one_frame_in_flight(engine):
    # spec: MET-8, MET-9, MET-10, MET-11
    counters = engine.scheduler.counters
    _serve(engine, 1, RequestSpec(PROMPT, 6, SamplingSettings()))
    assert counters.pipelined > 0                         # plain decode did use the second frame
    assert counters.constrained_max_inflight == 0 and _exported(engine) == 0
    grammar = engine.grammar_session(ep.Grammar(kind=ep.GRAMMAR_KIND_LARK, text=ANY_TEXT))
    assert grammar is not None
    pipelined = counters.pipelined
    _serve(engine, 2, RequestSpec(PROMPT, 6, SamplingSettings(), constrained=True), grammar)
    assert counters.pipelined == pipelined                # completion feedback for the constrained lane
    assert counters.constrained_max_inflight == 1 and _exported(engine) == 1
    _serve(engine, 3, RequestSpec(PROMPT, 6, SamplingSettings()))
    assert counters.constrained_max_inflight == 1         # the worker's lifetime, not per request


def test_two_constrained_frames_in_flight_are_reported(engine):
    # spec: MET-8, MET-10
    # A constrained request whose matcher the scheduler does not hold is pipelined like a plain
    # decode: its lanes then run on both frames at once, and the measurement says so.
    counters = engine.scheduler.counters
    _serve(engine, 1, RequestSpec(PROMPT, 6, SamplingSettings(), constrained=True))
    assert counters.pipelined > 0
    assert counters.constrained_max_inflight == 2 and _exported(engine) == 2
