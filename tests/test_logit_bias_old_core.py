"""A core prepared without the logit-bias input (the shape of cores from before it) keeps serving,
and refuses logit_bias with a 400 that says to re-prepare it, never serving the request unbiased:
the openai SDK against the gateway, and tritonclient against the backend directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helios_proto import contract_pb2 as cp

from helios_backend.engine.bootstrap import Bootstrap
from helios_backend.frontend.logit_bias import logit_bias_capacity
from tests import helios_client
from tests.engine_fixtures import ACCEPTANCE, cached_core, engine_test_options
from tests.gateway_harness import SERVED_ID, Stack, gateway_stack

pytestmark = [pytest.mark.triton, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def old_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_core("smollm2-nobias", engine_test_options(logit_bias_capacity=0), tmp_path_factory)


@pytest.fixture(scope="module")
def stack(old_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with gateway_stack(old_core, tmp_path_factory.mktemp("gateway-old-core")) as running:
        yield running


def test_the_old_core_has_no_logit_bias_input(old_core: Path) -> None:
    # spec: FMT-8
    bootstrap = Bootstrap.load(old_core, ACCEPTANCE)
    try:
        graphs, transport = bootstrap.contract.model.graphs, bootstrap.manifest.transport
        sources = {b.source for g in graphs for b in g.bindings}
        assert cp.VALUE_SOURCE_LOGIT_BIAS_IDS not in sources
        assert not any(n.kernel == "sampling.logit_bias.v1" for p in bootstrap.manifest.programs for n in p.nodes)
        assert logit_bias_capacity(graphs, transport) == 0
    finally:
        bootstrap.close()


def test_logit_bias_on_an_old_core_is_400_naming_it(stack: Stack) -> None:
    # spec: FMT-8
    sdk = openai.OpenAI(base_url=stack.gateway.base_url + "/v1", api_key="unused", max_retries=0)
    served = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=4, temperature=0)
    assert served.choices[0].message.content                     # it serves what it can
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=4, logit_bias={"42": 100})
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "logit_bias"
    assert "re-prepare" in error["message"]


def test_the_backend_refuses_it_too(stack: Stack) -> None:
    # spec: FMT-8
    assets = helios_client.run(helios_client.assets(stack.server.grpc_url))
    assert assets.logit_bias_capacity == 0
    request = helios_client.greedy(4)
    request.logit_bias[42] = 100.0
    result = helios_client.run(helios_client.generate(stack.server.grpc_url, [1, 9690, 253], request))
    assert result.outcome == "invalid" and result.terminal.invalid.field == "logit_bias"
    assert result.tokens == []
