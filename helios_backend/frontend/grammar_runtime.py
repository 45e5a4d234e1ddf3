"""The backend's view of a constrained request: one llguidance matcher, masks, token advancement.

The gateway builds the grammar text (`helios_backend.syntax.grammar`) and the exchange
carries it per request; the backend scheduler owns one GrammarSession per constrained lane:

    tokenizer = GrammarTokenizer.from_json(tokenizer_json, eos_token_ids)   # once per model
    session = GrammarSession.create(tokenizer, grammar_text)               # per request
    session.fill_mask(words)        # int32[mask_words], bit (id % 32) of word id // 32 set = allowed
    ok = session.consume(token)     # after the completion; False = the token broke the grammar
    session.is_stopped()            # the grammar admits nothing but EOS

Masks off the critical path: with an `executor`, `consume` starts computing the next mask on it
immediately, and `fill_mask` only waits for (usually: copies) the finished words. The matcher is
never touched by two threads at once: `consume` and `fill_mask` first wait for the pending mask.

Error model (llguidance's): the matcher never raises on bad input; it enters an error state.
`consume` returns False, or a later `fill_mask` hits a lexer/parser limit; then `error` is
non-empty and the mask allows only EOS. The scheduler must check `error` after `fill_mask` and
`consume` and end the request as an output error (HTTP 500 / terminal error event), never as a
normal EOS finish, so a grammar failure is never mistaken for a completed answer.
"""

from __future__ import annotations

import functools
import hashlib
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Sequence

import llguidance as llg
import llguidance.numpy as llnp
import numpy as np


class GrammarSessionError(ValueError):
    """The grammar text cannot be compiled for this tokenizer."""


@dataclass(frozen=True)
class GrammarTokenizer:
    """llguidance's view of the model vocabulary (0.2-0.4 s to build: once per model)."""

    tokenizer: llg.LLTokenizer
    eos_token_ids: tuple[int, ...]  # the core's EOS ids; the first is llguidance's EOS
    fingerprint: str  # sha256 of the tokenizer JSON

    @classmethod
    def from_json(cls, tokenizer_json: str, eos_token_ids: Sequence[int]) -> "GrammarTokenizer":
        if not eos_token_ids:
            raise GrammarSessionError("at least one EOS id is required")
        lltok = llg.LLTokenizer(tokenizer_json, eos_token=int(eos_token_ids[0]))
        digest = hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()
        return cls(lltok, tuple(int(i) for i in eos_token_ids), digest)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(tokenizer_json: str, eos_token_ids: tuple[int, ...]) -> GrammarTokenizer:
    # Keyed by the JSON text itself: a process serves a handful of tokenizers at most.
    return GrammarTokenizer.from_json(tokenizer_json, eos_token_ids)


class GrammarSession:
    """One request's matcher. Not shared between requests."""

    def __init__(self, tokenizer: GrammarTokenizer, matcher: llg.LLMatcher, executor: Executor | None) -> None:
        self._tokenizer = tokenizer
        self._matcher = matcher
        self._executor = executor
        self._words = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)  # [1, mask_words] int32
        self._ready = False  # _words holds the mask for the current position
        self._pending: Future[None] | None = None

    @classmethod
    def create(
        cls,
        tokenizer: GrammarTokenizer | str,
        grammar: str,
        executor: Executor | None = None,
        eos_token_ids: Sequence[int] = (),
        limits: llg.LLParserLimits | None = None,
    ) -> "GrammarSession":
        """A session for one request. `tokenizer` is the model's GrammarTokenizer, or its
        tokenizer JSON text plus `eos_token_ids` (built once per distinct text, then reused).
        `limits`: llguidance's parser/lexer limits (its defaults when None)."""
        if isinstance(tokenizer, str):
            tokenizer = _cached_tokenizer(tokenizer, tuple(int(i) for i in eos_token_ids))
        # The matcher compiles the grammar once and reports a bad grammar as its error state
        # (a separate validate_grammar call would compile it twice: ~2x the creation time).
        matcher = llg.LLMatcher(tokenizer.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarSessionError(matcher.get_error())
        session = cls(tokenizer, matcher, executor)
        session._schedule()
        return session

    # ---- masks --------------------------------------------------------------------------------
    def _compute(self) -> None:
        llnp.fill_next_token_bitmask(self._matcher, self._words)
        self._allow_every_eos()
        self._ready = True

    def _allow_every_eos(self) -> None:
        # llguidance knows one EOS id; generation may end at any of the core's EOS ids.
        words = self._words[0]
        first = self._tokenizer.eos_token_ids[0]
        if (int(words[first // 32]) >> (first % 32)) & 1:
            for eos in self._tokenizer.eos_token_ids[1:]:
                if eos < self._tokenizer.vocab_size:
                    bit = 1 << (eos % 32)
                    words[eos // 32] |= np.int32(bit - (1 << 32) if bit >= 1 << 31 else bit)

    def _schedule(self) -> None:
        self._ready = False
        if self._executor is not None:
            self._pending = self._executor.submit(self._compute)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failure of the mask computation

    def fill_mask(self, out_words: np.ndarray) -> None:
        """Write the allowed-token bitmask of the next position into `out_words` (int32, at least
        mask_words long; words past the vocabulary are zeroed: padded ids are never allowed)."""
        if out_words.dtype != np.int32 or out_words.ndim != 1:
            raise ValueError("out_words must be a 1-D int32 array")
        n = self._tokenizer.mask_words
        if out_words.shape[0] < n:
            raise ValueError(f"out_words holds {out_words.shape[0]} words, the vocabulary needs {n}")
        self._wait()
        if not self._ready:
            self._compute()
        out_words[:n] = self._words[0]
        out_words[n:] = 0

    # ---- advancement --------------------------------------------------------------------------
    def consume(self, token: int) -> bool:
        """Advance by one sampled token; False when it violates the grammar (error state)."""
        self._wait()
        if token in self._tokenizer.eos_token_ids:
            token = self._tokenizer.eos_token_ids[0]  # llguidance only knows its own EOS id
        ok = bool(self._matcher.consume_token(int(token)))
        self._schedule()
        return ok

    def is_stopped(self) -> bool:
        self._wait()
        return bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        self._wait()
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""
