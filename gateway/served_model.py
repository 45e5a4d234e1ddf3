"""What the gateway knows about the served model, learned from the model itself.

Built once at startup from the backend's FrontendAssets answer (docs/exchange.md), so the
tokenizer, chat template, EOS ids, limits and served ids can never disagree with the core
the backend loaded (no second copy, no model hub, no config files).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance as llg

from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.syntax.engine import ModelSyntax
from helios_backend.syntax.markup import atomic_tokens_from_tokenizer_json
from helios_backend.syntax.tables import FrontendSyntax
from helios_backend.frontend.tokenizer import FrontendTokenizer
from helios_proto import exchange_pb2 as ep


@dataclass(frozen=True, slots=True)
class BackendClock:
    """The backend's process-local monotonic origin. CLOCK_MONOTONIC is system-wide on
    Linux, so the gateway's stamps land on the token timestamps' origin (OBS-23)."""

    origin_monotonic_ns: int

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.origin_monotonic_ns


@dataclass(frozen=True)
class ServedModel:
    served_id: str
    aliases: tuple[str, ...]
    tokenizer: FrontendTokenizer
    chat_template: ChatTemplate
    eos_token_ids: frozenset[int]
    limits: ep.ServingLimits
    clock: BackendClock
    top_logprobs_capacity: int
    syntax: ModelSyntax  # the served syntaxes (reasoning, tools) for parsers and grammars
    grammar_tokenizer: llg.LLTokenizer | None  # validates request grammars; None without EOS ids
    assets: ep.FrontendAssets
    created: int  # unix seconds the gateway learned the model (OpenAI "created")

    @classmethod
    def from_assets(cls, assets: ep.FrontendAssets) -> "ServedModel":
        tokenizer_json = assets.tokenizer_json.decode("utf-8")
        tokenizer = FrontendTokenizer.from_json(tokenizer_json)
        tokens = assets.frontend.template_tokens
        special = {name: value for name, value in (
            ("bos_token", tokens.bos_token), ("eos_token", tokens.eos_token),
            ("pad_token", tokens.pad_token), ("unk_token", tokens.unk_token)) if value}
        return cls(
            served_id=assets.served_id,
            aliases=tuple(assets.aliases),
            tokenizer=tokenizer,
            chat_template=ChatTemplate(assets.chat_template, special),
            eos_token_ids=frozenset(assets.eos_token_ids),
            limits=assets.limits,
            clock=BackendClock(assets.clock.origin_monotonic_ns),
            top_logprobs_capacity=assets.top_logprobs_capacity,
            syntax=ModelSyntax.build(FrontendSyntax.from_contract(assets.frontend),
                                     atomic_tokens_from_tokenizer_json(tokenizer_json)),
            # llguidance's view of the vocabulary, built once (a few tenths of a second)
            grammar_tokenizer=(llg.LLTokenizer(tokenizer_json, eos_token=int(assets.eos_token_ids[0]))
                               if assets.eos_token_ids else None),
            assets=assets,
            created=int(time.time()),
        )

    @property
    def prompt_bytes_bound(self) -> int:
        """Prompt text beyond this many UTF-8 bytes cannot fit the context whatever it says
        (each token covers at most max_token_bytes bytes), so it is refused untokenized."""
        return max(self.limits.context_tokens, 1) * self.tokenizer.max_token_bytes

    @property
    def default_body_bytes(self) -> int:
        """The request body bound unless configured: the longest useful prompt four times over
        (JSON escapes, several messages) plus a MiB for tools, schemas and fields."""
        return 4 * self.prompt_bytes_bound + (1 << 20)

    def serves(self, model: str) -> bool:
        return model == self.served_id or model in self.aliases

    @property
    def vocabulary_size(self) -> int:
        return self.limits.sampled_vocabulary or self.tokenizer.vocab_size
