"""Completion records: parsed through the manifest's CompletionLayout, then validated.

Words (int32; f32 fields are raw bits):

    header: [sequence, live_rows, operation, rows]           (kernel_abi/state.py)
    row i : [slot, generation, token, consumed, emitted, finish, draft_cursor, reserved_model]

plus optional fields a layout may declare (frame, status, accepted, logprob, top-k);
fields are found by name, so the word order is the manifest's business. Row fields whose
word index is at or past row_words live in the row's extension record: extension records
of (largest field end - row_words) words follow the capacity standard records (the logprob
records of sampling.logprobs.v1, kernel_abi/logprobs.py), or start at the word of the header
field `logprob_records` where a layout declares one (speculative cores: their own extension
records, scheduler/speculative.py, come first).

The scheduler trusts nothing in them: before any lane is retired it checks the
sequence and frame (submission order, CACHE-16), the row count, and per row the slot
and generation in submission order (CACHE-15), the consumed endpoint (CACHE-18), the
accepted/emitted counts (CACHE-17), the sampled id inside the vocabulary (CACHE-13), the
reserved model field -1 (CACHE-14) and the draft cursor -1 for graphs without one
(CACHE-12). Any mismatch fails the round's lanes; nothing is published.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_proto import manifest_pb2 as mp

from helios_backend.scheduler.decode_block import DecodeBlock, lane_columns
from helios_backend.scheduler.errors import CompletionMismatch, ConfigurationError
from helios_backend.scheduler.plan import Submission

# Role -> accepted layout names (first present wins). Required roles must be declared.
HEADER_NAMES = {"sequence": ("sequence",), "live_rows": ("live_rows", "rows"),
                "frame": ("frame",), "status": ("status",), "operation": ("operation",),
                "logprob_records": ("logprob_records",)}
REQUIRED_HEADER = ("sequence", "live_rows")
ROW_NAMES = {"slot": ("slot",), "generation": ("generation",), "token": ("token",),
             "consumed": ("consumed", "consumed_tokens"), "emitted": ("emitted",),
             "finish": ("finish",), "draft_cursor": ("draft_cursor",),
             "reserved_model": ("reserved_model",), "accepted": ("accepted",),
             "logprob": ("logprob",), "top_ids": ("top_ids",), "top_logprobs": ("top_logprobs",)}
REQUIRED_ROW = ("slot", "generation", "token", "consumed", "emitted", "finish", "draft_cursor",
                "reserved_model")
STATUS_OK = 0


def _resolve(fields: dict[str, int], names: dict[str, tuple[str, ...]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for role, aliases in names.items():
        for alias in aliases:
            if alias in fields:
                out[role] = fields[alias]
                break
    return out


@dataclass(frozen=True)
class CompletionFormat:
    """Word indices resolved once from the manifest's CompletionLayout."""
    header_words: int
    row_words: int
    capacity: int
    header: dict[str, int]               # role -> word
    row: dict[str, int]
    top_k: int
    extension_words: int = 0             # words of each row's extension record (0: none)

    @classmethod
    def from_layout(cls, layout: mp.CompletionLayout) -> "CompletionFormat":
        header = _resolve({f.name: f.word for f in layout.header}, HEADER_NAMES)
        row = _resolve({f.name: f.word for f in layout.row}, ROW_NAMES)
        missing = [n for n in REQUIRED_HEADER if n not in header] + [n for n in REQUIRED_ROW if n not in row]
        if missing:
            raise ConfigurationError(f"completion layout lacks fields {missing}")
        extension = max([f.word + max(f.words, 1) for f in layout.row] + [layout.row_words]) - layout.row_words
        return cls(layout.header_words, layout.row_words, layout.rows, header, row, layout.top_logprobs, extension)

    def row_words_of(self, words: np.ndarray, n: int) -> np.ndarray:
        """[n, row_words + extension_words]: the first n standard records with their extensions."""
        words = np.asarray(words, dtype=np.int32).reshape(-1)
        body = words[self.header_words:self.header_words + n * self.row_words].reshape(n, self.row_words)
        if not self.extension_words:
            return body
        base = self.extension_base
        if words.size < base + n * self.extension_words:
            raise CompletionMismatch(f"completion of {words.size} words lacks the extension records")
        ext = words[base:base + n * self.extension_words].reshape(n, self.extension_words)
        return np.concatenate([body, ext], axis=1)

    @property
    def extension_base(self) -> int:
        """First word of the row extension records: right after the capacity standard records,
        unless the layout declares them later (after a speculative core's own extension records)."""
        return self.header.get("logprob_records", self.header_words + self.capacity * self.row_words)

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


class SubmittedLane(Protocol):
    """What the header check reads of one submitted lane."""
    @property
    def slot(self) -> int: ...
    @property
    def generation(self) -> int: ...


class SubmittedCohort(Protocol):
    """What the header check reads of a submission (a plan Submission, a speculative round)."""
    @property
    def sequence(self) -> int: ...
    @property
    def frame(self) -> int: ...
    @property
    def operation(self) -> cp.Operation.ValueType: ...
    @property
    def lanes(self) -> Sequence[SubmittedLane]: ...


def validate_header(fmt: CompletionFormat, words: np.ndarray, sub: SubmittedCohort) -> np.ndarray:
    """Header checks shared by every submission; returns the rows' words [n, row_words]."""
    words = np.asarray(words, dtype=np.int32).reshape(-1)
    n = len(sub.lanes)
    if words.size < fmt.header_words + n * fmt.row_words:
        raise CompletionMismatch(f"completion of {words.size} words is too short")
    h = fmt.header
    seq = int(words[h["sequence"]])
    if seq != sub.sequence:
        raise CompletionMismatch(f"completion sequence {seq} != submitted {sub.sequence}")
    if "frame" in h and int(words[h["frame"]]) != sub.frame:
        raise CompletionMismatch(f"completion frame {int(words[h['frame']])} != submitted {sub.frame}")
    if "status" in h and int(words[h["status"]]) != STATUS_OK:
        raise CompletionMismatch(f"program reported status {int(words[h['status']])}")
    if "operation" in h and int(words[h["operation"]]) != sub.operation:
        raise CompletionMismatch(f"completion of operation {int(words[h['operation']])}, submitted {sub.operation}")
    rows = int(words[h["live_rows"]])
    if rows != n:
        raise CompletionMismatch(f"completion has {rows} rows, submitted {n}")
    body = words[fmt.header_words:fmt.header_words + n * fmt.row_words].reshape(n, fmt.row_words)
    if isinstance(sub.lanes, DecodeBlock):
        slots, gens, _, _ = lane_columns(sub.lanes)
    else:
        slots = np.array([lane.slot for lane in sub.lanes], dtype=np.int32)
        gens = np.array([lane.generation for lane in sub.lanes], dtype=np.int32)
    _expect(body[:, fmt.row["slot"]], slots, "slot (submission order)")
    _expect(body[:, fmt.row["generation"]], gens, "generation")
    return body


def parse_and_validate(fmt: CompletionFormat, words: np.ndarray, sub: Submission, *,
                       vocab_size: int, reports_draft_cursor: bool = False) -> CompletionRows:
    body = validate_header(fmt, words, sub)
    n = len(sub.lanes)
    r = fmt.row
    col = {role: body[:, r[role]] for role in REQUIRED_ROW}
    _, _, ends, emitted = lane_columns(sub.lanes)
    sampled = emitted.astype(bool)
    _expect(col["consumed"], ends, "consumed endpoint")
    _expect(col["emitted"], emitted, "emitted count")
    if "accepted" in r:
        _expect(body[:, r["accepted"]], np.zeros(n, np.int32), "accepted drafts")
    _expect(col["reserved_model"], np.full(n, -1, np.int32), "reserved model field")
    if not reports_draft_cursor:
        _expect(col["draft_cursor"], np.full(n, -1, np.int32), "draft cursor")
    tokens = np.where(sampled, col["token"], -1).astype(np.int32)
    bad = sampled & ((col["token"] < 0) | (col["token"] >= vocab_size))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CompletionMismatch(f"row {i} sampled id {int(col['token'][i])} outside vocabulary [0, {vocab_size})")
    logprobs = top_ids = top_lp = None
    if fmt.extension_words and ("logprob" in r or "top_ids" in r):
        body = fmt.row_words_of(words, n)
    if "logprob" in r:
        logprobs = body[:, r["logprob"]].copy().view(np.float32)
    if fmt.top_k and "top_ids" in r and "top_logprobs" in r:
        top_ids = body[:, r["top_ids"]:r["top_ids"] + fmt.top_k].copy()
        top_lp = body[:, r["top_logprobs"]:r["top_logprobs"] + fmt.top_k].copy().view(np.float32)
    return CompletionRows(tokens, col["consumed"].copy(), col["finish"].copy(), logprobs, top_ids, top_lp)


def _expect(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.array_equal(got, want):
        i = int(np.flatnonzero(got != want)[0])
        raise CompletionMismatch(f"row {i}: {what} {int(got[i])} != expected {int(want[i])}")
