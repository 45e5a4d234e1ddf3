"""Shared helpers for the syntax tests: token streams written by hand, engines per syntax, and the
four ways of feeding a stream (all at once, token by token, character by character, random deltas).

A stream is a list of (token_id, text). Plain text uses PLAIN_ID; a delimiter generated as its
token uses the id from ATOMS (the test tokenizer's added tokens). `tok("</think>")` marks one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from helios_proto import contract_pb2 as pb

from helios_backend.syntax.engine import ModelSyntax, SyntaxEngine
from helios_backend.syntax.events import ParsedOutput, SyntaxEvent, coalesce, collect
from helios_backend.syntax.prompt_state import InitialState, ReasoningStart
from helios_backend.syntax.tables import FrontendSyntax, preset

PLAIN_ID = 7
# Delimiters the test tokenizer holds as added tokens (think tags, recipient-header controls).
ATOMS = {
    "<think>": 1001,
    "</think>": 1002,
    "<|start|>": 2001,
    "<|message|>": 2002,
    "<|end|>": 2003,
    "<|eom|>": 2004,
}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "options": {"type": "object"},
    },
    "required": ["city"],
}
TIME = {"type": "object", "properties": {}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}

Q = pb.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS
G = pb.TOOL_PARSER_GLM_ARGUMENT_TAGS
D = pb.TOOL_PARSER_DSML
X = pb.TOOL_PARSER_XTML
A = pb.TOOL_PARSER_ATEM
J = pb.TOOL_PARSER_JSON_CALL_TAGS
L = pb.TOOL_PARSER_JSON_CALL_LIST
JP = pb.TOOL_PARSER_JSON_PARAMETERS
THINK = pb.REASONING_PARSER_THINK_TAGS
XTHINK = pb.REASONING_PARSER_XTML_THINK
FRAMES = pb.REASONING_PARSER_RECIPIENT_HEADER

# Every selector pairing the spec allows, by name (the property test runs all of them).
PAIRINGS = {
    "qwen_coder+think": (Q, THINK),
    "glm+think": (G, THINK),
    "dsml+think": (D, THINK),
    "xtml+xtml_think": (X, XTHINK),
    "atem+recipient": (A, FRAMES),
    "json_call+think": (J, THINK),
    "json_call_list+think": (L, THINK),
    "json_parameters+think": (JP, THINK),
}


@dataclass(frozen=True)
class Atom:
    spelling: str


def tok(spelling: str) -> Atom:
    return Atom(spelling)


def stream(*parts: str | Atom, atoms: dict[str, int] = ATOMS) -> list[tuple[int, str]]:
    return [(atoms[p.spelling], p.spelling) if isinstance(p, Atom) else (PLAIN_ID, p) for p in parts]


def model(tool_parser: int, reasoning_parser: int, atoms: dict[str, int] = ATOMS) -> ModelSyntax:
    return ModelSyntax.build(preset(tool_parser, reasoning_parser), atoms)


def syntax_of(tool_parser: int, reasoning_parser: int) -> FrontendSyntax:
    return preset(tool_parser, reasoning_parser)


def default_start(reasoning_parser: int) -> InitialState:
    if reasoning_parser == FRAMES:
        return InitialState(ReasoningStart.FRAME_EXPECT_HEADER)
    return InitialState(ReasoningStart.MAY_OPEN)


def engine(ms: ModelSyntax, initial: InitialState, tools: dict | None = None, structured: bool = False) -> SyntaxEngine:
    return ms.engine(initial, TOOLS if tools is None else tools, structured_answer=structured)


# ---- feeding modes ----------------------------------------------------------------------------
def feed_at_once(e: SyntaxEngine, pieces: Sequence[tuple[int, str]]) -> list[SyntaxEvent]:
    return e.feed_many(pieces) + e.finish()


def feed_by_token(e: SyntaxEngine, pieces: Sequence[tuple[int, str]]) -> list[SyntaxEvent]:
    events: list[SyntaxEvent] = []
    for token_id, text in pieces:
        events += e.feed(token_id, text)
    return events + e.finish()


def feed_by_char(e: SyntaxEngine, pieces: Sequence[tuple[int, str]], atoms: Iterable[int]) -> list[SyntaxEvent]:
    atom_ids = set(atoms)
    events: list[SyntaxEvent] = []
    for token_id, text in pieces:
        if token_id in atom_ids or not text:
            events += e.feed(token_id, text)
        else:
            for ch in text:
                events += e.feed(token_id, ch)
    return events + e.finish()


def feed_random_deltas(e: SyntaxEngine, pieces: Sequence[tuple[int, str]], atoms: Iterable[int], seed: int) -> list[SyntaxEvent]:
    """Split plain tokens at random points, then group consecutive pieces into random deltas."""
    rng = random.Random(seed)
    atom_ids = set(atoms)
    split: list[tuple[int, str]] = []
    for token_id, text in pieces:
        if token_id in atom_ids or len(text) < 2:
            split.append((token_id, text))
            continue
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(3, len(text) - 1))))
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            split.append((token_id, text[a:b]))
    events: list[SyntaxEvent] = []
    i = 0
    while i < len(split):
        n = rng.randint(1, 5)
        events += e.feed_many(split[i : i + n])
        i += n
    return events + e.finish()


def parse(ms: ModelSyntax, pieces: Sequence[tuple[int, str]], initial: InitialState | None = None,
          tools: dict | None = None, structured: bool = False) -> ParsedOutput:
    start = initial if initial is not None else default_start(ms.syntax.reasoning_parser)
    return collect(feed_by_token(engine(ms, start, tools, structured), pieces))


def canonical_events(ms: ModelSyntax, pieces: Sequence[tuple[int, str]], initial: InitialState,
                     tools: dict | None = None, structured: bool = False) -> dict[str, list[SyntaxEvent]]:
    """The coalesced events of every feeding mode (they must all be equal)."""
    atoms = list(ms.markup.sentinel_of_token)
    modes = {
        "at_once": lambda e: feed_at_once(e, pieces),
        "by_token": lambda e: feed_by_token(e, pieces),
        "by_char": lambda e: feed_by_char(e, pieces, atoms),
        "random_a": lambda e: feed_random_deltas(e, pieces, atoms, 1),
        "random_b": lambda e: feed_random_deltas(e, pieces, atoms, 2),
    }
    return {name: coalesce(run(engine(ms, initial, tools, structured))) for name, run in modes.items()}
