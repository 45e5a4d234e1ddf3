"""`make serve` answers tools: the embedded default core through `helios-serve` and the openai SDK.

The default recipe declares the JSON-call tool syntax and carries a template that lists the tools
in the system turn. tool_choice required / named: the request grammar forces a call, the gateway
parses it back into schema-valid `tool_calls`, streamed and not. tool_choice auto: the tools reach
the prompt (the prompt ids hold the tool listing) and whatever the model writes is either content
or schema-valid calls, never a parse error leaking markup. Expectations are structural, never the
135M model's words.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from helios_backend.core import open_core
from helios_backend.frontend.tokenizer import FrontendTokenizer
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.serve_process import serve_with_gateway
from tests.test_e2e_tool_calls import SCHEMAS, TIME_QUESTION, TOOLS, WEATHER_QUESTION, reassemble, valid_arguments

pytestmark = [pytest.mark.triton, pytest.mark.slow]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(default_core: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:  # noqa: F811
    with serve_with_gateway(default_core, tmp_path_factory.mktemp("serve-tools"), "--max-active", "4") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def tokenizer(default_core: pathlib.Path) -> FrontendTokenizer:  # noqa: F811
    with open_core(default_core) as core:
        return FrontendTokenizer.from_json(core.read_resource("tokenizer.json").decode())


def create(client: openai.OpenAI, messages: list[dict[str, Any]], **fields: Any):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=fields.pop("max_tokens", 120),
                                          temperature=0, extra_body={"return_token_ids": True}, **fields)


def assert_calls(calls: list[Any] | None, names: set[str]) -> None:
    assert calls, "no tool_calls"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        valid_arguments(call.function.name, call.function.arguments)


# spec: FE-3, FE-4, FE-24, FE-41
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_required_returns_schema_valid_tool_calls(client: openai.OpenAI, tokenizer: FrontendTokenizer,
                                                  stream: bool) -> None:
    fields = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    if not stream:
        response = create(client, WEATHER_QUESTION, **fields)
        choice = response.choices[0]
        raw = tokenizer.decode(choice.model_extra["token_ids"])
        assert choice.finish_reason == "tool_calls", raw
        assert_calls(choice.message.tool_calls, set(SCHEMAS))
        assert len(choice.message.tool_calls) == 1 and '<tool_call>\n{"name": "' in raw
        assert choice.message.content is None                 # OpenAI: null beside tool calls
        return
    chunks = list(create(client, WEATHER_QUESTION, stream=True, **fields))
    # as OpenAI streams a tool call: the role with content null beside the first call, no "" content
    opening = next(c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.role)
    assert opening.role == "assistant" and opening.content is None and opening.tool_calls
    assert not any(c.choices[0].delta.content == "" for c in chunks if c.choices)
    view = reassemble(chunks)
    assert view["finish"] == "tool_calls" and list(view["calls"]) == [0]
    call = view["calls"][0]
    assert call["name"] in SCHEMAS and len(set(call["ids"])) == 1
    valid_arguments(call["name"], "".join(call["fragments"]))


# spec: FE-29, FE-30, FE-40, FE-41
def test_named_tool_streams_the_same_call_as_the_one_shot(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    one_shot = create(client, TIME_QUESTION, tools=TOOLS, tool_choice=named)
    view = reassemble(list(create(client, TIME_QUESTION, tools=TOOLS, tool_choice=named, stream=True)))
    message = one_shot.choices[0].message
    assert one_shot.choices[0].finish_reason == view["finish"] == "stop"     # a forced function (OpenAI)
    assert message.content is None
    assert_calls(message.tool_calls, {"get_time"})
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    assert view["calls"][0]["name"] == "get_time"
    assert "".join(view["calls"][0]["fragments"]) == message.tool_calls[0].function.arguments


# spec: FE-3, FE-43
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_auto_presents_the_tools_and_parses_what_the_model_writes(client: openai.OpenAI,
                                                                   tokenizer: FrontendTokenizer, stream: bool) -> None:
    if not stream:
        response = create(client, WEATHER_QUESTION, tools=TOOLS, tool_choice="auto")
        prompt = tokenizer.decode(response.model_extra["prompt_token_ids"])
        choice = response.choices[0]
        message, finish = choice.message, choice.finish_reason
        calls, content = message.tool_calls, message.content or ""
    else:
        chunks = list(create(client, WEATHER_QUESTION, tools=TOOLS, tool_choice="auto", stream=True))
        prompt = tokenizer.decode(chunks[0].model_extra["prompt_token_ids"])
        view = reassemble(chunks)
        finish, content = view["finish"], view["content"]
        calls = None
        for call in view["calls"].values():
            valid_arguments(call["name"], "".join(call["fragments"]))
            calls = (calls or []) + [call]
    # the template listed the tools and the syntax; no request silently drops them
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    if finish == "tool_calls":
        if not stream:
            assert_calls(calls, set(SCHEMAS))
    else:
        assert finish in ("stop", "length") and calls in (None, []) and content.strip()


PARIS = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


# spec: FE-41
@pytest.mark.real_weights
@pytest.mark.parametrize("tool_count", [1, 2])
def test_required_with_parallel_calls_returns_one_call_and_stops(client: openai.OpenAI, tokenizer: FrontendTokenizer,
                                                                  tool_count: int) -> None:
    """Greedy SmolLM2 (the real weights the default core embeds) under `required` with parallel
    calls allowed: one call, then the model ends, as it wants to once the call is written (the
    grammar used to forbid the end after the separator: nine calls until the length limit)."""
    response = create(client, PARIS, tools=TOOLS[:tool_count], tool_choice="required", max_tokens=200)
    choice = response.choices[0]
    raw = tokenizer.decode(choice.model_extra["token_ids"])
    print(f"\n{tool_count} tool(s): {raw!r}")
    assert choice.finish_reason == "tool_calls", raw
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1, raw
    assert choice.message.content is None
    assert_calls(choice.message.tool_calls, set(SCHEMAS))


# spec: FE-40, FE-42
@pytest.mark.parametrize("max_tokens", [8, 16, 200])
def test_every_answer_goes_back_as_history(client: openai.OpenAI, max_tokens: int) -> None:
    """The message the server returned (a complete call, or one cut by max_tokens: finish
    `length`, arguments that are no JSON document yet) is accepted as the next request's history."""
    choice = create(client, PARIS, tools=TOOLS, tool_choice="required", max_tokens=max_tokens).choices[0]
    message = choice.message
    assert choice.finish_reason in ("tool_calls", "length")
    assert not (message.content or "").strip() or "<tool_call>" not in message.content   # no markup as content
    history = [*PARIS, message.model_dump(exclude_none=True)]
    for call in message.tool_calls or []:
        history.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    if not message.tool_calls:
        history.append({"role": "user", "content": "Go on."})
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_tool_request() -> dict[str, Any]:
    """The README's tool example: the body of its curl with `"tool_choice": "required"`."""
    for block in README.read_text().split("curl -s localhost:9000/v1/chat/completions")[1:]:
        body = json.loads(block.split("-d '", 1)[1].split("'\n", 1)[0]) if "-d '" in block.split("\n")[0] else None
        if body is not None and body.get("tool_choice") == "required":
            return body
    raise AssertionError("the README has no tool example")


# spec: FE-41, FE-42
@pytest.mark.parametrize("variant", ["as written", "parallel off", "named"])
def test_the_readme_tool_example_answers_what_the_readme_says(client: openai.OpenAI, variant: str) -> None:
    body = readme_tool_request()
    if variant == "parallel off":
        body["parallel_tool_calls"] = False
    if variant == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == ("stop" if variant == "named" else "tool_calls"), choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
