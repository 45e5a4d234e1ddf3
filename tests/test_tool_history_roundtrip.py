"""Every assistant message the gateway produces is accepted back as history, in every tool syntax.

For each syntax pairing of the tables (tests/syntax_cases.PAIRINGS), the request grammar of
`tool_choice: required` with parallel calls picks every token (a seeded random walk over its
masks: nothing but the grammar decides what the output looks like), and the output is cut at
several output limits. The ids go through the gateway's own output pipeline, parser and
presenter as the backend's tokens would; the message it returns, followed by a tool result, is
the history of the next request, which must prepare without error (a 400 there means the server
refuses its own output). The messages follow OpenAI's shape: `content` null beside tool calls and
never markup, finish_reason `length` for a cut output, `tool_calls` for a natural end.

No Triton here; the end-to-end version of the same round trip is in test_serve_tools.py.
"""
from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.preparation import PreparedRequest, prepare_chat
from gateway.schemas import ChatCompletionRequest
from gateway.served_model import ServedModel
from helios_backend.frontend.grammar_runtime import GrammarSession, GrammarTokenizer
from helios_backend.syntax.engine import syntax_delimiters
from helios_backend.syntax.tables import preset
from helios_proto import exchange_pb2 as ep
from ignition.recipes import smollm2_135m_instruct as recipe
from ignition.sources.gguf import GGUFModel, default_gguf_path
from tests.presenting import present_chat
from tests.syntax_cases import PAIRINGS
from tests.test_syntax_grammar import EOS, _allowed, grammar_tokenizer, tokenizer_json  # noqa: F401 (fixtures)

# bounded values (an enum string, a bounded integer) and a small reasoning budget: random walks
# finish calls, end or go on to further calls, instead of wandering in free text to the limit
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
UNITS = {"type": "object", "properties": {"units": {"enum": ["c", "f"]}}, "required": ["units"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_units", "parameters": UNITS}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WALK_LIMIT = 200


_SERVED: dict[str, ServedModel] = {}


def served_with(pairing: str, tokenizer_json: str) -> ServedModel:
    """The SmolLM2 tokenizer and the recipe's tool template, with the pairing's syntax data."""
    if pairing in _SERVED:
        return _SERVED[pairing]
    assets = ep.FrontendAssets(
        version=ep.TRANSPORT_VERSION_1, served_id="test-model", tokenizer_json=tokenizer_json.encode(),
        chat_template=recipe.chat_template(GGUFModel.open(default_gguf_path())), eos_token_ids=[EOS],
        top_logprobs_capacity=4,
        limits=ep.ServingLimits(context_tokens=4096, queue_capacity=4, max_active=2, frontend_workers=1,
                                sampled_vocabulary=49152))
    preset(*PAIRINGS[pairing]).apply_to(assets.frontend)
    served = _SERVED[pairing] = ServedModel.from_assets(assets)
    return served


def prepare(served: ServedModel, messages: list[dict[str, Any]], **fields: Any) -> PreparedRequest:
    body = {"model": "test-model", "messages": messages, "tools": TOOLS, **fields}
    return prepare_chat(ChatCompletionRequest.model_validate(body), served, ingress_ns=0)


def walk(gt: GrammarTokenizer, grammar: str, seed: int) -> tuple[list[int], bool]:
    """The masks pick every token (seeded); (ids, ended): ended when EOS came before the limit."""
    session = GrammarSession.create(gt, grammar)
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(WALK_LIMIT):
        allowed = _allowed(gt, session)
        assert allowed, "the grammar allows nothing"
        # EOS, where allowed, one time in four: walks end after one call or go on to more
        if EOS in allowed and (len(allowed) == 1 or rng.random() < 0.25):
            return out, True
        choice = rng.choice(sorted(allowed - {EOS}))
        assert session.consume(choice), session.error
        out.append(choice)
    return out, False


def present(served: ServedModel, prepared: PreparedRequest, ids: list[int], reason: int,
            stream: bool) -> dict[str, Any]:
    """What the gateway answers for these generated ids: the JSON choice, or the SSE chunks
    folded into a message as the openai SDK's stream helper does."""
    terminal = ep.TerminalEvent(finished=ep.Finished(reason=reason, usage=ep.Usage(prompt_tokens=1,
                                                                                 completion_tokens=len(ids))))
    out = present_chat(served, prepared, ids, terminal, stream)
    if not stream:
        return out  # type: ignore[no-any-return]
    raw: bytes = out
    chunks = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n\n")
              if line.startswith(b"data: {")]
    message: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        if "role" in delta:
            assert "role" not in message, "the role came twice"
            message["role"], message["content"] = delta["role"], delta["content"]
        elif delta:
            assert "role" in message, f"a delta before the role: {delta}"
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            entry["function"]["name"] += call.get("function", {}).get("name", "")
            entry["function"]["arguments"] += call.get("function", {}).get("arguments", "")
        finish = choice["finish_reason"] or finish
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": finish}


def check_shape(choice: dict[str, Any], ended: bool, markup: list[str]) -> None:
    message = choice["message"]
    calls = message.get("tool_calls") or []
    assert choice["finish_reason"] == ("tool_calls" if ended and calls else "stop" if ended else "length")
    if calls:
        assert message["content"] is None, message          # OpenAI: null beside tool calls
    content = message["content"] or ""
    assert not any(m in content for m in markup), f"markup leaked into content: {content!r}"


@pytest.mark.parametrize("pairing", sorted(PAIRINGS))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_every_answer_is_accepted_back_as_history(pairing: str, seed: int, stream: bool, tokenizer_json: str,
                                                  grammar_tokenizer: GrammarTokenizer) -> None:
    # spec: FE-40, FE-41, FE-42
    served = served_with(pairing, tokenizer_json)
    prepared = prepare(served, QUESTION, tool_choice="required", stream=stream, reasoning_max_chars=12)
    assert prepared.syntax is not None and prepared.syntax.grammar is not None
    ids, ended = walk(grammar_tokenizer, prepared.syntax.grammar.grammar, seed)
    markup = [d for d in syntax_delimiters(served.syntax.syntax) if len(d) > 1]
    cuts = sorted({len(ids) * k // 4 for k in (1, 2, 3)} - {0, len(ids)})
    outputs = [(ids[:cut], False) for cut in cuts] + [(ids, ended)]
    print(f"{pairing} seed {seed}: {len(ids)} tokens, {'EOS' if ended else 'limit'}: "
          f"{served.tokenizer.decode(ids)[:300]!r}")
    for output, natural in outputs:
        choice = present(served, prepared, output, ep.FINISH_REASON_EOS if natural else ep.FINISH_REASON_LENGTH,
                         stream)
        text = served.tokenizer.decode(output)
        try:
            check_shape(choice, natural, markup)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noutput: {text!r}") from None
        message = choice["message"]
        history = [*QUESTION, message]
        for call in message.get("tool_calls") or []:
            history.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny"})
        if not message.get("tool_calls"):
            history.append({"role": "user", "content": "Go on."})
        prepare(served, history, tool_choice="auto")         # accepted: no InvalidRequestError
