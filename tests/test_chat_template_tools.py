"""The embedded default's tool template: the checkpoint's ChatML plus tools in the JSON-call syntax.

Without tools it renders exactly like the GGUF's own template; with tools the system turn lists
them and asks for the declared syntax; an assistant turn's tool calls render in that syntax, so
the shared engine parses the rendered history back into the same calls (template and syntax
data agree).
"""
from __future__ import annotations

import json

import pytest

from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.syntax.engine import ModelSyntax
from helios_backend.syntax.events import collect
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from helios_backend.syntax.tables import FrontendSyntax
from ignition.recipes import smollm2_135m_instruct as recipe
from ignition.sources.gguf import GGUFError, GGUFModel, default_gguf_path

TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye <b>{{ x }}</b>"}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def source() -> GGUFModel:
    return GGUFModel.open(default_gguf_path())


@pytest.fixture(scope="module")
def template(source: GGUFModel) -> ChatTemplate:
    return ChatTemplate(recipe.chat_template(source), TOKENS)


# spec: FE-43
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation", [True, False])
def test_without_tools_it_renders_like_the_checkpoint_template(source, template, messages, generation):
    checkpoint = ChatTemplate(source.chat_template, TOKENS)
    assert template.render(messages, add_generation_prompt=generation) == \
        checkpoint.render(messages, add_generation_prompt=generation)


def test_with_tools_the_system_turn_lists_them_and_names_the_syntax(template):
    text = template.render([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n" + recipe.DEFAULT_SYSTEM + "\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert rest == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    own = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], tools=TOOLS)
    assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and recipe.DEFAULT_SYSTEM not in own


# spec: FE-3, FE-43
def test_rendered_tool_calls_parse_back_with_the_declared_syntax(template):
    arguments = {"city": "Paris {centre}", "days": 3}
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "Checking.",
                "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    text = template.render(history, tools=TOOLS, add_generation_prompt=True)
    assistant = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    syntax = ModelSyntax.build(FrontendSyntax.from_contract(recipe.frontend()), {})
    engine = syntax.engine(InitialState(ReasoningStart.CLOSED), {"get_weather": WEATHER})
    out = collect(engine.feed(7, assistant) + engine.finish())
    assert out.content == "Checking.\n" and out.errors == []
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", arguments),
                                                                             ("get_weather", {"city": "Rome"})]


def test_a_different_checkpoint_template_is_refused(source):
    class Other:
        chat_template = source.chat_template + "{{ x }}"
        path = source.path

    with pytest.raises(GGUFError, match="chat_template"):
        recipe.chat_template(Other())
