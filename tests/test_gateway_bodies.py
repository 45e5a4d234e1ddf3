"""Request bodies that are not what OpenAI's API takes get a 400 naming the body or the field.

The real gateway app in process (its Triton is not reachable: every case here is refused while
the body is read and validated, before any backend work), through httpx and the openai SDK.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app("127.0.0.1:9")) as test_client:
        yield test_client


def error(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert body["type"] == "invalid_request_error" and body["code"]
    return body


@pytest.mark.parametrize(("content", "content_type", "says"), [
    (b'{"model": "m", "messages": [', "application/json", "the request body is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "the request body is not accepted JSON: it nests"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "application/json", "the request body is not accepted JSON: it nests"),
    (b"What is the capital of France?", "text/plain", "Content-Type: application/json (got text/plain)"),
    (b'{"model": "m", "messages": []}', "text/plain", "Content-Type: application/json (got text/plain)"),
    (b"[1, 2]", "application/json", "the request body must be a JSON object, got an array"),
    (b"", "application/json", "the request body is empty"),
], ids=["malformed", "nested-arrays", "nested-objects", "text", "json-as-text", "array", "empty"])
# spec: HTTP-18
def test_a_body_that_is_not_a_json_object_is_400_naming_the_body(client: TestClient, content: bytes,
                                                                   content_type: str, says: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = error(client.post(path, content=content, headers={"Content-Type": content_type}))
        assert says in body["message"], body
        assert body["param"] is None                   # the whole body, as OpenAI reports it


# spec: HTTP-18
def test_a_json_schema_without_name_is_400_naming_it_through_the_sdk(client: TestClient) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore[arg-type]
                                    response_format={"type": "json_schema",  # type: ignore[typeddict-item]
                                                     "json_schema": {"schema": {"type": "object"}}})
    assert refused.value.status_code == 400
    assert refused.value.param == "response_format.json_schema.name"     # type: ignore[attr-defined]
    bad_name = {"type": "json_schema", "json_schema": {"name": "a name with spaces", "schema": {"type": "object"}}}
    body = error(client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES,
                                                           "response_format": bad_name}))
    assert body["param"] == "response_format.json_schema.name"
