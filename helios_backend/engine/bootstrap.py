"""Bootstrap.load: open a core, check it, and load the frontend assets it carries.

Order (each step raises a typed error and nothing later runs):
  1. open_core(path)                               CoreError on a malformed carrier
  2. core.verify()                                 signatures, chunk digests, frames
  3. core.authorize(acceptance)                    exact publisher namespace (FMT-21)
  4. PreparedContract.decode(contract, manifest)   ContractError naming the field
  5. tokenizer.json and the chat template resources -> FrontendTokenizer, ChatTemplate
The typed frontend settings, sampling defaults and EOS ids come from the decoded contract;
nothing is read from checkpoint configs or model cards (FE-46).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from helios_proto import contract_pb2, manifest_pb2

from helios_backend.contract import PreparedContract
from helios_backend.core import Core, open_core
from helios_backend.frontend.chat_template import ChatTemplate
from helios_backend.frontend.tokenizer import FrontendTokenizer


@dataclass
class Bootstrap:
    core: Core
    prepared: PreparedContract
    tokenizer: FrontendTokenizer
    chat_template: ChatTemplate

    @property
    def contract(self) -> contract_pb2.ServingContract:
        return self.core.contract

    @property
    def manifest(self) -> manifest_pb2.ExecutionManifest:
        return self.core.manifest

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.prepared.defaults.eos_token_ids

    def read_resource(self, resource_id: str) -> bytes:
        return self.core.read_resource(resource_id)

    @classmethod
    def load(cls, path: str | os.PathLike[str], acceptance: str, verify: bool = True) -> "Bootstrap":
        core = open_core(path)
        try:
            if verify:
                core.verify()
            core.authorize(acceptance)
            prepared = PreparedContract.decode(core.contract, core.manifest,
                                               resource_ids=frozenset(r.id for r in core.resources))
            frontend = prepared.frontend
            tokenizer = FrontendTokenizer.from_json(core.read_resource(frontend.tokenizer_resource).decode("utf-8"))
            tokens = frontend.template_tokens
            special = {name: value for name, value in (("bos_token", tokens.bos_token), ("eos_token", tokens.eos_token),
                                                       ("pad_token", tokens.pad_token), ("unk_token", tokens.unk_token))
                       if value}
            template = ChatTemplate(core.read_resource(frontend.chat_template_resource).decode("utf-8"), special)
        except BaseException:
            core.close()
            raise
        return cls(core=core, prepared=prepared, tokenizer=tokenizer, chat_template=template)

    def close(self) -> None:
        self.core.close()
