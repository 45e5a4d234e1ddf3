"""Streaming equals one-shot parsing for every chunking, for every syntax (FE-38, FE-40).

Streams are drawn from each syntax's own alphabet: its delimiters generated as tokens and spelled
as text, prefixes of delimiters, names, typed and untyped values, whitespace and stray markup, so
most drawn streams are malformed in some way. For each stream, feeding everything at once, token
by token, character by character, and in random multi-token deltas with tokens split at random
points must give the same coalesced events, and none may raise.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_backend.syntax.engine import syntax_delimiters
from helios_backend.syntax.events import coalesce, collect
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from tests.syntax_cases import (
    ATOMS, FRAMES, PAIRINGS, PLAIN_ID, engine, feed_by_char, feed_random_deltas, model, syntax_of,
)

VALUES = ["Paris", "3", "three", '{"a": [1, "x"]}', '{"city": "Oslo"}', "", "\n", " ", '"q"', "\\", "é☃"]
NAMES = ["get_weather", "get_time", "city", "days", "options", "nope", "functions", "functions.get_weather", "self",
         "user", "commentary", "assistant to=", "assistant to=self", "assistant to=user", "assistant to=functions.get_time"]


def _alphabet(pairing: str) -> st.SearchStrategy[tuple[int, str]]:
    syntax = syntax_of(*PAIRINGS[pairing])
    delimiters = sorted({d for d in syntax_delimiters(syntax) if d})
    atomic = [(ATOMS[d], d) for d in delimiters if d in ATOMS]
    textual = [(PLAIN_ID, d) for d in delimiters]
    prefixes = [(PLAIN_ID, d[: len(d) // 2]) for d in delimiters if len(d) > 1]
    words = [(PLAIN_ID, w) for w in NAMES + VALUES]
    free = st.text(alphabet='<>/="\n abc|｜:{}', max_size=6).map(lambda s: (PLAIN_ID, s))
    return st.one_of(st.sampled_from(atomic or textual), st.sampled_from(textual), st.sampled_from(prefixes),
                     st.sampled_from(words), free)


def _initial_states(pairing: str) -> st.SearchStrategy[InitialState]:
    if PAIRINGS[pairing][1] == FRAMES:
        return st.sampled_from([
            InitialState(ReasoningStart.FRAME_EXPECT_HEADER),
            InitialState(ReasoningStart.FRAME_HEADER_OPEN, header_prefix="assistant"),
            InitialState(ReasoningStart.FRAME_BODY, recipient="self"),
            InitialState(ReasoningStart.FRAME_BODY, recipient="functions"),
        ])
    return st.sampled_from([InitialState(s) for s in (ReasoningStart.MAY_OPEN, ReasoningStart.OPEN, ReasoningStart.CLOSED)])


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_chunking_gives_the_same_events(pairing: str, data: st.DataObject) -> None:
    # spec: FE-38, FE-40
    ms = model(*PAIRINGS[pairing])
    pieces = data.draw(st.lists(_alphabet(pairing), max_size=30), label="stream")
    initial = data.draw(_initial_states(pairing), label="initial")
    structured = data.draw(st.booleans(), label="structured")
    with_tools = data.draw(st.booleans(), label="with_tools")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    tools = None if with_tools else {}
    atoms = list(ms.markup.sentinel_of_token)

    def run(feed):
        return coalesce(feed(engine(ms, initial, tools, structured)))

    at_once = run(lambda e: e.feed_many(pieces) + e.finish())
    assert run(lambda e: [ev for p in pieces for ev in e.feed(*p)] + e.finish()) == at_once
    assert run(lambda e: feed_by_char(e, pieces, atoms)) == at_once
    assert run(lambda e: feed_random_deltas(e, pieces, atoms, seed)) == at_once
    out = collect(at_once)  # the fold itself must accept the event order
    for call in out.tool_calls:
        if call.complete:
            assert isinstance(json.loads(call.arguments), dict)


WELL_FORMED = {
    "qwen_coder+think": ["<think>", "\nplan\n", "</think>", "\n\n",
                         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"],
    "glm+think": ["<think>", "plan", "</think>", "<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                  "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"],
    "dsml+think": ["<think>", "plan", "</think>", "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                   "<｜DSML｜parameter name=\"city\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\">3"
                   "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"],
    "xtml+xtml_think": ["<xtml:think>\nplan\n</xtml:think>\n<xtml:tools>\n<xtml:call name=\"get_weather\">"
                        "{\"city\": \"Paris\", \"days\": 3}</xtml:call>\n</xtml:tools>"],
    "atem+recipient": ["<|start|>", "assistant to=self", "<|message|>", "plan", "<|end|>", "<|start|>",
                       "assistant to=functions.get_weather", "<|message|>",
                       "<atem:function_calls>\n<atem:invoke name=\"get_weather\">\n<atem:parameter name=\"city\">Paris"
                       "</atem:parameter>\n<atem:parameter name=\"days\">3</atem:parameter>\n</atem:invoke>\n"
                       "</atem:function_calls>", "<|eom|>"],
    "json_call+think": ["<think>", "\nplan\n", "</think>", "\n\n",
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'],
    "json_call_list+think": ["<think>", "\nplan\n", "</think>", "\n\n",
                             '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'],
    "json_parameters+think": ["<think>", "\nplan\n", "</think>", "\n\n",
                              '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'],
}


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**20))
def test_well_formed_calls_parse_identically_under_random_chunking(pairing: str, seed: int) -> None:
    # spec: FE-40
    ms = model(*PAIRINGS[pairing])
    pieces = [(ATOMS[p], p) if p in ATOMS else (PLAIN_ID, p) for p in WELL_FORMED[pairing]]
    initial = InitialState(ReasoningStart.FRAME_EXPECT_HEADER if PAIRINGS[pairing][1] == FRAMES else ReasoningStart.MAY_OPEN)
    atoms = list(ms.markup.sentinel_of_token)
    out = collect(feed_random_deltas(engine(ms, initial), pieces, atoms, seed))
    assert out.reasoning == "plan"
    assert out.errors == []
    [call] = out.tool_calls
    assert (call.name, json.loads(call.arguments), call.complete) == ("get_weather", {"city": "Paris", "days": 3}, True)
