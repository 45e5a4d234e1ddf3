"""Chat templates render like HF apply_chat_template, sandboxed, with typed errors."""

from __future__ import annotations

import json

import pytest

from helios_backend.frontend.chat_template import (
    ChatTemplate,
    ContinuationError,
    TemplateCompileError,
    TemplateError,
    TemplateRaisedError,
    TemplateRenderError,
)
from ignition.sources.gguf import GGUFModel, default_gguf_path

CONVERSATION = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is the capital of France?"},
]

# From the model notes: the SmolLM2 template injects its default system prompt.
GOLDEN = (
    "<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {"type": "object"}},
}


@pytest.fixture(scope="module")
def smollm_template() -> ChatTemplate:
    model = GGUFModel.open(default_gguf_path())
    return ChatTemplate(model.chat_template, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})


def test_golden_render_of_the_gguf_template(smollm_template: ChatTemplate) -> None:
    # spec: FE-43
    assert smollm_template.render(CONVERSATION, add_generation_prompt=True) == GOLDEN


def test_without_generation_prompt_the_assistant_header_is_absent(smollm_template: ChatTemplate) -> None:
    text = smollm_template.render(CONVERSATION, add_generation_prompt=False)
    assert text == GOLDEN[: -len("<|im_start|>assistant\n")]


def test_own_system_message_replaces_the_default(smollm_template: ChatTemplate) -> None:
    text = smollm_template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "SmolLM" not in text


def test_tools_argument_is_accepted(smollm_template: ChatTemplate) -> None:
    # SmolLM2's template ignores tools (measured in the notes); passing them must not fail.
    assert smollm_template.render(CONVERSATION, tools=[TOOL]) == GOLDEN


def test_tools_render_through_tojson_without_html_escaping() -> None:
    template = ChatTemplate(
        "{% for tool in tools %}{{ tool | tojson }}\n{{ tool.function | tojson(indent=2, sort_keys=True) }}{% endfor %}"
    )
    text = template.render([], tools=[TOOL])
    first, rest = text.split("\n", 1)
    assert first == json.dumps(TOOL, ensure_ascii=False)
    assert "<now> & later" in first  # Jinja's own tojson would emit \u003c ... \u0026
    assert rest == json.dumps(TOOL["function"], indent=2, sort_keys=True)


def test_special_token_kwargs_documents_and_extra_variables() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for d in documents %}[{{ d.title }}]{% endfor %}{{ custom }}{{ eos_token }}",
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    text = template.render([], documents=[{"title": "a"}, {"title": "b"}], custom="!")
    assert text == "<s>[a][b]!</s>"
    assert template.render([], documents=[], custom="", eos_token="<e>") == "<s><e>"


def test_trim_blocks_lstrip_blocks_and_loop_controls() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "{{ m.content }};\n"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}, {"role": "user", "content": "c"}]
    assert template.render(messages) == "a;\n"


def test_generation_tag_and_strftime_now() -> None:
    template = ChatTemplate("{% generation %}{{ messages[0].content }}{% endgeneration %}|{{ strftime_now('%Y') }}")
    body, year = template.render([{"role": "assistant", "content": "ok"}]).split("|")
    assert body == "ok"
    assert year.isdigit() and len(year) == 4


def test_raise_exception_is_typed() -> None:
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(TemplateRaisedError, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_syntax_error_is_typed() -> None:
    with pytest.raises(TemplateCompileError):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append({'role': 'x'}) }}",  # immutable sandbox
        "{{ ''.__class__.__mro__ }}",  # sandboxed attribute access
        "{{ messages[0].content + 1 }}",  # type error inside the template
        "{{ undefined_thing.attr }}",  # undefined variable use
    ],
)
def test_render_failures_are_typed(source: str) -> None:
    with pytest.raises(TemplateRenderError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_missing_content_in_the_gguf_template_is_a_template_error(smollm_template: ChatTemplate) -> None:
    with pytest.raises(TemplateError):
        smollm_template.render([{"role": "user", "content": None}])


def test_continue_final_message_cuts_after_the_last_content(smollm_template: ChatTemplate) -> None:
    messages = CONVERSATION + [{"role": "assistant", "content": "The capital is"}]
    text = smollm_template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == GOLDEN + "The capital is"


def test_continue_final_message_keeps_trailing_space_only_if_rendered() -> None:
    keeps = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    trims = ChatTemplate("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}")
    messages = [{"role": "assistant", "content": "Paris is "}]
    assert keeps.render(messages, add_generation_prompt=False, continue_final_message=True) == "[Paris is "
    assert trims.render(messages, add_generation_prompt=False, continue_final_message=True) == "[Paris is"


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt"),
    [
        ([{"role": "assistant", "content": "x"}], True),  # both options at once
        ([], False),  # nothing to continue
        ([{"role": "assistant", "content": None}], False),  # no text
    ],
)
def test_impossible_continuation_is_typed(messages: list[dict], add_generation_prompt: bool) -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.content or '' }}{% endfor %}")
    with pytest.raises(ContinuationError):
        template.render(messages, add_generation_prompt=add_generation_prompt, continue_final_message=True)


def test_continuation_text_missing_from_the_render_is_typed() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ContinuationError):
        template.render([{"role": "assistant", "content": "abc"}], add_generation_prompt=False, continue_final_message=True)
