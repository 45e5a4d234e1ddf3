"""The independent numpy oracle answers correctly, and RoPE pairing mistakes are caught."""

from __future__ import annotations

import numpy as np
import pytest

from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.frontend.prompt import encode_chat
from helios_backend.frontend.tokenizer import FrontendTokenizer
from ignition.sources.gguf import GGUFModel, default_gguf_path
from ignition.sources.tokenizer import tokenizer_json_from_gguf
from tests.reference.llama_numpy import ReferenceLlama, RopePairing

EOS_IDS = (2, 0)  # <|im_end|>, <|endoftext|>
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def oracle() -> ReferenceLlama:
    return ReferenceLlama.load(default_gguf_path(), max_context=256)


@pytest.fixture(scope="module")
def frontend() -> tuple[ChatTemplate, FrontendTokenizer]:
    model = GGUFModel.open(default_gguf_path())
    return ChatTemplate(model.chat_template), FrontendTokenizer.from_json(tokenizer_json_from_gguf(model))


@pytest.fixture(scope="module")
def question_ids(frontend: tuple[ChatTemplate, FrontendTokenizer]) -> list[int]:
    template, tokenizer = frontend
    return encode_chat(template, tokenizer, [{"role": "user", "content": QUESTION}]).ids


def test_greedy_reply_names_paris(
    oracle: ReferenceLlama, question_ids: list[int], frontend: tuple[ChatTemplate, FrontendTokenizer]
) -> None:
    reply = oracle.greedy(question_ids, max_new_tokens=16, stop_ids=EOS_IDS)
    text = frontend[1].decode(reply, skip_special_tokens=True)
    assert "Paris" in text
    assert reply[-1] in EOS_IDS  # a short, finished answer


def test_wrong_rope_pairing_changes_the_answer(
    oracle: ReferenceLlama, question_ids: list[int], frontend: tuple[ChatTemplate, FrontendTokenizer]
) -> None:
    # The GGUF stores q/k permuted for adjacent-pair RoPE; rotate_half on those weights is a bug
    # that does not crash, so the oracle must make it visible.
    wrong = oracle.with_rope_pairing(RopePairing.HALF_SPLIT)
    reply = wrong.greedy(question_ids, max_new_tokens=16, stop_ids=EOS_IDS)
    assert "Paris" not in frontend[1].decode(reply, skip_special_tokens=True)
    right_logits = oracle.forward(question_ids, 0)
    wrong_logits = wrong.forward(question_ids, 0)
    assert np.abs(right_logits - wrong_logits).max() > 1.0


def test_unpermuted_qk_with_rotate_half_equals_adjacent_pairing(
    oracle: ReferenceLlama, question_ids: list[int]
) -> None:
    # The permutation fact: un-permuting q/k rows and using rotate_half is the same model.
    hf_layout = oracle.with_half_split_qk()
    a = oracle.forward(question_ids, 0)
    b = hf_layout.forward(question_ids, 0)
    np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)  # logit scale ~40, f32 sum-order noise
    assert int(a[-1].argmax()) == int(b[-1].argmax())


def test_chunked_forward_through_the_cache_equals_one_shot(
    oracle: ReferenceLlama, question_ids: list[int]
) -> None:
    one_shot = oracle.forward(question_ids, 0)
    split = 9
    chunked = np.concatenate(
        [oracle.forward(question_ids[:split], 0)]
        + [oracle.forward([t], split + i) for i, t in enumerate(question_ids[split:])]
    )
    np.testing.assert_allclose(chunked, one_shot, atol=2e-3, rtol=0)


def test_forward_past_max_context_is_rejected(oracle: ReferenceLlama) -> None:
    with pytest.raises(ValueError):
        oracle.forward([1, 2], oracle.max_context - 1)


def test_oracle_agrees_with_llama_cpp_on_the_same_file(oracle: ReferenceLlama, question_ids: list[int]) -> None:
    # A third reading of the GGUF. llama.cpp multiplies Q4_1 weights with 8-bit-quantized
    # activations, so logits differ by ~0.2 on average (scale ~40): compare shape, not digits.
    llama_cpp = pytest.importorskip("llama_cpp")  # the `bench` extra, built from source
    peer = llama_cpp.Llama(
        str(default_gguf_path()), n_ctx=256, n_batch=64, logits_all=True, verbose=False, n_threads=2
    )
    peer.eval(question_ids)
    theirs = np.array(peer.scores[: len(question_ids)], dtype=np.float32)
    ours = oracle.forward(question_ids, 0)
    for position in range(len(question_ids)):
        assert np.corrcoef(ours[position], theirs[position])[0, 1] > 0.99
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).mean()
    assert agreement >= 0.9
    # Where they disagree it is a near tie: each side's choice is in the other's top 3. (At the
    # last position "The" leads "L" by only 0.08 for us; llama.cpp picks "L".)
    their_top3 = np.argsort(-theirs, axis=-1)[:, :3]
    our_top3 = np.argsort(-ours, axis=-1)[:, :3]
    for position in range(len(question_ids)):
        assert ours[position].argmax() in their_top3[position]
        assert theirs[position].argmax() in our_top3[position]


def test_fp16_rounded_weights_stay_close_and_still_answer_paris(
    oracle: ReferenceLlama, question_ids: list[int], frontend: tuple[ChatTemplate, FrontendTokenizer]
) -> None:
    # The recipe stores fp16 weights; this bounds what that rounding alone does to the logits
    # (measured: max |diff| 0.04, mean 0.006 at logit scale ~40) so engine tests can pick a
    # tolerance against either oracle.
    rounded = oracle.with_weights_rounded(np.float16)
    exact = oracle.forward(question_ids, 0)
    approx = rounded.forward(question_ids, 0)
    assert 0.0 < np.abs(exact - approx).max() < 0.1
    assert (exact.argmax(-1) == approx.argmax(-1)).all()
    reply = rounded.greedy(question_ids, max_new_tokens=16, stop_ids=EOS_IDS)
    assert "Paris" in frontend[1].decode(reply, skip_special_tokens=True)
