"""Unit tests of the incremental stop matcher on hand-written token streams."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_backend.frontend.stops import StopDecision, StopMatcher, StopSpecError


def run_text(matcher: StopMatcher, deltas: list[str], *, finish: bool = True) -> tuple[str, bool, list[str]]:
    """Feed text deltas as tokens 0..n-1; returns (visible text, matched, per-token released)."""
    released: list[str] = []
    for token_id, delta in enumerate(deltas):
        decision = matcher.feed(token_id, delta)
        released.append(decision.text)
        if decision.matched:
            return "".join(released), True, released
    if finish:
        released.append(matcher.finish())
    return "".join(released), False, released


def drain(matcher: StopMatcher, decisions: Iterator[StopDecision]) -> tuple[str, bool]:
    """Consume decisions lazily up to the first match; (visible text, matched), flushed at the end."""
    out: list[str] = []
    for decision in decisions:
        out.append(decision.text)
        if decision.matched:
            return "".join(out), True
    out.append(matcher.finish())
    return "".join(out), False


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """One-shot oracle: the stop completing first wins; ties go to the earliest start."""
    best: tuple[int, int] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0:
            key = (index + len(stop), index)
            best = key if best is None or key < best else best
    if best is None:
        return text, False
    return text[: best[1]], True


# spec: STOP-11, STOP-21
def test_stop_inside_one_token_drops_match_and_rest_of_token() -> None:
    matcher = StopMatcher(["END"])
    visible, matched, released = run_text(matcher, ["Hello", " wENDorld", "never"])
    assert matched and visible == "Hello w"
    assert released == ["Hello", " w"]


# spec: STOP-11, STOP-13
def test_stop_across_token_boundaries_holds_prefix() -> None:
    matcher = StopMatcher(["</s>"])
    decisions = [matcher.feed(i, d) for i, d in enumerate(["ab<", "/", "s", ">tail"])]
    assert [d.text for d in decisions] == ["ab", "", "", ""]
    assert [d.matched for d in decisions] == [False, False, False, True]
    assert decisions[-1].stop_index == 0


# spec: STOP-13
def test_prefix_released_once_it_cannot_match() -> None:
    matcher = StopMatcher(["abc"])
    decisions = [matcher.feed(i, d) for i, d in enumerate(["xa", "b", "d", "e"])]
    assert [d.text for d in decisions] == ["x", "", "abd", "e"]
    assert not any(d.matched for d in decisions)


# spec: STOP-13, STOP-11
def test_overlapping_stops_first_completed_wins() -> None:
    # "bcd" completes before "abcdef" would; "abcdef" is never completed
    matcher = StopMatcher(["abcdef", "bcd"])
    visible, matched, _ = run_text(matcher, ["a", "b", "c", "d", "e", "f"])
    assert matched and visible == "a"


# spec: STOP-13
def test_overlapping_stops_same_end_earliest_start_wins() -> None:
    matcher = StopMatcher(["bc", "abc"])
    decision = [matcher.feed(i, d) for i, d in enumerate(["a", "bc"])][-1]
    assert decision.matched and decision.text == "" and decision.stop_index == 1


# spec: STOP-13
def test_self_overlapping_stop() -> None:
    # "aab" inside "aaab": the automaton must fall back to the shorter held prefix
    matcher = StopMatcher(["aab"])
    decisions = [matcher.feed(i, d) for i, d in enumerate(["a", "a", "a", "b"])]
    assert [d.text for d in decisions] == ["", "", "a", ""]
    assert decisions[-1].matched


# spec: STOP-14, STOP-15
def test_finish_flushes_unmatched_prefix() -> None:
    matcher = StopMatcher(["STOP"])
    visible, matched, released = run_text(matcher, ["go ", "ST", "O"])
    assert not matched and visible == "go STO"
    assert released[-1] == "STO"


# spec: STOP-12
def test_partial_utf8_buffered_until_complete() -> None:
    matcher = StopMatcher()
    snowman = "☃".encode()  # 3 bytes
    decisions = [matcher.feed_bytes(0, snowman[:1]), matcher.feed_bytes(1, snowman[1:2]),
                 matcher.feed_bytes(2, snowman[2:] + b"!")]
    assert [d.text for d in decisions] == ["", "", "☃!"]


# spec: STOP-12, STOP-11
def test_multibyte_stop_split_inside_a_character() -> None:
    matcher = StopMatcher(["日本"])
    data = "x日本y".encode()
    decisions = []
    for i in range(len(data)):
        decisions.append(matcher.feed_bytes(i, data[i:i + 1]))
        if decisions[-1].matched:
            break
    # the match completes on the last byte of 本, not before
    assert len(decisions) == len("x日本".encode())
    assert decisions[-1].matched and "".join(d.text for d in decisions) == "x"


# spec: STOP-12, STOP-14
def test_dangling_partial_utf8_flushed_as_replacement() -> None:
    matcher = StopMatcher()
    assert matcher.feed_bytes(0, "é".encode()[:1]).text == ""
    assert matcher.finish() == "\ufffd"


# spec: STOP-29, STOP-30
def test_token_sequence_held_then_omitted() -> None:
    matcher = StopMatcher(sequences=[[5, 6, 7]])
    decisions = [matcher.feed(t, s) for t, s in [(1, "a"), (5, "<"), (6, "|"), (7, ">"), (9, "z")][:4]]
    assert [d.text for d in decisions] == ["a", "", "", ""]
    assert decisions[-1].matched


# spec: STOP-30
def test_token_sequence_prefix_released_on_mismatch() -> None:
    matcher = StopMatcher(sequences=[[5, 6, 7]])
    decisions = [matcher.feed(t, s) for t, s in [(5, "<"), (6, "|"), (8, "x"), (5, "<")]]
    assert [d.text for d in decisions] == ["", "", "<|x", ""]
    assert matcher.finish() == "<"


# spec: STOP-30, STOP-13
def test_overlapping_token_sequences_keep_shorter_restart() -> None:
    # 5 5 6: the first 5 is released, the second 5 restarts the match
    matcher = StopMatcher(sequences=[[5, 6]])
    decisions = [matcher.feed(t, s) for t, s in [(5, "a"), (5, "b"), (6, "c")]]
    assert [d.text for d in decisions] == ["", "a", ""]
    assert decisions[-1].matched


# spec: STOP-29
def test_single_stop_token_id_omitted() -> None:
    matcher = StopMatcher.for_request(None, stop_token_ids=[42], vocabulary_size=100)
    assert matcher.feed(1, "x").text == "x"
    decision = matcher.feed(42, "<eot>")
    assert decision.matched and decision.text == ""


def test_no_stops_pass_through() -> None:
    matcher = StopMatcher.for_request([])  # spec: STOP-6
    assert not matcher.active
    assert [matcher.feed(i, d).text for i, d in enumerate(["a", "", "b"])] == ["a", "", "b"]


def test_feed_after_match_is_an_error() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed(0, "x").matched
    with pytest.raises(RuntimeError):
        matcher.feed(1, "y")


# spec: STOP-1, STOP-2, STOP-3, STOP-4, STOP-5, STOP-6
@pytest.mark.parametrize("stop, ok", [
    (None, True), ("a", True), (["a", "b", "c", "d"], True), ([], True),
    ("", False), (["a", ""], False), (["a"] * 5, False),
    (["x" * 4096], True), (["x" * 4095, "é"], False), (["é" * 2048], True), (["é" * 2049], False),
])
def test_stop_string_limits(stop: object, ok: bool) -> None:
    if ok:
        StopMatcher.for_request(stop)  # type: ignore[arg-type]
    else:
        with pytest.raises(StopSpecError) as err:
            StopMatcher.for_request(stop)  # type: ignore[arg-type]
        assert err.value.param == "stop"


# spec: STOP-7, STOP-8
def test_string_stops_not_combinable() -> None:
    with pytest.raises(StopSpecError):
        StopMatcher.for_request("x", stop_token_ids=[1])
    with pytest.raises(StopSpecError):
        StopMatcher.for_request(["x"], stop_token_sequences=[[1, 2]])
    with pytest.raises(StopSpecError):
        StopMatcher.for_request("x", structured_output=True)
    StopMatcher.for_request([], stop_token_ids=[1], structured_output=True)


# spec: STOP-25, STOP-26, STOP-27, STOP-28
@pytest.mark.parametrize("ids, seqs, param", [
    ([100], None, "stop_token_ids"), ([-1], None, "stop_token_ids"),
    (None, [[1, 100]], "stop_token_sequences"), (None, [[]], "stop_token_sequences"),
    (None, [[1] * 65], "stop_token_sequences"), (None, [[1]] * 17, "stop_token_sequences"),
    ([1] * 8, [[2]] * 9, "stop_token_sequences"),
])
def test_stop_token_limits(ids: list[int] | None, seqs: list[list[int]] | None, param: str) -> None:
    with pytest.raises(StopSpecError) as err:
        StopMatcher.for_request(None, ids, seqs, vocabulary_size=100)
    assert err.value.param == param


def test_stop_token_limits_at_bounds_accepted() -> None:
    StopMatcher.for_request(None, None, [[99] * 64] * 16, vocabulary_size=100)


ALPHABET = "ab☃日"


# spec: STOP-9, STOP-11, STOP-13, STOP-14
@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=24),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=24), max_size=10))
def test_any_chunking_equals_one_shot(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    visible, matched, _ = run_text(StopMatcher(stops), deltas)
    assert (visible, matched) == reference(text, stops)


# spec: STOP-12
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=16),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), min_size=1, max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=64), max_size=12))
def test_any_byte_chunking_equals_one_shot(text: str, stops: list[str], cuts: list[int]) -> None:
    data = text.encode()
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    matcher = StopMatcher(stops)
    decisions = (matcher.feed_bytes(token_id, data[a:b]) for token_id, (a, b) in enumerate(zip(bounds, bounds[1:])))
    assert drain(matcher, decisions) == reference(text, stops)


# spec: STOP-29, STOP-30
@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(min_value=0, max_value=3), max_size=20),
       seqs=st.lists(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=3),
                     min_size=1, max_size=4))
def test_token_sequences_equal_one_shot(tokens: list[int], seqs: list[list[int]]) -> None:
    matcher = StopMatcher(sequences=seqs)
    result = drain(matcher, (matcher.feed(token, str(token)) for token in tokens))
    # oracle over the one-character-per-token spelling
    assert result == reference("".join(map(str, tokens)), ["".join(map(str, s)) for s in seqs])
