"""Serving metadata checks: identity, extents, vocabulary, defaults (SRV, CON-3..6)."""
from __future__ import annotations

import math


from .catalog import CheckContext
from .views import OptionalCount
from .errors import ContractError


def _positive(value: int, field: str) -> None:
    if value <= 0:
        raise ContractError(field, "must be positive")


def check_identity(ctx: CheckContext) -> None:
    contract = ctx.contract
    if not contract.served_id:
        raise ContractError("served_id", "must be a nonempty model id")
    seen = {contract.served_id}
    for index, alias in enumerate(contract.aliases):
        if not alias or alias in seen:
            raise ContractError(f"aliases[{index}]", f"empty or repeated model id {alias!r}")
        seen.add(alias)
    if not contract.HasField("model"):
        raise ContractError("model", "missing ModelContract")


def check_extents(ctx: CheckContext) -> None:
    contract = ctx.contract
    for name in ("context_tokens", "prefill_tokens", "concurrency"):
        _positive(getattr(contract, name), name)
    slots = ctx.manifest.request_slots
    if slots and contract.concurrency > slots:
        raise ContractError("concurrency", f"{contract.concurrency} exceeds the manifest's {slots} request slots")
    widths = list(contract.speculative_widths)
    for index, width in enumerate(widths):
        if width < 1 or width in widths[:index]:
            raise ContractError(f"speculative_widths[{index}]", f"width {width} is zero or repeated")


def check_vocabulary(ctx: CheckContext) -> None:
    model = ctx.model
    if not model.HasField("vocabulary"):
        raise ContractError("model.vocabulary", "missing")
    vocab = model.vocabulary
    _positive(vocab.sampled_tokens, "model.vocabulary.sampled_tokens")
    if vocab.histogram_bins < vocab.sampled_tokens:
        raise ContractError("model.vocabulary.histogram_bins", "must cover every sampled token")
    if vocab.mask_words != math.ceil(vocab.sampled_tokens / 32):
        raise ContractError("model.vocabulary.mask_words", "must be ceil(sampled_tokens / 32)")
    inputs = model.input_vocabulary
    if inputs.input_tokens < vocab.sampled_tokens:
        raise ContractError("model.input_vocabulary.input_tokens", "must cover every sampled token")
    for index, sentinel in enumerate(inputs.image_sentinels):
        # sentinels are valid inputs that are never sampled (CON-4/5)
        if not vocab.sampled_tokens <= sentinel < inputs.input_tokens:
            raise ContractError(
                f"model.input_vocabulary.image_sentinels[{index}]",
                f"{sentinel} must be a valid input id outside the sampled range",
            )


def check_vision(ctx: CheckContext) -> None:
    model = ctx.model
    if not model.HasField("vision"):
        return
    vision = model.vision
    for name in ("feature_slots", "features_per_window", "patches_per_feature"):
        _positive(getattr(vision, name), f"model.vision.{name}")
    if not vision.patch_capacities:
        raise ContractError("model.vision.patch_capacities", "at least one captured patch capacity")
    for index, capacity in enumerate(vision.patch_capacities):
        _positive(capacity, f"model.vision.patch_capacities[{index}]")


def check_defaults(ctx: CheckContext) -> None:
    defaults = ctx.contract.defaults
    if not ctx.contract.HasField("defaults") or not defaults.HasField("sampling"):
        raise ContractError("defaults.sampling", "complete sampling defaults are required")
    sampling = defaults.sampling
    rules = (
        ("temperature", sampling.temperature >= 0 and math.isfinite(sampling.temperature), "must be >= 0"),
        ("top_p", 0 < sampling.top_p <= 1, "must lie in (0, 1]"),
        ("min_p", 0 <= sampling.min_p <= 1, "must lie in [0, 1]"),
        ("repetition_penalty", sampling.repetition_penalty > 0, "must be > 0 (1 = off)"),
        ("presence_penalty", math.isfinite(sampling.presence_penalty), "must be finite"),
        ("frequency_penalty", math.isfinite(sampling.frequency_penalty), "must be finite"),
    )
    for name, ok, reason in rules:
        if not ok:
            raise ContractError(f"defaults.sampling.{name}", reason)
    if not defaults.eos_token_ids:
        raise ContractError("defaults.eos_token_ids", "generation ends only at EOS ids: declare at least one")
    sampled = ctx.model.vocabulary.sampled_tokens
    for index, token in enumerate(defaults.eos_token_ids):
        if token >= sampled:
            raise ContractError(f"defaults.eos_token_ids[{index}]", f"{token} is outside the sampled vocabulary")
    if defaults.HasField("cache_memory_share") and not 0 < defaults.cache_memory_share <= 1:
        raise ContractError("defaults.cache_memory_share", "must lie in (0, 1]")
    counts: tuple[OptionalCount, ...] = (
        "queue_capacity", "max_active", "event_capacity", "frontend_workers", "max_output_tokens")
    for name in counts:
        if defaults.HasField(name) and getattr(defaults, name) == 0:
            raise ContractError(f"defaults.{name}", "must be positive when set")


CHECKS = (check_identity, check_extents, check_vocabulary, check_vision, check_defaults)
