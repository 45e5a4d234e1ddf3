"""Everything the gateway needs per request, from the prompt and the request's constraint fields.

    plan = plan_request(model, prompt_text, constraints, grammar_tokenizer)   # GrammarRequestError -> 400
    plan.grammar             # RequestGrammar | None: its .grammar text goes over the exchange
    plan.parser("call_x_")   # one SyntaxEngine per choice (the OutputParser seam)
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance as llg

from .engine import ModelSyntax, SyntaxEngine
from .grammar import ConstraintRequest, RequestGrammar, build_request_grammar, check_grammar
from .prompt_state import InitialState, initial_state


@dataclass(frozen=True)
class RequestSyntax:
    model: ModelSyntax
    initial: InitialState
    constraints: ConstraintRequest
    grammar: RequestGrammar | None  # None: the request is unconstrained by intent

    def parser(self, call_id_prefix: str) -> SyntaxEngine:
        """A fresh parser for one choice; `call_id_prefix` makes tool call ids unique."""
        return self.model.engine(
            self.initial,
            self.constraints.engine_tools(),
            structured_answer=self.constraints.structured_answer,
            call_id_prefix=call_id_prefix,
        )


def plan_request(
    model: ModelSyntax,
    prompt_text: str,
    constraints: ConstraintRequest,
    grammar_tokenizer: llg.LLTokenizer | None,
) -> RequestSyntax:
    """Initial state from the rendered prompt, the request grammar, validated when a tokenizer
    is given (a refusal names the schema keyword; nothing falls back to unconstrained)."""
    initial = initial_state(prompt_text, model.syntax)
    grammar = build_request_grammar(model, initial, constraints)
    if grammar is not None and grammar_tokenizer is not None:
        check_grammar(grammar, grammar_tokenizer)
    return RequestSyntax(model, initial, constraints, grammar)
