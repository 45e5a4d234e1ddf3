"""The Triton Python-backend adapter: only translates between Triton and the engine's Runtime
(engine/runtime.py: Engine in the stub, or ProcessEngine).

model_repository/helios/1/model.py subclasses this with the stub's
triton_python_backend_utils module (only importable inside the stub). `execute` admits
and returns at once (decoupled); responses come from the response thread.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from helios_proto import exchange_pb2 as ep

from helios_backend.engine.metrics import FAMILIES, LATENCY_BUCKETS, Family, Kind
from helios_backend.engine.responses import Channel, ChannelError, Stream
from helios_backend.engine.engine import Engine, StartupError
from helios_backend.engine.process_engine import ProcessEngine
from helios_backend.engine.runtime import Runtime
from helios_backend.engine.faults import FaultySink
from helios_backend.triton.finals import FinalSender
from helios_backend.triton.supervision import STUB_EXIT_ENGINE_FAILED
from helios_backend.scheduler.request import RequestSpec
from helios_backend.engine.settings import SWITCH_INTERVAL_US, SettingsError, StartupOptions
from helios_backend.exchange import (
    IN_PARAMETERS, IN_PROMPT, OUT_CHANNEL_BATCH, OUT_EVENT, ExchangeError, batch_prompts, decode_parameters,
    message_array, request_spec)

log = logging.getLogger("helios.triton")

# A lost executor (a rank process died or stopped answering): every request has its terminal
# failure by then; the stub answers health probes red for this long, then exits, and
# helios-serve restarts the server and the ranks (triton/supervision.py)
LOST_EXIT_GRACE_S = 2.0
LOST_EXIT_CODE = 70


# The stub of Triton 2.51 is built with pybind11 2.10, which reads numpy 2's array descriptors
# wrongly (empty or garbage tensors, the BYTES deserialization crash), so under numpy 2 tensors
# cross the stub through DLPack. Under numpy 1 the stub's own conversion is right and is kept.
_DLPACK = int(np.__version__.split(".")[0]) >= 2
# The stub renames a capsule it consumed "used_dlpack" where the DLPack protocol says
# "used_dltensor": numpy's capsule destructor then raises (an unraisable traceback per tensor).
# Naming it as the protocol does tells numpy the consumer owns the tensor now, as it does.
_USED_CAPSULE = ctypes.c_char_p(b"used_dltensor")
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_set_name.restype = ctypes.c_int


def output_tensor(pb: Any, name: str, value: np.ndarray) -> Any:
    value = np.ascontiguousarray(value)
    if not _DLPACK:
        return pb.Tensor(name, value)
    capsule = value.__dlpack__()
    tensor = pb.Tensor.from_dlpack(name, capsule)
    _capsule_set_name(capsule, _USED_CAPSULE)
    return tensor


def input_array(tensor: Any) -> np.ndarray:
    """A request tensor as numpy (a copy under DLPack: the stub owns that memory)."""
    return np.from_dlpack(tensor).copy() if _DLPACK else tensor.as_numpy()


class TritonSender:
    """Sender protocol over a pb_utils response sender; builds only requested outputs."""

    def __init__(self, pb: Any, sender: Any, requested: set[str]) -> None:
        self._pb, self._sender, self._requested = pb, sender, requested

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        pb = self._pb
        tensors = [output_tensor(pb, name, value) for name, value in arrays.items()
                   if not self._requested or name in self._requested]
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self._sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def is_cancelled(self) -> bool:
        return bool(self._sender.is_cancelled())


class TritonChannelSink:
    """ChannelSink over the response sender of a channel request: batches without the FINAL
    flag, then one flag-only FINAL when the channel ends."""

    def __init__(self, pb: Any, sender: Any) -> None:
        self._pb, self._sender = pb, sender

    def send_batch(self, payload: bytes) -> None:
        tensor = output_tensor(self._pb, OUT_CHANNEL_BATCH, message_array(payload))
        self._sender.send(self._pb.InferenceResponse(output_tensors=[tensor]), flags=0)

    def close(self) -> None:
        self._sender.send(flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        return bool(self._sender.is_cancelled())


class TritonMetricBackend:
    """pb_utils metric families, created once at initialize (references kept: a dropped
    family invalidates its metrics); metric handles are created lazily per label set."""

    def __init__(self, pb: Any, model_labels: dict[str, str]) -> None:
        kinds = {Kind.COUNTER: pb.MetricFamily.COUNTER, Kind.GAUGE: pb.MetricFamily.GAUGE,
                 Kind.HISTOGRAM: pb.MetricFamily.HISTOGRAM}
        self._labels = model_labels
        self._families = {f.name: pb.MetricFamily(name=f.name, description=f.description, kind=kinds[f.kind])
                          for f in FAMILIES}

    def create(self, family: Family, labels: dict[str, str]) -> Any:
        merged = {**self._labels, **labels}
        if family.kind is Kind.HISTOGRAM:
            return self._families[family.name].Metric(labels=merged, buckets=list(LATENCY_BUCKETS))
        return self._families[family.name].Metric(labels=merged)


class TritonHeliosModel:
    def __init__(self, pb_utils: Any) -> None:
        self._pb = pb_utils
        self._serials = itertools.count(1)
        # the engine in the stub (engine_process=false) or in a process of its own (the default)
        self.runtime: Runtime | None = None
        self._finals: FinalSender | None = None
        # the serialized assets answer and a probe's (no tokenizer, no template): _assets_payload
        self._answers: tuple[np.ndarray, np.ndarray] | None = None

    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="%(asctime)s helios %(levelname)s %(name)s: %(message)s")
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        model_dir = Path(args["model_repository"])       # <repository>/<model name>
        try:
            options = StartupOptions.from_parameters(parameters, project_root=model_dir.parent.parent)
            sys.setswitchinterval((options.switch_interval_us or SWITCH_INTERVAL_US) / 1e6)
            backend = TritonMetricBackend(self._pb, {"model": args["model_name"],
                                                     "version": str(args["model_version"])})
            if options.engine_process is False:
                self.runtime = Engine.start(options, backend, on_fatal=self._exit_stub)
            else:
                self.runtime = ProcessEngine.start(options, backend, on_fatal=self._exit_stub)
            self._finals = FinalSender(self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except (StartupError, SettingsError) as exc:
            message = f"helios startup failed: {exc}"
            self._pb.Logger.log_error(message)
            raise RuntimeError(message) from None
        threading.Thread(target=self._exit_when_lost, args=(self.runtime,), name="helios-lost-watch",
                         daemon=True).start()
        self._pb.Logger.log_info(f"helios model ready: core {options.core_path}; numpy {np.__version__}, "
                                 f"tensors through {'DLPack' if _DLPACK else 'the stub'}")

    def _exit_stub(self, reason: str) -> None:
        """The engine failed and every open request has its terminal failure: end this stub
        process. A thread that died leaves state nobody can trust (the scheduler's pages and
        slots, the executor's frames, a device context after a sticky error); a new process is
        clean, and the stub's exit is what supervision already detects and restarts
        (helios-serve), or what a standalone gateway sees as an unhealthy model."""
        # straight to stderr: Triton's own logger sends through the server, which may be killed
        # before it writes
        log.critical("helios engine failed, ending the stub (exit %d): %s", STUB_EXIT_ENGINE_FAILED, reason)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(STUB_EXIT_ENGINE_FAILED)

    def _sink(self, sink: Any, runtime: Runtime) -> Any:
        return FaultySink(sink, runtime.fault) if runtime.fault is not None else sink

    def execute(self, requests: list[Any]) -> None:
        runtime, finals = self.runtime, self._finals
        if runtime is None or finals is None:
            raise RuntimeError("the helios runtime is not running")
        for request in requests:
            serial = next(self._serials)
            sender = request.get_response_sender()
            try:
                params = decode_parameters(self._input(request, IN_PARAMETERS))
            except ExchangeError as exc:
                self._answer(sender, ep.ResponseEvent(terminal=exc.event()))
                continue
            kind = params.WhichOneof("kind")
            if kind == "generate_batch" or (kind == "generate" and params.generate.channel):
                # a lone generate naming a channel is a batch of one
                batch = (params.generate_batch if kind == "generate_batch" else
                         ep.GenerateBatch(channel=params.generate.channel, requests=[params.generate]))
                self._generate_on_channel(runtime, serial, batch, self._input(request, IN_PROMPT))
                finals.close(sender)                 # one FINAL; the output goes by the channel
            elif kind == "generate":
                self._generate(runtime, serial, request, params.generate, sender)
            elif kind == "channel":
                try:
                    runtime.hub.open_channel(params.channel.id, self._sink(TritonChannelSink(self._pb, sender), runtime))
                except ChannelError as exc:
                    self._answer(sender, ep.ResponseEvent(terminal=ExchangeError("channel.id", str(exc)).event()))
            elif kind == "cancel":
                try:
                    runtime.hub.cancel_tags(runtime.hub.channel(params.cancel.channel), list(params.cancel.tags))
                except ChannelError:
                    pass                             # the channel ended: its requests are gone already
                finals.close(sender)
            elif not runtime.healthy:              # the gateway's health probe reads this as red
                self._answer(sender, ep.ResponseEvent(terminal=ep.TerminalEvent(failed=ep.ExecutionFailure(
                    message=runtime.loop.lost or "the helios worker stopped"))))
            else:
                self._answer_payload(sender, self._assets_payload(runtime, params.assets.probe))
        return None

    def _assets_payload(self, runtime: Runtime, probe: bool = False) -> np.ndarray:
        """The assets answer, serialized once: it carries the tokenizer (megabytes); building it
        per request held the GIL for milliseconds, in front of every other request and send. A
        probe's answer (AssetsRequest.probe) leaves the megabytes out: the gateway's backend
        watch asks twice a second per gateway process, and each full answer crossed the stub's
        shared memory and Triton's gRPC frontend whole (1.5 MB for SmolLM2, ~3 ms of a gateway
        process's CPU)."""
        if self._answers is None:
            assets = runtime.assets()
            light = ep.FrontendAssets(version=assets.version, served_id=assets.served_id,
                                      aliases=assets.aliases, clock=assets.clock)
            self._answers = (message_array(ep.ResponseEvent(assets=assets).SerializeToString()),
                             message_array(ep.ResponseEvent(assets=light).SerializeToString()))
        return self._answers[1] if probe else self._answers[0]

    def _exit_when_lost(self, runtime: Runtime) -> None:
        """Exit the stub once the executor is lost, after the grace (module constants)."""
        while runtime.loop.alive:
            time.sleep(0.1)
        if runtime.loop.lost is None:
            return                                   # an orderly stop (finalize), nothing to restart
        self._pb.Logger.log_error(f"helios: {runtime.loop.lost}; the stub exits so that the stack restarts")
        time.sleep(LOST_EXIT_GRACE_S)
        os._exit(LOST_EXIT_CODE)

    def _generate(self, runtime: Runtime, serial: int, request: Any, gen: ep.GenerateRequest, sender: Any) -> None:
        """A request on its own stream: its responses go to its own sender."""
        try:
            spec = request_spec(gen, self._input(request, IN_PROMPT), runtime.spec_defaults)
            own = self._sink(TritonSender(self._pb, sender, set(request.requested_output_names())), runtime)
            runtime.add_request(spec, self._stream(serial, spec, gen, sender=own), gen.grammar)
        except ExchangeError as exc:                # refused before its stream was registered
            self._answer(sender, ep.ResponseEvent(terminal=exc.event()))

    def _generate_on_channel(self, runtime: Runtime, serial: int, batch: ep.GenerateBatch,
                             prompt: np.ndarray | None) -> None:
        """Each request of the batch in order, as if it had come alone; everything a request
        produces, its InvalidRequest included, goes by the batch's channel. Lengths that do not
        fit the prompt tensor end every request of the batch with that InvalidRequest."""
        try:
            channel = runtime.hub.channel(batch.channel)
        except ChannelError as exc:
            log.warning("%d requests name %s", len(batch.requests), exc)
            return                                   # nobody reads a closed channel
        problem: ExchangeError | None = None
        if batch.prompt_lengths or len(batch.requests) != 1:
            try:
                prompts: list[np.ndarray | None] = list(batch_prompts(batch, prompt))
            except ExchangeError as exc:
                prompts, problem = [None] * len(batch.requests), exc
        else:
            prompts = [prompt]                       # a lone GenerateRequest: the whole tensor is its prompt
        for index, (gen, own) in enumerate(zip(batch.requests, prompts)):
            # serials stay unique per request: the Triton request's own, then fresh ones
            self._submit_on_channel(runtime, serial if index == 0 else next(self._serials), channel, gen, own,
                                    problem)

    def _submit_on_channel(self, runtime: Runtime, serial: int, channel: Channel, gen: ep.GenerateRequest,
                           prompt: np.ndarray | None, problem: ExchangeError | None) -> None:
        gen.channel = channel.id
        try:
            if problem is not None:
                raise problem
            spec = request_spec(gen, prompt, runtime.spec_defaults)
            runtime.add_request(spec, self._stream(serial, spec, gen, channel=channel), gen.grammar)
        except ExchangeError as exc:                # refused before its stream was registered
            try:
                runtime.hub.register(Stream(serial, None, channel=channel, tag=gen.tag))
            except ChannelError:
                return
            runtime.hub.finish_now(serial, ep.ResponseEvent(terminal=exc.event()))
        except ChannelError:
            pass                                     # a closed channel or a tag in use: nothing was registered

    @staticmethod
    def _stream(serial: int, spec: RequestSpec, gen: ep.GenerateRequest, sender: "TritonSender | None" = None,
                channel: Channel | None = None) -> Stream:
        return Stream(serial, sender, timestamps=spec.observe_timestamps, logprobs=spec.logprobs,
                      top_k=spec.top_logprobs, channel=channel, tag=gen.tag,
                      ingress_ns=gen.ingress_ns if gen.HasField("ingress_ns") else None,
                      enqueue_ns=gen.enqueue_ns if gen.HasField("enqueue_ns") else None)

    def finalize(self) -> None:
        if self.runtime is not None:
            self.runtime.stop(drain=True)
            self.runtime = None
        if self._finals is not None:
            self._finals.stop()
            self._finals = None

    def _input(self, request: Any, name: str) -> np.ndarray | None:
        tensor = self._pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else input_array(tensor)

    def _answer(self, sender: Any, event: ep.ResponseEvent) -> None:
        """The single FINAL response of a request answered without the engine."""
        self._answer_payload(sender, message_array(event.SerializeToString()))

    def _answer_payload(self, sender: Any, payload: np.ndarray) -> None:
        tensor = output_tensor(self._pb, OUT_EVENT, payload)
        sender.send(self._pb.InferenceResponse(output_tensors=[tensor]),
                    flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
