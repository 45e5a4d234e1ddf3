"""A simulated executor for pure scheduler tests (SGLang-style: no model, no Triton).

It keeps a real paged "cache" of token ids (page id x offset), reads every lane's
history back *through its page table*, and samples next = H(history) mod V. A wrong
page table, a shared page overwritten, a lost restore or a bad endpoint therefore
changes the generated ids, which tests compare against `reference_tokens` computed
without any paging. Completions are written as int32 words and go through the real
parse_and_validate.
"""
from __future__ import annotations

import hashlib

import numpy as np

from helios_proto import contract_pb2 as cp
from helios_proto import manifest_pb2 as mp

from helios_backend.scheduler.completion import CompletionFormat, CompletionRows, parse_and_validate
from helios_backend.scheduler.plan import PENDING_TOKEN, RoundPlan, Submission, Variant
from helios_backend.scheduler.scheduler import Scheduler

# the engine's layout (helios_backend/kernel_abi/state.py) plus frame and accepted, which the
# validation checks when a layout declares them
HEADER_FIELDS = ("sequence", "live_rows", "operation", "rows", "frame")
ROW_FIELDS = ("slot", "generation", "token", "consumed", "emitted", "finish", "draft_cursor",
              "reserved_model", "accepted")


def completion_layout(rows: int) -> mp.CompletionLayout:
    layout = mp.CompletionLayout(header_words=len(HEADER_FIELDS), row_words=len(ROW_FIELDS), rows=rows)
    for i, name in enumerate(HEADER_FIELDS):
        layout.header.add(name=name, word=i, words=1, dtype=8)
    for i, name in enumerate(ROW_FIELDS):
        layout.row.add(name=name, word=i, words=1, dtype=8)
    return layout


def next_token(history: list[int] | np.ndarray, vocab: int) -> int:
    digest = hashlib.blake2b(np.asarray(history, dtype=np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def reference_tokens(prompt: list[int], n: int, vocab: int, eos: tuple[int, ...] = ()) -> list[int]:
    """What any correct schedule must generate (greedy, no paging)."""
    history, out = list(prompt), []
    for _ in range(n):
        t = next_token(history, vocab)
        out.append(t)
        history.append(t)
        if t in eos:
            break
    return out


def variants(rows: tuple[int, ...] = (1, 2, 4, 8), tokens: tuple[int, ...] = (16, 64),
             mixed: bool = True, restoration: bool = True, initialization: bool = False,
             mixed_host_fed: int = -1, initialization_rows: tuple[int, ...] | None = None) -> list[Variant]:
    vs = [Variant(cp.OPERATION_DECODE, f"decode_b{b}", b, b) for b in rows]
    vs += [Variant(cp.OPERATION_PREFILL, f"prefill_b{b}_t{t}", b, t) for b in rows for t in tokens]
    if mixed:
        # mixed_host_fed: prefill rows a MIXED program takes (-1: one, it binds a mixed prefill row)
        vs += [Variant(cp.OPERATION_MIXED, f"mixed_b{b}_t{t}", b, t, min(mixed_host_fed, b) if mixed_host_fed > 0 else -1)
               for b in rows for t in tokens]
    if restoration:
        vs += [Variant(cp.OPERATION_RESTORATION, f"restore_b{b}", b, 0) for b in rows]
    if initialization:
        vs += [Variant(cp.OPERATION_INITIALIZATION, f"init_b{b}", b, 0) for b in initialization_rows or rows]
    return vs


class SimulatedEngine:
    def __init__(self, scheduler: Scheduler) -> None:
        cfg = scheduler.config
        self.scheduler = scheduler
        self.pt = cfg.page_tokens
        self.vocab = cfg.vocab_size
        self.cache = np.full((cfg.num_pages, cfg.page_tokens), -1, dtype=np.int64)
        self.pending = np.full(cfg.request_slots, -1, dtype=np.int64)
        self.continuation = np.full((max(cfg.snapshot_capacity, 1), cfg.page_tokens), -1, dtype=np.int64)
        self.fmt = CompletionFormat.from_layout(completion_layout(64))
        self.sequence = 0
        self.launched: list[str] = []
        self.corrupt: dict[str, int] | None = None   # next completion: row field -> value
        self.writes_to_shared: list[int] = []
        self._results: dict[int, object] = {}

    def run(self, plan: RoundPlan, in_flight: int = 0) -> CompletionRows:
        """`in_flight`: rounds launched before this one and not collected yet."""
        rows = None
        for sub in plan.submissions():
            self.sequence += 1
            sub.sequence, sub.frame = self.sequence, self.sequence % 2
            sub.frames_outstanding = in_flight + 1
            self.launched.append(sub.variant.program)
            words = self._execute(sub)
            if sub is plan.main:
                rows = parse_and_validate(self.fmt, words, sub, vocab_size=self.vocab)
        assert rows is not None
        return rows

    # two execution frames: the simulated device runs a round at submit; collect returns it
    def launch(self, plan: RoundPlan, frame: int) -> None:
        try:
            self._results[id(plan)] = self.run(plan, in_flight=len(self._results))
        except Exception as exc:  # reported at collect, like a device fault seen at the fence
            self._results[id(plan)] = exc

    def collect(self, plan: RoundPlan) -> CompletionRows:
        result = self._results.pop(id(plan))
        if isinstance(result, Exception):
            raise result
        return result

    def step(self) -> bool:
        """One round through schedule/run/complete (or fail); False when idle."""
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        try:
            rows = self.run(plan)
        except Exception as exc:  # the worker's contract: a failed round fails its lanes
            self.scheduler.fail(plan, str(exc))
            return True
        self.scheduler.complete(plan, rows)
        return True

    def _execute(self, sub: Submission) -> np.ndarray:
        words = np.zeros(self.fmt.nwords, dtype=np.int32)
        words[:len(HEADER_FIELDS)] = (sub.sequence, len(sub.lanes), sub.operation, sub.variant.rows, sub.frame)
        pool = self.scheduler.pool
        # the recorded programs' input rules (ignition/preparation/contract.py): DECODE reads
        # every row's pending token, PREFILL none, MIXED all but its prefill rows (as many as
        # the variant takes: one where it binds a mixed prefill row) and at least one pending
        host_fed = [lane for lane in sub.lanes if PENDING_TOKEN not in lane.tokens]
        if sub.operation == cp.OPERATION_DECODE:
            assert not host_fed, "DECODE rows read the device-owned pending token"
        elif sub.operation == cp.OPERATION_PREFILL:
            assert len(host_fed) == len(sub.lanes), "PREFILL reads host tokens only"
        elif sub.operation == cp.OPERATION_MIXED:
            limit = sub.variant.host_fed_rows          # resolved by VariantTable
            assert 1 <= len(host_fed) <= limit, f"MIXED takes {limit} prefill rows, got {len(host_fed)}"
            assert len(host_fed) < len(sub.lanes), "MIXED has a pending-token lane"
        for i, lane in enumerate(sub.lanes):
            row = np.zeros(len(ROW_FIELDS), dtype=np.int32)
            row[:] = (lane.slot, lane.generation, -1, lane.end, 0, 0, -1, -1, 0)
            table = lane.page_table
            if sub.operation == cp.OPERATION_RESTORATION:
                r = lane.restore
                self.cache[r.page, :r.tokens] = self.continuation[r.source_row, :r.tokens]
                row[3] = lane.start
            elif sub.operation == cp.OPERATION_INITIALIZATION:
                row[3] = 0
            else:
                for j, tok in enumerate(lane.tokens):
                    pos = lane.start + j
                    if tok == PENDING_TOKEN:
                        tok = int(self.pending[lane.slot])
                    page = table[pos // self.pt]
                    if pool.refcount(page) != 1 or pool.is_published(page):
                        self.writes_to_shared.append(page)
                    self.cache[page, pos % self.pt] = tok
                if lane.sample:
                    history = [int(self.cache[table[p // self.pt], p % self.pt]) for p in range(lane.end)]
                    tok = next_token(history, self.vocab)
                    self.pending[lane.slot] = tok
                    row[2], row[4] = tok, 1
                if lane.snapshot_row >= 0:
                    n = lane.end % self.pt
                    self.continuation[lane.snapshot_row, :n] = self.cache[table[lane.end // self.pt], :n]
            if self.corrupt and sub.operation not in (cp.OPERATION_RESTORATION, cp.OPERATION_INITIALIZATION):
                for name, value in self.corrupt.items():
                    row[ROW_FIELDS.index(name)] = value
            start = len(HEADER_FIELDS) + i * len(ROW_FIELDS)
            words[start:start + len(ROW_FIELDS)] = row
        if self.corrupt and sub.operation not in (cp.OPERATION_RESTORATION, cp.OPERATION_INITIALIZATION):
            self.corrupt = None
        return words
