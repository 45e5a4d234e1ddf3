"""Run one prepared request against the backend: fan out its choices, merge their events.

Each choice is one backend request on its own Triton stream, pumped by its own task into
an unbounded queue: the gRPC stream is always drained, so a paused HTTP reader never
blocks the backend (HTTP-9, HTTP-10), and the queue only grows as events arrive (HTTP-8).
``cancel`` (client gone, failure of a sibling choice) cancels every stream (HTTP-6).

Typed backend outcomes become typed gateway errors here; their status codes come from
errors.py, never from message text (HTTP-26, HTTP-27).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from helios_proto import exchange_pb2 as ep

from gateway.errors import (AdmissionRejectedError, BackendInvalidRequestError, BackendUnavailableError,
                            ExecutionFailedError, GatewayError)
from gateway.metrics import GatewayMetrics, observe_times
from gateway.output_pipeline import Delta, OutputParser, OutputPipeline, TokenStep
from gateway.preparation import PreparedRequest
from gateway.served_model import ServedModel
from gateway.triton_client import StreamFailure, StreamFailureKind, StreamTerminal, TokenBatch, TritonBackend

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    ep.FINISH_REASON_EOS: "stop",
    ep.FINISH_REASON_LENGTH: "length",
    ep.FINISH_REASON_STOP_STRING: "stop",
    ep.FINISH_REASON_STOP_TOKEN: "stop",
}

_PROMPT_REJECTIONS = (ep.REJECTION_REASON_PROMPT_BEYOND_CAPACITY, ep.REJECTION_REASON_OUTPUT_BEYOND_CONTEXT)


@dataclass(frozen=True, slots=True)
class PerformanceStamps:
    ingress_ns: int
    enqueue_ns: int
    reused_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ChoiceSteps:
    index: int
    steps: list[TokenStep]


@dataclass(frozen=True, slots=True)
class ChoiceFinished:
    index: int
    finish_reason: str  # OpenAI: "stop" | "length"
    ended_by_eos: bool  # the model ended naturally (no user stop, no limit)
    deltas: list[Delta]  # text flushed at the end (held stop prefixes, parser tail)
    usage: ep.Usage
    performance: PerformanceStamps


@dataclass(frozen=True, slots=True)
class ChoiceFailed:
    index: int
    error: GatewayError


ChoiceEvent = ChoiceSteps | ChoiceFinished | ChoiceFailed


def error_for_terminal(event: ep.TerminalEvent, prompt_param: str) -> GatewayError | None:
    """The typed terminal outcome decides the error class (and so the status)."""
    outcome = event.WhichOneof("outcome")
    if outcome == "rejected":
        rejection = event.rejected
        reason = ep.RejectionReason.Name(rejection.reason).removeprefix("REJECTION_REASON_").lower()
        param = prompt_param if rejection.reason in _PROMPT_REJECTIONS else None
        return AdmissionRejectedError(rejection.message or f"admission rejected: {reason}",
                                      param=param, code=reason)
    if outcome == "failed":
        return ExecutionFailedError(event.failed.message or "model execution failed")
    if outcome == "invalid":
        return BackendInvalidRequestError(event.invalid.message or "invalid request",
                                          param=event.invalid.field or None)
    if outcome == "finished":
        if event.finished.reason in _FINISH_REASONS:
            return None
        # a cancellation the gateway did not ask for (e.g. the backend is draining)
        return ExecutionFailedError("the backend ended the request early", code="cancelled")
    return ExecutionFailedError("the backend sent a terminal event without an outcome", code="output_error")


def error_for_stream_failure(failure: StreamFailure) -> GatewayError:
    if failure.kind in (StreamFailureKind.UNREACHABLE, StreamFailureKind.REFUSED):
        return BackendUnavailableError(f"the model backend is unavailable: {failure.detail}")
    if failure.kind is StreamFailureKind.MALFORMED:
        return ExecutionFailedError(f"malformed backend response: {failure.detail}", code="output_error")
    return ExecutionFailedError(f"the backend stream failed: {failure.detail}")


class ChoiceTranslator:
    """Backend events of one choice -> ChoiceEvents (pure: no I/O, unit-testable)."""

    def __init__(self, index: int, pipeline: OutputPipeline, prompt_param: str, ingress_ns: int,
                 enqueue_ns: int) -> None:
        self.index = index
        self._pipeline = pipeline
        self._prompt_param = prompt_param
        self._ingress_ns = ingress_ns
        self._enqueue_ns = enqueue_ns

    def tokens(self, batch: TokenBatch) -> ChoiceSteps:
        return ChoiceSteps(self.index, self._pipeline.feed(batch))

    def failure(self, failure: StreamFailure) -> ChoiceFailed:
        return ChoiceFailed(self.index, error_for_stream_failure(failure))

    def terminal(self, event: ep.TerminalEvent) -> ChoiceEvent:
        error = error_for_terminal(event, self._prompt_param)
        if error is not None:
            return ChoiceFailed(self.index, error)
        finished = event.finished
        pipeline = self._pipeline
        deltas = pipeline.finish(finished)
        reason = "stop" if pipeline.stopped else _FINISH_REASONS[finished.reason]
        if finished.HasField("performance"):
            perf = finished.performance
            stamps = PerformanceStamps(perf.ingress_ns, perf.enqueue_ns, perf.reused_prompt_tokens)
        else:
            stamps = PerformanceStamps(self._ingress_ns, self._enqueue_ns, finished.usage.reused_prompt_tokens)
        ended_by_eos = finished.reason == ep.FINISH_REASON_EOS and not pipeline.stopped
        return ChoiceFinished(self.index, reason, ended_by_eos, deltas, finished.usage, stamps)


class RequestRun:
    def __init__(self, backend: TritonBackend, served: ServedModel, prepared: PreparedRequest,
                 parser_factory: Callable[[int], OutputParser], metrics: GatewayMetrics, prompt_param: str,
                 on_stream_failure: Callable[[], None] = lambda: None) -> None:
        self._backend = backend
        self._served = served
        self._prepared = prepared
        self._parser_factory = parser_factory
        self._metrics = metrics
        self._prompt_param = prompt_param
        self._on_stream_failure = on_stream_failure  # lets readiness forget a stale "healthy"
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._first_token_seen = False
        model = served.served_id   # the labelled series, looked up once rather than per token
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)

    def start(self) -> None:
        model = self._served.served_id
        prepared = self._prepared
        self._metrics.queue_time.labels(model).observe(
            max(self._served.clock.now_ns() - prepared.ingress_ns, 0) / 1e9)
        for prompt in prepared.prompts:   # once per prompt: its n choices share it
            self._metrics.prompt_tokens.inc(len(prompt))
            self._metrics.prompt_length.labels(model).observe(len(prompt))
        for index, prompt, request in self._prepared.choices():
            self._tasks.append(asyncio.create_task(self._pump(index, prompt, request)))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    def abort(self, error: GatewayError) -> None:
        """End the run now with ``error`` as its one failure (the gateway is shutting down):
        every backend stream is cancelled and the reader sees a single ChoiceFailed."""
        self.cancel()
        self._queue.put_nowait(ChoiceFailed(0, error))

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events, interleaved in arrival order, until all choices ended."""
        async for batch, _ in self.event_batches():
            for event in batch:
                yield event

    async def event_batches(self) -> AsyncIterator[tuple[list[ChoiceEvent], bool]]:
        """The same events, each time as all of those that arrived since the last batch (a
        stream that fell behind under load catches up in one write, not one per event), and
        whether that batch ended the last open choice."""
        remaining = len(self._tasks)
        queue = self._queue
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            remaining -= sum(1 for event in batch if not isinstance(event, ChoiceSteps))
            yield batch, remaining == 0

    def _observe_tokens(self, count: int, previous_ns: int) -> int:
        """TTFT (the request's first token), the choice's inter-token gaps; the arrival time."""
        now_ns = self._served.clock.now_ns()
        if not self._first_token_seen:
            self._first_token_seen = True
            self._ttft.observe(max(now_ns - self._prepared.ingress_ns, 0) / 1e9)
        if previous_ns:             # a coalesced batch: the gap spread over its tokens
            observe_times(self._itl, max(now_ns - previous_ns, 0) / 1e9 / count, count)
        self._metrics.output_tokens.inc(count)
        return now_ns

    async def _pump(self, index: int, prompt: tuple[int, ...], request: ep.GenerateRequest) -> None:
        pipeline = OutputPipeline(self._served.tokenizer, self._prepared.stop_matcher(),
                                  self._parser_factory(index), self._served.eos_token_ids)
        request.ingress_ns = self._prepared.ingress_ns
        enqueue_ns = self._served.clock.now_ns()  # OBS-22: the enqueue stamp is taken immediately before submission
        request.enqueue_ns = enqueue_ns
        translator = ChoiceTranslator(index, pipeline, self._prompt_param, self._prepared.ingress_ns, enqueue_ns)
        generation = self._backend.generate(prompt, request, request.request_id)
        self._metrics.open_streams.inc()
        put = self._queue.put_nowait
        last_token_ns = 0
        try:
            async for event in generation.events():
                if isinstance(event, TokenBatch):
                    last_token_ns = self._observe_tokens(int(event.token_ids.size), last_token_ns)
                    put(translator.tokens(event))
                elif isinstance(event, StreamTerminal):
                    if event.event.HasField("finished"):
                        self._metrics.output_length.labels(self._served.served_id).observe(
                            event.event.finished.usage.completion_tokens)
                    put(translator.terminal(event.event))
                    return
                else:
                    self._on_stream_failure()
                    put(translator.failure(event))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an output error in decoding or parsing: report it, typed
            log.exception("choice %d of %s failed in the output pipeline", index, self._prepared.request_id)
            put(ChoiceFailed(index, ExecutionFailedError(f"output processing failed: {exc}", code="output_error")))
        finally:
            generation.cancel()
            self._metrics.open_streams.dec()
