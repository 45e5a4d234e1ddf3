"""The response thread: one coalescing output buffer per request, sent off the worker.

The worker appends events (deliver) and never waits on a client. The response thread
sends each request's accumulated output as ONE response: when a reader (or the stub,
~0.25 ms per send) is behind, tokens coalesce instead of queueing sends, so a paused
reader loses nothing and never stalls scheduling (HTTP-9: a paused reader loses no
output; HTTP-10: it does not block graph scheduling).

Two ways out. A request with its own Triton stream gets its own responses; the terminal
event rides on the last one with the FINAL flag. A request on a channel (docs/exchange.md)
has its output gathered, with every other request of that channel that produced some in
this pass, into ONE channel response: per pass one stub send per channel instead of one
per request, which is what lets the served rate follow the engine's. Per-request order
holds because one thread sends everything, in pass order.

A plain stream on a channel (ids only) may hold its tokens for a few rounds (StreamInterval):
its first token leaves at once, later ones when `interval` of them are pending or the oldest
has waited `hold_s`. Under load each message then carries several tokens of a request, and
every per-message cost downstream (Triton's stub send, the gateway's decode, event, SSE chunk
and socket write) is paid once per interval instead of once per token, as vLLM's and SGLang's
`--stream-interval` do. The automatic interval grows with the open streams (one token up to
2 x AUTO_STREAMS_PER_TOKEN - 1 of them, then one more per AUTO_STREAMS_PER_TOKEN), so a lightly
loaded server still streams token by token. The hold is decided per channel: when one stream
of a channel is due (or the channel carries another output or a terminal this pass), every
plain stream of it with pending tokens leaves in the same message. Streams decided one by one
left at staggered rounds, so each channel still sent a message nearly every pass; taken along,
the streams of a channel fall into step and the channel sends about once per interval.

Cancellation is polled at most every CANCEL_POLL_S: `is_cancelled()` of each own-stream
request, and of each channel once (a channel's client gone cancels all of its requests).

Invariant: every registered stream gets exactly one final response (its terminal event,
or, if the backend stops first, a typed execution failure), and every channel gets a
FINAL once its client is gone or the backend stops. If the response thread itself dies, it
makes one last pass that fails every open stream and closes every channel, then reports the
death through `on_death` (the engine's owner recovers the process).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.events import Emitted, Terminal, TokenBlock, WorkerEvent
from helios_backend.engine.metrics import MetricsQueue, Op, Update, update
from helios_backend.exchange import OutputChunk

log = logging.getLogger("helios.responses")
CANCEL_POLL_S = 0.02
# the automatic stream interval: one token more per this many open streams, up to AUTO_MAX_TOKENS
AUTO_STREAMS_PER_TOKEN = 32
AUTO_MAX_TOKENS = 8
# the longest a stream's tokens wait for their interval to fill (a 40 Hz update rate at worst:
# below what a reader of streamed text notices, above a decode step at any served batch)
HOLD_S = 0.025


@dataclass(frozen=True)
class StreamInterval:
    """Tokens a plain channel stream gathers before its output leaves (after its first token).
    `tokens` None: automatic, from the number of open streams (`at`)."""
    tokens: int | None = None
    hold_s: float = HOLD_S

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"a stream interval is at least one token, got {self.tokens}")

    def at(self, open_streams: int) -> int:
        if self.tokens is not None:
            return self.tokens
        return max(1, min(AUTO_MAX_TOKENS, open_streams // AUTO_STREAMS_PER_TOKEN))


class Sender(Protocol):
    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None: ...
    def is_cancelled(self) -> bool: ...


class ChannelSink(Protocol):
    def send_batch(self, payload: bytes) -> None: ...
    def close(self) -> None: ...          # the channel request's FINAL
    def is_cancelled(self) -> bool: ...


@dataclass
class Channel:
    id: str
    sink: ChannelSink
    tags: dict[int, int] = field(default_factory=dict)   # tag -> serial of its open requests
    closed: bool = False


@dataclass
class Stream:
    serial: int
    sender: Sender | None                # None: the request's output travels on `channel`
    timestamps: bool = False
    logprobs: bool = False
    top_k: int = 0
    ingress_ns: int | None = None        # gateway stamps echoed into Performance
    enqueue_ns: int | None = None
    channel: Channel | None = None
    tag: int = 0
    received_ns: int = field(default_factory=time.monotonic_ns)
    first_token_ns: int = 0
    pending: OutputChunk = field(default_factory=OutputChunk)
    final: bool = False                  # terminal event received (pending holds it)
    cancel_reported: bool = False
    sent_responses: int = 0
    last_sent_ns: int = 0                # when its output last left (the stream interval's hold)
    # output of ids only, on a channel: it travels in the batch's packed arrays (fixed for the
    # stream's life, so read once per token without recomputing)
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain = self.channel is not None and not (self.timestamps or self.logprobs or self.top_k)


class _ChannelPass:
    """One channel's batch under construction in one response-thread pass."""

    __slots__ = ("channel", "message", "tags", "counts", "token_ids")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.message = ep.ChannelBatch()
        self.tags: list[int] = []
        self.counts: list[int] = []
        self.token_ids: list[int] = []

    def finished(self) -> ep.ChannelBatch:
        if self.tags:
            self.message.plain_tags.extend(self.tags)
            self.message.plain_counts.extend(self.counts)
            self.message.plain_token_ids.extend(self.token_ids)
        return self.message


class ChannelError(ValueError):
    """A channel request the hub cannot honour (duplicate id, unknown channel)."""


class ResponseHub:
    def __init__(self, on_cancel: Callable[[int], None], metrics: MetricsQueue,
                 on_death: Callable[[str], None] = lambda reason: None,
                 interval: StreamInterval = StreamInterval()) -> None:
        self._on_cancel = on_cancel
        self._interval = interval
        self._hold_ns = int(interval.hold_s * 1e9)
        self._held: set[int] = set()         # plain streams whose pending tokens wait for their interval
        self._held_until_ns = 0              # when the first of them must leave
        self._interval_now = 0               # the interval of the last pass (its gauge; 0: none yet)
        self._on_death = on_death
        self._metrics = metrics
        self._lock = threading.Condition()
        self._streams: dict[int, Stream] = {}
        self._channels: dict[str, Channel] = {}
        self._dirty: set[int] = set()
        self._stopping = False
        self._next_poll = 0.0
        self._in_flight: list[tuple[Stream, OutputChunk, bool]] = []   # the pass being sent
        self._thread = threading.Thread(target=self._main, name="helios-responses", daemon=True)
        self.channel_responses = 0           # channel sends so far (tests, diagnostics)

    def start(self) -> None:
        self._thread.start()

    # ---- channels --------------------------------------------------------------------------
    def open_channel(self, channel_id: str, sink: ChannelSink) -> Channel:
        with self._lock:
            if not channel_id:
                raise ChannelError("a channel needs an id")
            if channel_id in self._channels or self._stopping:
                raise ChannelError(f"channel {channel_id!r} is already open" if not self._stopping
                                   else "the backend is stopping")
            channel = self._channels[channel_id] = Channel(channel_id, sink)
            return channel

    def channel(self, channel_id: str) -> Channel:
        with self._lock:
            channel = self._channels.get(channel_id)
        if channel is None or channel.closed:
            raise ChannelError(f"no open channel {channel_id!r}")
        return channel

    def cancel_tags(self, channel: Channel, tags: list[int]) -> None:
        with self._lock:
            serials = [channel.tags[t] for t in tags if t in channel.tags]
            streams = [self._streams[s] for s in serials if s in self._streams]
            for stream in streams:
                stream.cancel_reported = True
        for stream in streams:
            self._on_cancel(stream.serial)

    # ---- streams ---------------------------------------------------------------------------
    def register(self, stream: Stream) -> None:
        with self._lock:
            if stream.channel is not None:
                if stream.channel.closed:
                    raise ChannelError(f"channel {stream.channel.id!r} is closed")
                if stream.tag in stream.channel.tags:
                    raise ChannelError(f"tag {stream.tag} is already in use on channel {stream.channel.id!r}")
                stream.channel.tags[stream.tag] = stream.serial
            self._streams[stream.serial] = stream

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def deliver(self, events: Sequence[WorkerEvent]) -> None:
        """From the worker: append to buffers; never blocks on a client. A TokenBlock (one token
        of each of a round's decode lanes) is read as its arrays, with no event object per token:
        this runs on the stub's thread when the engine has its own process, and at 256 lanes its
        per-token Python was the largest share of the stub's GIL (py-spy at 9809c66)."""
        if not events:
            return
        now = time.monotonic_ns()
        updates: list[Update] = []
        with self._lock:
            for ev in events:
                if isinstance(ev, TokenBlock):
                    self._append(ev.serials.tolist(), ev.tokens.tolist(),
                                 None if ev.timestamps_ns is None else ev.timestamps_ns.tolist(),
                                 None if ev.logprobs is None else ev.logprobs.tolist(), None, now, updates)
                elif isinstance(ev, Emitted):
                    self._append((ev.serial,), (ev.token,), (ev.timestamp_ns,), (ev.logprob,),
                                 ((ev.top_ids, ev.top_logprobs),), now, updates)
                else:
                    self._terminal(ev, now, updates)
            self._lock.notify()
        self._metrics.push(updates)

    def _append(self, serials: Sequence[int], tokens: Sequence[int], stamps: Sequence[int] | None,
                logprobs: Sequence[float] | None, tops: Sequence[tuple[np.ndarray | None, np.ndarray | None]] | None,
                now: int, updates: list[Update]) -> None:
        """Token i to its stream's pending output. A field that is None is absent for every token
        (a TokenBlock's unobserved stamps are -1, missing logprobs 0.0, and it carries no top
        alternatives)."""
        streams, dirty = self._streams, self._dirty
        for i, (serial, token) in enumerate(zip(serials, tokens)):
            stream = streams.get(serial)
            if stream is None or stream.final:
                continue
            chunk = stream.pending
            chunk.tokens.append(token)
            if stream.timestamps:
                chunk.timestamps.append(stamps[i] if stamps is not None else -1)
            if stream.logprobs:
                chunk.logprobs.append(logprobs[i] if logprobs is not None else 0.0)
            if stream.top_k and tops is not None:
                top_ids, top_logprobs = tops[i]
                if top_ids is not None and top_logprobs is not None:
                    chunk.top_ids.append(top_ids)
                    chunk.top_logprobs.append(top_logprobs)
            if not stream.first_token_ns:
                stream.first_token_ns = now
                updates.append(update("flare_time_to_first_token_seconds", Op.OBSERVE,
                                      (now - stream.received_ns) / 1e9))
            dirty.add(serial)

    def _terminal(self, ev: Terminal, now: int, updates: list[Update]) -> None:
        stream = self._streams.get(ev.serial)
        if stream is None or stream.final:
            return
        terminal = ev.event
        if terminal.HasField("finished") and terminal.finished.HasField("performance"):
            perf = terminal.finished.performance
            if stream.ingress_ns is not None:
                perf.ingress_ns = stream.ingress_ns
            if stream.enqueue_ns is not None:
                perf.enqueue_ns = stream.enqueue_ns
        stream.pending.event = ep.ResponseEvent(terminal=terminal)
        stream.final = True
        updates.append(update("flare_e2e_request_latency_seconds", Op.OBSERVE, (now - stream.received_ns) / 1e9))
        self._dirty.add(ev.serial)

    def finish_now(self, serial: int, event: ep.ResponseEvent) -> None:
        """Answer a request that never reached the worker (assets, invalid, refused)."""
        with self._lock:
            stream = self._streams.get(serial)
            if stream is None or stream.final:
                return
            stream.pending.event = event
            stream.final = True
            self._dirty.add(serial)
            self._lock.notify()

    def stop(self, timeout: float = 10.0, reason: str = "the backend stopped") -> None:
        """Flush, fail whatever never got a terminal event, and end the thread."""
        self._fail_open(reason)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _fail_open(self, reason: str) -> None:
        with self._lock:
            for stream in self._streams.values():
                if not stream.final:
                    stream.pending.event = ep.ResponseEvent(terminal=ep.TerminalEvent(
                        failed=ep.ExecutionFailure(message=reason)))
                    stream.final = True
                    self._dirty.add(stream.serial)
            self._stopping = True
            self._lock.notify()

    # ---- the response thread -------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._run()
            return
        except BaseException as exc:
            death = f"the response thread died: {type(exc).__name__}: {exc}"
            log.exception("response thread stopped by an unexpected error")
        # one last pass on this thread: every open stream gets its failure, every channel its FINAL;
        # a final response the dead pass may not have sent goes again (a repeat is ignored)
        with self._lock:
            for stream, chunk, final in self._in_flight:
                if final and stream.serial not in self._streams:
                    stream.pending = chunk
                    self._streams[stream.serial] = stream
                    self._dirty.add(stream.serial)
                    if stream.channel is not None and not stream.channel.closed:
                        stream.channel.tags[stream.tag] = stream.serial
        self._fail_open(death)
        try:
            self._run()
        except BaseException:
            log.exception("the last pass of the dead response thread failed too")
        self._on_death(death)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._dirty and not self._stopping:
                    wait_s = CANCEL_POLL_S
                    if self._held:
                        wait_s = min(wait_s, max(self._held_until_ns - time.monotonic_ns(), 0) / 1e9)
                    self._lock.wait(wait_s)
                batch = []
                plain: list[tuple[Stream, list[int]]] = []   # ids-only output of a channel request
                now_ns = time.monotonic_ns()
                interval = self._interval.at(len(self._streams))
                if interval != self._interval_now:
                    self._interval_now = interval
                    self._metrics.push([update("flare_stream_interval_tokens", Op.SET, interval)])
                held, held_until = set(), 0
                # plain streams with tokens, by channel; a channel whose message leaves this pass
                # (a stream's first token, filled interval or ended hold; another output or a
                # terminal on it) takes every one of them along
                waiting: dict[str, list[Stream]] = {}
                due: set[str] = set()
                for serial in (self._dirty | self._held) if self._held else self._dirty:
                    stream = self._streams[serial]
                    chunk = stream.pending
                    if stream.plain and not stream.final:
                        assert stream.channel is not None   # plain: on a channel
                        channel_id = stream.channel.id
                        streams = waiting.get(channel_id)
                        if streams is None:
                            streams = waiting[channel_id] = []
                        streams.append(stream)
                        if not stream.sent_responses or len(chunk.tokens) >= interval \
                                or now_ns >= stream.last_sent_ns + self._hold_ns:
                            due.add(channel_id)
                        continue
                    stream.pending = OutputChunk()
                    batch.append((stream, chunk, stream.final))
                    if stream.channel is not None:
                        due.add(stream.channel.id)
                    if stream.final:
                        del self._streams[serial]
                        if stream.channel is not None:
                            stream.channel.tags.pop(stream.tag, None)
                for channel_id, streams in waiting.items():
                    if channel_id in due:
                        for stream in streams:
                            plain.append((stream, stream.pending.tokens))
                            stream.pending.tokens = []
                            stream.last_sent_ns = now_ns
                        continue
                    for stream in streams:
                        held.add(stream.serial)
                        leave_ns = stream.last_sent_ns + self._hold_ns
                        held_until = leave_ns if not held_until else min(held_until, leave_ns)
                self._dirty.clear()
                self._held, self._held_until_ns = held, held_until
                self._in_flight = batch
                done = self._stopping and not self._streams and not batch
                now = time.monotonic()
                poll = now >= self._next_poll
                if poll:
                    self._next_poll = now + CANCEL_POLL_S
                    watch = [s for s in self._streams.values()
                             if s.channel is None and not s.final and not s.cancel_reported]
                    channels = [c for c in self._channels.values() if not c.closed]
                if done:
                    ending = [c for c in self._channels.values() if not c.closed]
            by_channel: dict[str, _ChannelPass] = {}
            for stream, tokens in plain:
                channel = stream.channel
                assert channel is not None
                entry = by_channel.get(channel.id)
                if entry is None:
                    entry = by_channel[channel.id] = _ChannelPass(channel)
                entry.tags.append(stream.tag)
                entry.counts.append(len(tokens))
                entry.token_ids += tokens
                stream.sent_responses += 1
            for stream, chunk, final in batch:
                channel = stream.channel
                if channel is None:
                    self._send(stream, chunk, final)
                    continue
                entry = by_channel.get(channel.id)
                if entry is None:
                    entry = by_channel[channel.id] = _ChannelPass(channel)
                out = entry.message.outputs.add()
                out.tag = stream.tag
                chunk.fill(out, stream.timestamps, stream.logprobs, stream.top_k)
                stream.sent_responses += 1
            for entry in by_channel.values():
                self._send_channel(entry.channel, entry.finished())
            if poll:
                for stream in watch:
                    if self._cancelled(stream):
                        stream.cancel_reported = True
                        self._on_cancel(stream.serial)
                for channel in channels:
                    if self._channel_gone(channel):
                        self._drop_channel(channel)
            if done:
                for channel in ending:
                    self._close_channel(channel)
                return

    def _send(self, stream: Stream, chunk: OutputChunk, final: bool) -> None:
        assert stream.sender is not None
        try:
            stream.sender.send(chunk.arrays(stream.timestamps, stream.logprobs, stream.top_k), final)
            stream.sent_responses += 1
        except Exception as exc:   # a gone client must not stop the thread; the worker goes on
            log.warning("response to request %d not delivered: %s", stream.serial, exc)
            if not final and not stream.cancel_reported:
                stream.cancel_reported = True
                self._on_cancel(stream.serial)

    def _send_channel(self, channel: Channel, message: ep.ChannelBatch) -> None:
        if channel.closed:
            return                          # its client is gone: the output has no reader
        try:
            channel.sink.send_batch(message.SerializeToString())
            self.channel_responses += 1
            self._metrics.push([update("flare_channel_responses_total", Op.ADD, 1),
                                update("flare_channel_outputs_total", Op.ADD,
                                       len(message.outputs) + len(message.plain_tags))])
        except Exception as exc:
            log.warning("channel %s: response not delivered (%s); cancelling its requests", channel.id, exc)
            self._drop_channel(channel)

    def _drop_channel(self, channel: Channel) -> None:
        """The channel's client is gone: cancel every request on it and end the channel."""
        with self._lock:
            streams = [self._streams[s] for s in channel.tags.values() if s in self._streams]
            for stream in streams:
                stream.cancel_reported = True
        for stream in streams:
            self._on_cancel(stream.serial)
        self._close_channel(channel)

    def _close_channel(self, channel: Channel) -> None:
        with self._lock:
            if channel.closed:
                return
            channel.closed = True
            self._channels.pop(channel.id, None)
        try:
            channel.sink.close()
        except Exception as exc:
            log.warning("channel %s: FINAL not delivered: %s", channel.id, exc)

    @staticmethod
    def _cancelled(stream: Stream) -> bool:
        assert stream.sender is not None
        try:
            return bool(stream.sender.is_cancelled())
        except Exception:
            return True

    @staticmethod
    def _channel_gone(channel: Channel) -> bool:
        try:
            return bool(channel.sink.is_cancelled())
        except Exception:
            return True
