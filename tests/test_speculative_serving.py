"""Speculation as a startup choice of the serving runtime (Engine), on a real core.

A core prepared with SPECULATIVE programs serves speculative rounds only when the startup
options select a width above one; history drafting is a startup option that needs them.
The served tokens equal plain serving of the same core token for token.
"""
from __future__ import annotations

import numpy as np
import pytest

from helios_backend.scheduler.request import LogitBias, RequestSpec, SamplingSettings
from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.scheduler.speculative_scheduler import SpeculativeScheduler
from helios_backend.engine.responses import Stream
from helios_backend.engine.engine import Engine, StartupError
from helios_backend.engine.settings import StartupOptions
from tests.engine_fixtures import ACCEPTANCE, engine_test_options
from tests.test_rules_scheduler import Sender

VARIANTS = ((2, 1, 0, 2), (2, 4, 3, 8))        # (B, W, D, P)
REPEATING = tuple(range(100, 110)) * 3          # the model continues the cycle: drafts get accepted


@pytest.fixture(scope="module")
def speculative_core(tmp_path_factory: pytest.TempPathFactory):
    from ignition.cli import prepare_core

    directory = tmp_path_factory.mktemp("speculative-core")
    target = directory / "speculative.core"
    prepare_core("smollm2-135m-instruct", target, engine_test_options(speculative_variants=VARIANTS),
                 key_path=str(directory / "publisher.pem"), kernels=False)
    return target


def _serve(core, spec: RequestSpec | None = None, **options) -> tuple[list[int], list[str], type]:
    runtime = Engine.start(StartupOptions(core, ACCEPTANCE, **options))
    launched: list[str] = []
    launch = runtime.model.executor.launch

    def recording_launch(program, frame):  # type: ignore[no-untyped-def]
        launched.append(program)
        return launch(program, frame)

    runtime.model.executor.launch = recording_launch  # type: ignore[method-assign]
    sender = Sender()
    try:
        runtime.add_request(spec or RequestSpec(REPEATING, 12, SamplingSettings()), Stream(1, sender))
        assert sender.done.wait(120)
    finally:
        runtime.stop(drain=True)
    assert sender.finals[0].terminal.WhichOneof("outcome") == "finished", sender.finals[0]
    return sender.tokens, launched, type(runtime.scheduler)


def test_served_speculation_equals_plain_serving(speculative_core):
    # spec: SPEC-1, SPEC-3, SRV-8, SRV-11, SRV-13
    plain, plain_programs, plain_kind = _serve(speculative_core, speculative_width=1)
    drafted, drafted_programs, drafted_kind = _serve(speculative_core, speculative_width=4, history_drafting=True)
    assert plain_kind is Scheduler and drafted_kind is SpeculativeScheduler
    assert not any(p.startswith("speculative") for p in plain_programs)
    assert any(p.startswith("speculative") for p in drafted_programs)
    assert drafted == plain and len(plain) == 12
    # accepted drafts emit several tokens per launch: fewer launches than plain decode
    assert len(drafted_programs) < len(plain_programs)


def test_a_biased_request_is_never_speculated(speculative_core):
    # spec: SPEC-1, BND-9
    # the speculative programs have no logit-bias input: a biased request decodes plainly, and
    # its tokens are those of plain serving (the bias bans the cycle's next token)
    _, drafted_programs, _ = _serve(speculative_core, speculative_width=4, history_drafting=True)
    banned = LogitBias(np.array([105], np.int32), np.array([-100.0], np.float32))
    spec = RequestSpec(REPEATING, 12, SamplingSettings(), logit_bias=banned)
    plain, _, _ = _serve(speculative_core, spec, speculative_width=1)
    biased, programs, kind = _serve(speculative_core, spec, speculative_width=4, history_drafting=True)
    assert kind is SpeculativeScheduler and any(p.startswith("speculative") for p in drafted_programs)
    assert not any(p.startswith("speculative") for p in programs)
    assert biased == plain and 105 not in biased


def test_history_drafting_without_a_wider_width_fails_startup(speculative_core):
    # spec: SRV-12
    with pytest.raises(StartupError, match="history_drafting"):
        Engine.start(StartupOptions(speculative_core, ACCEPTANCE, speculative_width=1,
                                           history_drafting=True))


def test_a_core_without_speculative_programs_serves_plain_rounds(smollm2_core):
    # spec: SPEC-3, SRV-15
    tokens, programs, kind = _serve(smollm2_core)
    assert kind is Scheduler and tokens
    assert not any(p.startswith("speculative") for p in programs)
