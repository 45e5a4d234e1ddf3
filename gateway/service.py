"""The gateway's collaborators wired together; routers call only this.

``GatewayService`` owns the Triton client, the served model (once learned), admission
and metrics. Until the backend has answered the assets request, generation endpoints
answer 503 and /health is 503; a background task keeps asking, so the gateway may start
before tritonserver has loaded the model.

While generations are open, a second task watches the backend: Triton keeps a model READY,
and its streams open, after the model's Python stub died (shared/notes/triton-backend.md,
section 7), so without helios-serve nothing would ever end them. Every WATCH_S the watch asks
the model its assets (a tiny inference the stub answers without the engine); a refusal ends
every open generation with its terminal error and turns /health red, and the next request
opens a new channel, which works again once the model is back. A slow answer is not a
refusal: a saturated backend is busy, not dead.
"""

from __future__ import annotations

from pathlib import Path

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.access import AccessRecord
from helios_proto import exchange_pb2 as ep
from gateway.admission import AdmissionPermits, AdmissionSettings, Permit
from gateway.shared_permits import SharedPermits
from gateway.errors import BackendUnavailableError, IngressFullError, ShuttingDownError
from gateway.generation import ChoiceFailed, RequestRun
from gateway.metrics import GatewayMetrics
from gateway.output_pipeline import OutputParser, PlainTextParser
from gateway.preparation import PreparedRequest
from gateway.presentation import Presenter
from gateway.responses import Chunk, GenerationResponse
from gateway.schemas import VLLM_UNSUPPORTED_FIELDS, SamplingFields
from gateway.served_model import BackendClock, ServedModel
from gateway.triton_client import BackendRefused, TritonBackend

log = logging.getLogger(__name__)

ParserFactory = Callable[[ServedModel, PreparedRequest, int], OutputParser]


def syntax_parsers(served: ServedModel, prepared: PreparedRequest, choice: int) -> OutputParser:
    """Default syntax seam: the served model's reasoning/tool syntax for chat (one engine per
    choice, with call ids unique in the response); plain text for raw completions."""
    if prepared.syntax is None:
        return PlainTextParser()
    return prepared.syntax.parser(f"call_{prepared.request_id[-12:]}_{choice}_")


@dataclass(slots=True)
class _Outcome:
    status: int = 200  # the response's status for metrics (499: the client left)


@dataclass(frozen=True, slots=True)
class AdmissionOverrides:
    """CLI values that win over the served model's effective limits (None = take the model's)."""

    queue_capacity: int | None = None
    max_active: int | None = None
    frontend_workers: int | None = None
    shared_budget: str | None = None    # the permit file of a multi-worker gateway (shared_permits.py)


class GatewayService:
    # a probe is one tiny inference; coalesce health-check storms, yet turn red within a
    # second of the backend dying (a broken stream also forgets the cached answer)
    HEALTH_CACHE_S = 0.5
    # the watch's period and its probe's patience: a dead stub is refused after ~1 s (Triton's
    # own stub health check), so open streams end within ~1.5 s of the death
    WATCH_S = 0.5
    WATCH_TIMEOUT_S = 10.0
    # How long a request that finds the model not learned yet waits for it before its 503. Several
    # gateway processes share one port and each learns the model on its own, retrying with a delay
    # of up to a second: without the wait, a client that saw one process ready could be refused by
    # a sibling still asleep in that delay. The request wakes its loader, which asks at once; an
    # answering backend is learned in milliseconds, so this bound is reached only while it loads.
    LOAD_WAIT_S = 2.0

    def __init__(self, backend: TritonBackend, overrides: AdmissionOverrides,
                 parser_factory: ParserFactory = syntax_parsers, metrics: GatewayMetrics | None = None) -> None:
        self.backend = backend
        self.metrics = metrics or GatewayMetrics()
        self._overrides = overrides
        self._parser_factory = parser_factory
        self._served: ServedModel | None = None
        self._admission: AdmissionPermits | None = None
        self._loader: asyncio.Task[None] | None = None
        self._learned = asyncio.Event()           # set once the assets arrived
        self._ask_now = asyncio.Event()           # a request is waiting: the loader skips its delay
        self._watch: asyncio.Task[None] | None = None
        self._health: tuple[float, bool] = (0.0, False)
        self._runs: set[RequestRun] = set()        # responses still open (for shutdown)
        self._shutting_down = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loader = asyncio.create_task(self._load_assets())
        self._watch = asyncio.create_task(self._watch_backend())

    def begin_shutdown(self, drain_s: float) -> None:
        """From a signal handler: refuse new requests now; after ``drain_s`` end every response
        still open with one terminal ``shutting_down`` error (SSE event or 503 JSON), before
        the server drops connections (HTTP-15)."""
        loop = self._loop
        if loop is None or self._shutting_down:
            return

        def refuse_and_schedule() -> None:
            self._shutting_down = True
            self._health = (float("inf"), False)
            loop.call_later(drain_s, self._abort_open_runs)

        loop.call_soon_threadsafe(refuse_and_schedule)

    def _abort_open_runs(self) -> None:
        for run in list(self._runs):
            run.abort(ShuttingDownError("the server is shutting down; retry on another instance or later"))

    async def _load_assets(self) -> None:
        delay = 0.2
        waiting = logging.INFO       # said once; every later attempt at debug level
        while self._served is None:
            try:
                assets = await self.backend.fetch_assets(timeout_s=30.0)
                self._install(ServedModel.from_assets(assets))
                log.info("serving %s (aliases %s)", assets.served_id, list(assets.aliases))
            except ConnectionError as exc:
                log.log(waiting, "waiting for the model backend at %s (readiness stays 503 until it answers): %s",
                        self.backend.url, str(exc).splitlines()[0])
                waiting = logging.DEBUG
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._ask_now.wait(), delay)
                self._ask_now.clear()
                delay = min(delay * 2, 1.0)
        self._learned.set()

    async def wait_learned(self, wait_s: float | None = None) -> bool:
        """Whether the model is learned, asking the backend at once and waiting up to `wait_s`
        (LOAD_WAIT_S) when it is not yet."""
        if self._served is None and not self._shutting_down:
            self._ask_now.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._learned.wait(), self.LOAD_WAIT_S if wait_s is None else wait_s)
        return self._served is not None

    async def _watch_backend(self) -> None:
        while True:
            await asyncio.sleep(self.WATCH_S)
            if self._served is None or self._shutting_down:
                continue
            if not self.backend.open_generations:
                await self._release_idle_channel()
                continue
            try:
                await self.backend.fetch_assets(timeout_s=self.WATCH_TIMEOUT_S, probe=True)
            except BackendRefused as exc:
                ended = self.backend.abandon_generations(f"the model stopped answering ({exc})")
                self._health = (time.monotonic(), False)
                self.metrics.backend_lost.inc()
                log.error("the model backend refused a probe; ended %d open requests: %s", ended, exc)
            except ConnectionError:
                pass                        # slow, not refused

    async def _release_idle_channel(self) -> None:
        """An idle channel is one long request of the model: while it is open, a tritonserver
        asked to stop cannot unload the model and waits for its whole exit timeout (then leaves
        the stub behind). Triton reports itself not ready from the stop on, so the channel is
        closed then; the next request opens a new one."""
        if self.backend.channel_open and not await self.backend.model_ready(timeout_s=self.WATCH_TIMEOUT_S):
            if not self.backend.open_generations:       # none arrived while the probe ran
                self.backend.abandon_generations("the backend is not ready")
                self._health = (time.monotonic(), False)
                log.info("the model backend is not ready; closed the idle channel so that it can unload")

    def _install(self, served: ServedModel) -> None:
        limits = served.limits
        o = self._overrides
        settings = AdmissionSettings(
            queue_capacity=o.queue_capacity if o.queue_capacity is not None else limits.queue_capacity,
            max_active=o.max_active if o.max_active is not None else max(limits.max_active, 1),
            frontend_workers=o.frontend_workers if o.frontend_workers is not None
            else max(limits.frontend_workers, 1))
        shared = SharedPermits(Path(o.shared_budget)) if o.shared_budget else None
        self._admission = AdmissionPermits(settings, shared)
        self.metrics.track_permits(lambda: self._admission.in_use if self._admission else 0, settings.permits)
        self._served = served

    async def close(self) -> None:
        for task in (self._loader, self._watch):
            if task is not None:
                task.cancel()
        if self._admission is not None:
            self._admission.close()
        await self.backend.close()

    # ---- state -----------------------------------------------------------------------------
    @property
    def served(self) -> ServedModel:
        if self._served is None:
            raise BackendUnavailableError("the model is still loading; retry later")
        return self._served

    @property
    def served_or_none(self) -> ServedModel | None:
        return self._served

    @property
    def admission(self) -> AdmissionPermits:
        if self._admission is None:
            raise BackendUnavailableError("the model is still loading; retry later")
        return self._admission

    async def healthy(self) -> bool:
        """Triton and the model ready and answering a tiny inference (a dead Python stub
        can leave Triton's own readiness green)."""
        if self._shutting_down:
            return False
        if self._served is None:
            self._ask_now.set()                   # a probe never waits, but its loader asks now
        checked_at, ok = self._health
        if time.monotonic() - checked_at < self.HEALTH_CACHE_S:
            return ok
        ok = self._served is not None and await self.backend.model_ready(timeout_s=2.0)
        if ok:
            try:
                assets = await self.backend.fetch_assets(timeout_s=5.0, probe=True)
            except ConnectionError:
                ok = False
            else:
                self._follow_backend_clock(assets)
        self._health = (time.monotonic(), ok)
        return ok and not self._shutting_down

    def _follow_backend_clock(self, assets: ep.FrontendAssets) -> None:
        """A restarted backend has a new clock origin: stamps follow it from the next request."""
        served = self._served
        origin = assets.clock.origin_monotonic_ns
        if served is not None and origin != served.clock.origin_monotonic_ns:
            log.info("the backend restarted (clock origin %d); following it", origin)
            self._served = dataclasses.replace(served, clock=BackendClock(origin))

    def _forget_health(self) -> None:
        """A backend stream broke: the next /health probes again instead of trusting its cache."""
        self._health = (0.0, False)

    # ---- requests --------------------------------------------------------------------------
    def admit(self) -> Permit:
        if self._shutting_down:
            raise ShuttingDownError("the server is shutting down; retry later")
        try:
            return self.admission.admit()
        except IngressFullError:
            self.metrics.ingress_full.inc()
            raise

    def note_unknown_fields(self, body: SamplingFields, endpoint: str) -> None:
        """Fields no table names (schemas.py): kept working, but logged and counted."""
        unknown = sorted(set(body.model_extra or ()) - VLLM_UNSUPPORTED_FIELDS)
        if unknown:
            self.metrics.unknown_fields.labels(endpoint).inc(len(unknown))
            log.warning("%s: ignored unknown request fields %s", endpoint, unknown)

    async def handle(self, body: SamplingFields, prepare: Callable[[ServedModel, int], PreparedRequest],
                     presenter_type: type[Presenter], endpoint: str, prompt_param: str,
                     record: AccessRecord) -> GenerationResponse:
        """The whole request path shared by the generation endpoints: stamp ingress, take a
        permit (429 when none), prepare in a frontend slot (400s), start and respond."""
        self.note_unknown_fields(body, endpoint)
        served = self.served
        ingress_ns = served.clock.now_ns()  # ingress: after JSON decoding, before waiting for preparation (OBS-21)
        permit = self.admit()
        try:
            prepared = await self.admission.prepare(lambda: prepare(served, ingress_ns))
            presenter = presenter_type(prepared, served.served_id, served.tokenizer)
            return self.respond(prepared, presenter, permit, endpoint, prompt_param, record)
        except BaseException:
            permit.release()
            raise

    def respond(self, prepared: PreparedRequest, presenter: Presenter, permit: Permit,
                endpoint: str, prompt_param: str, record: AccessRecord) -> GenerationResponse:
        """Start the backend requests and return the response that delivers them."""
        served = self.served
        run = RequestRun(self.backend, served, prepared,
                         lambda choice: self._parser_factory(served, prepared, choice), self.metrics, prompt_param,
                         on_stream_failure=self._forget_health)
        run.start()
        self._runs.add(run)
        outcome = _Outcome()

        def on_close(disconnected: bool) -> None:
            self._runs.discard(run)
            run.cancel()
            if disconnected:
                self.metrics.disconnects.inc()
                outcome.status = 499  # nginx's "client closed request"
            record.outcome = outcome.status  # counted by the access middleware
            elapsed = (served.clock.now_ns() - prepared.ingress_ns) / 1e9
            self.metrics.duration.labels(endpoint).observe(max(elapsed, 0.0))
            self.metrics.e2e.labels(served.served_id).observe(max(elapsed, 0.0))

        if prepared.stream:
            async def chunks() -> AsyncIterator[Chunk]:
                # one write per batch of backend events: the SSE events they produced (a text
                # chunk per run of tokens, one per token where each shows its own) go out
                # together, which halves the writes of an observed stream and lets a stream
                # that fell behind catch up in one write; the batch
                # that ends the last choice is marked last, so the body ends in its write
                opening = b"".join(presenter.opening())
                if opening:
                    yield opening, False
                async for batch, last in run.event_batches():
                    parts: list[bytes] = []
                    for event in batch:
                        if isinstance(event, ChoiceFailed):
                            outcome.status = event.error.status
                            run.cancel()
                            parts.append(presenter.error_event(event.error))
                            yield b"".join(parts), True
                            return
                        parts.extend(presenter.stream(event))
                    data = b"".join(parts)
                    if data or last:
                        yield data, last

            return GenerationResponse(permit, on_close, chunks=chunks())

        async def body_once() -> tuple[int, dict]:
            async for event in run.events():
                if isinstance(event, ChoiceFailed):
                    outcome.status = event.error.status
                    run.cancel()
                    raise event.error
                presenter.fold(event)
            return 200, presenter.body()

        return GenerationResponse(permit, on_close, body_once=body_once)
