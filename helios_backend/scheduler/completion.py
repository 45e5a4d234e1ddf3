"""Completion records: parsed through the manifest's CompletionLayout, then validated.

Words (int32; f32 fields are raw bits):

    header: [sequence, frame, rows, status, ...]            header_words
    row i : [slot, generation, token, consumed_tokens, draft_cursor, reserved_model,
             accepted, emitted, finish, logprob, top_ids[k], top_logprobs[k], ...]

The scheduler trusts nothing in them: before any lane is retired it checks the
sequence and frame (submission order, CACHE-16), the row count, and per row the slot
and generation in submission order (CACHE-15), the consumed endpoint (CACHE-18), the
accepted/emitted counts (CACHE-17), the sampled id inside the vocabulary (CACHE-13), the
reserved model field -1 (CACHE-14) and the draft cursor -1 for graphs without one
(CACHE-12). Any mismatch fails the round's lanes; nothing is published.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from helios_proto import manifest_pb2 as mp

from helios_backend.scheduler.errors import CompletionMismatch, ConfigurationError
from helios_backend.scheduler.plan import Submission

HEADER_FIELDS = ("sequence", "frame", "rows", "status")
ROW_FIELDS = ("slot", "generation", "token", "consumed_tokens", "draft_cursor",
              "reserved_model", "accepted", "emitted", "finish")
OPTIONAL_ROW_FIELDS = ("logprob", "top_ids", "top_logprobs")
STATUS_OK = 0


@dataclass(frozen=True)
class CompletionFormat:
    """Word indices resolved once from the manifest's CompletionLayout."""
    header_words: int
    row_words: int
    capacity: int
    header: dict[str, int]
    row: dict[str, int]
    top_k: int
    logprob_word: int                   # -1 when not recorded
    top_ids_word: int
    top_logprobs_word: int

    @classmethod
    def from_layout(cls, layout: mp.CompletionLayout) -> "CompletionFormat":
        header = {f.name: f.word for f in layout.header}
        row = {f.name: f.word for f in layout.row}
        missing = [n for n in HEADER_FIELDS if n not in header] + [n for n in ROW_FIELDS if n not in row]
        if missing:
            raise ConfigurationError(f"completion layout lacks fields {missing}")
        return cls(layout.header_words, layout.row_words, layout.rows, header, row,
                   layout.top_logprobs, row.get("logprob", -1), row.get("top_ids", -1),
                   row.get("top_logprobs", -1))

    @property
    def nwords(self) -> int:
        return self.header_words + self.capacity * self.row_words


@dataclass
class CompletionRows:
    """One submission's validated rows, in submission order."""
    tokens: np.ndarray                  # [n] int32, -1 where nothing was emitted
    consumed: np.ndarray                # [n] int32
    finish: np.ndarray                  # [n] int32 (0 none, 1 eos, 2 length: device view)
    logprobs: np.ndarray | None         # [n] float32
    top_ids: np.ndarray | None          # [n, k] int32
    top_logprobs: np.ndarray | None     # [n, k] float32


def parse_and_validate(fmt: CompletionFormat, words: np.ndarray, sub: Submission, *,
                       vocab_size: int, reports_draft_cursor: bool = False) -> CompletionRows:
    words = np.asarray(words, dtype=np.int32).reshape(-1)
    if words.size < fmt.header_words + len(sub.lanes) * fmt.row_words:
        raise CompletionMismatch(f"completion of {words.size} words is too short")
    h = fmt.header
    seq, frame, rows, status = (int(words[h[n]]) for n in HEADER_FIELDS)
    if seq != sub.sequence:
        raise CompletionMismatch(f"completion sequence {seq} != submitted {sub.sequence}")
    if frame != sub.frame:
        raise CompletionMismatch(f"completion frame {frame} != submitted {sub.frame}")
    if status != STATUS_OK:
        raise CompletionMismatch(f"program reported status {status}")
    n = len(sub.lanes)
    if rows != n:
        raise CompletionMismatch(f"completion has {rows} rows, submitted {n}")
    body = words[fmt.header_words:fmt.header_words + n * fmt.row_words].reshape(n, fmt.row_words)
    r = fmt.row
    col = {name: body[:, r[name]] for name in ROW_FIELDS}
    slots = np.array([lane.slot for lane in sub.lanes], dtype=np.int32)
    gens = np.array([lane.generation for lane in sub.lanes], dtype=np.int32)
    ends = np.array([lane.end for lane in sub.lanes], dtype=np.int32)
    sampled = np.array([lane.sample for lane in sub.lanes], dtype=bool)
    _expect(col["slot"], slots, "slot (submission order)")
    _expect(col["generation"], gens, "generation")
    _expect(col["consumed_tokens"], ends, "consumed endpoint")
    _expect(col["emitted"], sampled.astype(np.int32), "emitted count")
    _expect(col["accepted"], np.zeros(n, np.int32), "accepted drafts")
    _expect(col["reserved_model"], np.full(n, -1, np.int32), "reserved model field")
    if not reports_draft_cursor:
        _expect(col["draft_cursor"], np.full(n, -1, np.int32), "draft cursor")
    tokens = np.where(sampled, col["token"], -1).astype(np.int32)
    bad = sampled & ((col["token"] < 0) | (col["token"] >= vocab_size))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CompletionMismatch(f"row {i} sampled id {int(col['token'][i])} outside vocabulary [0, {vocab_size})")
    logprobs = top_ids = top_lp = None
    if fmt.logprob_word >= 0:
        logprobs = body[:, fmt.logprob_word].copy().view(np.float32)
    if fmt.top_k and fmt.top_ids_word >= 0 and fmt.top_logprobs_word >= 0:
        top_ids = body[:, fmt.top_ids_word:fmt.top_ids_word + fmt.top_k].copy()
        top_lp = body[:, fmt.top_logprobs_word:fmt.top_logprobs_word + fmt.top_k].copy().view(np.float32)
    return CompletionRows(tokens, col["consumed_tokens"].copy(), col["finish"].copy(),
                          logprobs, top_ids, top_lp)


def _expect(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.array_equal(got, want):
        i = int(np.flatnonzero(got != want)[0])
        raise CompletionMismatch(f"row {i}: {what} {int(got[i])} != expected {int(want[i])}")
