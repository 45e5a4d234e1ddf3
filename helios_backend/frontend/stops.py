"""Incremental string and token stops, shared by the backend worker and the gateway.

The backend worker decides the match (a stop gates scheduling: width one, one round
outstanding) and the gateway replays the same matcher over the same token stream to
trim the visible text, so both halves agree by construction.

Per completed token the caller does one ``feed(token_id, text_delta)`` (or
``feed_bytes`` when it has raw token bytes) and gets a ``StopDecision``:

* ``text``: decoded text that can no longer become part of a stop, safe to present;
* ``matched``: a stop completed in this token; ``text`` then holds the text before
  the match, and the match plus everything after it (even later in the same token)
  is dropped. The caller stops feeding.

Held back until resolved: a partial UTF-8 character (``feed_bytes``), a suffix that is
a prefix of some string stop, and tokens that are a prefix of some stop sequence.
``finish()`` flushes the held text when generation ends normally (EOS, output limit).

Matching is chunking-independent: the first stop to *complete* in the text wins, and
when several complete at the same character the earliest-starting (longest) wins.
Both modes run one Aho-Corasick automaton, whose state depth is exactly the length of
the held suffix, so a token costs O(len(token)) regardless of stop lengths.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MAX_STOP_STRINGS = 4
MAX_STOP_STRING_BYTES = 4096  # all strings together, UTF-8
MAX_STOP_SEQUENCES = 16  # stop_token_ids count as one-token sequences
MAX_STOP_SEQUENCE_TOKENS = 64


class StopSpecError(ValueError):
    """A stop specification the spec rejects; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class StopDecision:
    text: str  # visible text released by this token (before any match)
    matched: bool = False
    stop_index: int = -1  # index into the string stops or the token sequences; -1 = none


_NO_MATCH_EMPTY = StopDecision("")


class _Automaton:
    """Aho-Corasick over hashable symbols (characters or token ids).

    Node 0 is the root. ``depth[n]`` is the length of the pattern prefix spelled by n,
    ``match_len[n]`` the longest pattern ending at n (via suffix links), 0 if none,
    and ``match_index[n]`` that pattern's index.
    """

    __slots__ = ("goto", "fail", "depth", "match_len", "match_index")

    def __init__(self, patterns: Sequence[Sequence[Hashable]]) -> None:
        self.goto: list[dict[Hashable, int]] = [{}]
        self.fail: list[int] = [0]
        self.depth: list[int] = [0]
        self.match_len: list[int] = [0]
        self.match_index: list[int] = [-1]
        for index, pattern in enumerate(patterns):
            node = 0
            for symbol in pattern:
                nxt = self.goto[node].get(symbol)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][symbol] = nxt
                    self.goto.append({})
                    self.fail.append(0)
                    self.depth.append(self.depth[node] + 1)
                    self.match_len.append(0)
                    self.match_index.append(-1)
                node = nxt
            # a duplicate pattern keeps its first index
            if self.match_len[node] == 0:
                self.match_len[node] = len(pattern)
                self.match_index[node] = index
        queue: deque[int] = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            inherited = self.fail[node]
            if self.match_len[inherited] > self.match_len[node]:
                self.match_len[node] = self.match_len[inherited]
                self.match_index[node] = self.match_index[inherited]
            for symbol, child in self.goto[node].items():
                link = self.fail[node]
                while link and symbol not in self.goto[link]:
                    link = self.fail[link]
                target = self.goto[link].get(symbol, 0)
                self.fail[child] = target if target != child else 0
                queue.append(child)

    def step(self, node: int, symbol: Hashable) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[node].get(symbol)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = fail[node]


class StopMatcher:
    """One request's stop state. Build it with ``StopMatcher.for_request``.

    With no stops configured every call passes the text straight through.
    """

    __slots__ = ("_strings", "_sequences", "_automaton", "_node", "_held_text",
                 "_held_tokens", "_utf8", "_done")

    def __init__(self, strings: Sequence[str] = (), sequences: Sequence[Sequence[int]] = ()) -> None:
        if strings and sequences:
            raise StopSpecError("stop", "string stops cannot be combined with stop token ids or sequences")
        self._strings = tuple(strings)
        self._sequences = tuple(tuple(s) for s in sequences)
        patterns: Sequence[Sequence[Hashable]] = self._strings or self._sequences
        self._automaton = _Automaton(patterns) if patterns else None
        self._node = 0
        self._held_text = ""  # string mode: the held suffix (len == depth[node])
        self._held_tokens: deque[str] = deque()  # token mode: text of each held token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._done = False

    @classmethod
    def for_request(
        cls,
        stop: str | Sequence[str] | None,
        stop_token_ids: Sequence[int] | None = None,
        stop_token_sequences: Sequence[Sequence[int]] | None = None,
        *,
        vocabulary_size: int | None = None,
        structured_output: bool = False,
    ) -> "StopMatcher":
        """Validate the request's stop fields (StopSpecError names the param) and build."""
        strings = validate_stop_strings(stop)
        sequences = validate_stop_tokens(stop_token_ids, stop_token_sequences, vocabulary_size)
        if strings and sequences:
            raise StopSpecError("stop", "stop cannot be combined with stop_token_ids or stop_token_sequences")
        if strings and structured_output:
            raise StopSpecError("stop", "stop cannot be combined with structured output (response_format)")
        return cls(strings, sequences)

    @property
    def strings(self) -> tuple[str, ...]:
        return self._strings

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return self._sequences

    @property
    def active(self) -> bool:
        """True when the request has stops (the scheduler's host-stop barrier applies)."""
        return self._automaton is not None

    @property
    def matched(self) -> bool:
        return self._done

    def feed_bytes(self, token_id: int, token_bytes: bytes) -> StopDecision:
        """Feed a token's raw bytes; an incomplete UTF-8 character stays buffered."""
        return self.feed(token_id, self._utf8.decode(token_bytes))

    def feed(self, token_id: int, text_delta: str) -> StopDecision:
        """Feed one completed token and the decoded text it completed."""
        if self._done:
            raise RuntimeError("feed after a stop matched")
        automaton = self._automaton
        if automaton is None:
            return StopDecision(text_delta) if text_delta else _NO_MATCH_EMPTY
        if self._sequences:
            return self._feed_token(automaton, token_id, text_delta)
        return self._feed_text(automaton, text_delta)

    def finish(self) -> str:
        """Normal EOS or output-limit end: flush held text (and a dangling UTF-8 tail)."""
        if self._done:
            return ""
        tail = self._utf8.decode(b"", final=True)
        held = self._held_text + "".join(self._held_tokens) + tail
        self._held_text = ""
        self._held_tokens.clear()
        self._node = 0
        self._done = True
        return held

    def _feed_text(self, automaton: _Automaton, text_delta: str) -> StopDecision:
        node = self._node
        step, match_len = automaton.step, automaton.match_len
        for position, char in enumerate(text_delta):
            node = step(node, char)
            length = match_len[node]
            if length:
                # the match ends at `position`; it starts in held text or in this delta
                stream = self._held_text + text_delta[: position + 1]
                self._done = True
                self._held_text = ""
                self._node = 0
                return StopDecision(stream[: len(stream) - length], True, automaton.match_index[node])
        self._node = node
        stream = self._held_text + text_delta
        keep = automaton.depth[node]
        self._held_text = stream[len(stream) - keep:] if keep else ""
        released = stream[: len(stream) - keep]
        return StopDecision(released) if released else _NO_MATCH_EMPTY

    def _feed_token(self, automaton: _Automaton, token_id: int, text_delta: str) -> StopDecision:
        node = automaton.step(self._node, token_id)
        held = self._held_tokens
        held.append(text_delta)
        length = automaton.match_len[node]
        if length:
            # the matched tokens are omitted; tokens held before the match are released
            released = "".join(list(held)[: len(held) - length])
            held.clear()
            self._done = True
            self._node = 0
            return StopDecision(released, True, automaton.match_index[node])
        self._node = node
        keep = automaton.depth[node]
        parts: list[str] = []
        while len(held) > keep:
            parts.append(held.popleft())
        released = "".join(parts)
        return StopDecision(released) if released else _NO_MATCH_EMPTY


def validate_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """null -> none; "" rejected; [] disables; at most 4 strings, 4096 UTF-8 bytes in all."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise StopSpecError("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings")
    total = 0
    for value in strings:
        if not isinstance(value, str):
            raise StopSpecError("stop", "stop strings must be strings")
        if not value:
            raise StopSpecError("stop", "stop strings must be non-empty")
        total += len(value.encode("utf-8"))
    if total > MAX_STOP_STRING_BYTES:
        raise StopSpecError("stop", f"stop strings total more than {MAX_STOP_STRING_BYTES} UTF-8 bytes")
    return strings


def validate_stop_tokens(
    stop_token_ids: Sequence[int] | None,
    stop_token_sequences: Sequence[Sequence[int]] | None,
    vocabulary_size: int | None,
) -> tuple[tuple[int, ...], ...]:
    """Each stop token id is a one-token sequence; at most 16 sequences of at most 64 ids."""
    sequences: list[tuple[int, ...]] = []
    for param, values in (("stop_token_ids", [[t] for t in stop_token_ids or ()]),
                          ("stop_token_sequences", stop_token_sequences or ())):
        for sequence in values:
            sequence = tuple(sequence)
            if not sequence:
                raise StopSpecError(param, f"{param} holds an empty sequence")
            if len(sequence) > MAX_STOP_SEQUENCE_TOKENS:
                raise StopSpecError(param, f"a stop token sequence has at most {MAX_STOP_SEQUENCE_TOKENS} tokens")
            for token in sequence:
                if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                        vocabulary_size is not None and token >= vocabulary_size):
                    raise StopSpecError(param, f"{param} holds {token!r}, outside the vocabulary")
            sequences.append(sequence)
    if len(sequences) > MAX_STOP_SEQUENCES:
        raise StopSpecError("stop_token_sequences",
                            f"at most {MAX_STOP_SEQUENCES} stop token sequences (stop_token_ids included)")
    return tuple(sequences)
