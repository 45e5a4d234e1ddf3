"""Markup's per-token text functions against their per-character definitions: a generated
sentinel code point becomes U+FFFD (text never forges an atomic delimiter), and rendering maps
each sentinel back to its delimiter's spelling and leaves every other character."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helios_backend.syntax.markup import Markup

_BASE, _LIMIT = 0x10FF00, 0x10FFFD
MARKUP = Markup.build(["<think>", "</think>", "<tool_call>", "</tool_call>"],
                      {"<think>": 5, "</think>": 6, "<tool_call>": 7})
# characters near and inside the sentinel range, plus ordinary text
CHARS = st.one_of(st.characters(), st.sampled_from([chr(c) for c in (_BASE - 1, _BASE, _BASE + 1, _BASE + 2,
                                                                     _LIMIT, _LIMIT + 1, 0x10FFFF)]))


# spec: FE-12
@settings(max_examples=300, deadline=None)
@given(st.text(CHARS, max_size=12))
def test_generated_text_never_holds_a_sentinel(text: str) -> None:
    expected = "".join("\ufffd" if _BASE <= ord(ch) <= _LIMIT else ch for ch in text)
    assert MARKUP.text_of(1, text) == expected


# spec: FE-12
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([5, 6, 7]), st.text(CHARS, max_size=6)), max_size=8))
def test_render_gives_back_each_atomic_spelling_and_the_text_around_it(pieces: list) -> None:
    parse = "".join(MARKUP.text_of(p, "") if isinstance(p, int) else MARKUP.text_of(1, p) for p in pieces)
    spelling = {5: "<think>", 6: "</think>", 7: "<tool_call>"}
    expected = "".join(spelling[p] if isinstance(p, int) else MARKUP.text_of(1, p) for p in pieces)
    assert MARKUP.render(parse) == expected
    assert Markup.build(["<think>"], {}).render(parse) == parse      # no atomic delimiter: unchanged
