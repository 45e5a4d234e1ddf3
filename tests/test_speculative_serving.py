"""Speculation as a startup choice of the serving runtime (Engine), on a real core.

A core prepared with SPECULATIVE programs serves speculative rounds only when the startup
options select a width above one; history drafting is a startup option that needs them.
The served tokens equal plain serving of the same core token for token.
"""
from __future__ import annotations

import numpy as np
import pytest

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.exchange import OUT_EVENT, OUT_LOGPROBS, OUT_TIMESTAMPS, OUT_TOKENS, decode_event
from helios_backend.scheduler.request import LogitBias, RequestSpec, SamplingSettings, StopSettings
from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.scheduler.speculative_scheduler import DraftingCounters, SpeculativeScheduler
from helios_backend.scheduler.speculative_width import QUIET_ROUNDS, WidthPolicy
from helios_backend.engine.responses import Stream
from helios_backend.engine.engine import Engine, StartupError
from helios_backend.engine.settings import StartupOptions
from tests.engine_fixtures import ACCEPTANCE, engine_test_options
from tests.test_rules_scheduler import Sender

VARIANTS = ((2, 1, 0, 2), (2, 4, 3, 8))        # (B, W, D, P)
# the adaptive width's programs: widths 4 and 8 for up to 4 rows (engine_test_options' decode rows)
ADAPTIVE = tuple((b, w, w - 1, b * w) for b in (1, 2, 4) for w in (4, 8)) + ((4, 1, 0, 4),)
REPEATING = tuple(range(100, 110)) * 3          # the model continues the cycle: drafts get accepted
ANY_TEXT = "start: /(.|\\n)*/"                 # a Lark grammar every output satisfies


def _core(tmp_path_factory: pytest.TempPathFactory, name: str, variants: tuple) -> object:
    from ignition.cli import prepare_core

    directory = tmp_path_factory.mktemp(name)
    target = directory / f"{name}.core"
    prepare_core("smollm2-135m-instruct", target, engine_test_options(speculative_variants=variants),
                 key_path=str(directory / "publisher.pem"), kernels=False)
    return target


@pytest.fixture(scope="module")
def speculative_core(tmp_path_factory: pytest.TempPathFactory):
    return _core(tmp_path_factory, "speculative", VARIANTS)


@pytest.fixture(scope="module")
def adaptive_core(tmp_path_factory: pytest.TempPathFactory):
    return _core(tmp_path_factory, "adaptive", ADAPTIVE)


class Recorder:
    """A response sender that keeps every output array."""

    def __init__(self) -> None:
        import threading

        self.arrays: dict[str, list] = {OUT_TOKENS: [], OUT_LOGPROBS: [], OUT_TIMESTAMPS: []}
        self.finals: list[object] = []
        self.done = threading.Event()

    def send(self, arrays, final):  # type: ignore[no-untyped-def]
        for name, kept in self.arrays.items():
            if name in arrays:
                kept.extend(arrays[name].tolist())
        if final:
            self.finals.append(decode_event(arrays[OUT_EVENT]))
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def _started(core, **options):  # type: ignore[no-untyped-def]
    """An Engine on `core` whose executor records the programs it launches."""
    # the fixed cost model: width choices that do not depend on how fast this machine runs
    runtime = Engine.start(StartupOptions(core, ACCEPTANCE, speculative_row_cost=0.05, **options))
    launched: list[str] = []
    launch = runtime.model.executor.launch

    def recording_launch(program, frame):  # type: ignore[no-untyped-def]
        launched.append(program)
        return launch(program, frame)

    runtime.model.executor.launch = recording_launch  # type: ignore[method-assign]
    return runtime, launched


def _serve_many(core, specs: list[RequestSpec], grammar: object = None, logprobs: bool = False,
                drafting: list[DraftingCounters] | None = None, **options) -> tuple[list[Recorder], list[str]]:
    """Serve `specs` at once (one batch); each request's recorder and the programs launched (the
    speculative scheduler's counters appended to `drafting`)."""
    runtime, launched = _started(core, **options)
    senders = [Recorder() for _ in specs]
    try:
        for serial, (spec, sender) in enumerate(zip(specs, senders), start=1):
            runtime.add_request(spec, Stream(serial, sender, timestamps=spec.observe_timestamps,
                                             logprobs=logprobs), grammar)
        for sender in senders:
            assert sender.done.wait(300)
    finally:
        runtime.stop(drain=True)
    for sender in senders:
        assert sender.finals[0].terminal.WhichOneof("outcome") == "finished", sender.finals[0]
    if drafting is not None:
        assert isinstance(runtime.scheduler, SpeculativeScheduler)
        drafting.append(runtime.scheduler.drafting)
    return senders, launched


def _serve(core, spec: RequestSpec | None = None, **options) -> tuple[list[int], list[str], type]:
    runtime, launched = _started(core, **options)
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


def test_speculative_variants_load_only_with_history_drafting(speculative_core):
    # spec: SRV-11
    """Drafting is the one use of the SPECULATIVE variants: off, none is loaded, bound or captured
    (an executor binds the model's graphs' programs); on, every captured width is."""
    def loaded(**options):  # type: ignore[no-untyped-def]
        runtime, _ = _started(speculative_core, **options)
        try:
            captured = {g.program for g in runtime.model.contract.model.graphs
                        if g.operation == cp.OPERATION_SPECULATIVE}
            graphs = {g.program for g in runtime.model.graphs if g.operation == cp.OPERATION_SPECULATIVE}
            bound = {p for rank in runtime.model.executor.ranks for p in rank.programs if p.startswith("speculative")}
        finally:
            runtime.stop(drain=True)
        return captured, graphs, bound

    captured, graphs, bound = loaded(speculative_width=1)
    assert captured and graphs == bound == set()
    captured, graphs, bound = loaded(speculative_width=4, history_drafting=True)
    assert graphs == bound == captured


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


# ---- adaptive width ------------------------------------------------------------------------------

COPY_BATCH = [REPEATING, tuple(range(300, 316)) * 2, (7, 8, 9) * 8]


def test_greedy_batch_with_history_drafting_equals_plain_token_for_token(adaptive_core):
    # spec: SPEC-1, SPEC-3, SPEC-15, SRV-11
    specs = [RequestSpec(prompt, 24, SamplingSettings()) for prompt in COPY_BATCH]
    plain, plain_programs = _serve_many(adaptive_core, specs)
    drafted, drafted_programs = _serve_many(adaptive_core, specs, history_drafting=True)
    assert [s.arrays[OUT_TOKENS] for s in drafted] == [s.arrays[OUT_TOKENS] for s in plain]
    assert all(len(s.arrays[OUT_TOKENS]) == 24 for s in plain)
    wide = {p for p in drafted_programs if p.startswith("speculative")}
    assert wide and not any(p.startswith("speculative") for p in plain_programs)
    # accepted copies widen the rounds: the width-8 programs serve once acceptance is established
    assert any(".w8." in p for p in wide)
    assert len(drafted_programs) < len(plain_programs)


def test_a_request_with_little_to_copy_decodes_plainly(adaptive_core):
    # spec: SPEC-3, SPEC-47
    # an explanation in prose: history lookups find single common tokens whose copies the target
    # rejects. Shadow lookups see that without a round: no round waits for completion feedback and
    # none is speculative (offering every lookup's copies would make about a third of the rounds
    # speculative; the uniform prior alone made the first rounds wait for feedback)
    from helios_backend.engine.bootstrap import Bootstrap

    bootstrap = Bootstrap.load(adaptive_core, ACCEPTANCE)
    try:
        prompt = tuple(bootstrap.tokenizer.encode_template(
            "<|im_start|>user\nExplain why the sky is blue, in simple words.<|im_end|>\n<|im_start|>assistant\n"))
    finally:
        bootstrap.close()
    spec = RequestSpec(prompt, 64, SamplingSettings())
    (plain,), _ = _serve_many(adaptive_core, [spec])
    counters: list[DraftingCounters] = []
    (drafted,), programs = _serve_many(adaptive_core, [spec], drafting=counters, history_drafting=True)
    assert drafted.arrays[OUT_TOKENS] == plain.arrays[OUT_TOKENS]
    speculative = [p for p in programs if p.startswith("speculative")]
    decode = [p for p in programs if p.startswith("decode")]
    assert not speculative and len(decode) == 63, programs
    (drafting,) = counters
    # a lookup every weighing (QUIET_ROUNDS rounds), none of them made a round wait
    assert drafting.waited == 0 and drafting.shadows >= len(decode) // QUIET_ROUNDS, drafting


def test_drafting_starts_once_a_shadow_lookup_saw_its_copies_emitted(adaptive_core):
    # spec: SPEC-15, SPEC-47
    # a request repeating its prompt: the first rounds decode on the pipelined path while one
    # shadow lookup's copies are compared with the emitted tokens; then the rounds are speculative
    # and accepted copies widen them at once (the evidence is the shadow's), with the tokens of
    # plain decode and fewer launches
    spec = RequestSpec(REPEATING, 24, SamplingSettings())
    (plain,), plain_programs = _serve_many(adaptive_core, [spec])
    counters: list[DraftingCounters] = []
    (drafted,), programs = _serve_many(adaptive_core, [spec], drafting=counters, history_drafting=True)
    assert drafted.arrays[OUT_TOKENS] == plain.arrays[OUT_TOKENS]
    kinds = [p.split(".")[0] for p in programs]
    first = kinds.index("speculative")
    assert kinds[:first].count("decode") >= WidthPolicy(7).shadow_tokens, programs
    assert all(kind == "speculative" for kind in kinds[first:]) and ".w8." in programs[first], programs
    (drafting,) = counters
    assert drafting.shadows == 1 and drafting.waited == 1 and drafting.accepted == drafting.offered > 0
    assert len(programs) < len(plain_programs)


def test_logprob_requests_decode_plainly_with_their_records(adaptive_core, smollm2_core):
    # spec: SPEC-3, SRV-11
    # a speculative core records logprobs too (after its speculative extension records): a request
    # asking for them is never speculated and gets the tokens and logprobs of a core without
    # speculative programs
    specs = [RequestSpec(REPEATING, 12, SamplingSettings(), logprobs=True)]
    (plain,), _ = _serve_many(smollm2_core, specs, logprobs=True)
    (drafted,), programs = _serve_many(adaptive_core, specs, logprobs=True, history_drafting=True)
    assert drafted.arrays[OUT_TOKENS] == plain.arrays[OUT_TOKENS]
    assert len(drafted.arrays[OUT_LOGPROBS]) == 12
    assert np.allclose(drafted.arrays[OUT_LOGPROBS], plain.arrays[OUT_LOGPROBS])
    assert not any(p.startswith("speculative") for p in programs)


def test_host_stops_and_grammar_keep_width_one_semantics(adaptive_core):
    # spec: SPEC-45, SPEC-46, STOP-33
    (reference,), _ = _serve_many(adaptive_core, [RequestSpec(REPEATING, 16, SamplingSettings())])
    stop_id = reference.arrays[OUT_TOKENS][9]
    stopped = RequestSpec(REPEATING, 16, SamplingSettings(), stops=StopSettings(token_ids=(stop_id,)))
    (plain,), _ = _serve_many(adaptive_core, [stopped])
    (drafted,), programs = _serve_many(adaptive_core, [stopped], history_drafting=True)
    assert drafted.arrays[OUT_TOKENS] == plain.arrays[OUT_TOKENS]
    assert not any(p.startswith("speculative") for p in programs)
    constrained = RequestSpec(REPEATING, 12, SamplingSettings(), constrained=True)
    grammar = ep.Grammar(kind=ep.GRAMMAR_KIND_LARK, text=ANY_TEXT)
    (plain,), _ = _serve_many(adaptive_core, [constrained], grammar)
    (drafted,), programs = _serve_many(adaptive_core, [constrained], grammar, history_drafting=True)
    assert drafted.arrays[OUT_TOKENS] == plain.arrays[OUT_TOKENS]
    assert not any(p.startswith("speculative") for p in programs)


def test_token_observation_counts_every_speculated_token(adaptive_core):
    # spec: OBS-11, OBS-12
    spec = RequestSpec(REPEATING, 20, SamplingSettings(), observe_timestamps=True)
    (drafted,), programs = _serve_many(adaptive_core, [spec], history_drafting=True)
    assert any(p.startswith("speculative") for p in programs)
    tokens, stamps = drafted.arrays[OUT_TOKENS], drafted.arrays[OUT_TIMESTAMPS]
    assert len(tokens) == len(stamps) == 20
    assert stamps == sorted(stamps)


def test_shipped_recipes_derive_speculative_programs_and_inspect_lists_them(adaptive_core, capsys):
    # spec: SPEC-6, SPEC-10, SPEC-11
    from helios_backend.cli.core import main as core_main
    from ignition.preparation.prepare import variants
    from ignition.preparation.speculative import declared_variants
    from ignition.recipes import gemma_3_270m, hf_checkpoint, smollm2_135m_instruct
    from ignition.recipes.qwen2_5_coder_instruct import RECIPES

    # a GPU server's rows by default: decode to 256 rows, SPECULATIVE width 1 and 4 to 64 rows,
    # width 8 where its P = 8 B target rows fit the kernels' 256
    expected = ({(b, 1, 0, b) for b in (1, 2, 4, 8, 16, 32, 64)} | {(b, 4, 3, 4 * b) for b in (1, 2, 4, 8, 16, 32, 64)}
                | {(b, 8, 7, 8 * b) for b in (1, 2, 4, 8, 16, 32)})
    for recipe in (smollm2_135m_instruct, *RECIPES.values(), gemma_3_270m, hf_checkpoint):
        options = recipe.RecipeOptions()
        assert options.decode_rows == (1, 2, 4, 8, 16, 32, 64, 128, 256)
        assert max(rows for rows, _ in options.mixed_variants) == 256 and max(options.admission_rows) == 64
        max_tokens = max(v.tokens for v in variants(options))
        found = {(v.rows, v.width, v.drafts, v.packed) for v in declared_variants(options, max_tokens)}
        assert found == expected, recipe.__name__
    # lean test cores declare none; an explicit declaration wins over the derived ones
    assert declared_variants(engine_test_options(), 512) == ()
    assert {v.width for v in declared_variants(engine_test_options(speculative_variants=VARIANTS), 512)} == {1, 4}
    assert core_main(["inspect", str(adaptive_core)]) == 0
    listed = capsys.readouterr().out
    assert "speculative.r4.w8.t32" in listed and "B=4 D=7 W=8 P=32" in listed
    assert "speculative widths [1, 4, 8]" in listed
