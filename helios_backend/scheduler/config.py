"""The scheduler's geometry and limits, resolved once at startup from the loaded model."""
from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        for name in ("page_tokens", "num_pages", "request_slots", "max_active", "context_tokens",
                     "max_pages_per_row", "vocab_size", "input_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler {name} must be positive, got {getattr(self, name)}")
        if self.queue_capacity < 0 or self.snapshot_capacity < 0:
            raise ValueError("queue and snapshot capacities cannot be negative")
