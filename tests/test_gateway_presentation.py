"""Unit tests of the output pipeline and presenters on hand-written token streams.

No Triton here: a FrontendAssets message built from the embedded GGUF's tokenizer and
template stands in for the backend's assets answer, and token batches are fed by hand.
The end-to-end tests (test_gateway_e2e*.py) run the same code against a real backend.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import AdmissionRejectedError, ExecutionFailedError, InvalidRequestError
from gateway.generation import ChoiceFailed, ChoiceTranslator
from gateway.output_pipeline import OutputPipeline, PlainTextParser, TokenStep
from gateway.preparation import PreparedRequest, prepare_chat, prepare_completion
from gateway.presentation import ChatPresenter, CompletionPresenter, Presenter
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.served_model import ServedModel
from gateway.triton_client import TokenBatch
from helios_proto import exchange_pb2 as ep
from ignition.sources.gguf import GGUFModel, default_gguf_path
from ignition.sources.tokenizer import tokenizer_json_from_gguf
from tests.presenting import present_chat

EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def served() -> ServedModel:
    gguf = GGUFModel.open(default_gguf_path())
    assets = ep.FrontendAssets(
        version=ep.TRANSPORT_VERSION_1, served_id="test-model", aliases=["alias"],
        tokenizer_json=tokenizer_json_from_gguf(gguf).encode(), chat_template=gguf.chat_template,
        eos_token_ids=[EOS], top_logprobs_capacity=4,
        limits=ep.ServingLimits(context_tokens=2048, queue_capacity=4, max_active=2, frontend_workers=1,
                                sampled_vocabulary=49152))
    return ServedModel.from_assets(assets)


def chat(served: ServedModel, **fields: Any) -> PreparedRequest:
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], **fields}
    return prepare_chat(ChatCompletionRequest.model_validate(body), served, ingress_ns=10)


def finished(reason: int, completion: int, stop: ep.StopMatch | None = None, timed: bool = False) -> ep.TerminalEvent:
    event = ep.TerminalEvent(finished=ep.Finished(
        reason=reason, usage=ep.Usage(prompt_tokens=7, completion_tokens=completion, reused_prompt_tokens=3)))
    if stop is not None:
        event.finished.stop.CopyFrom(stop)
    if timed:
        event.finished.performance.CopyFrom(ep.Performance(ingress_ns=10, enqueue_ns=20, reused_prompt_tokens=3))
    return event


def batch(ids: list[int], start_ts: int = 100) -> TokenBatch:
    return TokenBatch(np.asarray(ids, dtype=np.int32), np.arange(start_ts, start_ts + len(ids), dtype=np.int64),
                      None, None, None)


def run(presenter: Presenter, served: ServedModel, prepared: PreparedRequest, ids: list[int],
        cuts: list[int], terminal: ep.TerminalEvent, stream: bool) -> Any:
    """Feed ids in batches split at `cuts`, then the terminal; SSE bytes or the JSON body."""
    pipeline = OutputPipeline(served.tokenizer, prepared.stop_matcher(), PlainTextParser(), served.eos_token_ids)
    translator = ChoiceTranslator(0, pipeline, "messages", prepared.ingress_ns, 20)
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    events = [translator.tokens(batch(ids[a:b], 100 + a)) for a, b in zip(bounds, bounds[1:])]
    events.append(translator.terminal(terminal))
    if not stream:
        for event in events:
            presenter.fold(event)
        return presenter.body()
    out = b"".join(presenter.opening())
    for event in events:
        out += b"".join(presenter.stream(event))
    return out


def parse_sse(raw: bytes) -> tuple[list[dict[str, Any]], bool]:
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    done = frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames if f != "data: [DONE]"], done


def text_ids(served: ServedModel, text: str) -> list[int]:
    return served.tokenizer.encode_untrusted(text)


# spec: OBS-2, OBS-3, OBS-11, OBS-18, OBS-19, OBS-20
def test_json_observation_fields(served: ServedModel) -> None:
    prepared = chat(served, return_token_ids=True, return_token_timestamps=True)
    ids = text_ids(served, "Paris is nice.") + [EOS]
    body = run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids, [2],
               finished(ep.FINISH_REASON_EOS, len(ids), timed=True), stream=False)
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == list(prepared.prompts[0])
    assert choice["token_ids"] == ids  # EOS included (OBS-7)
    assert choice["token_timestamps_ns"] == list(range(100, 100 + len(ids)))
    assert choice["message"]["content"] == "Paris is nice."
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": len(ids), "total_tokens": 7 + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert body["reused_prompt_tokens"] == 3
    assert body["performance"] == {"ingress_ns": 10, "enqueue_ns": 20, "reused_prompt_tokens": 3}


# spec: OBS-17
def test_unobserved_json_has_no_observation_fields(served: ServedModel) -> None:
    prepared = chat(served)
    ids = text_ids(served, "ok") + [EOS]
    body = run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids, [],
               finished(ep.FINISH_REASON_EOS, len(ids)), stream=False)
    assert "prompt_token_ids" not in body and "performance" not in body
    assert "token_ids" not in body["choices"][0]


# spec: OBS-4, OBS-5, OBS-6, OBS-25, OBS-26
def test_sse_metadata_chunks_and_include_usage(served: ServedModel) -> None:
    prepared = chat(served, stream=True, stream_options={"include_usage": True}, return_token_ids=True,
                    return_token_timestamps=True)
    ids = text_ids(served, "A b c") + [EOS]
    raw = run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids, [1, 3],
              finished(ep.FINISH_REASON_EOS, len(ids), timed=True), stream=True)
    chunks, done = parse_sse(raw)
    assert done
    assert chunks[0]["prompt_token_ids"] == list(prepared.prompts[0])
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    meta = [c for c in chunks if c["choices"] and "token_ids" in c["choices"][0]]
    assert [c["choices"][0]["token_ids"] for c in meta] == [[i] for i in ids]
    assert all(c["choices"][0]["delta"] == {} for c in meta)
    assert [c["choices"][0]["token_timestamps_ns"][0] for c in meta] == list(range(100, 100 + len(ids)))
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert all("token_ids" not in c["choices"][0] for c in text_chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in text_chunks) == "A b c"
    assert all(c["usage"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(ids)
    assert final["performance"]["enqueue_ns"] == 20
    assert sum(1 for c in chunks if "performance" in c) == 1


def test_tokens_that_arrive_together_leave_as_one_text_chunk_unless_each_shows_something(served: ServedModel) -> None:
    """A batch of several tokens (held by the stream interval) is one content chunk of their
    text; with logprobs each token keeps a chunk of its own, carrying its entry."""
    ids = text_ids(served, "one two three four five six") + [EOS]
    cuts = [1, 4]                       # batches of 1, 3 and the rest of the tokens
    contents = {}
    for logprobs in (False, True):
        prepared = chat(served, stream=True, logprobs=logprobs)
        chunks, done = parse_sse(run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared,
                                     ids, cuts, finished(ep.FINISH_REASON_EOS, len(ids)), stream=True))
        assert done
        text = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        contents[logprobs] = [c["delta"]["content"] for c in text]
        if logprobs:
            assert [e["token"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]] == \
                [served.tokenizer.token_text(i) for i in ids]
    assert "".join(contents[False]) == "".join(contents[True]) == "one two three four five six"
    assert len(contents[False]) == 3 and len(contents[True]) == len(ids) - 1


# spec: OBS-27
def test_sse_without_include_usage_puts_usage_on_terminal_chunk(served: ServedModel) -> None:
    prepared = chat(served, stream=True, return_token_ids=True)
    ids = text_ids(served, "x") + [EOS]
    chunks, done = parse_sse(run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids,
                                 [], finished(ep.FINISH_REASON_EOS, len(ids)), stream=True))
    assert done
    terminal = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(terminal) == 1 and terminal[0]["usage"]["completion_tokens"] == len(ids)
    assert terminal[0]["reused_prompt_tokens"] == 3
    assert all("usage" not in c for c in chunks if c is not terminal[0])


# spec: STOP-11, STOP-19, STOP-20, STOP-21
def test_stop_string_across_tokens_trims_text_but_not_ids(served: ServedModel) -> None:
    ids = text_ids(served, "one two three four")
    prepared = chat(served, stop=["o thr"], return_token_ids=True)
    stop = ep.StopMatch(kind=ep.STOP_KIND_STRING, index=0, visible_text_bytes=len("one tw"))
    body = run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids[:4], [1],
               finished(ep.FINISH_REASON_STOP_STRING, 4, stop), stream=False)
    assert body["choices"][0]["message"]["content"] == "one tw"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["token_ids"] == ids[:4]
    assert body["usage"]["completion_tokens"] == 4


# spec: STOP-15
def test_length_end_flushes_held_prefix(served: ServedModel) -> None:
    ids = text_ids(served, "abc de")
    prepared = chat(served, stop=" def")
    body = run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids, [],
               finished(ep.FINISH_REASON_LENGTH, len(ids)), stream=False)
    assert body["choices"][0]["message"]["content"] == "abc de"
    assert body["choices"][0]["finish_reason"] == "length"


# spec: STOP-29, STOP-8
def test_stop_token_sequence_omitted_from_text(served: ServedModel) -> None:
    ids = text_ids(served, "left right")
    prepared = chat(served, stop_token_sequences=[ids[1:]], return_token_ids=True)
    stop = ep.StopMatch(kind=ep.STOP_KIND_TOKEN_SEQUENCE, index=0, presented_tokens=1)
    body = run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids, [],
               finished(ep.FINISH_REASON_STOP_TOKEN, len(ids), stop), stream=False)
    assert body["choices"][0]["message"]["content"] == "left"
    assert body["choices"][0]["token_ids"] == ids


# spec: STOP-12
def test_multibyte_character_split_across_tokens(served: ServedModel) -> None:
    ids = text_ids(served, "🙂 ok")
    assert len(served.tokenizer.token_bytes(ids[0])) < 4  # the emoji spans several tokens
    prepared = chat(served, stream=True)
    chunks, _ = parse_sse(run(ChatPresenter(prepared, "test-model", served.tokenizer), served, prepared,
                              ids, list(range(len(ids))), finished(ep.FINISH_REASON_LENGTH, len(ids)),
                              stream=True))
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "\ufffd" not in "".join(p for p in pieces if p)
    assert "".join(p for p in pieces if p) == "🙂 ok"


def sse_view(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold SSE chunks into what a client sees, to compare with the JSON body."""
    content, ids, stamps, reason, usage = [], [], [], None, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            content.append(choice["delta"].get("content") or "")
            ids += choice.get("token_ids", [])
            stamps += choice.get("token_timestamps_ns", [])
            reason = choice["finish_reason"] or reason
        usage = chunk.get("usage") or usage
    return {"content": "".join(content), "ids": ids, "stamps": stamps, "reason": reason, "usage": usage}


# spec: STOP-9, STOP-13, OBS-3, OBS-5
@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(["The end is near. Near the end!", "日本語 and ÷ signs 🙂🙃 too", "aaaa bbbb aaaa"]),
       stop=st.sampled_from([None, "end", "ear", "🙃", "a b", "zzz"]),
       cuts=st.lists(st.integers(min_value=1, max_value=30), max_size=8),
       eos=st.booleans())
def test_stream_equals_json_for_every_chunking(served: ServedModel, text: str, stop: str | None,
                                               cuts: list[int], eos: bool) -> None:
    ids = text_ids(served, text)
    prepared_json = chat(served, stop=stop, return_token_ids=True, return_token_timestamps=True)
    prepared_sse = chat(served, stop=stop, return_token_ids=True, return_token_timestamps=True, stream=True,
                        stream_options={"include_usage": True})
    # the backend's decision: the same matcher over the same ids
    decided = prepared_json.stop_matcher()
    decoder = served.tokenizer.incremental_decoder()
    generated, visible, reason, match = [], 0, ep.FINISH_REASON_LENGTH, None
    for token in ids + ([EOS] if eos else []):
        generated.append(token)
        if token == EOS:
            reason = ep.FINISH_REASON_EOS
            break
        decision = decided.feed(token, decoder.feed_one(token))
        visible += len(decision.text.encode())
        if decision.matched:
            reason = ep.FINISH_REASON_STOP_STRING
            match = ep.StopMatch(kind=ep.STOP_KIND_STRING, index=0, visible_text_bytes=visible)
            break
    terminal = finished(reason, len(generated), match, timed=True)
    body = run(ChatPresenter(prepared_json, "test-model", served.tokenizer), served, prepared_json, generated,
               cuts, terminal, stream=False)
    chunks, done = parse_sse(run(ChatPresenter(prepared_sse, "test-model", served.tokenizer), served,
                                 prepared_sse, generated, cuts, terminal, stream=True))
    view = sse_view(chunks)
    choice = body["choices"][0]
    assert done
    assert view["content"] == choice["message"]["content"]
    assert view["ids"] == choice["token_ids"] == generated
    assert view["stamps"] == choice["token_timestamps_ns"]
    assert view["reason"] == choice["finish_reason"]
    assert view["usage"] == body["usage"]
    if stop is None or stop not in text:
        assert choice["message"]["content"] == text
    else:
        assert choice["message"]["content"] == text[: text.index(stop)]


def test_completion_presenter_shapes(served: ServedModel) -> None:
    body = CompletionRequest.model_validate({"model": "alias", "prompt": "Once", "return_token_ids": True})
    prepared = prepare_completion(body, served, ingress_ns=1)
    ids = text_ids(served, " upon a time")
    out = run(CompletionPresenter(prepared, "test-model", served.tokenizer), served, prepared, ids, [2],
              finished(ep.FINISH_REASON_LENGTH, len(ids)), stream=False)
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == " upon a time"
    assert out["prompt_token_ids"] == served.tokenizer.encode_template("Once")


# spec: HTTP-26, HTTP-27
def test_terminal_outcomes_map_to_typed_errors(served: ServedModel) -> None:
    prepared = chat(served)
    pipeline = OutputPipeline(served.tokenizer, prepared.stop_matcher(), PlainTextParser(), served.eos_token_ids)
    translator = ChoiceTranslator(0, pipeline, "messages", 0, 0)
    # the same message text on every outcome: only the outcome decides the class
    rejected = translator.terminal(ep.TerminalEvent(rejected=ep.AdmissionRejection(
        reason=ep.REJECTION_REASON_PROMPT_BEYOND_CAPACITY, message="boom")))
    failed = translator.terminal(ep.TerminalEvent(failed=ep.ExecutionFailure(message="boom")))
    invalid = translator.terminal(ep.TerminalEvent(invalid=ep.InvalidRequest(field="stops.strings", message="boom")))
    assert isinstance(rejected, ChoiceFailed) and isinstance(rejected.error, AdmissionRejectedError)
    assert rejected.error.status == 503 and rejected.error.param == "messages"
    assert isinstance(failed, ChoiceFailed) and isinstance(failed.error, ExecutionFailedError)
    assert failed.error.status == 500
    assert isinstance(invalid, ChoiceFailed) and invalid.error.status == 400
    assert invalid.error.param == "stops.strings"


# spec: OBS-10, OBS-28, STOP-7, HTTP-18
@pytest.mark.parametrize("fields, param", [
    ({"return_token_timestamps": True}, "return_token_timestamps"),
    ({"return_token_timestamps": True, "return_token_ids": False}, "return_token_timestamps"),
    ({"stop": "x", "stop_token_ids": [5]}, "stop"),
    ({"stop": "x", "response_format": {"type": "json_object"}}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 5}, "top_logprobs"),
    ({"model": "other"}, "model"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
])
def test_preparation_names_the_parameter(served: ServedModel, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(Exception) as err:
        chat(served, **fields)
    assert getattr(err.value, "param", None) == param
    assert isinstance(err.value, InvalidRequestError) or err.value.status == 404  # type: ignore[attr-defined]


def test_n_fans_out_with_offset_seeds(served: ServedModel) -> None:
    prepared = chat(served, n=3, seed=7, temperature=0.5)
    choices = list(prepared.choices())
    assert [i for i, _, _ in choices] == [0, 1, 2]
    assert [r.sampling.seed for _, _, r in choices] == [7, 8, 9]
    assert all(r.sampling.temperature == 0.5 for _, _, r in choices)
    assert not choices[0][2].sampling.HasField("top_p")  # unset: the core default applies (SRV-17)


@pytest.fixture(scope="module")
def served_with_reasoning(served: ServedModel) -> ServedModel:
    """The same vocabulary, but the frontend declares think-tag reasoning and Qwen Coder tools."""
    from helios_backend.syntax.tables import preset
    from helios_proto import contract_pb2 as pb

    assets = ep.FrontendAssets()
    assets.CopyFrom(served.assets)
    preset(pb.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS, pb.REASONING_PARSER_THINK_TAGS).apply_to(assets.frontend)
    return ServedModel.from_assets(assets)


def syntax_run(served: ServedModel, text: str, stop: str | None, stream: bool) -> Any:
    prepared = prepare_chat(ChatCompletionRequest.model_validate(
        {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stop": stop, "stream": stream}),
        served, ingress_ns=0)
    ids = text_ids(served, text)
    reason = ep.FINISH_REASON_LENGTH if stop is None else ep.FINISH_REASON_STOP_STRING
    out = present_chat(served, prepared, ids, finished(reason, len(ids)), stream)
    return parse_sse(out)[0] if stream else out


# spec: STOP-10, FE-38
def test_stop_string_matches_inside_reasoning(served_with_reasoning: ServedModel) -> None:
    text = "<think>I should say STOP right away</think>The answer is Paris."
    plain = syntax_run(served_with_reasoning, text, None, stream=False)
    assert plain["message"]["reasoning_content"].strip() == "I should say STOP right away"
    assert plain["message"]["content"].strip() == "The answer is Paris."
    stopped = syntax_run(served_with_reasoning, text, "STOP", stream=False)
    assert stopped["message"]["reasoning_content"].strip() == "I should say"
    assert stopped["message"]["content"] == "" and stopped["finish_reason"] == "stop"


# spec: STOP-10, FE-40
def test_stop_string_matches_inside_tool_envelope(served_with_reasoning: ServedModel) -> None:
    text = "Let me check.<tool_call>\n<function=lookup>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    stopped = syntax_run(served_with_reasoning, text, "<function=", stream=False)
    assert "Let me check." in stopped["message"]["content"]
    assert "function=" not in stopped["message"]["content"] and stopped["finish_reason"] == "stop"
    chunks = syntax_run(served_with_reasoning, text, "<function=", stream=True)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == stopped["message"]["content"]


# spec: OBS-25
@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=12), include_usage=st.booleans(), index=st.integers(0, 2),
       completion=st.booleans())
def test_text_chunk_template_equals_the_generic_chunk(served: ServedModel, text: str, include_usage: bool,
                                                      index: int, completion: bool) -> None:
    """The per-stream template of a one-text chunk gives the bytes _chunk encodes, for any
    text (quotes, backslashes, control characters, non-ASCII), with and without usage: null."""
    fields: dict[str, Any] = {"stream": True, "n": 3}
    if include_usage:
        fields["stream_options"] = {"include_usage": True}
    if completion:
        body = {"model": "test-model", "prompt": "hi", **fields}
        presenter: Presenter = CompletionPresenter(prepare_completion(CompletionRequest.model_validate(body), served,
                                                                      ingress_ns=10), "test-model", served.tokenizer)
        key = "text"
    else:
        presenter = ChatPresenter(chat(served, **fields), "test-model", served.tokenizer)
        key = "content"
    b"".join(presenter.opening())
    presenter._first_chunk = False
    for _ in range(2):   # the template's first use builds it, the second reads it back
        got = presenter._text_chunk(index, key, text)
        assert got == presenter._chunk([presenter.chunk_choice(index, {key: text})])
        assert json.loads(got[len(b"data: "):])["choices"][0]["delta" if key == "content" else "text"] == \
            ({key: text} if key == "content" else text)


# spec: OBS-5, OBS-25
@settings(max_examples=40, deadline=None)
@given(token_id=st.integers(0, 49151), include_usage=st.booleans(), index=st.integers(0, 2),
       completion=st.booleans())
def test_token_ids_chunk_template_equals_the_generic_chunk(served: ServedModel, token_id: int, include_usage: bool,
                                                           index: int, completion: bool) -> None:
    """An observed stream's per-token ids chunk from its template is the bytes _chunk encodes
    for {delta: {}, token_ids: [id]}, with and without usage: null, chat and text completions."""
    fields: dict[str, Any] = {"stream": True, "n": 3, "return_token_ids": True}
    if include_usage:
        fields["stream_options"] = {"include_usage": True}
    if completion:
        body = {"model": "test-model", "prompt": "hi", **fields}
        presenter: Presenter = CompletionPresenter(prepare_completion(CompletionRequest.model_validate(body), served,
                                                                      ingress_ns=10), "test-model", served.tokenizer)
    else:
        presenter = ChatPresenter(chat(served, **fields), "test-model", served.tokenizer)
    b"".join(presenter.opening())
    presenter._first_chunk = False
    step = TokenStep(token_id, None, None, (), ())
    for _ in range(2):   # the template's first use builds it, the second reads it back
        got = b"".join(presenter._stream_step(index, presenter.states[index], step))
        generic = presenter.chunk_choice(index, {})
        generic["token_ids"] = [token_id]
        assert got == presenter._chunk([generic])
        assert json.loads(got[len(b"data: "):])["choices"][0]["token_ids"] == [token_id]


# spec: HTTP-8
def test_event_batches_carry_what_queued_in_order_until_every_choice_ended(served: ServedModel) -> None:
    """The streaming writer's batches: everything queued since the last batch, in arrival
    order, and the run ends only after each choice's terminal event (also when two choices'
    terminals arrive in one batch, or a batch holds a terminal and later steps); only the
    batch that ended the last choice says it is the last (the SSE writer ends the body in it)."""
    import asyncio

    from gateway.generation import ChoiceFinished, ChoiceSteps, PerformanceStamps, RequestRun
    from gateway.metrics import GatewayMetrics

    def finish(index: int) -> ChoiceFinished:
        return ChoiceFinished(index, "length", False, [], ep.Usage(), PerformanceStamps(0, 0, 0))

    async def scenario() -> list[list[object]]:
        run = RequestRun(None, served, chat(served, n=3, stream=True), lambda i: PlainTextParser(),  # type: ignore[arg-type]
                         GatewayMetrics(), "messages")
        run._tasks = [None, None, None]  # type: ignore[list-item]   # three choices, pumped by hand
        events: list[object] = [ChoiceSteps(0, []), ChoiceSteps(1, []), finish(0), ChoiceSteps(2, [])]
        for event in events:
            run._queue.put_nowait(event)  # type: ignore[arg-type]
        batches: list[list[object]] = []
        lasts: list[bool] = []

        async def later() -> None:
            await asyncio.sleep(0)
            run._queue.put_nowait(finish(1))
            run._queue.put_nowait(finish(2))

        task = asyncio.create_task(later())
        async for batch, last in run.event_batches():
            batches.append(list(batch))
            lasts.append(last)
        await task
        assert lasts == [False, True]
        return batches

    batches = asyncio.run(scenario())
    assert [type(e).__name__ for b in batches for e in b] == \
        ["ChoiceSteps", "ChoiceSteps", "ChoiceFinished", "ChoiceSteps", "ChoiceFinished", "ChoiceFinished"]
    assert len(batches[0]) == 4 and len(batches) == 2


def tool_run(served: ServedModel, text: str, reason: int, stream: bool, **fields: Any) -> Any:
    """A chat request with one tool; `text` generated, then the terminal `reason`."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    prepared = prepare_chat(ChatCompletionRequest.model_validate(
        {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "stream": stream,
         **fields}), served, ingress_ns=0)
    ids = text_ids(served, text)
    out = present_chat(served, prepared, ids, finished(reason, len(ids)), stream)
    return parse_sse(out)[0] if stream else out


CALL = "<tool_call>\n<function=lookup>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"


# spec: FE-39, FE-40
def test_a_tool_only_message_has_null_content_as_openai(served_with_reasoning: ServedModel) -> None:
    choice = tool_run(served_with_reasoning, CALL, ep.FINISH_REASON_EOS, stream=False)
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["lookup"]
    chunks = tool_run(served_with_reasoning, CALL, ep.FINISH_REASON_EOS, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    # OpenAI: the role with content null beside the first tool call, never a content "" delta
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "lookup"
    assert all("role" not in d and "content" not in d for d in deltas[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# spec: FE-39
def test_text_under_tools_opens_with_the_role_and_empty_content(served_with_reasoning: ServedModel) -> None:
    chunks = tool_run(served_with_reasoning, "It is sunny.", ep.FINISH_REASON_EOS, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] == "It is sunny."[:len(deltas[0]["content"])]
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    empty = tool_run(served_with_reasoning, "", ep.FINISH_REASON_EOS, stream=True)
    assert [c["choices"][0]["delta"] for c in empty] == [{"role": "assistant", "content": ""}, {}]


# spec: FE-42
def test_a_named_choice_finishes_with_stop_and_a_cut_call_with_length(served_with_reasoning: ServedModel) -> None:
    named = {"tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    for stream in (False, True):
        out = tool_run(served_with_reasoning, CALL, ep.FINISH_REASON_EOS, stream, **named)
        finish = out["finish_reason"] if not stream else out[-1]["choices"][0]["finish_reason"]
        assert finish == "stop"                              # a forced function (OpenAI)
    cut = tool_run(served_with_reasoning, CALL[:49], ep.FINISH_REASON_LENGTH, False, tool_choice="required")
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    [call] = cut["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup" and call["function"]["arguments"].startswith('{"city": "')
    opener = tool_run(served_with_reasoning, "<tool_call>\n", ep.FINISH_REASON_LENGTH, False, tool_choice="required")
    assert opener["finish_reason"] == "length" and not opener["message"]["content"]   # no markup as content
