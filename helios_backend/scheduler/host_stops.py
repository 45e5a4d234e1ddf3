"""The host-stop check of one request: string and token stops decided by the worker.

Wraps the shared incremental StopMatcher (helios_backend/frontend/stops.py) so the
backend's decision and the gateway's presentation replay the same automaton. String
stops need each token's decoded text delta (an IncrementalDecoder); token stops do not.
"""
from __future__ import annotations

from typing import Protocol

from helios_proto import exchange_pb2 as ep

from helios_backend.frontend.stops import StopMatcher
from helios_backend.scheduler.request import StopSettings


class TextDecoder(Protocol):
    def feed_one(self, token_id: int) -> str: ...


class HostStopCheck:
    def __init__(self, stops: StopSettings, decoder: TextDecoder | None) -> None:
        self._stops = stops
        self._sequences = tuple((t,) for t in stops.token_ids) + stops.token_sequences
        self._matcher = StopMatcher(stops.strings, self._sequences)
        if stops.strings and decoder is None:
            raise ValueError("string stops need a text decoder")
        self._decoder = decoder if stops.strings else None
        self._visible_bytes = 0
        self._generated = 0

    def observe(self, token: int) -> ep.StopMatch | None:
        """Feed one validated generated id; a StopMatch when a stop completed with it."""
        self._generated += 1
        delta = self._decoder.feed_one(token) if self._decoder is not None else ""
        decision = self._matcher.feed(token, delta)
        self._visible_bytes += len(decision.text.encode("utf-8"))
        if not decision.matched:
            return None
        index = decision.stop_index
        if self._stops.strings:
            return ep.StopMatch(kind=ep.STOP_KIND_STRING, index=index,
                                visible_text_bytes=self._visible_bytes,
                                matched_text=self._stops.strings[index])
        length = len(self._sequences[index])
        presented = self._generated - length
        n_ids = len(self._stops.token_ids)
        if index < n_ids:
            return ep.StopMatch(kind=ep.STOP_KIND_TOKEN_ID, index=index, presented_tokens=presented)
        return ep.StopMatch(kind=ep.STOP_KIND_TOKEN_SEQUENCE, index=index - n_ids,
                            presented_tokens=presented)
