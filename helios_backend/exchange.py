"""The exchange, declared once: tensor names and types, request decoding, response encoding
(proto/helios_proto/exchange.proto, docs/exchange.md).

Backend side: decode a request's tensors into a RequestSpec (or an assets, channel or
cancel request) and turn coalesced output into response arrays or channel outputs. Client
side (gateway, tests): build the request arrays and decode responses. No Triton import here;
model_repository/helios/config.pbtxt declares exactly TENSORS (a test checks it).

Every serialized message travels as a UINT8 tensor, never BYTES: the Python backend stub of
Triton 2.51 cannot deserialize BYTES tensors under numpy 2.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from google.protobuf.message import DecodeError

from helios_proto import contract_pb2 as cp
from helios_proto import exchange_pb2 as ep

from helios_backend.frontend.logit_bias import LogitBiasError, check_logit_bias
from helios_backend.frontend.stops import StopSpecError, validate_stop_strings, validate_stop_tokens
from helios_backend.scheduler.request import LogitBias, RequestSpec, SamplingSettings, StopSettings

MODEL_NAME = "helios"
IN_PARAMETERS = "parameters"
IN_PROMPT = "prompt_token_ids"
OUT_TOKENS = "token_ids"
OUT_TIMESTAMPS = "token_timestamps_ns"
OUT_LOGPROBS = "logprobs"
OUT_TOP_IDS = "top_token_ids"
OUT_TOP_LOGPROBS = "top_logprobs"
OUT_EVENT = "event"
OUT_CHANNEL_BATCH = "channel_batch"
OUTPUTS = (OUT_TOKENS, OUT_TIMESTAMPS, OUT_LOGPROBS, OUT_TOP_IDS, OUT_TOP_LOGPROBS, OUT_EVENT, OUT_CHANNEL_BATCH)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                          # Triton data type without the TYPE_ prefix
    dims: tuple[int, ...]
    optional: bool = False


INPUTS = (TensorSpec(IN_PARAMETERS, "UINT8", (-1,)),
          TensorSpec(IN_PROMPT, "INT32", (-1,), optional=True))
OUTPUT_TENSORS = (TensorSpec(OUT_TOKENS, "INT32", (-1,)),
                  TensorSpec(OUT_TIMESTAMPS, "INT64", (-1,)),
                  TensorSpec(OUT_LOGPROBS, "FP32", (-1,)),
                  TensorSpec(OUT_TOP_IDS, "INT32", (-1, -1)),
                  TensorSpec(OUT_TOP_LOGPROBS, "FP32", (-1, -1)),
                  TensorSpec(OUT_EVENT, "UINT8", (-1,)),
                  TensorSpec(OUT_CHANNEL_BATCH, "UINT8", (-1,)))
TENSORS = INPUTS + OUTPUT_TENSORS


def message_array(message: bytes) -> np.ndarray:
    """A serialized message as the UINT8 tensor that carries it. An owned, writable copy: under
    numpy 2 the Python backend stub sends a read-only view over `bytes` as an empty tensor."""
    return np.frombuffer(message, dtype=np.uint8).copy()


def array_message(raw: np.ndarray) -> bytes:
    return np.ascontiguousarray(raw, dtype=np.uint8).tobytes()


class ExchangeError(ValueError):
    """A malformed exchange request; becomes an InvalidRequest terminal event."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def event(self) -> ep.TerminalEvent:
        return ep.TerminalEvent(invalid=ep.InvalidRequest(field=self.field, message=self.message))


def decode_parameters(raw: np.ndarray | None) -> ep.RequestParameters:
    if raw is None or raw.dtype != np.uint8 or raw.size == 0:
        raise ExchangeError(IN_PARAMETERS, "one serialized RequestParameters (UINT8) is required")
    try:
        params = ep.RequestParameters.FromString(array_message(raw))
    except DecodeError as exc:
        raise ExchangeError(IN_PARAMETERS, f"not a RequestParameters message ({exc})") from None
    if params.version != ep.TRANSPORT_VERSION_1:
        raise ExchangeError("parameters.version", f"unsupported exchange version {params.version}")
    if params.WhichOneof("kind") is None:
        raise ExchangeError("parameters.kind",
                             "no request kind (generate, generate_batch, assets, channel or cancel)")
    return params


def batch_prompts(batch: ep.GenerateBatch, prompt: np.ndarray | None) -> list[np.ndarray]:
    """Each request's prompt of a GenerateBatch: consecutive slices of the one prompt tensor."""
    lengths = list(batch.prompt_lengths)
    if len(lengths) != len(batch.requests):
        raise ExchangeError("generate_batch.prompt_lengths",
                             f"{len(lengths)} lengths for {len(batch.requests)} requests")
    flat = np.zeros(0, np.int32) if prompt is None else np.asarray(prompt).reshape(-1)
    if sum(lengths) != flat.size:
        raise ExchangeError("generate_batch.prompt_lengths",
                             f"the lengths add up to {sum(lengths)}, the prompt tensor holds {flat.size} ids")
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    return [flat[end - n:end] for n, end in zip(lengths, ends)]


SamplingField = Literal["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                        "repetition_penalty"]


@dataclass(frozen=True)
class SpecDefaults:
    """Core sampling defaults and limits that fill what a request leaves unset (SRV-17)."""
    sampling: cp.SamplingDefaults
    max_output_tokens: int
    vocab_size: int
    logit_bias_capacity: int = 0        # entries per request the sampling programs apply (0: none)


def request_spec(gen: ep.GenerateRequest, prompt: np.ndarray | None, defaults: SpecDefaults) -> RequestSpec:
    if prompt is None:
        raise ExchangeError(IN_PROMPT, "a generate request needs prompt_token_ids")
    if gen.channel and gen.tag == 0:
        raise ExchangeError("tag", "a request on a channel needs a nonzero tag")
    ids = tuple(np.asarray(prompt).reshape(-1).tolist())     # Python ints, one C call
    s, d = gen.sampling, defaults.sampling

    def pick(name: SamplingField) -> float:
        return getattr(s, name) if s.HasField(name) else getattr(d, name)

    sampling = SamplingSettings(
        temperature=float(pick("temperature")), top_p=float(pick("top_p")), top_k=int(pick("top_k")),
        min_p=float(pick("min_p")), presence_penalty=float(pick("presence_penalty")),
        frequency_penalty=float(pick("frequency_penalty")), repetition_penalty=float(pick("repetition_penalty")),
        logprobs=gen.logprobs.top_logprobs if gen.logprobs.logprobs else -1,
        seed=s.seed if s.HasField("seed") else secrets.randbits(64))
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.min_p < 0:
        raise ExchangeError("sampling", "temperature >= 0, 0 < top_p <= 1 and min_p >= 0 are required")
    try:
        strings = validate_stop_strings(list(gen.stops.strings)) if gen.stops.strings else ()
        sequences = validate_stop_tokens(list(gen.stops.token_ids),
                                         [list(q.token_ids) for q in gen.stops.token_sequences],
                                         defaults.vocab_size)
    except StopSpecError as exc:
        raise ExchangeError(f"stops.{exc.param}", str(exc)) from None
    if strings and sequences:
        raise ExchangeError("stops", "string stops cannot be combined with token stops")
    constrained = gen.grammar.kind != ep.GRAMMAR_KIND_UNSPECIFIED
    if strings and constrained:
        raise ExchangeError("stops", "string stops cannot be combined with structured output")
    obs = gen.observation
    if obs.return_token_timestamps and not obs.return_token_ids:
        raise ExchangeError("observation", "return_token_timestamps requires return_token_ids")
    max_tokens = gen.max_tokens if gen.HasField("max_tokens") else defaults.max_output_tokens
    if max_tokens <= 0:
        raise ExchangeError("max_tokens", "must be positive")
    if gen.min_tokens > max_tokens:
        raise ExchangeError("min_tokens", f"{gen.min_tokens} exceeds max_tokens {max_tokens}")
    if gen.min_tokens and (strings or gen.stops.token_sequences):
        raise ExchangeError("min_tokens", "cannot be combined with string stops or stop token sequences")
    logit_bias = None
    if gen.logit_bias:
        try:
            logit_bias = LogitBias(*check_logit_bias(gen.logit_bias, defaults.vocab_size,
                                                     defaults.logit_bias_capacity))
        except LogitBiasError as exc:
            raise ExchangeError("logit_bias", str(exc)) from None
    return RequestSpec(
        prompt=ids, max_tokens=max_tokens, sampling=sampling,
        stops=StopSettings(strings=strings, token_ids=tuple(gen.stops.token_ids),
                           token_sequences=tuple(tuple(q.token_ids) for q in gen.stops.token_sequences)),
        logprobs=gen.logprobs.logprobs, top_logprobs=gen.logprobs.top_logprobs,
        observe_timestamps=obs.return_token_timestamps, constrained=constrained,
        priority=gen.priority, external_id=gen.request_id,
        ignore_eos=gen.ignore_eos, min_tokens=gen.min_tokens, logit_bias=logit_bias)


@dataclass
class OutputChunk:
    """Output accumulated for one request since its last response (coalesced)."""
    tokens: list[int] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logprobs: list[np.ndarray] = field(default_factory=list)
    event: ep.ResponseEvent | None = None

    def arrays(self, timestamps: bool, logprobs: bool, top_k: int) -> dict[str, np.ndarray]:
        out = {OUT_TOKENS: np.asarray(self.tokens, dtype=np.int32)}
        if timestamps:
            out[OUT_TIMESTAMPS] = np.asarray(self.timestamps, dtype=np.int64)
        if logprobs:
            out[OUT_LOGPROBS] = np.asarray(self.logprobs, dtype=np.float32)
        if top_k:
            out[OUT_TOP_IDS] = (np.stack(self.top_ids).astype(np.int32) if self.top_ids
                                else np.zeros((0, top_k), np.int32))
            out[OUT_TOP_LOGPROBS] = (np.stack(self.top_logprobs).astype(np.float32) if self.top_logprobs
                                     else np.zeros((0, top_k), np.float32))
        if self.event is not None:
            out[OUT_EVENT] = message_array(self.event.SerializeToString())
        return out

    def fill(self, out: ep.ChannelOutput, timestamps: bool, logprobs: bool, top_k: int) -> None:
        """This chunk as one request's entry of a channel batch."""
        out.token_ids.extend(self.tokens)
        if timestamps:
            out.timestamps_ns.extend(self.timestamps)
        if logprobs:
            out.logprobs.extend(self.logprobs)
        if top_k and self.top_ids:
            out.top_k = top_k
            out.top_token_ids.extend(np.concatenate(self.top_ids).astype(np.int32).tolist())
            out.top_logprobs.extend(np.concatenate(self.top_logprobs).astype(np.float32).tolist())
        if self.event is not None:
            out.event.CopyFrom(self.event)


# ---- client side ---------------------------------------------------------------------------

def parameters_array(params: ep.RequestParameters) -> np.ndarray:
    return message_array(params.SerializeToString())


def generate_arrays(prompt: list[int] | np.ndarray, request: ep.GenerateRequest) -> dict[str, np.ndarray]:
    params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1, generate=request)
    return {IN_PARAMETERS: parameters_array(params), IN_PROMPT: np.asarray(prompt, dtype=np.int32)}


def assets_arrays() -> dict[str, np.ndarray]:
    params = ep.RequestParameters(version=ep.TRANSPORT_VERSION_1, assets=ep.AssetsRequest())
    return {IN_PARAMETERS: parameters_array(params)}


def decode_event(raw: np.ndarray) -> ep.ResponseEvent:
    return ep.ResponseEvent.FromString(array_message(raw))


def decode_channel_batch(raw: bytes) -> ep.ChannelBatch:
    return ep.ChannelBatch.FromString(raw)
