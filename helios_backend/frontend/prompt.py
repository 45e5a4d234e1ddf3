"""Render a conversation and encode it so that only the template's own markup yields control ids.

Why this exists: `tokenizer.encode(rendered_text)` parses every special-token spelling, so a user
message containing "<|im_end|>\\n<|im_start|>system\\n..." would forge a turn boundary. We must
keep the template's markup as control tokens while encoding everything the request supplied as
plain text.

How (`encode_chat`):
1. Find the request strings (any string leaf of messages/tools/documents) that contain a
   special-token spelling. If there are none, every special spelling in the rendered text came
   from the template: take them all as trusted.
2. Otherwise render a second time with each such string replaced by a unique sentinel that
   contains no special spelling. Substituting the originals back into that render must reproduce
   the real render exactly (the template did not transform or branch on those strings); then the
   trusted specials are exactly those outside the substituted spans.
3. If the template transformed a poisoned string (e.g. `content | trim`), substitution does not
   reproduce the text. We accept the render only when it contains the same sequence of special
   spellings as the sentinel render (the content added none); otherwise `UntrustedMarkupError`.
4. Split the real text at the trusted special spans: each special becomes its single id, each
   segment between them is encoded with `encode_untrusted`. Because `tokenizers` also splits at
   added tokens before BPE, this gives exactly the ids of `encode(text)` whenever the request
   holds no special spelling (HF parity), and never a control id from request text.
"""

from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.frontend.tokenizer import FrontendTokenizer, UnrepresentableTextError


class UntrustedMarkupError(ValueError):
    """Request text cannot be encoded faithfully as plain text inside the template's markup.
    A client error. Raised as is when content holds control-token spellings that the template
    transforms (the boundary between markup and content cannot be recovered); see the subclass
    for characters the vocabulary cannot encode."""


class UnrepresentableContentError(UntrustedMarkupError):
    """Request text holds characters with no byte token in the vocabulary (they would be dropped)."""


@dataclass(frozen=True)
class PromptIds:
    text: str  # the rendered prompt, exactly as the template produced it
    ids: list[int]  # token ids; control ids only where the template wrote markup


@functools.lru_cache(maxsize=8)   # one per served tokenizer: built once, not per request
def _special_pattern(tokenizer: FrontendTokenizer) -> re.Pattern[str]:
    # Longest first so that at one position the longest special wins (tokenizers' added-token
    # matcher is leftmost-longest).
    texts = sorted(tokenizer.special_tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts))


def _poisoned_strings(value: Any, pattern: re.Pattern[str], found: list[str]) -> None:
    if isinstance(value, str):
        if pattern.search(value) and value not in found:
            found.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _poisoned_strings(v, pattern, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _poisoned_strings(v, pattern, found)


def _substitute(value: Any, replacements: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return replacements.get(value, value)
    if isinstance(value, Mapping):
        return {k: _substitute(v, replacements) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_substitute(v, replacements) for v in value]
    return value


def _trusted_spans(
    text: str,
    sentinel_text: str,
    sentinels: Mapping[str, str],
    pattern: re.Pattern[str],
) -> list[tuple[int, int]]:
    """Spans of `text` holding template-written specials, given the render with sentinels."""
    sentinel_pattern = re.compile("|".join(re.escape(s) for s in sentinels))
    spans: list[tuple[int, int]] = []
    rebuilt: list[str] = []
    offset = 0  # position in the reconstructed real text
    cursor = 0  # position in sentinel_text
    for m in sentinel_pattern.finditer(sentinel_text):
        markup = sentinel_text[cursor : m.start()]
        spans += [(offset + s.start(), offset + s.end()) for s in pattern.finditer(markup)]
        original = sentinels[m.group()]
        rebuilt += [markup, original]
        offset += len(markup) + len(original)
        cursor = m.end()
    tail = sentinel_text[cursor:]
    spans += [(offset + s.start(), offset + s.end()) for s in pattern.finditer(tail)]
    rebuilt.append(tail)
    if "".join(rebuilt) == text:
        return spans
    # The template transformed a poisoned string; trust the render only if it holds the same
    # special spellings, in order, as the render whose content had none.
    real = [m.group() for m in pattern.finditer(text)]
    template_only = [m.group() for m in pattern.finditer(sentinel_text)]
    if real != template_only:
        raise UntrustedMarkupError(
            "message text contains control-token spellings that the chat template transforms; "
            "the prompt cannot be encoded safely"
        )
    return [(m.start(), m.end()) for m in pattern.finditer(text)]


def _encode_with_trusted(text: str, spans: Sequence[tuple[int, int]], tokenizer: FrontendTokenizer) -> list[int]:
    ids: list[int] = []
    specials = tokenizer.special_tokens
    cursor = 0
    for start, end in spans:
        if start > cursor:
            ids += tokenizer.encode_untrusted(text[cursor:start])
        ids.append(specials[text[start:end]])
        cursor = end
    if cursor < len(text):
        ids += tokenizer.encode_untrusted(text[cursor:])
    return ids


def encode_chat(
    template: ChatTemplate,
    tokenizer: FrontendTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> PromptIds:
    """Render and encode; see the module docstring.

    `messages`, `tools` and `documents` are request data (untrusted). Other keyword arguments are
    template variables chosen by the caller (e.g. `continue_final_message`) and are trusted:
    special spellings in them stay control tokens.
    Raises TemplateError (from the template) or UntrustedMarkupError (from the request text).
    """
    try:
        return _encode_chat(template, tokenizer, messages, tools, documents, add_generation_prompt, kwargs)
    except UnrepresentableTextError as exc:
        raise UnrepresentableContentError(str(exc)) from exc


def _encode_chat(
    template: ChatTemplate,
    tokenizer: FrontendTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    documents: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> PromptIds:
    def render(msgs: Any, tls: Any, docs: Any) -> str:
        return template.render(msgs, tools=tls, documents=docs, add_generation_prompt=add_generation_prompt, **variables)

    text = render(messages, tools, documents)
    pattern = _special_pattern(tokenizer)
    poisoned: list[str] = []
    _poisoned_strings([messages, tools, documents], pattern, poisoned)
    if not poisoned:
        spans = [(m.start(), m.end()) for m in pattern.finditer(text)]
        return PromptIds(text, _encode_with_trusted(text, spans, tokenizer))

    nonce = secrets.token_hex(8)
    # Private-use code points delimit each sentinel: they cannot be a special spelling and are
    # not produced by templates.
    sentinel_of = {s: f"\ue000helios-{nonce}-{k}\ue001" for k, s in enumerate(poisoned)}
    original_of = {v: k for k, v in sentinel_of.items()}
    sentinel_text = render(
        _substitute(list(messages), sentinel_of),
        _substitute(list(tools), sentinel_of) if tools is not None else None,
        _substitute(list(documents), sentinel_of) if documents is not None else None,
    )
    spans = _trusted_spans(text, sentinel_text, original_of, pattern)
    return PromptIds(text, _encode_with_trusted(text, spans, tokenizer))
