"""A small tritonclient (gRPC aio) driver of the `helios` model for end-to-end tests.

One gRPC stream per request (cancelling a stream cancels exactly that request).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput, InferRequestedOutput

from helios_proto import exchange_pb2 as ep

from helios_backend.exchange import (
    MODEL_NAME, OUT_EVENT, OUT_TIMESTAMPS, OUT_TOKENS, OUT_TOP_IDS, OUT_TOP_LOGPROBS, assets_arrays, decode_event,
    generate_arrays)

TRITON_TYPES = {np.dtype(np.int32): "INT32", np.dtype(np.uint8): "UINT8"}


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)          # per token, when top logprobs were asked
    top_logprobs: list[list[float]] = field(default_factory=list)
    responses: int = 0
    event: ep.ResponseEvent | None = None
    error: str | None = None

    @property
    def terminal(self) -> ep.TerminalEvent:
        assert self.event is not None and self.event.HasField("terminal"), self.error
        return self.event.terminal

    @property
    def outcome(self) -> str | None:
        return self.terminal.WhichOneof("outcome")


def _inputs(arrays: dict[str, np.ndarray]) -> list[InferInput]:
    out = []
    for name, value in arrays.items():
        tensor = InferInput(name, list(value.shape), TRITON_TYPES[value.dtype])
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def greedy(max_tokens: int, **kw: object) -> ep.GenerateRequest:
    request = ep.GenerateRequest(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    request.sampling.temperature = 0.0
    return request


async def stream(client: grpcclient.InferenceServerClient, arrays: dict[str, np.ndarray], *,
                 cancel_after: int | None = None, pause_s: float = 0.0,
                 pause_after_first: "Callable[[], Awaitable[None]] | None" = None,
                 request_id: str = "r", top: bool = False) -> StreamResult:
    """Run one request on its own stream; optionally cancel after `cancel_after` tokens,
    pause before reading each response, or await `pause_after_first()` once after the
    first response (a reader that stops reading for a while). `top`: collect the top-k
    alternatives the request asked for (LogprobOptions.top_logprobs)."""
    result = StreamResult()

    async def requests():
        yield {"model_name": MODEL_NAME, "inputs": _inputs(arrays), "request_id": request_id,
               "outputs": [InferRequestedOutput(n) for n in outputs]}

    outputs = (OUT_TOKENS, OUT_TIMESTAMPS, OUT_EVENT) + ((OUT_TOP_IDS, OUT_TOP_LOGPROBS) if top else ())
    responses = client.stream_infer(inputs_iterator=requests(), stream_timeout=None)
    async for item, error in responses:
        if error is not None:
            result.error = str(error)
            break
        result.responses += 1
        tokens = item.as_numpy(OUT_TOKENS)
        if tokens is not None:
            result.tokens += tokens.tolist()
        stamps = item.as_numpy(OUT_TIMESTAMPS)
        if stamps is not None:
            result.timestamps += stamps.tolist()
        top_ids = item.as_numpy(OUT_TOP_IDS) if top else None
        if top_ids is not None:
            result.top_ids += top_ids.tolist()
            result.top_logprobs += item.as_numpy(OUT_TOP_LOGPROBS).tolist()
        event = item.as_numpy(OUT_EVENT)
        if event is not None:
            # keep reading until the server closes the stream: cancelling a stream whose
            # final response was just written races Triton 2.51's shutdown (the model then
            # stays UNLOADING until the exit timeout)
            result.event = decode_event(event)
            continue
        if cancel_after is not None and len(result.tokens) >= cancel_after:
            responses.cancel()
            break
        if pause_s:
            await asyncio.sleep(pause_s)
        if pause_after_first is not None and result.responses == 1:
            await pause_after_first()
    return result


async def generate(url: str, prompt: list[int], request: ep.GenerateRequest, **kw: object) -> StreamResult:
    async with grpcclient.InferenceServerClient(url) as client:
        return await stream(client, generate_arrays(prompt, request), **kw)  # type: ignore[arg-type]


async def generate_many(url: str, jobs: list[tuple[list[int], ep.GenerateRequest]], **kw: object) -> list[StreamResult]:
    async with grpcclient.InferenceServerClient(url) as client:
        return list(await asyncio.gather(*(stream(client, generate_arrays(p, r), request_id=f"r{i}", **kw)  # type: ignore[arg-type]
                                           for i, (p, r) in enumerate(jobs))))


async def assets(url: str) -> ep.FrontendAssets:
    async with grpcclient.InferenceServerClient(url) as client:
        result = await stream(client, assets_arrays())
    assert result.event is not None and result.event.HasField("assets"), result.error
    return result.event.assets


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)
