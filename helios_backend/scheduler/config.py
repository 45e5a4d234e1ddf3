"""The scheduler's geometry and limits, resolved once at startup from the loaded model."""
from __future__ import annotations

from dataclasses import dataclass


# Waiting requests that make a round of prompts only; fewer are admitted one a round beside the
# decode lanes (MIXED). Served on the H200 (32-token prompts, the same lease), 2 against 32:
# 41.0k / 55.1k / 62.9k against 42.4k / 54.9k / 61.2k tokens/s at 64 / 128 / 256 clients, TTFT
# p50 at 256 clients 48.9 against 85.1 ms: a MIXED round costs the GPU more than the equal-cost
# rounds of bench/scheduler_round.py assume, where 32 looked better (docs/scheduler.md).
ADMISSION_BURST = 2


@dataclass(frozen=True)
class SchedulerConfig:
    page_tokens: int
    num_pages: int
    request_slots: int
    max_active: int
    queue_capacity: int
    context_tokens: int
    max_pages_per_row: int
    vocab_size: int                      # sampled ids are in [0, vocab_size)
    input_vocab_size: int                # prompt ids are in [0, input_vocab_size)
    eos_ids: tuple[int, ...]
    snapshot_capacity: int = 0           # 0: snapshots off (no RESTORATION program)
    cache_fingerprint: bytes = b""
    top_logprobs_capacity: int = 0
    logprobs_recorded: bool = False      # the completion layout carries the sampled token's logprob
    device_pending_token: bool = True    # DECODE/MIXED read the slot's pending token on device
    clock_origin_ns: int = 0             # time.monotonic_ns() at runtime startup
    admission_burst: int = ADMISSION_BURST   # waiting requests that make a round of prompts only
    # the most prompt tokens one lane consumes in a round; 0: as many as a prepared variant holds
    prefill_chunk_tokens: int = 0
    # plain decode lanes behind a round in flight held as columns (decode_block.py); False: every
    # lane a Lane object (the per-lane path the columns are tested against)
    columnar_decode: bool = True

    def __post_init__(self) -> None:
        for name in ("page_tokens", "num_pages", "request_slots", "max_active", "context_tokens",
                     "max_pages_per_row", "vocab_size", "input_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler {name} must be positive, got {getattr(self, name)}")
        if self.admission_burst < 2:
            raise ValueError(f"scheduler admission_burst must be at least 2, got {self.admission_burst}")
        if self.queue_capacity < 0 or self.snapshot_capacity < 0 or self.prefill_chunk_tokens < 0:
            raise ValueError("queue and snapshot capacities and the prefill chunk cannot be negative")
