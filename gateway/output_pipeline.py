"""Per-choice output pipeline: token ids -> decoded text -> stops -> syntax parser -> deltas.

Order matters and follows the spec: string stops match the incremental decoded text
*before* presentation, reasoning and tool envelopes included (STOP-9, STOP-10), so the stop
matcher runs before the parser. The parser is the seam for reasoning/tool syntaxes
(helios_backend/syntax/): any object with ``feed(token_id, text)`` and
``finish()`` returning typed deltas; until those land every request gets PlainTextParser.

The backend decides stops (it gates scheduling) and names its decision in the terminal
event; the gateway runs the same StopMatcher over the same ids only to know which text
is safe to stream before that decision arrives, then reconciles with the backend's cut.
Streaming and non-streaming responses are built from the same steps, so they agree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from helios_backend.frontend.stops import StopMatcher
from helios_backend.syntax.events import ContentDelta, SyntaxEvent
from helios_backend.frontend.tokenizer import FrontendTokenizer
from helios_proto import exchange_pb2 as ep

from gateway.triton_client import TokenBatch

log = logging.getLogger(__name__)


Delta = SyntaxEvent  # content, reasoning, tool-call start/arguments/end, parse notes


class OutputParser(Protocol):
    """The syntax seam: one instance per choice, fed the stop-checked text per token
    (token id -1: text flushed at the end, not owned by one token)."""

    def feed(self, token_id: int, text: str) -> Sequence[Delta]: ...

    def finish(self) -> Sequence[Delta]: ...


class PlainTextParser:
    """No reasoning or tool syntax: all text is answer content."""

    __slots__ = ()

    def feed(self, token_id: int, text: str) -> Sequence[Delta]:
        return (ContentDelta(text),) if text else ()

    def finish(self) -> Sequence[Delta]:
        return ()


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token: its raw observation plus the deltas it released."""

    token_id: int
    timestamp_ns: int | None
    logprob: float | None
    top: tuple[TopLogprob, ...]
    deltas: Sequence[Delta]


class OutputPipeline:
    def __init__(self, tokenizer: FrontendTokenizer, stops: StopMatcher, parser: OutputParser,
                 eos_token_ids: frozenset[int]) -> None:
        self._decoder = tokenizer.incremental_decoder()
        self._stops = stops
        self._parser = parser
        self._eos = eos_token_ids
        self._stopped = False  # the gateway's own matcher found the stop
        self._released_bytes = 0  # UTF-8 bytes of stop-checked text handed to the parser

    @property
    def parser(self) -> OutputParser:
        return self._parser

    def feed(self, batch: TokenBatch) -> list[TokenStep]:
        ids = batch.token_ids.tolist()
        stamps = batch.timestamps_ns.tolist() if batch.timestamps_ns is not None else None
        logprobs = batch.logprobs.tolist() if batch.logprobs is not None else None
        top_ids = batch.top_token_ids.tolist() if batch.top_token_ids is not None else None
        top_lps = batch.top_logprobs.tolist() if batch.top_logprobs is not None else None
        steps: list[TokenStep] = []
        for i, token_id in enumerate(ids):
            top = (tuple(TopLogprob(t, lp) for t, lp in zip(top_ids[i], top_lps[i]))
                   if top_ids is not None and top_lps is not None else ())
            steps.append(TokenStep(token_id, stamps[i] if stamps is not None else None,
                                   logprobs[i] if logprobs is not None else None, top,
                                   self._text_deltas(token_id)))
        return steps

    def _text_deltas(self, token_id: int) -> Sequence[Delta]:
        if self._stopped:
            return ()  # text after a stop is never shown; the ids still count (STOP-20)
        # EOS ends generation; its control text is not answer text
        text = "" if token_id in self._eos else self._decoder.feed_one(token_id)
        decision = self._stops.feed(token_id, text)
        if decision.matched:
            self._stopped = True
        return self._parse(token_id, decision.text)

    def _parse(self, token_id: int, text: str) -> Sequence[Delta]:
        self._released_bytes += len(text.encode("utf-8")) if text else 0
        return self._parser.feed(token_id, text) if text else ()

    def finish(self, finished: ep.Finished) -> list[Delta]:
        """Reconcile with the backend's terminal decision and flush what is still held."""
        deltas: list[Delta] = []
        stop_reason = finished.reason in (ep.FINISH_REASON_STOP_STRING, ep.FINISH_REASON_STOP_TOKEN)
        if not self._stopped:
            tail = self._decoder.finish()  # a dangling partial character, as U+FFFD
            if stop_reason:
                held = self._stops.finish() + tail
                deltas.extend(self._parse(-1, self._backend_cut(finished.stop, held)))
            else:
                if tail:
                    decision = self._stops.feed(-1, tail)
                    self._stopped = decision.matched
                    deltas.extend(self._parse(-1, decision.text))
                if not self._stopped:  # EOS / length: flush an unmatched prefix (STOP-14, STOP-15)
                    deltas.extend(self._parse(-1, self._stops.finish()))
        deltas.extend(self._parser.finish())
        return deltas

    def _backend_cut(self, stop: ep.StopMatch, held: str) -> str:
        """The backend matched a stop our matcher has not: keep only its visible prefix."""
        log.warning("backend stop decision %s not reproduced by the gateway matcher", stop.kind)
        if stop.kind == ep.STOP_KIND_STRING:
            room = max(stop.visible_text_bytes - self._released_bytes, 0)
            return held.encode("utf-8")[:room].decode("utf-8", errors="ignore")
        return ""  # token stops: the held tokens are the (partial) match itself

    @property
    def stopped(self) -> bool:
        return self._stopped
