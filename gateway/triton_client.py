"""The gateway's Triton client: generations multiplexed on one channel, typed events out.

Generations travel on a channel (docs/exchange.md): one long-lived gRPC stream per gateway
process carries the channel request, every generate request (each tagged; those queued next
to each other leave as one GenerateBatch) and the cancels. The backend answers each batch at
once with a flag-only FINAL, which Triton forwards as an empty response because the batch asks
for it: the acknowledgement that lets the next batch leave (one in flight per channel: Outbox).
The output of all of them comes as channel batches, one message per backend pass instead of
one per request per token. The stream is read by one task that
routes each request's output, in order, to its generation; a client that goes away cancels
exactly its own request with a CancelRequest naming its tag (HTTP-6). The assets request,
asked once at startup, keeps a stream of its own.

A generation yields, in order: zero or more ``TokenBatch`` (coalesced ids, aligned
timestamps and logprobs) and then exactly one ``StreamTerminal`` (the backend's typed
TerminalEvent) or one ``StreamFailure`` (the stream broke or Triton refused in-band).
If the channel's stream breaks, every generation on it fails at once with LOST (UNREACHABLE
when the channel never opened, REFUSED when Triton refused to open it), and the next
generation opens a new channel. A stream that does not break although the model behind it
died (Triton keeps a dead stub's streams open) is ended from outside: `abandon`, called by
the gateway's backend watch (service.py) when the model refuses a probe.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput, service_pb2, service_pb2_grpc

from helios_backend.exchange import (IN_PARAMETERS, IN_PROMPT, MODEL_NAME, OUT_CHANNEL_BATCH, OUT_EVENT,
                                      array_message, parameters_array)
from helios_proto import exchange_pb2 as ep

log = logging.getLogger("helios.gateway.triton")
_UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
# gRPC's reconnect backoff grows to two minutes by default: a gateway started before tritonserver
# (helios-serve starts both at once, an operator may too) would learn the model that long after
# it loaded. Reconnecting every second at most keeps readiness within about a second of Triton's.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
              ("grpc.max_reconnect_backoff_ms", 1000)]
_CHANNEL_OPTIONS = _UNLIMITED + _RECONNECT


@dataclass(frozen=True, slots=True)
class TokenBatch:
    token_ids: np.ndarray  # [n] int32, ids sampled since the previous batch
    timestamps_ns: np.ndarray | None  # [n] int64 on the backend origin; only when timed
    logprobs: np.ndarray | None  # [n] float32
    top_token_ids: np.ndarray | None  # [n, k] int32
    top_logprobs: np.ndarray | None  # [n, k] float32


@dataclass(frozen=True, slots=True)
class StreamTerminal:
    event: ep.TerminalEvent


class StreamFailureKind(enum.Enum):
    UNREACHABLE = 1  # the request could not be sent (Triton down or refusing): nothing ran
    REFUSED = 2  # Triton refused the request in-band before the model answered (not loaded, ...)
    IN_BAND_ERROR = 3  # Triton reported an error after the model had answered
    LOST = 4  # the stream ended or broke before the terminal event
    MALFORMED = 5  # a response did not follow the exchange contract (output error)


@dataclass(frozen=True, slots=True)
class StreamFailure:
    kind: StreamFailureKind
    detail: str


GenerationEvent = TokenBatch | StreamTerminal | StreamFailure


class BackendRefused(ConnectionError):
    """Triton answered and refused (the model is not ready, its stub is not healthy), or could
    not be reached at all: unlike a slow answer, this says the model cannot serve now."""


def _parameters_input(params: ep.RequestParameters) -> InferInput:
    payload = parameters_array(params)
    tensor = InferInput(IN_PARAMETERS, [payload.size], "UINT8")
    tensor.set_data_from_numpy(payload)
    return tensor


def _infer_request(model_name: str, request_id: str, params: ep.RequestParameters,
                   prompt: Sequence[int] | np.ndarray | None = None, output: str | None = None) -> service_pb2.ModelInferRequest:
    """A raw ModelInferRequest (the channel path skips tritonclient's per-message wrappers)."""
    request = service_pb2.ModelInferRequest(model_name=model_name, id=request_id)
    payload = params.SerializeToString()
    tensor = request.inputs.add(name=IN_PARAMETERS, datatype="UINT8")
    tensor.shape.append(len(payload))
    request.raw_input_contents.append(payload)
    if prompt is not None:
        ids = np.asarray(prompt, dtype="<i4")
        tensor = request.inputs.add(name=IN_PROMPT, datatype="INT32")
        tensor.shape.append(ids.size)
        request.raw_input_contents.append(ids.tobytes())
    if output is not None:
        request.outputs.add(name=output)
    return request


def _token_batch(out: ep.ChannelOutput) -> TokenBatch | None:
    if not out.token_ids:
        return None
    ids = np.array(out.token_ids, dtype=np.int32)
    k = out.top_k
    return TokenBatch(
        token_ids=ids,
        timestamps_ns=np.array(out.timestamps_ns, dtype=np.int64) if out.timestamps_ns else None,
        logprobs=np.array(out.logprobs, dtype=np.float32) if out.logprobs else None,
        top_token_ids=np.array(out.top_token_ids, dtype=np.int32).reshape(-1, k) if k else None,
        top_logprobs=np.array(out.top_logprobs, dtype=np.float32).reshape(-1, k) if k else None)


class ChannelGeneration:
    """One generate request on a channel. Iterate ``events`` once; ``cancel`` at any time."""

    def __init__(self, mux: "ChannelMux", prompt: Sequence[int], request: ep.GenerateRequest,
                 request_id: str) -> None:
        self._mux = mux
        self._prompt = prompt
        self._request = request
        self._request_id = request_id
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.tag = 0
        self._ended = False

    def push(self, event: GenerationEvent) -> None:
        """From the channel reader, in arrival order."""
        if not self._ended:
            self._ended = not isinstance(event, TokenBatch)
            self._queue.put_nowait(event)

    def deliver(self, out: ep.ChannelOutput) -> None:
        batch = _token_batch(out)
        if batch is not None:
            self.push(batch)
        if out.HasField("event"):
            if out.event.WhichOneof("kind") != "terminal":
                self.push(StreamFailure(StreamFailureKind.MALFORMED,
                                        f"expected a terminal event, got {out.event.WhichOneof('kind')}"))
            else:
                self.push(StreamTerminal(out.event.terminal))

    async def events(self) -> AsyncIterator[GenerationEvent]:
        try:
            await self._mux.submit(self)
        except ConnectionError as exc:
            self._ended = True
            yield StreamFailure(StreamFailureKind.UNREACHABLE, str(exc))
            return
        while True:
            event = await self._queue.get()
            yield event
            if not isinstance(event, TokenBatch):
                return

    def add_to(self, batch: ep.GenerateBatch) -> Sequence[int]:
        """This generation as the next request of `batch`; returns its prompt, which the caller
        appends to the batch's prompt tensor."""
        self._request.tag = self.tag
        batch.requests.append(self._request)
        batch.prompt_lengths.append(len(self._prompt))
        return self._prompt

    def cancel(self) -> None:
        """Cancel the backend request unless it already ended (idempotent)."""
        if not self._ended:
            self._ended = True
            self._mux.cancel(self)


# the most generations one GenerateBatch carries (a wave larger than this takes several)
BATCH_LIMIT = 256
# the longest a channel holds its next GenerateBatch for the acknowledgement of the one before
# (Triton's empty FINAL of that request); a Triton that never forwards one is detected by the
# first wait that times out, and the channel then sends without waiting
ACK_WAIT_S = 0.05
# asks Triton's gRPC frontend to forward a request's flag-only FINAL: the acknowledgement
ACK_PARAMETER = "triton_enable_empty_final_response"
# None ends the stream
OutboxItem: TypeAlias = "ChannelGeneration | service_pb2.ModelInferRequest | None"


class Outbox:
    """What the channel's stream still has to send, in submission order. Generations that wait
    next to each other leave as one GenerateBatch request (BATCH_LIMIT at most): a wave of
    arrivals costs the backend one Triton request instead of one each.

    One GenerateBatch is in flight at a time: the next leaves when Triton acknowledges the one
    before (its flag-only FINAL, sent once the backend's execute() has taken the batch), or after
    ACK_WAIT_S. Triton runs execute() one request at a time and each took 1.0-1.7 ms under load
    (of it ~0.2 ms of our Python per generation), so when arrivals outpace it they wait here and leave together
    instead of queueing in Triton one request each (at 256 clients on an H100 host a new request
    waited ~50 ms there). An idle channel sends at once: its last batch is acknowledged."""

    def __init__(self, model_name: str, channel_id: str) -> None:
        self._model_name, self._channel_id = model_name, channel_id
        self._items: deque[OutboxItem] = deque()
        self._ready = asyncio.Event()
        self._acked = asyncio.Event()
        self._acked.set()
        self._awaiting: str | None = None      # the request id of the batch in flight
        self.acknowledged = 0                  # batches Triton acknowledged
        self.waits_timed_out = 0
        self._acks_on = True                   # off once a wait times out before any acknowledgement

    def put(self, item: OutboxItem) -> None:
        self._items.append(item)
        self._ready.set()

    def acknowledge(self, request_id: str) -> None:
        """Triton's empty FINAL of the GenerateBatch `request_id`: the next one may leave."""
        if request_id == self._awaiting:
            self._awaiting = None
            self.acknowledged += 1
            self._acked.set()

    async def _acknowledged(self) -> None:
        if self._acked.is_set() or not self._acks_on:
            return
        try:
            await asyncio.wait_for(self._acked.wait(), ACK_WAIT_S)
        except asyncio.TimeoutError:
            self.waits_timed_out += 1
            if not self.acknowledged:
                self._acks_on = False
                log.warning("channel %s: Triton forwards no empty FINAL; generations leave without waiting",
                            self._channel_id)
            self._awaiting = None
            self._acked.set()

    async def messages(self) -> AsyncIterator[service_pb2.ModelInferRequest]:
        items = self._items
        while True:
            while not items:
                self._ready.clear()
                await self._ready.wait()
            if isinstance(items[0], ChannelGeneration):
                await self._acknowledged()           # arrivals meanwhile join this batch
            item = items.popleft()
            if item is None:
                return
            if not isinstance(item, ChannelGeneration):
                yield item
                continue
            generations = [item]
            while items and isinstance(items[0], ChannelGeneration) and len(generations) < BATCH_LIMIT:
                generations.append(items.popleft())      # type: ignore[arg-type]  # checked just above
            request = self._batch(generations)
            if self._acks_on:
                self._awaiting = request.id
                self._acked.clear()
            yield request

    def _batch(self, generations: list[ChannelGeneration]) -> service_pb2.ModelInferRequest:
        batch = ep.GenerateBatch(channel=self._channel_id)
        prompts = [generation.add_to(batch) for generation in generations]
        params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1, generate_batch=batch)
        # the id names the batch's tags, which are consecutive: an in-band error fails them all
        request_id = batch_request_id(generations[0].tag, generations[-1].tag)
        ids = np.fromiter(itertools.chain.from_iterable(prompts), dtype="<i4",
                          count=sum(batch.prompt_lengths))
        request = _infer_request(self._model_name, request_id, params, ids)
        request.parameters[ACK_PARAMETER].bool_param = True
        return request


def batch_request_id(first_tag: int, last_tag: int) -> str:
    return f"batch-{first_tag}-{last_tag}"


def batch_tags(request_id: str) -> range | None:
    """The tags of the batch request `request_id` names (batch_request_id), or None."""
    kind, _, span = request_id.partition("-")
    first, _, last = span.partition("-")
    if kind != "batch" or not first.isdigit() or not last.isdigit():
        return None
    return range(int(first), int(last) + 1)


class ChannelMux:
    """One channel: a gRPC stream to Triton, its open generations by tag, one reader task."""

    def __init__(self, url: str, model_name: str) -> None:
        self._url = url
        self._model_name = model_name
        self._grpc: grpc.aio.Channel | None = None
        self._outbox: Outbox | None = None
        self._reader: asyncio.Task[None] | None = None
        self._call: Any = None               # the channel's ModelStreamInfer call
        self._routes: dict[int, ChannelGeneration] = {}
        self._tags = itertools.count(1)
        self._channel_id = ""
        self._opened = False                 # a response of the channel's stream arrived
        self._lock = asyncio.Lock()

    async def submit(self, generation: ChannelGeneration) -> None:
        async with self._lock:
            if self._reader is None or self._reader.done():
                await self._open()
        assert self._outbox is not None
        generation.tag = next(self._tags)
        self._routes[generation.tag] = generation
        self._outbox.put(generation)

    def cancel(self, generation: ChannelGeneration) -> None:
        if self._routes.pop(generation.tag, None) is None or self._outbox is None:
            return
        params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1,
                                      cancel=ep.CancelRequest(channel=self._channel_id, tags=[generation.tag]))
        self._outbox.put(_infer_request(self._model_name, f"cancel-{generation.tag}", params))

    async def _open(self) -> None:
        if self._grpc is None:
            self._grpc = grpc.aio.insecure_channel(self._url, options=_CHANNEL_OPTIONS)
        self._channel_id = uuid.uuid4().hex
        self._opened = False
        outbox = Outbox(self._model_name, self._channel_id)
        params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1, channel=ep.ChannelRequest(id=self._channel_id))
        outbox.put(_infer_request(self._model_name, self._channel_id, params, output=OUT_CHANNEL_BATCH))
        self._outbox = outbox
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self._grpc)
        call = self._call = stub.ModelStreamInfer(outbox.messages())
        self._reader = asyncio.create_task(self._read(call, self._channel_id, outbox))

    @property
    def open_generations(self) -> int:
        return len(self._routes)

    @property
    def stream_open(self) -> bool:
        return self._reader is not None and not self._reader.done()

    def abandon(self, failure: StreamFailure) -> int:
        """End the channel now: each open generation gets `failure`, the stream is cancelled
        (the backend, if it still lives, cancels its requests), the next generation opens a
        new channel. Returns how many generations were open."""
        routes, self._routes = self._routes, {}
        if self._outbox is not None:
            self._outbox.put(None)
        if self._reader is not None:
            self._reader.cancel()
        if self._call is not None:
            # cancel the RPC itself, not only our reading of it: the model sees its channel's
            # client gone (an idle channel otherwise keeps the model from unloading)
            self._call.cancel()
        self._reader, self._outbox, self._channel_id, self._call = None, None, "", None
        for generation in routes.values():
            generation.push(failure)
        return len(routes)

    async def _read(self, call: object, channel_id: str, outbox: Outbox) -> None:
        failure = StreamFailure(StreamFailureKind.LOST, "the channel ended")
        try:
            async for response in call:  # type: ignore[attr-defined]
                infer = response.infer_response
                if response.error_message:
                    # an in-band error names a request only by its id: a batch's fails each of its
                    # generations; the channel's own, or an id we cannot route, leaves the
                    # channel unusable
                    tags = batch_tags(infer.id)
                    if tags is not None:
                        outbox.acknowledge(infer.id)     # Triton is done with it: the next may leave
                        refused = StreamFailure(StreamFailureKind.REFUSED, response.error_message)
                        for tag in tags:
                            target = self._routes.pop(tag, None)
                            if target is not None:
                                target.push(refused)
                        continue
                    kind = StreamFailureKind.IN_BAND_ERROR if self._opened else StreamFailureKind.REFUSED
                    failure = StreamFailure(kind, response.error_message)
                    return
                self._opened = True
                if infer.id != channel_id:
                    # a GenerateBatch's empty FINAL (asked for: the acknowledgement); a cancel's is
                    # never sent
                    outbox.acknowledge(infer.id)
                    continue
                self._dispatch(infer)
                final = infer.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    failure = StreamFailure(StreamFailureKind.LOST, "the backend closed the channel")
                    return
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            kind = (StreamFailureKind.UNREACHABLE if exc.code() == grpc.StatusCode.UNAVAILABLE and not self._opened
                    else StreamFailureKind.LOST)
            failure = StreamFailure(kind, f"{exc.code().name}: {exc.details()}")
        except (ValueError, TypeError) as exc:       # a malformed batch
            failure = StreamFailure(StreamFailureKind.MALFORMED, str(exc))
        finally:
            routes: dict[int, ChannelGeneration] = {}
            if channel_id == self._channel_id:       # not abandoned: its generations are still routed
                routes, self._routes = self._routes, {}
            outbox.put(None)
            for generation in routes.values():
                generation.push(failure)
            if routes:
                log.warning("channel %s ended with %d open requests: %s", channel_id, len(routes), failure.detail)

    def _dispatch(self, infer: service_pb2.ModelInferResponse) -> None:
        for index, output in enumerate(infer.outputs):
            if output.name == OUT_EVENT:          # the backend refused the channel itself
                event = ep.ResponseEvent.FromString(infer.raw_output_contents[index])
                raise ValueError(f"channel refused: {event}")
            if output.name != OUT_CHANNEL_BATCH:
                continue
            batch = ep.ChannelBatch.FromString(infer.raw_output_contents[index])
            if batch.plain_tags:
                self._dispatch_plain(batch)
            for out in batch.outputs:
                generation = self._routes.get(out.tag)
                if generation is None:
                    continue                  # cancelled here already
                generation.deliver(out)
                if out.HasField("event"):
                    del self._routes[out.tag]

    def _dispatch_plain(self, batch: ep.ChannelBatch) -> None:
        """The batch's id-only outputs: one array for all of them, a view per request."""
        counts = np.array(batch.plain_counts, dtype=np.int64)
        ids = np.array(batch.plain_token_ids, dtype=np.int32)
        if counts.size != len(batch.plain_tags) or int(counts.sum()) != ids.size:
            raise ValueError(f"channel batch: {len(batch.plain_tags)} tags, {counts.size} counts "
                             f"and {ids.size} ids do not agree")
        ends = counts.cumsum().tolist()
        start = 0
        for tag, end in zip(batch.plain_tags, ends):
            generation = self._routes.get(tag)
            if generation is not None and end > start:   # None: cancelled here already
                generation.push(TokenBatch(ids[start:end], None, None, None, None))
            start = end

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put(None)
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if self._grpc is not None:
            await self._grpc.close()


class AssetsStream:
    """The assets request on a gRPC stream of its own (the model is decoupled: tritonclient's
    streaming call). Iterate ``results`` once; ``cancel`` at the end."""

    def __init__(self, client: grpcclient.InferenceServerClient, inputs: list[InferInput],
                 request_id: str, model_name: str = MODEL_NAME) -> None:
        self._client = client
        self._model_name = model_name
        self._inputs = inputs
        self._request_id = request_id
        self._closed = asyncio.Event()
        self._call: object | None = None

    async def _requests(self) -> AsyncIterator[dict]:
        yield {"model_name": self._model_name, "inputs": self._inputs, "request_id": self._request_id}
        await self._closed.wait()  # keep the request side open until we are done reading

    def cancel(self) -> None:
        """Cancel the stream, which cancels the backend request (idempotent)."""
        self._closed.set()
        if self._call is not None:
            self._call.cancel()  # type: ignore[attr-defined]

    def results(self) -> AsyncIterator[tuple[grpcclient.InferResult | None, Exception | None]]:
        """The raw (result, in-band error) pairs of the stream; opens it on first use."""
        self._call = self._client.stream_infer(inputs_iterator=self._requests())
        return self._call  # type: ignore[return-value]


class TritonBackend:
    """Generations go on this process's channel; the assets request and readiness probes use
    tritonclient on the same server."""

    def __init__(self, url: str, model_name: str = MODEL_NAME) -> None:
        self.url = url
        self.model_name = model_name
        self._client = grpcclient.InferenceServerClient(url, channel_args=_CHANNEL_OPTIONS)
        self._mux = ChannelMux(url, model_name)

    async def close(self) -> None:
        await self._mux.close()
        await self._client.close()

    def generate(self, prompt_token_ids: Sequence[int], request: ep.GenerateRequest,
                 request_id: str) -> ChannelGeneration:
        return ChannelGeneration(self._mux, prompt_token_ids, request, request_id)

    @property
    def open_generations(self) -> int:
        return self._mux.open_generations

    @property
    def channel_open(self) -> bool:
        """The channel's gRPC stream is open (an idle one included)."""
        return self._mux.stream_open

    def abandon_generations(self, detail: str) -> int:
        """Fail every open generation (LOST: they were submitted) and start a new channel."""
        return self._mux.abandon(StreamFailure(StreamFailureKind.LOST, detail))

    async def fetch_assets(self, timeout_s: float, probe: bool = False) -> ep.FrontendAssets:
        """Ask the served model for its frontend assets (a tiny inference on the model); with
        `probe`, only whether it answers: the assets come without tokenizer and template.

        Raises ConnectionError when Triton or the model cannot answer within ``timeout_s``.
        """
        params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1, assets=ep.AssetsRequest(probe=probe))
        stream = AssetsStream(self._client, [_parameters_input(params)], "assets", self.model_name)
        try:
            async with asyncio.timeout(timeout_s):
                async for result, error in stream.results():
                    if error is not None or result is None:
                        raise BackendRefused(f"assets request refused: {error}")
                    tensor = result.as_numpy(OUT_EVENT)
                    if tensor is None or not tensor.size:
                        continue
                    event = ep.ResponseEvent.FromString(array_message(tensor))
                    if event.WhichOneof("kind") != "assets":
                        raise ConnectionError(f"assets request answered with {event.WhichOneof('kind')}")
                    return event.assets
        except grpc.aio.AioRpcError as exc:
            failure = BackendRefused if exc.code() == grpc.StatusCode.UNAVAILABLE else ConnectionError
            raise failure(f"Triton at {self.url} did not answer the assets request: {exc!r}") from exc
        except TimeoutError as exc:
            raise ConnectionError(f"Triton at {self.url} did not answer the assets request: {exc!r}") from exc
        finally:
            stream.cancel()
        raise ConnectionError("the assets stream ended without an answer")

    async def model_ready(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                return bool(await self._client.is_server_ready()) and bool(
                    await self._client.is_model_ready(self.model_name))
        except Exception:  # any failure to answer means not ready; the probe never raises
            return False
