"""JSON and SSE presentation of choice events, for chat and text completions.

One ``Presenter`` per HTTP response consumes the merged ChoiceEvents. Streaming turns each
event into SSE chunks as it arrives; non-streaming folds the same events into one body, so
both views are built from the same steps and agree.

Observation fields (spec "Token and timing observation"):
* ``prompt_token_ids``: top level of the JSON body / of the first SSE chunk (OBS-2, OBS-4);
* ``choices[i].token_ids`` / ``token_timestamps_ns``: JSON arrays (OBS-3, OBS-11); in SSE one
  metadata-only chunk per generated id, ``delta`` {} (OBS-5); text chunks carry no ids (OBS-6);
* terminal responses carry ``usage`` and ``reused_prompt_tokens`` (OBS-18, OBS-19), timed ones
  one ``performance`` object (OBS-20);
* ``stream_options.include_usage``: every chunk has ``usage: null`` until a final usage-only
  chunk with ``choices: []`` before [DONE] (OBS-25, OBS-26); otherwise an observed stream puts
  usage on each choice's terminal chunk (OBS-27).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from helios_backend.syntax.events import (ContentDelta, ReasoningDelta, ToolCallArgumentsDelta,
                                                   ToolCallStart)
from helios_backend.syntax.grammar import ToolChoiceMode
from helios_backend.frontend.tokenizer import FrontendTokenizer
from helios_proto import exchange_pb2 as ep

from gateway.errors import GatewayError
from gateway.generation import ChoiceEvent, ChoiceFinished, ChoiceSteps, PerformanceStamps
from gateway.output_pipeline import Delta, TokenStep
from gateway.preparation import PreparedRequest

DONE = b"data: [DONE]\n\n"

# stands for a text delta while a chunk template is encoded (never a real text: NUL bytes)
_TEXT_SLOT = "\x00helios-text\x00"
_TEXT_SLOT_JSON = json.dumps(_TEXT_SLOT).encode()
_IDS_KEY = "\x00token_ids"     # the template key of the per-token ids chunk (no delta field has it)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class _ChoiceState:
    """Accumulated per choice; the streaming path keeps only what the terminal needs."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    text_offset: int = 0  # completions: characters of text before the next token's
    opened: bool = False  # chat streams that may call tools: the role went out with a delta
    finish_reason: str | None = None
    usage: ep.Usage | None = None
    performance: PerformanceStamps | None = None


class Presenter:
    """Shared logic; ChatPresenter and CompletionPresenter fix the OpenAI shapes."""

    object_json = ""
    object_chunk = ""

    def __init__(self, prepared: PreparedRequest, served_id: str, tokenizer: FrontendTokenizer) -> None:
        self.prepared = prepared
        self.observation = prepared.observation
        self.tokenizer = tokenizer
        self.base = {"id": prepared.request_id, "object": self.object_chunk, "created": int(time.time()),
                     "model": served_id}
        self.states = [_ChoiceState() for _ in range(prepared.choice_count)]
        self._finished = 0
        self._first_chunk = True
        # (choice index, delta key or _IDS_KEY) -> the SSE bytes before and after the one value of
        # a stream's common chunk (one text delta, or one token id): encoded once per stream
        self._templates: dict[tuple[int, str], tuple[bytes, bytes]] = {}

    # ---- shape hooks ---------------------------------------------------------------------
    def delta_payload(self, delta: Delta, state: _ChoiceState) -> dict[str, Any] | None:
        raise NotImplementedError

    def opening_payload(self) -> dict[str, Any] | None:
        """The delta each choice's stream opens with (chat: the role), or None."""
        return None

    def chunk_choice(self, index: int, payload: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs_json(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        raise NotImplementedError

    def choice_json(self, index: int, state: _ChoiceState) -> dict[str, Any]:
        raise NotImplementedError

    # ---- shared ----------------------------------------------------------------------------
    def _prompt_ids_field(self) -> list[int] | list[list[int]]:
        prompts = [list(p) for p in self.prepared.prompts]
        return prompts[0] if len(prompts) == 1 else prompts

    def _logprob_entry(self, step: TokenStep, state: _ChoiceState) -> dict[str, Any]:
        tokenizer = self.tokenizer
        return {"token": tokenizer.token_text(step.token_id), "logprob": step.logprob,
                "bytes": list(tokenizer.token_bytes(step.token_id)),
                "top_logprobs": [{"token": tokenizer.token_text(t.token_id), "logprob": t.logprob,
                                  "bytes": list(tokenizer.token_bytes(t.token_id))} for t in step.top]}

    def _observe(self, state: _ChoiceState, step: TokenStep) -> None:
        state.token_ids.append(step.token_id)
        if step.timestamp_ns is not None:
            state.timestamps.append(step.timestamp_ns)

    def usage_json(self, states: list[_ChoiceState]) -> dict[str, Any]:
        n = self.prepared.n
        prompt = sum(s.usage.prompt_tokens for i, s in enumerate(states) if i % n == 0 and s.usage)
        completion = sum(s.usage.completion_tokens for s in states if s.usage)
        reused = self._reused(states)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": reused}}

    @staticmethod
    def _reused(states: list[_ChoiceState]) -> int:
        return states[0].usage.reused_prompt_tokens if states and states[0].usage else 0

    def _performance_json(self) -> dict[str, int]:
        perf = self.states[0].performance or PerformanceStamps(0, 0, 0)
        return {"ingress_ns": perf.ingress_ns, "enqueue_ns": perf.enqueue_ns,
                "reused_prompt_tokens": perf.reused_prompt_tokens}

    # ---- non-streaming ---------------------------------------------------------------------
    def fold(self, event: ChoiceEvent) -> None:
        """Accumulate one event for the JSON body (failures are raised by the caller)."""
        state = self.states[event.index]
        if isinstance(event, ChoiceSteps):
            for step in event.steps:
                self._observe(state, step)
                if self.observation.logprobs:
                    state.logprobs.append(self._logprob_entry(step, state))
                for delta in step.deltas:
                    self.delta_payload(delta, state)
        elif isinstance(event, ChoiceFinished):
            for delta in event.deltas:
                self.delta_payload(delta, state)
            state.finish_reason = self._finish_reason(event, state)
            state.usage = event.usage
            state.performance = event.performance

    def _finish_reason(self, event: ChoiceFinished, state: _ChoiceState) -> str:
        return event.finish_reason

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.base, "object": self.object_json,
                               "choices": [self.choice_json(i, s) for i, s in enumerate(self.states)],
                               "usage": self.usage_json(self.states)}
        if self.observation.token_ids:
            out["prompt_token_ids"] = self._prompt_ids_field()
            out["reused_prompt_tokens"] = self._reused(self.states)
        if self.observation.timestamps:
            out["performance"] = self._performance_json()
        return out

    def _observation_fields(self, state: _ChoiceState) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.observation.token_ids:
            fields["token_ids"] = state.token_ids
        if self.observation.timestamps:
            fields["token_timestamps_ns"] = state.timestamps
        return fields

    # ---- streaming -------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **top: Any) -> bytes:
        payload: dict[str, Any] = {**self.base, "choices": choices}
        if self._first_chunk:
            self._first_chunk = False
            if self.observation.token_ids:
                payload["prompt_token_ids"] = self._prompt_ids_field()
        if self.observation.include_usage:
            payload["usage"] = None
        payload.update(top)
        return sse(payload)

    def opening(self) -> Iterator[bytes]:
        """Chunks sent as soon as the stream opens (before any backend event)."""
        opening = self.opening_payload()
        if opening is not None:
            for index in range(len(self.states)):
                yield self._chunk([self.chunk_choice(index, dict(opening))])
        elif self.observation.token_ids:
            yield self._chunk([self.chunk_choice(0, {})])

    def stream(self, event: ChoiceEvent) -> Iterator[bytes]:
        index = event.index
        state = self.states[index]
        if isinstance(event, ChoiceSteps):
            if self.observation.logprobs or self.observation.token_ids:
                for step in event.steps:
                    yield from self._stream_step(index, state, step)
            else:               # nothing per token to show: the steps' deltas are one run of text
                yield from self._stream_deltas(index, state, [d for step in event.steps for d in step.deltas], None)
        elif isinstance(event, ChoiceFinished):
            yield from self._stream_deltas(index, state, event.deltas, None)
            state.usage = event.usage
            state.performance = event.performance
            self._finished += 1
            yield self._terminal_chunk(index, state, self._finish_reason(event, state))
            if self._finished == len(self.states):
                if self.observation.include_usage:
                    yield self._usage_chunk()
                yield DONE

    def _stream_step(self, index: int, state: _ChoiceState, step: TokenStep) -> Iterator[bytes]:
        logprobs = self.logprobs_json([self._logprob_entry(step, state)]) if self.observation.logprobs else None
        if self.observation.token_ids:
            if logprobs is None and not self.observation.timestamps and not self._first_chunk:
                yield self._templated(index, _IDS_KEY, b"[%d]" % step.token_id)
            else:
                meta = self.chunk_choice(index, {})
                meta["token_ids"] = [step.token_id]
                if self.observation.timestamps:
                    meta["token_timestamps_ns"] = [step.timestamp_ns]
                if logprobs is not None:
                    meta["logprobs"] = logprobs
                    logprobs = None
                yield self._chunk([meta])
        yield from self._stream_deltas(index, state, step.deltas, logprobs)

    def _stream_deltas(self, index: int, state: _ChoiceState, deltas: Sequence[Delta],
                       logprobs: dict[str, Any] | None) -> Iterator[bytes]:
        """The chunks of a run of deltas. Consecutive text of one field leaves as one chunk: a
        stream whose tokens were held to leave together (the stream interval) gets one chunk
        per field change, not one per token, as vLLM's and SGLang's stream intervals send it;
        each token's own chunk stays where something per token is shown (logprobs, ids)."""
        run_key, run = "", list[str]()                   # text of one field not yet sent
        for delta in deltas:
            payload = self.delta_payload(delta, state)
            if payload is None:
                continue
            if logprobs is None and len(payload) == 1 and not self._first_chunk:
                (key, text), = payload.items()
                if isinstance(text, str):                 # not a tool-call list
                    if run and key != run_key:
                        yield self._text_chunk(index, run_key, "".join(run))
                        run = []
                    run_key = key
                    run.append(text)
                    continue
            if run:
                yield self._text_chunk(index, run_key, "".join(run))
                run = []
            choice = self.chunk_choice(index, payload)
            if logprobs is not None:
                choice["logprobs"] = logprobs
                logprobs = None
            yield self._chunk([choice])
        if run:
            yield self._text_chunk(index, run_key, "".join(run))
        if logprobs is not None:  # a token whose text is still held: its logprob goes out now
            choice = self.chunk_choice(index, {})
            choice["logprobs"] = logprobs
            yield self._chunk([choice])

    def _text_chunk(self, index: int, key: str, text: str) -> bytes:
        """What _chunk([chunk_choice(index, {key: text})]) gives after the first chunk."""
        return self._templated(index, key, json.dumps(text, ensure_ascii=False).encode())

    def _templated(self, index: int, key: str, value_json: bytes) -> bytes:
        """A stream's common chunk from its template, the JSON of its one changing value put
        in the slot: json.dumps of the whole chunk per token was the gateway's largest
        encoding cost, and only that value changes between a stream's chunks. `key` names the
        delta field of a text chunk, or _IDS_KEY for an observed stream's per-token ids chunk
        (its `delta` {} and `token_ids` [id], OBS-5)."""
        template = self._templates.get((index, key))
        if template is None:
            if key == _IDS_KEY:
                choice = self.chunk_choice(index, {})
                choice["token_ids"] = _TEXT_SLOT
            else:
                choice = self.chunk_choice(index, {key: _TEXT_SLOT})
            payload: dict[str, Any] = {**self.base, "choices": [choice]}
            if self.observation.include_usage:
                payload["usage"] = None
            before, after = sse(payload).split(_TEXT_SLOT_JSON)
            template = self._templates[(index, key)] = (before, after)
        return template[0] + value_json + template[1]

    def _terminal_chunk(self, index: int, state: _ChoiceState, finish_reason: str) -> bytes:
        top: dict[str, Any] = {}
        observed = self.observation.token_ids
        if observed and not self.observation.include_usage:
            top["usage"] = self.usage_json([state])
        if observed:
            top["reused_prompt_tokens"] = self._reused([state])
        last = self._finished == len(self.states)
        if last and self.observation.timestamps and not self.observation.include_usage:
            top["performance"] = self._performance_json()
        return self._chunk([self.chunk_choice(index, {}, finish_reason)], **top)

    def _usage_chunk(self) -> bytes:
        payload: dict[str, Any] = {**self.base, "choices": [], "usage": self.usage_json(self.states)}
        if self.observation.token_ids:
            payload["reused_prompt_tokens"] = self._reused(self.states)
        if self.observation.timestamps:
            payload["performance"] = self._performance_json()
        return sse(payload)

    @staticmethod
    def error_event(error: GatewayError) -> bytes:
        """The one terminal SSE error event after headers were sent; no [DONE] follows."""
        return sse(error.body())


class ChatPresenter(Presenter):
    """OpenAI's chat shapes. A message with tool calls and no text has `content: null`. A
    stream opens with the role and `content: ""`, except where the model may call tools: there
    the role goes with the first delta, as OpenAI sends it (`content: null` beside the first
    tool call, or before reasoning; `""` before text)."""

    object_json = "chat.completion"
    object_chunk = "chat.completion.chunk"
    _ROLE = {"role": "assistant", "content": ""}

    def __init__(self, prepared: PreparedRequest, served_id: str, tokenizer: FrontendTokenizer) -> None:
        super().__init__(prepared, served_id, tokenizer)
        syntax = prepared.syntax
        self._role_with_first_delta = (syntax is not None and syntax.model.syntax.has_tools
                                       and bool(syntax.constraints.engine_tools()))
        # a forced function ends with "stop" (OpenAI); `required` and auto calls with "tool_calls"
        self._named_tool = syntax is not None and syntax.constraints.tool_choice is ToolChoiceMode.NAMED

    def opening_payload(self) -> dict[str, Any] | None:
        return None if self._role_with_first_delta else dict(self._ROLE)

    def delta_payload(self, delta: Delta, state: _ChoiceState) -> dict[str, Any] | None:
        payload = self._delta_fields(delta, state)
        if payload is None or state.opened or not self._role_with_first_delta:
            return payload
        state.opened = True
        content = "" if isinstance(delta, ContentDelta) else None
        return {"role": "assistant", "content": content, **payload}

    def _delta_fields(self, delta: Delta, state: _ChoiceState) -> dict[str, Any] | None:
        if isinstance(delta, ContentDelta):
            state.content.append(delta.text)
            return {"content": delta.text} if delta.text else None
        if isinstance(delta, ReasoningDelta):
            state.reasoning.append(delta.text)
            return {"reasoning_content": delta.text, "reasoning": delta.text} if delta.text else None
        if isinstance(delta, ToolCallStart):
            state.tool_calls.append({"id": delta.call_id, "type": "function",
                                     "function": {"name": delta.name, "arguments": ""}})
            return {"tool_calls": [{"index": delta.index, "id": delta.call_id, "type": "function",
                                    "function": {"name": delta.name, "arguments": ""}}]}
        if isinstance(delta, ToolCallArgumentsDelta):
            state.tool_calls[delta.index]["function"]["arguments"] += delta.fragment
            return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.fragment}}]}
        return None  # ToolCallEnd and parse notes change no visible field

    def _terminal_chunk(self, index: int, state: _ChoiceState, finish_reason: str) -> bytes:
        if self._role_with_first_delta and not state.opened:   # nothing visible came: the role now
            state.opened = True
            return self._chunk([self.chunk_choice(index, dict(self._ROLE))]) + \
                super()._terminal_chunk(index, state, finish_reason)
        return super()._terminal_chunk(index, state, finish_reason)

    def chunk_choice(self, index: int, payload: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": payload, "logprobs": None, "finish_reason": finish_reason}

    def logprobs_json(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"content": entries}

    def _finish_reason(self, event: ChoiceFinished, state: _ChoiceState) -> str:
        # a natural end after tool calls is "tool_calls" ("stop" for a named tool_choice, as
        # OpenAI); a user stop stays "stop" (STOP-22), a cut call "length"
        if state.tool_calls and event.ended_by_eos:
            return "stop" if self._named_tool else "tool_calls"
        return event.finish_reason

    def choice_json(self, index: int, state: _ChoiceState) -> dict[str, Any]:
        content = "".join(state.content)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": None if state.tool_calls and not content else content}
        if state.reasoning:
            message["reasoning_content"] = message["reasoning"] = "".join(state.reasoning)
        if state.tool_calls:
            message["tool_calls"] = state.tool_calls
        choice = {"index": index, "message": message,
                  "logprobs": self.logprobs_json(state.logprobs) if self.observation.logprobs else None,
                  "finish_reason": state.finish_reason}
        choice.update(self._observation_fields(state))
        return choice


class CompletionPresenter(Presenter):
    object_json = "text_completion"
    object_chunk = "text_completion"

    def delta_payload(self, delta: Delta, state: _ChoiceState) -> dict[str, Any] | None:
        text = delta.text if isinstance(delta, (ContentDelta, ReasoningDelta)) else ""
        if not text:
            return None
        state.content.append(text)
        return {"text": text}

    def __init__(self, prepared: PreparedRequest, served_id: str, tokenizer: FrontendTokenizer) -> None:
        super().__init__(prepared, served_id, tokenizer)
        for index, state in enumerate(self.states):
            state.text_offset = len(self._echo(index))

    def _echo(self, index: int) -> str:
        """The echoed prompt text of a choice ("" without echo); choices are prompt-major."""
        texts = self.prepared.echo_texts
        return texts[index // self.prepared.n] if texts else ""

    def opening(self) -> Iterator[bytes]:
        yield from super().opening()
        for index in range(len(self.states)):   # echo: the prompt is each choice's first text
            if self._echo(index):
                yield self._chunk([self.chunk_choice(index, {"text": self._echo(index)})])

    def _logprob_entry(self, step: TokenStep, state: _ChoiceState) -> dict[str, Any]:
        # OpenAI's text_offset: where the token's text starts in the choice's text (echo included)
        entry = super()._logprob_entry(step, state)
        entry["text_offset"] = state.text_offset
        state.text_offset += len(entry["token"])
        return entry

    def chunk_choice(self, index: int, payload: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": index, "text": payload.get("text", ""), "logprobs": None, "finish_reason": finish_reason}

    def logprobs_json(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": [e["text_offset"] for e in entries]}

    def choice_json(self, index: int, state: _ChoiceState) -> dict[str, Any]:
        choice = {"index": index, "text": self._echo(index) + "".join(state.content),
                  "logprobs": self.logprobs_json(state.logprobs) if self.observation.logprobs else None,
                  "finish_reason": state.finish_reason}
        choice.update(self._observation_fields(state))
        return choice
