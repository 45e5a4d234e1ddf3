"""One streaming client for every benchmark: a chat completion read as server-sent events,
timed per token.

Both servers the benchmarks drive speak OpenAI's SSE dialect; they differ only in how a chunk
says how many tokens it carries: ours returns `token_ids` (`return_token_ids`), so a chunk that
holds several tokens counts them all; llama-server sends one token per content chunk. That rule
is the `count` argument, and everything else (status, `[DONE]`, in-band errors, the clock) is
shared.

The client is aiohttp: its C line reader costs a fraction of httpx's (~150 us of client CPU
per streamed token on the 2-core CI machine with httpx), so at tens of thousands of tokens per
second the load generator measures the server, not its own event loop.

Times are `time.perf_counter()` values, which on Linux read CLOCK_MONOTONIC: one clock for every
process of the machine, so timings from several client processes can be put on one axis (the
load's wall time is the first request's start to the last one's end, not the processes' start-up).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TokenCount = Callable[[dict[str, Any]], int]


def token_ids_count(choice: dict[str, Any]) -> int:
    """Ours: each chunk names its tokens (`return_token_ids`)."""
    return len(choice.get("token_ids") or ())


def content_chunk_count(choice: dict[str, Any]) -> int:
    """A plain OpenAI stream (llama-server's; ours without `return_token_ids`): one token per
    chunk that carries content, corrected by the stream's closing usage where it has one (ours
    sends the tokens a stream interval held as one chunk, text held back until it decodes too)."""
    return 1 if (choice.get("delta") or {}).get("content") else 0


@dataclass(frozen=True)
class Dialect:
    """How a benchmark client asks for a stream and counts its tokens."""
    extra: dict[str, Any]          # request fields beyond the chat completion's own
    count: TokenCount
    keep_alive: bool               # llama-server closes a connection after a streamed answer


DIALECTS = {
    # what an OpenAI SDK user sends: content chunks (a token each, or the tokens that left
    # together), usage at the end
    "openai": Dialect({"stream_options": {"include_usage": True}}, content_chunk_count, True),
    # ours with token observation (OBS-5): a metadata-only chunk per token beside the text chunks
    "token-ids": Dialect({"return_token_ids": True}, token_ids_count, True),
    "llama-server": Dialect({"stream_options": {"include_usage": True}}, content_chunk_count, False),
}


@dataclass
class RequestTiming:
    ok: bool = False
    status: int = 0
    start_s: float = float("nan")          # perf_counter at the request's start (shared clock)
    ttft_s: float = float("nan")           # from start_s
    e2e_s: float = float("nan")
    token_times_s: list[float] = field(default_factory=list)   # arrival of each token, from start_s

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def itls_s(self) -> list[float]:
        """Gaps between chunks (tokens that share a chunk share its arrival)."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:]) if b > a]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def load_session(base_url: str, connections: int, headers: dict[str, str] | None = None,
                 keep_alive: bool = True) -> aiohttp.ClientSession:
    """The load generator's HTTP client: `connections` kept-alive connections to `base_url`.
    keep_alive=False opens one per request: llama-server closes a connection after a streamed
    answer, and aiohttp's reuse of it failed the next request with ServerDisconnectedError
    (2026-12-03); a loopback connect costs well under a millisecond of a ~100 ms request."""
    return aiohttp.ClientSession(base_url=base_url, headers=headers, read_bufsize=1 << 20,
                                 connector=aiohttp.TCPConnector(limit=connections, force_close=not keep_alive),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def stream_completion(session: aiohttp.ClientSession, path: str, body: dict[str, Any],
                            count: TokenCount = token_ids_count) -> RequestTiming:
    """POST `body` to `path` on a load_session and read the stream to its end."""
    timing = RequestTiming()
    reported: int | None = None
    timing.start_s = time.perf_counter()
    async with session.post(path, json=body) as response:
        timing.status = response.status
        if response.status != 200:
            await response.read()
            return timing
        async for raw in response.content:
            if not raw.startswith(b"data: "):
                continue
            line = raw.rstrip()
            if line == b"data: [DONE]":
                timing.ok = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return timing
            tokens = sum(count(choice) for choice in event.get("choices", ()))
            if tokens:
                timing.token_times_s += [time.perf_counter() - timing.start_s] * tokens
            usage = event.get("usage")
            if usage:
                reported = usage.get("completion_tokens")
    timing.e2e_s = time.perf_counter() - timing.start_s
    # content chunks undercount where a chunk's text covers several tokens (text held back until
    # it decodes): the usage the stream ends with (stream_options.include_usage) has the count,
    # and the tokens a chunk held arrived with the last one
    if reported is not None and reported > len(timing.token_times_s) and timing.token_times_s:
        timing.token_times_s += [timing.token_times_s[-1]] * (reported - len(timing.token_times_s))
    if timing.token_times_s:
        timing.ttft_s = timing.token_times_s[0]
    return timing
