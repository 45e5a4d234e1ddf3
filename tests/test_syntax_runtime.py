"""GrammarSession, the backend's matcher wrapper, with the real SmolLM2 tokenizer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import llguidance as llg
import numpy as np
import pytest

from helios_backend.frontend.grammar_runtime import GrammarSession, GrammarSessionError, GrammarTokenizer

EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|>
YES_NO = llg.LLMatcher.grammar_from_lark('start: "yes" | "no"')


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from ignition.sources.gguf import GGUFModel, default_gguf_path
    from ignition.sources.tokenizer import tokenizer_json_from_gguf
    return tokenizer_json_from_gguf(GGUFModel.open(default_gguf_path()))


@pytest.fixture(scope="module")
def gt(tokenizer_json: str) -> GrammarTokenizer:
    return GrammarTokenizer.from_json(tokenizer_json, EOS_IDS)


def allowed(gt: GrammarTokenizer, words: np.ndarray) -> set[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_mask_allows_exactly_the_grammar_prefixes(gt):
    session = GrammarSession.create(gt, YES_NO)
    words = np.full(gt.mask_words + 4, -1, dtype=np.int32)  # a padded destination row
    session.fill_mask(words)
    texts = {gt.tokenizer.decode_str([i]) for i in allowed(gt, words)}
    assert texts == {"y", "ye", "yes", "n", "no"}
    assert (words[gt.mask_words:] == 0).all(), "padding ids are never allowed"


def test_after_completion_only_every_eos_id_is_allowed(gt):
    session = GrammarSession.create(gt, YES_NO)
    [yes] = gt.tokenizer.tokenize_str("yes")
    assert session.consume(yes)
    assert session.is_stopped() and session.is_accepting()
    words = np.zeros(gt.mask_words, dtype=np.int32)
    session.fill_mask(words)
    assert allowed(gt, words) == set(EOS_IDS)
    assert session.consume(0), "a second core EOS id is accepted as EOS"


def test_a_token_outside_the_grammar_enters_the_error_state(gt):
    session = GrammarSession.create(gt, YES_NO)
    [maybe] = gt.tokenizer.tokenize_str("maybe")[:1]
    assert not session.consume(maybe)
    assert session.error


def test_executor_masks_equal_synchronous_masks(gt):
    grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    ids = gt.tokenizer.tokenize_str('{"a": 12}')
    with ThreadPoolExecutor(max_workers=1) as pool:
        eager = GrammarSession.create(gt, grammar, executor=pool)
        lazy = GrammarSession.create(gt, grammar)
        a = np.zeros(gt.mask_words, dtype=np.int32)
        b = np.zeros(gt.mask_words, dtype=np.int32)
        for token in ids:
            eager.fill_mask(a)
            lazy.fill_mask(b)
            assert np.array_equal(a, b)
            assert eager.consume(token) and lazy.consume(token)
        assert eager.is_accepting() and lazy.is_accepting()


def test_invalid_grammar_is_refused_at_creation(gt):
    with pytest.raises(GrammarSessionError):
        GrammarSession.create(gt, llg.LLMatcher.grammar_from_lark("start: nowhere"))


def test_create_from_tokenizer_json_reuses_the_built_tokenizer(tokenizer_json):
    first = GrammarSession.create(tokenizer_json, YES_NO, eos_token_ids=EOS_IDS)
    second = GrammarSession.create(tokenizer_json, YES_NO, eos_token_ids=EOS_IDS)
    assert first._tokenizer is second._tokenizer


def test_mask_destination_is_checked(gt):
    session = GrammarSession.create(gt, YES_NO)
    with pytest.raises(ValueError):
        session.fill_mask(np.zeros(gt.mask_words - 1, dtype=np.int32))
    with pytest.raises(ValueError):
        session.fill_mask(np.zeros(gt.mask_words, dtype=np.int64))


def test_a_lexer_limit_hit_is_an_error_not_a_quiet_eos(gt):
    from llguidance import LLParserLimits
    grammar = llg.LLMatcher.grammar_from_lark('start: "a" BODY "b"\nBODY: /(?s:.){0,400}x/ & ~/(?s:.*)(yy|zz)(?s:.*)x/\n')
    session = GrammarSession.create(gt, grammar, limits=LLParserLimits(step_lexer_fuel=10))
    words = np.zeros(gt.mask_words, dtype=np.int32)
    session.fill_mask(words)
    assert session.error, "the limit must surface as an error"
    assert allowed(gt, words) <= set(EOS_IDS)
