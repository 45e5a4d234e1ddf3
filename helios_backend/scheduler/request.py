"""Requests as the scheduler sees them: an immutable spec and the mutable state it owns.

State machine (one owner: the Scheduler):

    WAITING --admit--> RUNNING --finish/cancel/fail (after its fence)--> FINISHED
       ^                  |
       +----preempt-------+   (pages released, computed reset to 0; readmission
                               recomputes prompt + output, usually from the prefix cache)

Token bookkeeping (vLLM v1 style): `tokens` = prompt + validated output; `computed` =
tokens whose history is in the cache (the consumed endpoint). Every round moves
`computed` towards len(tokens); a round that reaches len(tokens) samples one token.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from helios_proto import exchange_pb2 as ep

from helios_backend.sampling_parameters import SamplingParameters


class Grammar(Protocol):
    """A constrained request's matcher (frontend/grammar_runtime.GrammarSession)."""
    def fill_mask(self, out_words: np.ndarray) -> None: ...
    def consume(self, token: int) -> bool: ...


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingSettings(SamplingParameters):
    """Resolved sampling (request values over core defaults) and the request's seed.
    The parameter fields and their packed order are sampling_parameters.SamplingParameters."""
    seed: int = 0


@dataclass(frozen=True)
class StopSettings:
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    token_sequences: tuple[tuple[int, ...], ...] = ()

    @property
    def host_stops(self) -> bool:
        """Stops the worker decides between rounds (the host-stop barrier)."""
        return bool(self.strings or self.token_ids or self.token_sequences)


@dataclass(frozen=True, eq=False)
class LogitBias:
    """OpenAI's logit_bias, validated at admission: distinct token ids (int32) and their biases
    (float32, same length), packed as they are into every sampling lane of the request."""
    ids: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class RequestSpec:
    """What a request asked for, validated at admission."""
    prompt: tuple[int, ...]
    max_tokens: int                      # output limit after clipping to context and pages
    sampling: SamplingSettings
    stops: StopSettings = StopSettings()
    logprobs: bool = False
    top_logprobs: int = 0
    observe_timestamps: bool = False
    constrained: bool = False            # a grammar constrains this request
    priority: int = 0
    external_id: str = ""
    ignore_eos: bool = False             # EOS ids neither end the request nor are withheld
    min_tokens: int = 0                  # outputs before EOS or a stop token id may be sampled
    logit_bias: LogitBias | None = None  # added to the logits before sampling (never speculated)

    def withheld_ids(self, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Ids masked out of sampling until min_tokens outputs exist (vLLM's min_tokens):
        the core's EOS ids (unless ignore_eos) and the request's stop token ids."""
        if self.min_tokens <= 0:
            return ()
        return (() if self.ignore_eos else eos_ids) + self.stops.token_ids


# one object per request, equal only to itself (list.remove and list.index on the running list
# compare by identity, not field by field); slots: its fields in the object itself, which the
# per-lane bookkeeping of every round reads and writes
@dataclass(eq=False, slots=True)
class Request:
    serial: int                          # scheduler-assigned, never a metric label
    spec: RequestSpec
    arrival: int                         # admission order
    state: RequestState = RequestState.WAITING
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int = -1
    generation: int = 0
    pages: list[int] = field(default_factory=list)
    published_pages: int = 0             # leading pages known published/shared (immutable)
    chain_keys: list[bytes] = field(default_factory=list)  # keys of pages [0, published_pages)
    # keys of the leading complete pages of `tokens` hashed at its last admission (the prefix
    # lookup), published or not: their publication takes them instead of hashing the pages again
    # (tokens only grow, so a page's key never changes; preemption clears them with the pages)
    admission_keys: list[bytes] = field(default_factory=list)
    fresh: bool = True                   # next round (re)initializes the slot
    device_pending: bool = False         # the slot's device pending token is tokens[-1]
    reused_prompt_tokens: int = -1       # set at first admission
    inflight: int = 0                    # submitted rounds not yet completed (fence)
    cancelled: bool = False
    finish: "ep.FinishReason.ValueType" = ep.FINISH_REASON_UNSPECIFIED
    stop: ep.StopMatch | None = None
    preemptions: int = 0
    grammar: Grammar | None = None       # constrained requests: advanced after each validated token
    # len(tokens) at which it ends by length: prompt + output limit, within the context
    # (the scheduler sets it from its context at add(); no limit of its own otherwise)
    token_limit: int = 1 << 62
    # its sampled lanes may carry host values (a grammar or min_tokens mask, a logit bias), or it
    # is constrained: fixed by the spec and the grammar, read once per lane and round by the
    # packing (engine/runner.py) and by complete(); a round without any has no constrained lane
    host_values: bool = field(init=False)
    # its decode lanes may be held as columns (scheduler/decode_block.py): no host values, no top
    # logprobs, no host stops; fixed by the spec and the grammar
    columnar: bool = field(init=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.spec.prompt)
        self.host_values = (self.grammar is not None or self.spec.constrained or self.spec.min_tokens > 0
                            or self.spec.logit_bias is not None)
        self.columnar = not (self.host_values or self.spec.top_logprobs or self.spec.stops.host_stops)

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def withholds(self, eos_ids: tuple[int, ...]) -> bool:
        """The next sampled token must not be an EOS or stop id (min_tokens not reached):
        its round needs a host mask, so completion feedback, as a grammar does."""
        return self.output_len < self.spec.min_tokens and bool(self.spec.withheld_ids(eos_ids))

    def needs_mask(self, eos_ids: tuple[int, ...]) -> bool:
        """Its next sampled token needs a host mask (its grammar, or ids withheld until
        min_tokens): that round is planned from completion feedback and never speculated."""
        return self.grammar is not None or (self.spec.min_tokens > 0 and self.withholds(eos_ids))

    @property
    def remaining_tokens(self) -> int:
        return len(self.tokens) - self.computed
