"""Render a model's Jinja chat template the way HF `apply_chat_template` does.

Environment (mirrors transformers' `chat_template_utils._compile_jinja_template`):
- `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with `loopcontrols`;
  the sandbox refuses attribute access to internals and mutation of the passed messages.
- `tojson` is replaced by a plain `json.dumps` (no HTML escaping; accepts `indent`,
  `separators`, `sort_keys`, `ensure_ascii`), because templates embed tool schemas with it.
- globals `raise_exception(msg)` (the template rejects the conversation) and `strftime_now(fmt)`.
- `{% generation %}...{% endgeneration %}` is accepted and renders its body unchanged
  (transformers uses it only to compute assistant masks, which serving does not need).

Render variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the special-token
strings given at compile time (`bos_token`, `eos_token`, ...) and any extra keyword arguments.
`continue_final_message` is applied after rendering, as transformers does (the text is cut
right after the final message's content), and is not a template variable.

Every failure surfaces as a `TemplateError` subclass, so callers map one family to a 400/500.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    """Base of all chat-template failures."""


class TemplateCompileError(TemplateError):
    """The template source is not valid Jinja."""


class TemplateRaisedError(TemplateError):
    """The template called `raise_exception(message)`: it rejects this conversation (a client error)."""


class ContinuationError(TemplateError):
    """continue_final_message was asked for but cannot be honoured (a client error)."""


class TemplateRenderError(TemplateError):
    """Rendering failed: undefined variable use, type error, sandbox violation, ..."""


class _GenerationTag(Extension):
    """`{% generation %}` / `{% endgeneration %}`: render the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Exceptions a template can provoke while rendering (beyond Jinja's own TemplateError family).
_RENDER_FAILURES = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        # e.g. {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}; passed to every render
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateCompileError(f"chat template line {exc.lineno}: {exc.message}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text. `continue_final_message` (not a template variable, as in HF) cuts the
        text right after the last message's content, so generation continues that message."""
        if continue_final_message and add_generation_prompt:
            raise ContinuationError("continue_final_message and add_generation_prompt are exclusive")
        variables = {**self.special_tokens, **kwargs}
        try:
            text = self._template.render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateRaisedError:
            raise
        except _RENDER_FAILURES as exc:
            raise TemplateRenderError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return _cut_after_final_message(text, messages) if continue_final_message else text


def _final_text(messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages:
        raise ContinuationError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if isinstance(content, (list, tuple)):  # content parts: the last one with text
        content = next((part["text"] for part in reversed(content) if isinstance(part, Mapping) and "text" in part), None)
    if not isinstance(content, str):
        raise ContinuationError("continue_final_message: the final message has no text to continue")
    return content


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """transformers' rule: find the stripped final content (last occurrence); keep its trailing
    whitespace only if the template kept it."""
    final = _final_text(messages)
    core = final.strip()
    if core not in text:
        raise ContinuationError("continue_final_message: the final message does not appear in the rendered chat")
    start = text.rindex(core)
    kept = final.lstrip()
    if text[start : start + len(kept)] == kept:
        return text[: start + len(kept)]
    return text[: start + len(core)]
