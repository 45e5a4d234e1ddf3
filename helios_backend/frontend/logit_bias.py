"""OpenAI's logit_bias, checked alike by the gateway (HTTP 400) and the backend (InvalidRequest).

A request maps token ids to biases in [-100, 100]; each is added to that token's logit before
sampling (sampling.logit_bias.v1, in place: the logprobs see it too, as OpenAI's do). At most
the core's capacity of entries (OpenAI's 300 for cores prepared here; `logit_bias_capacity`
reads it from the contract's sampling programs); a core prepared without the logit-bias input
has capacity 0 and refuses every request that carries one, rather than serving it unbiased.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

LOGIT_BIAS_BOUND = 100.0       # |bias| <= this (OpenAI)


class LogitBiasError(ValueError):
    """A logit_bias the served core cannot apply as asked; the message names the entry."""


def parse_token_keys(raw: Mapping[str, float]) -> dict[int, float]:
    """The JSON object's keys (decimal token ids, as OpenAI's SDKs send them) as ints."""
    parsed: dict[int, float] = {}
    for key, value in raw.items():
        text = key.strip()
        if not text.isdigit():
            raise LogitBiasError(f"key {key!r} is not a token id (a non-negative decimal integer)")
        token = int(text)
        if token in parsed:
            raise LogitBiasError(f"token id {token} appears twice")
        parsed[token] = value
    return parsed


def check_logit_bias(entries: Mapping[int, float], vocab: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, biases float32) of a valid logit_bias; LogitBiasError otherwise."""
    if entries and capacity <= 0:
        raise LogitBiasError("the served core was prepared without the logit-bias input; "
                             "re-prepare it (make core / helios-prepare) to use logit_bias")
    if len(entries) > capacity:
        raise LogitBiasError(f"{len(entries)} entries exceed the limit of {capacity}")
    items = list(entries.items())          # one pass: ids and biases stay paired
    for token, bias in items:
        if not 0 <= token < vocab:
            raise LogitBiasError(f"token id {token} is outside the vocabulary [0, {vocab})")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias) \
                or abs(bias) > LOGIT_BIAS_BOUND:
            raise LogitBiasError(f"bias {bias!r} of token {token} is not a number in "
                                 f"[-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}]")
    return (np.array([token for token, _ in items], np.int32).reshape(-1),
            np.array([bias for _, bias in items], np.float32).reshape(-1))


# ---- the core's capacity -----------------------------------------------------------------------
# Operations whose programs end with a draw: the ones a logit bias must reach.
SAMPLING_OPERATIONS = frozenset({C.OPERATION_PREFILL, C.OPERATION_DECODE, C.OPERATION_MIXED, C.OPERATION_RESUME})
_LOGIT_BIAS_SOURCES = (C.VALUE_SOURCE_LOGIT_BIAS_IDS, C.VALUE_SOURCE_LOGIT_BIAS_VALUES)
_ROW_MODES = (C.INDEX_MODE_SUBMISSION_ROW, C.INDEX_MODE_ACTIVE_ROW)   # the bias rows are packed by request row


def logit_bias_capacity(graphs: Sequence[C.GraphContract], transport: M.Transport) -> int:
    """Logit-bias entries per request that every selected sampling program takes (the row width
    of its logit-bias destinations), or 0 when one of them binds no logit-bias source (a core
    prepared before them: requests carrying logit_bias are refused, never served unbiased).
    SPECULATIVE programs are left out: the scheduler never speculates a biased request."""
    widths = {d.name: int(d.row_elements) for d in transport.destinations}
    capacity = None
    for graph in graphs:
        if graph.operation not in SAMPLING_OPERATIONS:
            continue
        bound = {b.source: widths.get(b.destination, 0) for b in graph.bindings
                 if b.source in _LOGIT_BIAS_SOURCES and b.index in _ROW_MODES}
        width = min((bound.get(source, 0) for source in _LOGIT_BIAS_SOURCES), default=0)
        capacity = width if capacity is None else min(capacity, width)
    return capacity or 0
