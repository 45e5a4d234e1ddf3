"""Integers that travel in 32-bit exchange fields are bounded at the HTTP edge.

Schemathesis found a 500 for `top_k` and `priority` beyond 32 bits (the protobuf setter
raised inside the gateway); such values are invalid requests: 400 naming the field."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.schemas import ChatCompletionRequest, CompletionRequest

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**35), ("priority", 2**58), ("priority", -(2**40)), ("max_tokens", 2**32),
    ("max_completion_tokens", 2**32), ("reasoning_max_chars", 2**40), ("stop_token_ids", [2**31]),
    ("seed", 2**64),
])
def test_out_of_range_integers_are_invalid_requests(field, value):
    # spec: HTTP-18
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(**BASE, **{field: value})
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("field, value", [("top_k", 2**31 - 1), ("priority", -(2**31)), ("seed", 2**64 - 1)])
def test_values_at_the_bounds_are_accepted(field, value):
    assert getattr(ChatCompletionRequest(**BASE, **{field: value}), field) == value


def test_completion_prompt_token_ids_are_bounded():
    # spec: HTTP-18
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt=[1, 2**40])
