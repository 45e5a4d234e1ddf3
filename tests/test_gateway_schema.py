"""Schemathesis over the gateway's own OpenAPI document, against a real gateway on a real
tritonserver: generated requests (valid and invalid) never get a 5xx from the gateway.

Generated bodies keep their shape but get small output limits and the served model id, so
most of them reach the backend and generate, within the CPU test budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from gateway.app import create_app
from tests.engine_fixtures import smollm2_core  # noqa: F401  (session fixture: the test core)
from tests.gateway_harness import SERVED_ID, Stack, gateway_stack

pytestmark = [pytest.mark.triton, pytest.mark.slow]

schema = schemathesis.openapi.from_dict(create_app("unused:1").openapi())


@pytest.fixture(scope="module")
def stack(smollm2_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: F811
    with gateway_stack(smollm2_core, tmp_path_factory.mktemp("gateway-schema")) as running:
        yield running


def keep_it_small(body: dict[str, Any]) -> None:
    """Bound the work a generated request asks of the CPU backend; nothing else changes."""
    body["model"] = SERVED_ID
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and body[field] > 2:
            body[field] = 2
    body.setdefault("max_tokens", 2)
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool) and body["logprobs"] > 0:
        body["logprobs"] = 0


# spec: HTTP-18, HTTP-27
@schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_generated_requests_never_get_a_server_error(case: schemathesis.Case, stack: Stack) -> None:
    if isinstance(case.body, dict):
        keep_it_small(case.body)
    response = case.call(base_url=stack.gateway.base_url, timeout=120)
    case.validate_response(response, checks=[not_a_server_error])
