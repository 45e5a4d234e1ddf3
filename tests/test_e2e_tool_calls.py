"""Every tool/reasoning syntax end to end through the real stack (issue #6 item 5).

openai SDK -> gateway process -> tritonserver -> Helios backend (numpy executor, llguidance masks
applied in the backend) on test cores with the SmolLM2-135M weights and another syntax's data
(ignition/recipes/syntax_variants.py, derived from the prepared test core by ignition/variants.py).
The model was never trained on these syntaxes: with tool_choice required / named and with a JSON
schema, the request grammar (built by the gateway from the served syntax data) forces the markup,
and the gateway's parser reads the same structure back. Nothing is mocked; expectations are
structural (schema validity, syntax markup in the raw token ids, stream == one-shot), never the
model's words.

One tritonserver serves all five variant cores (one model directory each); one gateway per model.

The 135M model under MAY_OPEN may open reasoning and never close it; requests set the gateway's
`reasoning_max_chars` (the grammar's reasoning budget: once reached, the close delimiter / frame
end is the only continuation; with frames at most one further reasoning frame).
"""
from __future__ import annotations

import json
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import openai
import pytest

from helios_backend.core import open_core
from helios_backend.core.layout import read_header
from helios_backend.frontend.tokenizer import FrontendTokenizer
from ignition.recipes.syntax_variants import VARIANTS, SyntaxVariant, recipe_name, variant_frontend
from tests.variant_fixtures import VariantStack, model_name, variant_stack
from tests.gateway_harness import wait_until
from tests.test_syntax_model import VERDICT, WEATHER  # the schemas the in-process model test uses
from tests.triton_server import metric_value

SUFFIXES = [v.suffix for v in VARIANTS]
BY_SUFFIX = {v.suffix: v for v in VARIANTS}

REASONING_BUDGET = 200  # characters per reasoning span (gateway field reasoning_max_chars)
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["Europe/Paris", "Asia/Tokyo"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": SCHEMAS[name]}}
         for name, desc in (("get_weather", "Weather forecast for a city"), ("get_time", "Current time in a zone"))]
WEATHER_QUESTION = [{"role": "system", "content": "You can call get_weather(city, days)."},
                    {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
TIME_QUESTION = [{"role": "user", "content": "What time is it in Paris?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
JSON_QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(variant_cores: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VariantStack]:
    with variant_stack(variant_cores, tmp_path_factory.mktemp("e2e-tool-calls")) as running:
        running.initial_metrics = running.server.metrics()  # type: ignore[attr-defined]  (before any request)
        yield running


@pytest.fixture(scope="module")
def tokenizer(variant_cores: dict[str, pathlib.Path]) -> FrontendTokenizer:
    """The tokenizer the variant cores carry (the base core's resource, byte for byte)."""
    with open_core(next(iter(variant_cores.values()))) as core:
        return FrontendTokenizer.from_json(core.read_resource("tokenizer.json").decode())


def client(stack: VariantStack, suffix: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateways[suffix].base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)


REST_OF_CONTEXT = None   # no max_tokens: the core's output limit, clipped to what the context leaves


def create(stack: VariantStack, suffix: str, messages: list[dict[str, Any]], max_tokens: int | None, **fields: Any):
    """max_tokens None leaves the limit to the server: an explicit one that cannot fit beside
    these tool prompts (~300 tokens in a 512-token context) is a 400 (context_length_exceeded)."""
    extra = {"reasoning_max_chars": REASONING_BUDGET, "return_token_ids": True, **fields.pop("extra_body", {})}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return client(stack, suffix).chat.completions.create(model=recipe_name(BY_SUFFIX[suffix]), messages=messages,
                                                         temperature=0, extra_body=extra, **fields)


def reassemble(chunks: list[Any]) -> dict[str, Any]:
    """The streamed view: content, reasoning, per-index tool calls (every id seen, name, fragments)."""
    view: dict[str, Any] = {"content": "", "reasoning": "", "reasoning_alias": "", "calls": {}, "finish": None,
                            "token_ids": []}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            view["content"] += delta.content or ""
            view["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            view["reasoning_alias"] += getattr(delta, "reasoning", None) or ""
            view["token_ids"] += (choice.model_extra or {}).get("token_ids") or []
            for tc in delta.tool_calls or []:
                call = view["calls"].setdefault(tc.index, {"ids": [], "name": "", "fragments": []})
                if tc.id:
                    call["ids"].append(tc.id)
                if tc.function is not None and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function is not None and tc.function.arguments:
                    call["fragments"].append(tc.function.arguments)
            view["finish"] = choice.finish_reason or view["finish"]
    return view


def valid_arguments(name: str, arguments: str) -> dict[str, Any]:
    document = json.loads(arguments)
    jsonschema_rs.validate(SCHEMAS[name], document)  # raises ValidationError naming the violation
    return document


def call_markup(variant: SyntaxVariant) -> str:
    """The text that must open a call in this syntax (the tool block; ATEM inside its tool frame)."""
    tool = variant_frontend(variant).tool_syntax
    return tool.block_open


def reasoning_markup(variant: SyntaxVariant) -> str:
    r = variant_frontend(variant).reasoning_syntax
    return r.message_end if r.header_start else r.close


def reasoning_opener(variant: SyntaxVariant) -> str:
    """An assistant continuation that leaves the prompt inside open reasoning (FE-14, FE-35)."""
    r = variant_frontend(variant).reasoning_syntax
    if r.header_start:
        return f"{r.header_start}{r.header_role}{r.recipient_prefix}{r.reasoning_recipient}{r.message_start}"
    return r.open + ("\n" if r.wrap_newlines else "")


# ---- the derived cores ------------------------------------------------------------------------

# spec: FE-7, FE-52
def test_derived_cores_keep_resources_and_replace_only_syntax(smollm2_core: pathlib.Path,
                                                              variant_cores: dict[str, pathlib.Path]) -> None:
    def data_section(path: pathlib.Path) -> bytes:
        with open(path, "rb") as f:
            _, _, offset = read_header(f.fileno(), path.stat().st_size)
            f.seek(offset)
            return f.read()

    with open_core(smollm2_core) as base:
        base_contract, base_resources, namespace = base.contract, base.resources, base.namespace
    base_data = data_section(smollm2_core)
    for suffix, path in variant_cores.items():
        variant = BY_SUFFIX[suffix]
        with open_core(path) as core:
            core.verify()
            core.authorize(namespace)                      # same publisher namespace
            assert core.resources == base_resources
            contract = core.contract
        assert data_section(path) == base_data
        wanted = variant_frontend(variant)
        frontend = contract.model.frontend
        assert (frontend.tool_parser, frontend.reasoning_parser) == (variant.tool_parser, variant.reasoning_parser)
        assert frontend.tool_syntax == wanted.tool_syntax and frontend.reasoning_syntax == wanted.reasoning_syntax
        assert list(frontend.prefix_rules) == list(wanted.prefix_rules)
        assert contract.served_id == recipe_name(variant)
        # everything else is the base's
        restored = type(contract)()
        restored.CopyFrom(contract)
        restored.served_id = base_contract.served_id
        restored.aliases[:] = base_contract.aliases
        restored.model.frontend.CopyFrom(base_contract.model.frontend)
        assert restored == base_contract


def test_derive_refuses_a_tampered_base(smollm2_core: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from helios_backend.core import IntegrityError
    from ignition.variants import derive_variant_core

    tampered = tmp_path / "tampered.core"
    data = bytearray(smollm2_core.read_bytes())
    data[-1000] ^= 0x01   # inside the last resource's stored bytes
    tampered.write_bytes(bytes(data))
    out = tmp_path / "out.core"
    with pytest.raises(IntegrityError):
        derive_variant_core(tampered, out, variant_frontend(VARIANTS[0]), Ed25519PrivateKey.generate())
    assert not out.exists()


# ---- forced calls, one per syntax ----------------------------------------------------------------

@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.triton
@pytest.mark.slow
# spec: FE-3, FE-4, FE-5, FE-6, FE-21, FE-24, FE-25, FE-27, FE-32, FE-38, FE-41
def test_required_tool_choice_emits_a_schema_valid_call(stack: VariantStack, tokenizer: FrontendTokenizer,
                                                        suffix: str) -> None:
    variant = BY_SUFFIX[suffix]
    response = create(stack, suffix, WEATHER_QUESTION, REST_OF_CONTEXT, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False)
    choice = response.choices[0]
    raw = tokenizer.decode(choice.model_extra["token_ids"])
    print(f"\n[{suffix}] required: {raw!r}")
    assert choice.finish_reason == "tool_calls", raw
    assert response.model == recipe_name(variant)
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1, raw     # parallel_tool_calls false: exactly one
    call = calls[0]
    assert call.type == "function" and call.function.name in SCHEMAS and call.id
    valid_arguments(call.function.name, call.function.arguments)
    assert call_markup(variant) in raw                    # the model wrote this syntax's markup
    assert not (choice.message.content or "").strip()     # markup never leaks as content


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.triton
@pytest.mark.slow
# spec: FE-29, FE-30, FE-39, FE-40, FE-41
def test_named_tool_call_streams_the_same_call(stack: VariantStack, tokenizer: FrontendTokenizer, suffix: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    one_shot = create(stack, suffix, TIME_QUESTION, REST_OF_CONTEXT, tools=TOOLS, tool_choice=named)
    stream = create(stack, suffix, TIME_QUESTION, REST_OF_CONTEXT, tools=TOOLS, tool_choice=named, stream=True)
    view = reassemble(list(stream))
    message = one_shot.choices[0].message
    raw = tokenizer.decode(one_shot.choices[0].model_extra["token_ids"])
    print(f"\n[{suffix}] named: {raw!r}")
    assert one_shot.choices[0].finish_reason == view["finish"] == "stop", raw   # a forced function (OpenAI)
    assert message.tool_calls is not None and [c.function.name for c in message.tool_calls] == ["get_time"]
    assert valid_arguments("get_time", message.tool_calls[0].function.arguments)
    # streamed deltas reassemble to the same call; the id is stable across deltas
    assert list(view["calls"]) == [0]
    streamed = view["calls"][0]
    assert streamed["name"] == "get_time" and len(set(streamed["ids"])) == 1 and streamed["ids"][0]
    assert len(streamed["ids"]) >= 1 and streamed["fragments"]
    assert "".join(streamed["fragments"]) == message.tool_calls[0].function.arguments
    assert view["reasoning"] == view["reasoning_alias"] == (getattr(message, "reasoning_content", None) or "")
    assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None)
    assert view["content"] == (message.content or "")
    assert view["token_ids"] == one_shot.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.triton
@pytest.mark.slow
# spec: FE-13, FE-36, FE-37, FE-41
def test_json_schema_answer_validates(stack: VariantStack, tokenizer: FrontendTokenizer, suffix: str) -> None:
    response = create(stack, suffix, JSON_QUESTION, REST_OF_CONTEXT,
                      response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}})
    choice = response.choices[0]
    raw = tokenizer.decode(choice.model_extra["token_ids"])
    print(f"\n[{suffix}] json_schema: {raw!r}")
    assert choice.finish_reason == "stop", raw
    assert not choice.message.tool_calls
    jsonschema_rs.validate(VERDICT, json.loads(choice.message.content))


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.triton
@pytest.mark.slow
# spec: FE-10, FE-14, FE-22, FE-35, FE-39, FE-41
def test_open_reasoning_then_forced_call_streams_reasoning_content(stack: VariantStack, tokenizer: FrontendTokenizer,
                                                                   suffix: str) -> None:
    """The prompt ends inside the assistant's open reasoning (continue_final_message): the output
    is reasoning, its close (forced by the budget at the latest), then the required call."""
    variant = BY_SUFFIX[suffix]
    messages = [*WEATHER_QUESTION, {"role": "assistant", "content": reasoning_opener(variant)}]
    stream = create(stack, suffix, messages, REST_OF_CONTEXT, tools=TOOLS, tool_choice="required", stream=True,
                    extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                "reasoning_max_chars": 120})
    view = reassemble(list(stream))
    raw = tokenizer.decode(view["token_ids"])
    print(f"\n[{suffix}] open reasoning: {raw!r}")
    assert view["finish"] == "tool_calls", raw
    assert view["reasoning"].strip(), raw                 # reasoning_content deltas
    assert view["reasoning_alias"] == view["reasoning"]    # and the same text as `reasoning`
    assert reasoning_markup(variant) in raw and call_markup(variant) in raw
    assert all(line in raw for line in view["reasoning"].split("\n"))   # (ATEM: may span two self frames)
    assert reasoning_markup(variant) not in view["reasoning"] and call_markup(variant) not in view["reasoning"]
    assert len(view["calls"]) >= 1
    for call in view["calls"].values():
        assert len(set(call["ids"])) == 1
        valid_arguments(call["name"], "".join(call["fragments"]))
    assert not view["content"].strip()


# ---- grammar metrics ---------------------------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.slow
# spec: MET-6, MET-8, MET-9, MET-10, MET-11
def test_grammar_metrics_on_the_metrics_endpoint(stack: VariantStack) -> None:
    suffix = "xtml"
    model = model_name(suffix)
    initial = stack.initial_metrics  # type: ignore[attr-defined]
    assert metric_value(initial, "flare_constrained_max_inflight", model=model) == 0      # MET-9
    assert metric_value(initial, "flare_mixed_grammar_decode_steps_total", model=model) == 0

    # a constrained request alone: the gauge is one afterwards (MET-8, MET-10)
    create(stack, suffix, TIME_QUESTION, REST_OF_CONTEXT, tools=TOOLS, tool_choice={"type": "function",
                                                                         "function": {"name": "get_time"}})
    assert wait_until(lambda: stack.backend_metric(suffix, "flare_constrained_max_inflight") == 1, 30)
    mixed_before = stack.backend_metric(suffix, "flare_mixed_grammar_decode_steps_total")

    # an unconstrained stream decoding while a constrained one decodes: mixed submissions (MET-6)
    free_started = threading.Event()
    results: dict[str, Any] = {}

    def free() -> None:
        stream = client(stack, suffix).chat.completions.create(
            model=recipe_name(BY_SUFFIX[suffix]), messages=STORY, max_tokens=96, temperature=0, stream=True)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            free_started.set()
        results["free"] = reassemble(chunks)

    worker = threading.Thread(target=free)
    worker.start()
    try:
        assert free_started.wait(120)
        # (parallel calls allowed, this model repeats the call until the length limit)
        results["constrained"] = create(stack, suffix, TIME_QUESTION, REST_OF_CONTEXT, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False)
    finally:
        worker.join(300)
    assert not worker.is_alive()
    assert results["constrained"].choices[0].finish_reason == "tool_calls"
    assert results["free"]["finish"] in ("stop", "length")
    mixed = stack.backend_metric(suffix, "flare_mixed_grammar_decode_steps_total")
    assert mixed > mixed_before, "no DECODE submission mixed the constrained and the unconstrained lane"
    assert stack.backend_metric(suffix, "flare_constrained_max_inflight") == 1        # never above one
    # lifetime counters: another request does not reset them (MET-11)
    create(stack, suffix, JSON_QUESTION, 60)
    time.sleep(0.5)
    assert stack.backend_metric(suffix, "flare_mixed_grammar_decode_steps_total") >= mixed
    assert stack.backend_metric(suffix, "flare_constrained_max_inflight") == 1


# ---- refusals and unconstrained modes ---------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["qwen-coder-think", "atem-recipient"])
@pytest.mark.triton
@pytest.mark.slow
# spec: FE-41
def test_unenforceable_schema_keywords_are_400_naming_the_keyword(stack: VariantStack, suffix: str) -> None:
    """Never an unconstrained success: a keyword llguidance would not enforce is refused."""
    refused_answer = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as answer:
        create(stack, suffix, JSON_QUESTION, 8,
               response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": refused_answer}})
    assert "keyword 'not'" in answer.value.message and answer.value.body["param"] == "response_format"
    refused_tool = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tools = [{"type": "function", "function": {"name": "tag", "parameters": refused_tool}}]
    with pytest.raises(openai.BadRequestError) as tool:
        create(stack, suffix, WEATHER_QUESTION, 8, tools=tools, tool_choice="required")
    assert "keyword 'uniqueItems'" in tool.value.message and tool.value.body["param"] == "tools"


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.triton
@pytest.mark.slow
# spec: FE-38, FE-41
def test_tool_choice_none_is_unconstrained_text(stack: VariantStack, suffix: str) -> None:
    response = create(stack, suffix, WEATHER_QUESTION, 16, tools=TOOLS, tool_choice="none")
    choice = response.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
