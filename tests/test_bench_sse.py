"""bench/sse.py's client against a canned stream: how each dialect counts the tokens it receives."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from bench.sse import DIALECTS, load_session, stream_completion


def _chunk(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


# two content chunks for three tokens (the second chunk's text held until it decoded), then the usage
OPENAI_STREAM = [_chunk({"choices": [{"index": 0, "delta": {"content": "He"}}]}),
                 _chunk({"choices": [{"index": 0, "delta": {"content": "llo!"}}]}),
                 _chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
                 _chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}),
                 b"data: [DONE]\n\n"]


async def _timing(events: list[bytes], dialect: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert all(body[k] == v for k, v in DIALECTS[dialect].extra.items())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with load_session(f"http://127.0.0.1:{port}", 1, keep_alive=DIALECTS[dialect].keep_alive) as client:
            body = {"model": "m", "messages": [], "stream": True, **DIALECTS[dialect].extra}
            return await stream_completion(client, "/v1/chat/completions", body, DIALECTS[dialect].count)
    finally:
        await runner.cleanup()


def test_openai_clients_take_the_token_count_from_the_closing_usage() -> None:
    timing = asyncio.run(_timing(OPENAI_STREAM, "openai"))
    assert timing.ok and timing.output_tokens == 3
    # the held token arrived with the chunk that carried its text
    assert timing.token_times_s[2] == timing.token_times_s[1] and timing.ttft_s == timing.token_times_s[0]


def test_a_stream_without_usage_counts_its_content_chunks() -> None:
    timing = asyncio.run(_timing([e for e in OPENAI_STREAM if b"usage" not in e], "llama-server"))
    assert timing.ok and timing.output_tokens == 2


def test_token_ids_clients_count_the_observed_ids() -> None:
    events = [_chunk({"choices": [{"index": 0, "delta": {}, "token_ids": [7]}]}),
              _chunk({"choices": [{"index": 0, "delta": {"content": "He"}}]}),
              _chunk({"choices": [{"index": 0, "delta": {}, "token_ids": [8]}]}),
              _chunk({"choices": [{"index": 0, "delta": {}, "token_ids": [9]}]}),
              _chunk({"choices": [{"index": 0, "delta": {"content": "llo!"}}]}),
              b"data: [DONE]\n\n"]
    timing = asyncio.run(_timing(events, "token-ids"))
    assert timing.ok and timing.output_tokens == 3
