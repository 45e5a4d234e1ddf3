"""The serving runtime: Bootstrap.load, then NativeModel.load, then the threads.

    runtime = Engine.start(options, metrics_backend)   # raises StartupError naming the cause
    runtime.add_request(spec, stream, grammar)        # any thread
    runtime.cancel(serial)
    runtime.stop()                                    # drain, then every stream gets its final

If the worker or the response thread dies (an error no handler expected), every open request
gets its terminal failure first, then `on_fatal(reason)` is called: the Triton adapter ends the
stub process there, so that supervision starts a clean one (docs/triton-backend.md).

Nothing here knows Triton: the Triton adapter (triton/adapter.py) drives it, or ProcessEngine,
through the Runtime protocol (runtime.py); the benchmarks and tests drive it directly.
Nothing here dispatches on a model name: the core's contract decides.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import llguidance as llg

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.engine.model import NativeModel
from helios_backend.engine.setup import EngineSetup, derive_setup
from helios_backend.scheduler.host_stops import HostStopCheck
from helios_backend.frontend.grammar_runtime import GrammarSession, GrammarSessionError, GrammarTokenizer
from helios_backend.scheduler.request import RequestSpec
from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.scheduler.speculative import SpeculativeOptions, SpeculativeTable
from helios_backend.scheduler.speculative_scheduler import SpeculativeScheduler
from helios_backend.scheduler.speculative_width import WidthPolicy
from helios_backend.scheduler.variants import VariantTable
from helios_backend.engine.assets import frontend_assets
from helios_backend.engine.faults import FaultTrigger, FaultyRunner
from helios_backend.engine.runner import ProgramRunner
from helios_backend.engine.speculative_runner import SpeculativeProgramRunner
from helios_backend.engine.metrics import MetricBackend, MetricsQueue, MetricsThread, NullMetrics
from helios_backend.engine.responses import ResponseHub, Stream, StreamInterval
from helios_backend.engine.settings import EffectiveSettings, SettingsError, StartupOptions
from helios_backend.exchange import SpecDefaults, ExchangeError
from helios_backend.engine.loop import EngineLoop, EventSink
from helios_backend.frontend.logit_bias import logit_bias_capacity

log = logging.getLogger("helios.runtime")
T = TypeVar("T")


class StartupError(Exception):
    """Startup failed; the message names the stage and the cause (the model stays not ready)."""


@dataclass
class EngineParts:
    """What serving builds in the process that owns the executor: the loaded core, the model,
    the scheduler and its runner. Engine runs it beside the response thread in one process;
    the engine process (process_child.py) runs it alone and ships events to the stub."""
    bootstrap: Bootstrap
    model: NativeModel
    settings: EffectiveSettings
    scheduler: Scheduler
    runner: ProgramRunner
    spec_defaults: SpecDefaults
    clock_origin_ns: int
    grammar_tokenizer: GrammarTokenizer | None = None
    fault: FaultTrigger | None = None            # test fault injection (faults.py); None when off
    # built on the first assets request and kept: every part is fixed for the engine's life, and
    # the gateway's readiness probes are assets requests (several a second, one per worker)
    _assets: ep.FrontendAssets | None = field(default=None, repr=False)

    @classmethod
    def build(cls, options: StartupOptions, origin: int) -> "EngineParts":
        """Bootstrap, setup, scheduler and runner (StartupError names the stage and the cause)."""
        bootstrap = _stage("Bootstrap.load", lambda: Bootstrap.load(options.core_path, options.acceptance))
        try:
            setup = _stage("engine setup", lambda: derive_setup(
                bootstrap.contract, bootstrap.manifest, bootstrap.read_resource, options, origin,
                core_digest=bootstrap.core.content_digest() if options.rank_peers == "processes" else ""))
        except BaseException:
            bootstrap.close()
            raise
        try:
            return cls._assemble(bootstrap, setup, origin)
        except BaseException:
            setup.model.close()
            bootstrap.close()
            raise

    @classmethod
    def _assemble(cls, bootstrap: Bootstrap, setup: EngineSetup, origin: int) -> "EngineParts":
        contract = bootstrap.contract
        settings, model, config = setup.settings, setup.model, setup.scheduler
        vocab = contract.model.vocabulary
        tokenizer = bootstrap.tokenizer

        def stop_factory(spec: RequestSpec) -> HostStopCheck:
            decoder = tokenizer.incremental_decoder() if spec.stops.strings else None
            return HostStopCheck(spec.stops, decoder)

        # Speculation is a startup choice (SRV-11): rounds go speculative only when history drafting
        # (the one drafter) is on, the selected width exceeds one and the core captured SPECULATIVE
        # programs of those widths; otherwise the plain scheduler serves (no per-round drafting work).
        captured_widths = sorted({g.speculative.token_capacity for g in model.graphs
                                  if g.operation == cp.OPERATION_SPECULATIVE})
        speculative_options = SpeculativeOptions(
            enabled=settings.history_drafting and settings.speculative_width > 1 and bool(captured_widths),
            history_drafting=settings.history_drafting,
            widths=tuple(w for w in captured_widths if w <= settings.speculative_width) or None)
        table = _stage("speculative selection", lambda: SpeculativeTable.select(model.graphs, speculative_options))
        variants = VariantTable.from_graphs(model.graphs)
        executor = model.executor
        auxiliary_frame = executor.frames if executor.auxiliary_frames else None   # the first one after them
        scheduler: Scheduler
        if table.active:
            drafts = max(p.lane_limit for p in table.programs) - 1
            policy = (WidthPolicy(drafts) if settings.speculative_row_cost is None
                      else WidthPolicy(drafts, row_cost=settings.speculative_row_cost, measured=False))
            scheduler = _stage("scheduler", lambda: SpeculativeScheduler(config, variants, table, stop_factory,
                                                                          model.generations, policy))
            speculative = SpeculativeProgramRunner.for_model(model, auxiliary_frame=auxiliary_frame)
            speculative.max_width = table.max_width
            runner: ProgramRunner = speculative
        else:
            scheduler = _stage("scheduler", lambda: Scheduler(config, variants, stop_factory, model.generations))
            runner = ProgramRunner.for_model(model, auxiliary_frame=auxiliary_frame)
        grammar_tokenizer = _stage("grammar tokenizer", lambda: GrammarTokenizer.from_json(
            bootstrap.read_resource(contract.model.frontend.tokenizer_resource).decode("utf-8"),
            tuple(contract.defaults.eos_token_ids)))
        fault = FaultTrigger.from_environment()
        if fault is not None:
            log.warning("fault injection is on (%s)", fault.path)
        defaults = SpecDefaults(contract.defaults.sampling, settings.max_output_tokens, vocab.sampled_tokens,
                                logit_bias_capacity(model.graphs, bootstrap.manifest.transport))
        return cls(bootstrap, model, settings, scheduler, runner, defaults, origin, grammar_tokenizer, fault)

    def loop(self, sink: EventSink, metrics: MetricsQueue, on_death: Callable[[str], None]) -> EngineLoop:
        """The worker over this core's scheduler and runner (not started)."""
        runner = FaultyRunner(self.runner, self.fault) if self.fault is not None else self.runner
        return EngineLoop(self.scheduler, runner, sink, metrics, on_death=on_death)

    def describe(self) -> str:
        config = self.scheduler.config
        return (f"{self.bootstrap.contract.served_id}, {config.num_pages} pages x {config.page_tokens} tokens, "
                f"{config.request_slots} slots, max_active {self.scheduler.max_active}")

    def assets(self) -> ep.FrontendAssets:
        if self._assets is None:
            b = self.bootstrap
            contract = b.contract
            frontend = contract.model.frontend
            self._assets = frontend_assets(contract, b.read_resource(frontend.tokenizer_resource),
                                           b.read_resource(frontend.chat_template_resource).decode("utf-8"),
                                           self.settings, self.scheduler.max_prompt_tokens,
                                           b.manifest.completion.top_logprobs, self.spec_defaults.logit_bias_capacity,
                                           self.clock_origin_ns)
        return self._assets

    def grammar_session(self, grammar: ep.Grammar) -> GrammarSession | None:
        """The request's matcher, or None when unconstrained; ExchangeError when the grammar
        does not compile (invalid request, never an execution failure)."""
        if grammar.kind == ep.GRAMMAR_KIND_UNSPECIFIED:
            return None
        if self.grammar_tokenizer is None:
            raise ExchangeError("grammar", "this model serves no constrained requests")
        text = grammar.text
        if grammar.kind == ep.GRAMMAR_KIND_LARK:
            text = llg.grammar_from("lark", text)
        elif grammar.kind == ep.GRAMMAR_KIND_JSON_SCHEMA:
            text = llg.grammar_from("json_schema", text)
        elif grammar.kind != ep.GRAMMAR_KIND_LLGUIDANCE:
            raise ExchangeError("grammar.kind", f"unknown grammar kind {grammar.kind}")
        try:
            return GrammarSession.create(self.grammar_tokenizer, text)
        except (GrammarSessionError, ValueError) as exc:
            raise ExchangeError("grammar", str(exc)) from None

    def close(self) -> None:
        self.model.close()
        self.bootstrap.close()


def freeze_startup_objects() -> None:
    """Startup leaves many long-lived objects (manifests, tokenizer tables, protobuf
    descriptors); frozen, they are never scanned again, so a full collection while serving
    walks only what serving allocated instead of pausing every thread under the GIL."""
    gc.collect()
    gc.freeze()


class ResponseSide:
    """What lives beside Triton's senders, with the engine in this process or in its own: the
    response thread, the metrics thread, and the fatal path that a dying thread takes."""

    def __init__(self, metrics_backend: MetricBackend | None, on_fatal: Callable[[str], None] | None,
                 interval: StreamInterval = StreamInterval()) -> None:
        self.metrics: MetricsThread | NullMetrics = (
            MetricsThread(metrics_backend, on_error=log.warning) if metrics_backend is not None else NullMetrics())
        self.fatal = FatalPath(on_fatal)
        self._cancel: Callable[[int], None] = lambda serial: None
        self.hub = ResponseHub(on_cancel=lambda serial: self._cancel(serial), metrics=self.metrics,
                               on_death=self.fatal, interval=interval)
        self.fatal.attach(self.hub, self.metrics)

    def start(self, cancel: Callable[[int], None]) -> None:
        """Start the threads; the hub's cancellations go to `cancel` (the worker's)."""
        self._cancel = cancel
        if isinstance(self.metrics, MetricsThread):
            self.metrics.start()
        freeze_startup_objects()
        self.hub.start()


@dataclass
class Engine:
    """The core, its worker and the response thread in one process."""
    parts: EngineParts
    loop: EngineLoop
    hub: ResponseHub
    metrics: MetricsThread | NullMetrics

    @classmethod
    def start(cls, options: StartupOptions, metrics_backend: MetricBackend | None = None,
              on_fatal: Callable[[str], None] | None = None) -> "Engine":
        origin = time.monotonic_ns()   # token timestamps are relative to runtime startup (OBS-15)
        parts = EngineParts.build(options, origin)
        side = ResponseSide(metrics_backend, on_fatal, StreamInterval(options.stream_interval))
        worker = parts.loop(side.hub, side.metrics, on_death=side.fatal)
        side.start(cancel=worker.cancel)
        worker.start()
        log.info("helios runtime ready: %s", parts.describe())
        return cls(parts, worker, side.hub, side.metrics)

    # the parts, read by the adapter, the benchmarks and the tests
    @property
    def bootstrap(self) -> Bootstrap:
        return self.parts.bootstrap

    @property
    def model(self) -> NativeModel:
        return self.parts.model

    @property
    def settings(self) -> EffectiveSettings:
        return self.parts.settings

    @property
    def scheduler(self) -> Scheduler:
        return self.parts.scheduler

    @property
    def runner(self) -> ProgramRunner:
        return self.parts.runner

    @property
    def spec_defaults(self) -> SpecDefaults:
        return self.parts.spec_defaults

    @property
    def clock_origin_ns(self) -> int:
        return self.parts.clock_origin_ns

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer | None:
        return self.parts.grammar_tokenizer

    @property
    def fault(self) -> FaultTrigger | None:
        return self.parts.fault

    def assets(self) -> ep.FrontendAssets:
        return self.parts.assets()

    @property
    def healthy(self) -> bool:
        """False once the worker stopped (its executor lost, e.g. a rank process died): every
        request it held has failed, and the model must be started again."""
        return self.loop.lost is None and self.loop.alive

    def add_request(self, spec: RequestSpec, stream: Stream, grammar: ep.Grammar | None = None) -> None:
        """The grammar is compiled here, on the caller's thread, before the stream is registered:
        ExchangeError when it does not compile, and nothing was registered."""
        session = None if grammar is None else self.parts.grammar_session(grammar)
        self.hub.register(stream)
        self.loop.enqueue(stream.serial, spec, session)

    def cancel(self, serial: int) -> None:
        self.loop.cancel(serial)

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Drain the worker, deliver every final response, then release the model.

        Metric updates still queued are dropped: during unload each one would be an IPC
        round trip to a server that is waiting for this very call to return."""
        start = time.monotonic()
        if isinstance(self.metrics, MetricsThread):
            self.metrics.discard()
        self.loop.stop(drain=drain, timeout=timeout)
        log.info("helios worker stopped after %.2fs", time.monotonic() - start)
        self.hub.stop()
        log.info("helios responses flushed after %.2fs", time.monotonic() - start)
        if isinstance(self.metrics, MetricsThread):
            self.metrics.stop(discard=True, timeout=1.0)
        self.parts.close()
        log.info("helios runtime stopped after %.2fs", time.monotonic() - start)


class FatalPath:
    """Called on the dying thread, once: flush every open request's terminal failure and the
    last gauges, then hand the reason to the owner's `on_fatal` (without one: only logged, and
    the engine refuses new requests from then on)."""

    def __init__(self, on_fatal: Callable[[str], None] | None) -> None:
        self._on_fatal = on_fatal
        self._once = threading.Lock()
        self._hub: ResponseHub | None = None
        self._metrics: MetricsThread | NullMetrics | None = None

    def attach(self, hub: ResponseHub, metrics: MetricsThread | NullMetrics) -> None:
        self._hub, self._metrics = hub, metrics

    def __call__(self, reason: str) -> None:
        if not self._once.acquire(blocking=False):
            return
        log.critical("helios engine failed: %s", reason)
        if self._hub is not None:
            self._hub.stop(timeout=2.0, reason=reason)      # on the hub's own thread: no join
        if isinstance(self._metrics, MetricsThread):
            self._metrics.stop(timeout=1.0)                  # the gauges read idle, not stale
        if self._on_fatal is not None:
            self._on_fatal(reason)


def _stage(name: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except StartupError:
        raise
    except SettingsError as exc:
        raise StartupError(f"{name}: {exc}") from exc
    except Exception as exc:
        raise StartupError(f"{name} failed: {type(exc).__name__}: {exc}") from exc
