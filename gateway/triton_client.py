"""The gateway's Triton client: one gRPC stream per backend request, typed events out.

Why one stream per request: Triton's gRPC protocol has no per-request cancel inside a
stream, so cancelling the stream is how a disconnected client cancels exactly its own
request (HTTP-6). The request side of the stream stays open until the caller is done, so
Triton never sees a half-close while responses are still due.

A generation yields, in order: zero or more ``TokenBatch`` (coalesced ids, aligned
timestamps and logprobs) and then exactly one ``StreamTerminal`` (the backend's typed
TerminalEvent) or one ``StreamFailure`` (the stream broke or Triton refused in-band).
Tensor names and messages: docs/transport.md.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput

from helios_proto import transport_pb2 as tp

MODEL_NAME = "helios"          # the default Triton model name (model_repository/helios)


@dataclass(frozen=True, slots=True)
class TokenBatch:
    token_ids: np.ndarray  # [n] int32, ids sampled since the previous batch
    timestamps_ns: np.ndarray | None  # [n] int64 on the backend origin; only when timed
    logprobs: np.ndarray | None  # [n] float32
    top_token_ids: np.ndarray | None  # [n, k] int32
    top_logprobs: np.ndarray | None  # [n, k] float32


@dataclass(frozen=True, slots=True)
class StreamTerminal:
    event: tp.TerminalEvent


class StreamFailureKind(enum.Enum):
    UNREACHABLE = 1  # the request could not be sent (Triton down or refusing): nothing ran
    REFUSED = 2  # Triton refused the request in-band before the model answered (not loaded, ...)
    IN_BAND_ERROR = 3  # Triton reported an error after the model had answered
    LOST = 4  # the stream ended or broke before the terminal event
    MALFORMED = 5  # a response did not follow the transport contract (output error)


@dataclass(frozen=True, slots=True)
class StreamFailure:
    kind: StreamFailureKind
    detail: str


GenerationEvent = TokenBatch | StreamTerminal | StreamFailure


def _parameters_input(params: tp.RequestParameters) -> InferInput:
    tensor = InferInput("parameters", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([params.SerializeToString()], dtype=np.object_))
    return tensor


class Generation:
    """One backend request on its own gRPC stream. Iterate once; ``cancel`` at any time."""

    def __init__(self, client: grpcclient.InferenceServerClient, inputs: list[InferInput],
                 request_id: str, model_name: str = MODEL_NAME) -> None:
        self._client = client
        self._model_name = model_name
        self._inputs = inputs
        self._request_id = request_id
        self._closed = asyncio.Event()
        self._call: object | None = None
        self._cancelled = False
        self._sent = False

    async def _requests(self) -> AsyncIterator[dict]:
        yield {"model_name": self._model_name, "inputs": self._inputs, "request_id": self._request_id}
        # gRPC asks for the next message only once the first is written: the request is out,
        # so a broken stream from here on is a failure of submitted work, not unavailability
        self._sent = True
        await self._closed.wait()  # keep the request side open until we are done reading

    def cancel(self) -> None:
        """Cancel the stream, which cancels the backend request (idempotent)."""
        self._cancelled = True
        self._closed.set()
        if self._call is not None:
            self._call.cancel()  # type: ignore[attr-defined]

    def finish(self) -> None:
        """Half-close the stream after the terminal event: the server ends it on its own.

        A cancel here would reach Triton as a cancellation of a request that already
        finished; during server shutdown that keeps the model UNLOADING until the exit timeout."""
        self._closed.set()

    def results(self) -> AsyncIterator[tuple[grpcclient.InferResult | None, Exception | None]]:
        """The raw (result, in-band error) pairs of the stream; opens it on first use."""
        self._call = self._client.stream_infer(inputs_iterator=self._requests())
        return self._call  # type: ignore[return-value]

    async def events(self) -> AsyncIterator[GenerationEvent]:
        try:
            results = self.results()
        except Exception as exc:  # tritonclient wraps connection errors in its own type
            yield StreamFailure(StreamFailureKind.UNREACHABLE, str(exc))
            return
        received = finished = False
        try:
            async for result, error in results:
                if error is not None:
                    # the model itself always answers with a typed terminal event; an in-band
                    # error before any answer is Triton refusing the request, not an execution
                    kind = StreamFailureKind.IN_BAND_ERROR if received else StreamFailureKind.REFUSED
                    yield StreamFailure(kind, str(error))
                    return
                received = True
                batch, terminal = self._decode(result)
                if batch is not None:
                    yield batch
                if terminal is not None:
                    finished = True
                    yield terminal
                    return
            yield StreamFailure(StreamFailureKind.LOST, "the stream ended without a terminal event")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if self._cancelled:
                return
            unsent = not self._sent and not received
            kind = (StreamFailureKind.UNREACHABLE
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and unsent else StreamFailureKind.LOST)
            yield StreamFailure(kind, f"{exc.code().name}: {exc.details()}")
        except (ValueError, TypeError) as exc:  # protobuf DecodeError is a ValueError subclass
            yield StreamFailure(StreamFailureKind.MALFORMED, str(exc))
        finally:
            if finished:
                self.finish()
            else:
                self.cancel()

    @staticmethod
    def _decode(result: grpcclient.InferResult) -> tuple[TokenBatch | None, StreamTerminal | None]:
        token_ids = result.as_numpy("token_ids")
        batch = None
        if token_ids is not None and token_ids.size:
            batch = TokenBatch(
                token_ids=token_ids.reshape(-1),
                timestamps_ns=result.as_numpy("token_timestamps_ns"),  # None when not requested
                logprobs=result.as_numpy("logprobs"),
                top_token_ids=result.as_numpy("top_token_ids"),
                top_logprobs=result.as_numpy("top_logprobs"),
            )
        event_tensor = result.as_numpy("event")
        terminal = None
        if event_tensor is not None and event_tensor.size:
            event = tp.ResponseEvent.FromString(bytes(event_tensor.reshape(-1)[0]))
            if event.WhichOneof("kind") != "terminal":
                raise ValueError(f"expected a terminal event, got {event.WhichOneof('kind')}")
            terminal = StreamTerminal(event.terminal)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param and terminal is None:
            raise ValueError("FINAL response without a terminal event")
        return batch, terminal


class TritonBackend:
    """Shares one gRPC channel; every generation opens its own stream on it."""

    def __init__(self, url: str, model_name: str = MODEL_NAME) -> None:
        self.url = url
        self.model_name = model_name
        self._client = grpcclient.InferenceServerClient(url)

    async def close(self) -> None:
        await self._client.close()

    def generate(self, prompt_token_ids: Sequence[int], request: tp.GenerateRequest,
                 request_id: str) -> Generation:
        params = tp.RequestParameters(version=tp.TRANSPORT_VERSION_1, generate=request)
        prompt = InferInput("prompt_token_ids", [len(prompt_token_ids)], "INT32")
        prompt.set_data_from_numpy(np.asarray(prompt_token_ids, dtype=np.int32))
        return Generation(self._client, [_parameters_input(params), prompt], request_id, self.model_name)

    async def fetch_assets(self, timeout_s: float) -> tp.FrontendAssets:
        """Ask the served model for its frontend assets (a tiny inference on the model).

        Raises ConnectionError when Triton or the model cannot answer within ``timeout_s``.
        """
        params = tp.RequestParameters(version=tp.TRANSPORT_VERSION_1, assets=tp.AssetsRequest())
        generation = Generation(self._client, [_parameters_input(params)], "assets", self.model_name)
        try:
            async with asyncio.timeout(timeout_s):
                async for result, error in generation.results():
                    if error is not None:
                        raise ConnectionError(f"assets request refused: {error}")
                    tensor = result.as_numpy("event")
                    if tensor is None or not tensor.size:
                        continue
                    event = tp.ResponseEvent.FromString(bytes(tensor.reshape(-1)[0]))
                    if event.WhichOneof("kind") != "assets":
                        raise ConnectionError(f"assets request answered with {event.WhichOneof('kind')}")
                    return event.assets
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            raise ConnectionError(f"Triton at {self.url} did not answer the assets request: {exc!r}") from exc
        finally:
            generation.cancel()
        raise ConnectionError("the assets stream ended without an answer")

    async def model_ready(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                return bool(await self._client.is_server_ready()) and bool(
                    await self._client.is_model_ready(self.model_name))
        except Exception:  # any failure to answer means not ready; the probe never raises
            return False
