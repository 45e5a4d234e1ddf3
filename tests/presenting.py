"""The gateway's answer for hand-fed generated ids, without Triton: its output pipeline, the
request's own syntax parser and the chat presenter, as the backend's tokens would drive them."""
from __future__ import annotations

from typing import Any

import numpy as np

from gateway.generation import ChoiceTranslator
from gateway.output_pipeline import OutputPipeline
from gateway.preparation import PreparedRequest
from gateway.presentation import ChatPresenter
from gateway.served_model import ServedModel
from gateway.triton_client import TokenBatch
from helios_proto import exchange_pb2 as ep


def present_chat(served: ServedModel, prepared: PreparedRequest, ids: list[int], terminal: ep.TerminalEvent,
                 stream: bool) -> Any:
    """The JSON choice, or (streamed) the SSE bytes, for these ids then `terminal`."""
    assert prepared.syntax is not None
    pipeline = OutputPipeline(served.tokenizer, prepared.stop_matcher(), prepared.syntax.parser("call_t_"),
                              served.eos_token_ids)
    translator = ChoiceTranslator(0, pipeline, "messages", 0, 0)
    events = [translator.tokens(TokenBatch(np.asarray([t], dtype=np.int32), np.asarray([100 + i], dtype=np.int64),
                                           None, None, None)) for i, t in enumerate(ids)]
    events.append(translator.terminal(terminal))
    presenter = ChatPresenter(prepared, "test-model", served.tokenizer)
    if not stream:
        for event in events:
            presenter.fold(event)
        return presenter.body()["choices"][0]
    return b"".join(presenter.opening()) + b"".join(b"".join(presenter.stream(e)) for e in events)
