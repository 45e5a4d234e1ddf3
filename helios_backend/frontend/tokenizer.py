"""The serving-side tokenizer: trusted/untrusted encoding, exact byte-level decoding.

Built from the core's tokenizer.json (a HF `tokenizers` byte-level BPE, or a SentencePiece-style
BPE with byte fallback: "▁" spaces and <0xXX> byte tokens, which the byte table spells out). Two
encodings of the same vocabulary, by one `tokenizers.Tokenizer`:

- `encode_template(text)` parses special tokens: the chat template's own markup such as
  "<|im_start|>" becomes its single control id. Only text the *template* produced may go here.
- `encode_untrusted(text)` never produces a special id from text (`encode_special_tokens=True`):
  a user who types "<|im_end|>" gets the ordinary tokens for those characters, so message content
  cannot close its own turn or forge a role header.

The switch between them is the Tokenizer's `encode_special_tokens`, set for each encode under a
lock. A second Tokenizer kept for the untrusted spelling held ~12 MiB more (SmolLM2's 49K-token
vocabulary and merges); `tokenizers`' single-text encode holds the GIL, so the lock serializes
no encodes that ran in parallel.

Decoding is done from a per-id byte table (the GPT-2 byte-to-unicode alphabet reversed; special
tokens contribute their UTF-8 content). `IncrementalDecoder` feeds those bytes through a UTF-8
incremental decoder, so a multibyte character split across tokens is emitted once, whole, when
its last byte arrives; the concatenation of everything it emits equals `decode(all ids)`.
Invalid byte sequences become U+FFFD exactly as `tokenizers`' lossy decode does.
"""

from __future__ import annotations

import codecs
import re
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

from tokenizers import Tokenizer


class TokenizerDataError(Exception):
    """The tokenizer.json text cannot be loaded or is not a byte-level tokenizer."""


class UnknownTokenIdError(ValueError):
    """A token id outside [0, vocab_size)."""


class UnrepresentableTextError(ValueError):
    """The text holds a character whose UTF-8 bytes have no token in this vocabulary.

    Byte-level BPE would silently drop such bytes (so would llama.cpp); refusing keeps the
    invariant decode(encode(text)) == text. For SmolLM2 the vocabulary lacks bytes 0x04, 0x06,
    0x13, 0x14, 0x16, 0x1D (ASCII control characters) and the lead bytes 0xF1, 0xF2 (code points
    U+40000-U+BFFFF, all unassigned), plus bytes that never occur in UTF-8. Lone surrogates
    (possible in a Python str decoded from JSON) are refused the same way.
    """


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible map from each of the 256 bytes to a printable unicode char, reversed."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_CHAR_TO_BYTE = _byte_level_alphabet()


def _is_surrogate(ch: str) -> bool:
    return 0xD800 <= ord(ch) <= 0xDFFF


_SPACE_PIECE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(token: str) -> bytes:
    """A SentencePiece token's bytes (the decoder Replace("▁", " ") + ByteFallback): "<0xXX>"
    is that one byte, every other token its text with U+2581 as a space."""
    found = _BYTE_PIECE.fullmatch(token)
    if found:
        return bytes([int(found.group(1), 16)])
    return token.replace(_SPACE_PIECE, " ").encode("utf-8")


def _is_sentencepiece(tk: Tokenizer) -> bool:
    """Byte-fallback BPE (SentencePiece spelling) rather than byte-level BPE: the model's own
    flag, as tokenizer.json declares it."""
    return bool(getattr(tk.model, "byte_fallback", False))


def _token_bytes(token: str) -> bytes:
    # Same rule as tokenizers' ByteLevel decoder: chars of the alphabet map to their byte, any
    # other char (only possible in added tokens) contributes its own UTF-8 encoding.
    out = bytearray()
    for ch in token:
        b = _CHAR_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


@dataclass(frozen=True)
class _ByteTable:
    by_id: tuple[bytes, ...]  # id -> exact bytes the token decodes to
    special: frozenset[int]
    special_by_text: dict[str, int]  # special token content -> id
    missing_bytes: frozenset[int]  # byte values with no single-byte token


def _build_byte_table(tk: Tokenizer) -> _ByteTable:
    added = tk.get_added_tokens_decoder()  # id -> AddedToken
    special = frozenset(i for i, t in added.items() if t.special)
    size = tk.get_vocab_size(with_added_tokens=True)
    spelling = _sentencepiece_bytes if _is_sentencepiece(tk) else _token_bytes
    table = []
    for i in range(size):
        token = tk.id_to_token(i)
        if token is None:
            raise TokenizerDataError(f"vocabulary has a hole at id {i}")
        table.append(added[i].content.encode("utf-8") if i in added else spelling(token))
    by_text = {added[i].content: i for i in sorted(special)}
    # A byte is encodable only if its byte-level char is itself a (non-added) vocab token: BPE
    # starts from single-byte symbols and drops those it does not know.
    present = {t[0] for i, t in enumerate(table) if len(t) == 1 and i not in added}
    return _ByteTable(tuple(table), special, by_text, frozenset(range(256)) - present)


class FrontendTokenizer:
    """Encode prompts and decode generated ids for one model's vocabulary. Thread-safe: the one
    underlying tokenizer's special-token switch changes only under `_lock`, around an encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._table = _build_byte_table(tokenizer)
        self._vocab_size = len(self._table.by_id)
        added = set(tokenizer.get_added_tokens_decoder())
        self._max_token_bytes = max((len(t) for i, t in enumerate(self._table.by_id) if i not in added), default=1)

    @classmethod
    def from_json(cls, text: str) -> "FrontendTokenizer":
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerDataError(f"cannot load tokenizer.json: {exc}") from exc
        return cls(tokenizer)

    # ---- encoding -------------------------------------------------------------------------
    def encode_untrusted(self, text: str) -> list[int]:
        """Ids for user-supplied text: special-token spellings stay plain text.

        Raises UnrepresentableTextError rather than dropping characters the vocabulary lacks.
        """
        self._check_representable(text)
        with self._lock:
            self._tokenizer.encode_special_tokens = True
            try:
                return self._tokenizer.encode(text, add_special_tokens=False).ids
            finally:
                self._tokenizer.encode_special_tokens = False

    def encode_template(self, text: str) -> list[int]:
        """Ids for template-produced markup: special-token spellings become their control ids."""
        self._check_representable(text)
        with self._lock:
            return self._tokenizer.encode(text, add_special_tokens=False).ids

    def unrepresentable_chars(self, text: str) -> list[str]:
        """Characters of `text` that would be lost in encoding (empty for almost all text)."""
        missing = self._table.missing_bytes
        try:
            if missing.isdisjoint(text.encode("utf-8")):
                return []
        except UnicodeEncodeError:
            pass  # lone surrogates: not text at all, reported below
        return sorted({ch for ch in text if _is_surrogate(ch) or not missing.isdisjoint(ch.encode("utf-8"))})

    def _check_representable(self, text: str) -> None:
        bad = self.unrepresentable_chars(text)
        if bad:
            shown = ", ".join(f"U+{ord(ch):04X}" for ch in bad[:8])
            raise UnrepresentableTextError(f"text contains characters the vocabulary cannot encode: {shown}")

    # ---- vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_token_bytes(self) -> int:
        """The most text bytes one ordinary (non-added) token covers: a text of B bytes has at
        least B / max_token_bytes tokens, which bounds prompts before they are tokenized."""
        return self._max_token_bytes

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special (control) tokens, e.g. 0-16 for SmolLM2."""
        return self._table.special

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token content -> id, e.g. {"<|im_end|>": 2, ...}. A copy."""
        return dict(self._table.special_by_text)

    def token_id(self, text: str) -> int | None:
        """The id whose token is exactly `text` (special content or byte-level spelling), else None."""
        return self._tokenizer.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes this id contributes to decoded output (may be part of a character)."""
        self._check(token_id)
        return self._table.by_id[token_id]

    def token_text(self, token_id: int) -> str:
        """This token alone as text; bytes that are not valid UTF-8 on their own become U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _check(self, token_id: int) -> None:
        if not 0 <= token_id < self._vocab_size:
            raise UnknownTokenIdError(f"token id {token_id} outside [0, {self._vocab_size})")

    # ---- decoding -------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        out = bytearray()
        for i in ids:
            self._check(i)
            if skip_special_tokens and i in self._table.special:
                continue
            out += self._table.by_id[i]
        return bytes(out)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Feed generated ids, get only the text they complete.

    Bytes of an unfinished UTF-8 character stay buffered (at most 3) until a later token resolves
    them; `finish()` flushes what is left as U+FFFD. Cost per `feed` is proportional to the new
    tokens' bytes, not to the history.
    """

    def __init__(self, tokenizer: FrontendTokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, self._skip_special), final=False)

    def feed_one(self, token_id: int) -> str:
        return self.feed((token_id,))

    @property
    def pending_bytes(self) -> bytes:
        """Bytes of an incomplete character not yet emitted."""
        buffered, _ = self._utf8.getstate()
        return buffered

    def finish(self) -> str:
        """End of stream: emit any incomplete trailing bytes (as U+FFFD) and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
