"""When a round of prompts only admits a burst of waiting requests (step 1b of schedule()).

A MIXED round admits requests beside the decode lanes (one, or as many as its host-fed rows
and spare tokens take), which falls behind arrivals at high concurrency; a round of prompts
only (PREFILL, as many rows as the widest PREFILL variant) admits several at once while the
decoding requests sit that one round out. Never two in a row: the decode lanes run between
them. The measurements behind the rule: docs/scheduler.md.
"""
from __future__ import annotations

from collections.abc import Sequence

from helios_proto import contract_pb2 as cp

from helios_backend.scheduler.request import Request
from helios_backend.scheduler.variants import VariantTable


class PromptRounds:
    def __init__(self, admission_burst: int, variants: VariantTable) -> None:
        self.burst = admission_burst
        self.rows = variants.max_rows(cp.OPERATION_PREFILL)     # prompts one such round admits
        # prompt tokens a MIXED round takes beside its decode lanes, when it takes several
        # prompts (0: one at most, or no MIXED program): shorter prompts need no prompt rounds
        self.mixed_spare_tokens = 0 if variants.mixed_host_fed_rows() < 2 else max(
            v.tokens - v.rows for v in variants.variants(cp.OPERATION_MIXED))
        self.last_was_prompts = False        # the round planned last was a round of prompts only

    def due(self, waiting: Sequence[tuple[object, Request]], running: int, free_slots: int,
            max_active: int) -> bool:
        """`burst` or more requests wait, slots are free for two of them, the previous round
        was not one already, a PREFILL variant takes more than one of them, and no MIXED round
        takes the head of the queue whole beside the decode lanes (a MIXED program that takes
        several host-fed lanes admits a burst of short prompts without stopping the decoding ones)."""
        return (len(waiting) >= self.burst and running > 0 and not self.last_was_prompts
                and free_slots >= 2 and running + 2 <= max_active and self.rows >= 2
                and len(waiting[0][1].tokens) > self.mixed_spare_tokens)

    def planned(self, prompts_only: bool) -> None:
        """Record the kind of the round just planned (or of the decode round that ran instead)."""
        self.last_was_prompts = prompts_only
