"""The frontend assets answer: everything the gateway learns from the served model."""
from __future__ import annotations

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.engine.settings import EffectiveSettings


def frontend_assets(contract: cp.ServingContract, tokenizer_json: bytes, chat_template: str,
                    settings: EffectiveSettings, max_prompt_tokens: int, top_logprobs: int,
                    logit_bias_capacity: int, clock_origin_ns: int) -> ep.FrontendAssets:
    d = contract.defaults
    return ep.FrontendAssets(
        version=ep.TRANSPORT_VERSION_1, served_id=contract.served_id, aliases=list(settings.aliases),
        tokenizer_json=tokenizer_json, chat_template=chat_template, frontend=contract.model.frontend,
        sampling_defaults=d.sampling, eos_token_ids=list(d.eos_token_ids),
        limits=ep.ServingLimits(
            context_tokens=contract.context_tokens, max_prompt_tokens=max_prompt_tokens,
            max_output_tokens=settings.max_output_tokens, queue_capacity=settings.queue_capacity,
            max_active=settings.max_active, event_capacity=settings.event_capacity,
            frontend_workers=settings.frontend_workers,
            sampled_vocabulary=contract.model.vocabulary.sampled_tokens),
        clock=ep.BackendClock(origin_monotonic_ns=clock_origin_ns),
        cache_label=contract.cache_identity.label, top_logprobs_capacity=top_logprobs,
        logit_bias_capacity=logit_bias_capacity)
