"""Delimiters as patterns: atomic tokens versus plain text (FE-9, FE-12, FE-33).

A delimiter whose exact spelling is an *added* token of the frontend tokenizer (special or not:
added tokens are never merged with neighbouring text) delimits output only when it is generated
as that token. Any other delimiter is plain text and matches wherever its characters appear.

The engine parses one string. An atomic delimiter token becomes a single private-use sentinel
character, so the plain-text spelling of the same delimiter never matches it, and a textual
delimiter is simply its own characters:

    token stream   [..."abc"] [id 151668 "</think>"] ["</think>"?]
    parse text     "abc" + U+10FF00 + "</think>"     (the last one is plain text)

Sentinels come from plane 16's private-use area (U+10FF00..U+10FFFD); generated text containing
such a code point is passed through `Markup.text_of` which replaces it with U+FFFD, so text can
never forge a delimiter token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping

_SENTINEL_BASE = 0x10FF00
_SENTINEL_LIMIT = 0x10FFFD
_REPLACEMENT = "\ufffd"
_FIRST_SENTINEL = chr(_SENTINEL_BASE)
# str.translate table: every sentinel code point to U+FFFD (generated text cannot forge one)
_FORGED = {code: _REPLACEMENT for code in range(_SENTINEL_BASE, _SENTINEL_LIMIT + 1)}


def atomic_tokens_from_tokenizer_json(tokenizer_json: str) -> dict[str, int]:
    """Content -> id of every added token of a HF tokenizer.json (the atomic spellings)."""
    data = json.loads(tokenizer_json)
    return {entry["content"]: int(entry["id"]) for entry in data.get("added_tokens", [])}


@dataclass(frozen=True)
class Markup:
    """The pattern of every delimiter of one syntax for one tokenizer (built once per model)."""

    pattern_of: Mapping[str, str]  # delimiter spelling -> parse pattern (sentinel or the spelling)
    sentinel_of_token: Mapping[int, str]  # atomic token id -> sentinel char
    spelling_of_sentinel: Mapping[str, str]  # sentinel char -> delimiter spelling
    token_of_spelling: Mapping[str, int]  # atomic delimiter spelling -> token id

    @classmethod
    def build(cls, delimiters: Iterable[str], atomic_tokens: Mapping[str, int]) -> "Markup":
        pattern_of: dict[str, str] = {}
        sentinel_of_token: dict[int, str] = {}
        spelling_of_sentinel: dict[str, str] = {}
        token_of_spelling: dict[str, int] = {}
        for spelling in sorted({d for d in delimiters if d}):
            token_id = atomic_tokens.get(spelling)
            if token_id is None:
                pattern_of[spelling] = spelling
                continue
            code = _SENTINEL_BASE + len(sentinel_of_token)
            if code > _SENTINEL_LIMIT:
                raise ValueError("too many atomic delimiters for the sentinel range")
            sentinel = chr(code)
            pattern_of[spelling] = sentinel
            sentinel_of_token[token_id] = sentinel
            spelling_of_sentinel[sentinel] = spelling
            token_of_spelling[spelling] = token_id
        return cls(pattern_of, sentinel_of_token, spelling_of_sentinel, token_of_spelling)

    def pattern(self, spelling: str) -> str:
        """The parse pattern of a delimiter; "" stays "" (an absent delimiter never matches)."""
        return self.pattern_of.get(spelling, spelling) if spelling else ""

    def is_atomic(self, spelling: str) -> bool:
        return spelling in self.token_of_spelling

    def text_of(self, token_id: int, text: str) -> str:
        """The parse text of one generated token (or a fragment of its text)."""
        sentinel = self.sentinel_of_token.get(token_id)
        if sentinel is not None:
            return sentinel
        # per generated token: max() scans in C, and only text reaching plane 16's private
        # use area can hold a sentinel (a Python loop per character was the gateway's largest
        # cost of plain answers)
        if text and max(text) >= _FIRST_SENTINEL:
            text = text.translate(_FORGED)
        return text

    def render(self, parse_text: str) -> str:
        """Parse text back to what the model generated (sentinels to their spellings)."""
        if not self.spelling_of_sentinel or not parse_text or max(parse_text) < _FIRST_SENTINEL:
            return parse_text
        return parse_text.translate(self._spellings)

    @cached_property
    def _spellings(self) -> dict[int, str]:
        """str.translate table of render(): sentinel code point -> delimiter spelling."""
        return {ord(sentinel): spelling for sentinel, spelling in self.spelling_of_sentinel.items()}


def earliest(buffer: str, patterns: Iterable[str]) -> tuple[int, str] | None:
    """The first occurrence of any non-empty pattern; on a tie the longest pattern wins."""
    best: tuple[int, str] | None = None
    for pattern in patterns:
        if not pattern:
            continue
        at = buffer.find(pattern)
        if at < 0:
            continue
        if best is None or at < best[0] or (at == best[0] and len(pattern) > len(best[1])):
            best = (at, pattern)
    return best


def partial_suffix(buffer: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of `buffer` that is a proper prefix of some pattern: text that
    must wait for more input before it can be emitted."""
    longest = 0
    for pattern in patterns:
        for size in range(min(len(pattern) - 1, len(buffer)), longest, -1):
            if buffer.endswith(pattern[:size]):
                longest = size
                break
    return longest
