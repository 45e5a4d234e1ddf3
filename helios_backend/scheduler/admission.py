"""Admission against the prepared capacities (OWN-21): reject what can never run, clip
the output limit to what the context and the page table hold; everything else queues."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.config import SchedulerConfig
from helios_backend.scheduler.errors import AdmissionRejected, InvalidSpecError
from helios_backend.scheduler.request import RequestSpec


def max_prompt_tokens(config: SchedulerConfig) -> int:
    """Longest admissible prompt: it and one output token fit the context and a page table."""
    pages = min(config.num_pages, config.max_pages_per_row)
    return min(config.context_tokens - 1, config.page_tokens * pages - 1)


def check_admission(config: SchedulerConfig, spec: RequestSpec, max_prompt: int, queued: int) -> RequestSpec:
    """The spec with its output limit clipped, or AdmissionRejected / InvalidSpecError."""
    if not spec.prompt:
        raise InvalidSpecError("prompt_token_ids", "the prompt is empty")
    prompt = np.asarray(spec.prompt, dtype=np.int64)
    if prompt.min() < 0 or prompt.max() >= config.input_vocab_size:
        raise InvalidSpecError("prompt_token_ids", f"ids must lie in [0, {config.input_vocab_size})")
    if spec.max_tokens <= 0:
        raise InvalidSpecError("max_tokens", "the output limit must be positive")
    if len(spec.prompt) > max_prompt:
        raise AdmissionRejected(ep.REJECTION_REASON_PROMPT_BEYOND_CAPACITY,
                                f"prompt of {len(spec.prompt)} tokens exceeds the prepared capacity of {max_prompt}",
                                limit=max_prompt, requested=len(spec.prompt))
    if spec.top_logprobs > config.top_logprobs_capacity:
        raise AdmissionRejected(ep.REJECTION_REASON_UNSUPPORTED_FEATURE,
                                f"top_logprobs {spec.top_logprobs} exceeds the recorded {config.top_logprobs_capacity}",
                                limit=config.top_logprobs_capacity, requested=spec.top_logprobs)
    if spec.logprobs and not config.logprobs_recorded:
        raise AdmissionRejected(ep.REJECTION_REASON_UNSUPPORTED_FEATURE,
                                "this core's completion records carry no logprobs")
    if queued >= config.queue_capacity:
        raise AdmissionRejected(ep.REJECTION_REASON_QUEUE_FULL, f"{config.queue_capacity} requests are already queued",
                                limit=config.queue_capacity, requested=queued + 1)
    room = max_prompt + 1 - len(spec.prompt)
    return replace(spec, max_tokens=min(spec.max_tokens, room))
