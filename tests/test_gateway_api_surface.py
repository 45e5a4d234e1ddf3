"""The request surface users port from vLLM and OpenAI, end to end: the openai SDK and raw
HTTP against a real gateway on a real tritonserver (numpy executor, the test core).

Expectations are derived from a reference greedy request run first in the same stack, never
hard-coded texts: e.g. the reference shows where the model samples EOS, and ignore_eos /
min_tokens are checked by counting the tokens around that point.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine_fixtures import smollm2_core  # noqa: F401  (session fixture: the test core)
from tests.gateway_harness import SERVED_ID, Stack, gateway_stack

pytestmark = [pytest.mark.triton, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EOS_IDS = (2, 0)                          # the test core's EOS ids (assets.eos_token_ids)


@pytest.fixture(scope="module")
def stack(smollm2_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: F811
    with gateway_stack(smollm2_core, tmp_path_factory.mktemp("gateway-surface")) as running:
        yield running


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.gateway.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway.base_url + "/v1", api_key="unused", max_retries=0)


def chat(http: httpx.Client, max_tokens: int, **fields: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={
        "model": SERVED_ID, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.fixture(scope="module")
def eos_reference(http: httpx.Client) -> list[int]:
    """The greedy answer's ids; it ends with EOS well inside the limit."""
    choice = chat(http, 64)
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] in EOS_IDS
    assert len(choice["token_ids"]) < 40
    return choice["token_ids"]


# ---- fixed output lengths: ignore_eos, min_tokens ----------------------------------------

def test_ignore_eos_generates_exactly_max_tokens(sdk: openai.OpenAI, http: httpx.Client,
                                                 eos_reference: list[int]) -> None:
    limit = len(eos_reference) + 9
    choice = chat(http, limit, ignore_eos=True)
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "length" and len(ids) == limit
    assert ids[:len(eos_reference)] == eos_reference      # the EOS was sampled and did not end it
    response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=limit, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert response.usage is not None and response.usage.completion_tokens == limit
    assert response.choices[0].finish_reason == "length"


def test_ignore_eos_streamed_counts_every_token(sdk: openai.OpenAI, eos_reference: list[int]) -> None:
    limit = len(eos_reference) + 5
    stream = sdk.completions.create(model=SERVED_ID, prompt="The capital of France is", max_tokens=limit,
                                    temperature=0, stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == limit
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_min_tokens_withholds_eos_until_reached(http: httpx.Client, eos_reference: list[int]) -> None:
    minimum = len(eos_reference) + 6
    choice = chat(http, minimum + 30, min_tokens=minimum)
    ids = choice["token_ids"]
    assert len(ids) >= minimum
    assert not set(ids[:minimum]) & set(EOS_IDS)         # withheld, not sampled and ignored
    assert ids[:len(eos_reference) - 1] == eos_reference[:-1]   # the same answer up to where EOS was
    if choice["finish_reason"] == "stop":
        assert ids[-1] in EOS_IDS                        # and once reached, EOS ends it again


def test_min_tokens_withholds_stop_token_ids(http: httpx.Client, eos_reference: list[int]) -> None:
    stop_id = eos_reference[2]                           # a token the greedy answer samples early
    stopped = chat(http, 64, stop_token_ids=[stop_id])
    assert stopped["finish_reason"] == "stop"
    assert len(stopped["token_ids"]) == eos_reference.index(stop_id) + 1
    held = chat(http, 20, stop_token_ids=[stop_id], min_tokens=8, ignore_eos=True)
    assert len(held["token_ids"]) >= 8 and stop_id not in held["token_ids"][:8]


@pytest.mark.parametrize("fields, param", [
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": 2, "stop": ["x"]}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_fixed_length_fields_are_validated(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    body = {"model": SERVED_ID, "messages": QUESTION, "max_tokens": 10, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
