"""The scheduler's geometry and limits, resolved once at startup from the loaded model."""
from __future__ import annotations

from dataclasses import dataclass


# A round of prompts only costs a latency-bound GPU about what a decode round costs and
# advances none of the decoding requests, while a MIXED round admits one request beside them:
# rounds of prompts are for bursts that one admission a round cannot absorb. Closed-loop
# clients returning 8 rounds after their answer (bench/scheduler_round.py --return-rounds 8:
# every round costs the same there, as on the H200 with this model size), tokens per round
# at 64 / 128 / 256 clients: 54.5 / 99.4 / 164.9 with 2, 56.4 / 104.0 / 170.0 with 32; first
# tokens 8 / 11 / 11 rounds after arrival (p50) with 2, 2 / 2 / 23 with 32.
ADMISSION_BURST = 32


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

    def __post_init__(self) -> None:
        for name in ("page_tokens", "num_pages", "request_slots", "max_active", "context_tokens",
                     "max_pages_per_row", "vocab_size", "input_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler {name} must be positive, got {getattr(self, name)}")
        if self.admission_burst < 2:
            raise ValueError(f"scheduler admission_burst must be at least 2, got {self.admission_burst}")
        if self.queue_capacity < 0 or self.snapshot_capacity < 0:
            raise ValueError("queue and snapshot capacities cannot be negative")
