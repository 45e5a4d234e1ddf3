"""The request surface users port from vLLM and OpenAI, end to end: the openai SDK and raw
HTTP against a real gateway on a real tritonserver (numpy executor, the test core).

Expectations are derived from a reference greedy request run first in the same stack, never
hard-coded texts: e.g. the reference shows where the model samples EOS, and ignore_eos /
min_tokens are checked by counting the tokens around that point.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine_fixtures import smollm2_core  # noqa: F401  (session fixture: the test core)
from tests.gateway_harness import SERVED_ID, Stack, gateway_stack, wait_until

pytestmark = [pytest.mark.triton, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EOS_IDS = (2, 0)                          # the test core's EOS ids (assets.eos_token_ids)


API_KEY = "sk-surface-test"
CONTEXT = 512                             # the test core's context_tokens


@pytest.fixture(scope="module")
def stack(smollm2_core: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: F811
    # one backend slot and two queue places behind a gateway admitting more: a fourth concurrent
    # request is refused by the scheduler (the 503 that stays for requests that fit the context)
    with gateway_stack(smollm2_core, tmp_path_factory.mktemp("gateway-surface"), "--api-key", API_KEY,
                       "--queue-capacity", "8", "--max-active", "8", "--allowed-origins", '["https://ui.example"]',
                       max_active="1", queue_capacity="2") as running:
        yield running


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.gateway.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway.base_url + "/v1", api_key=API_KEY, max_retries=0)


def chat(http: httpx.Client, max_tokens: int, **fields: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={
        "model": SERVED_ID, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.fixture(scope="module")
def eos_reference(http: httpx.Client) -> list[int]:
    """The greedy answer's ids; it ends with EOS well inside the limit."""
    choice = chat(http, 64)
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] in EOS_IDS
    assert len(choice["token_ids"]) < 40
    return choice["token_ids"]


# ---- fixed output lengths: ignore_eos, min_tokens ----------------------------------------

def test_ignore_eos_generates_exactly_max_tokens(sdk: openai.OpenAI, http: httpx.Client,
                                                 eos_reference: list[int]) -> None:
    limit = len(eos_reference) + 9
    choice = chat(http, limit, ignore_eos=True)
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "length" and len(ids) == limit
    assert ids[:len(eos_reference)] == eos_reference      # the EOS was sampled and did not end it
    response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=limit, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert response.usage is not None and response.usage.completion_tokens == limit
    assert response.choices[0].finish_reason == "length"


def test_ignore_eos_streamed_counts_every_token(sdk: openai.OpenAI, eos_reference: list[int]) -> None:
    limit = len(eos_reference) + 5
    stream = sdk.completions.create(model=SERVED_ID, prompt="The capital of France is", max_tokens=limit,
                                    temperature=0, stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == limit
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_min_tokens_withholds_eos_until_reached(http: httpx.Client, eos_reference: list[int]) -> None:
    minimum = len(eos_reference) + 6
    choice = chat(http, minimum + 30, min_tokens=minimum)
    ids = choice["token_ids"]
    assert len(ids) >= minimum
    assert not set(ids[:minimum]) & set(EOS_IDS)         # withheld, not sampled and ignored
    assert ids[:len(eos_reference) - 1] == eos_reference[:-1]   # the same answer up to where EOS was
    if choice["finish_reason"] == "stop":
        assert ids[-1] in EOS_IDS                        # and once reached, EOS ends it again


def test_min_tokens_withholds_stop_token_ids(http: httpx.Client, eos_reference: list[int]) -> None:
    stop_id = eos_reference[2]                           # a token the greedy answer samples early
    stopped = chat(http, 64, stop_token_ids=[stop_id])
    assert stopped["finish_reason"] == "stop"
    assert len(stopped["token_ids"]) == eos_reference.index(stop_id) + 1
    held = chat(http, 20, stop_token_ids=[stop_id], min_tokens=8, ignore_eos=True)
    assert len(held["token_ids"]) >= 8 and stop_id not in held["token_ids"][:8]


@pytest.mark.parametrize("fields, param", [
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": 2, "stop": ["x"]}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_fixed_length_fields_are_validated(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    body = {"model": SERVED_ID, "messages": QUESTION, "max_tokens": 10, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- logit_bias (OpenAI semantics, applied in the sampling programs) -----------------------

def test_large_positive_logit_bias_forces_its_token(sdk: openai.OpenAI, eos_reference: list[int]) -> None:
    # spec: BND-9
    forced = eos_reference[0] + 17                       # a token the greedy answer does not start with
    assert forced not in eos_reference[:3]
    response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=3, temperature=0,
                                           logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert response.choices[0].model_dump()["token_ids"] == [forced] * 3
    completion = sdk.completions.create(model=SERVED_ID, prompt="The capital of France is", max_tokens=2,
                                        temperature=0.9, seed=5, logit_bias={str(forced): 100},
                                        extra_body={"return_token_ids": True})
    assert completion.choices[0].model_dump()["token_ids"] == [forced] * 2


def test_minus_100_bans_the_greedy_token(http: httpx.Client, eos_reference: list[int]) -> None:
    # spec: BND-9
    banned = eos_reference[0]
    choice = chat(http, 4, logit_bias={str(banned): -100})
    assert banned not in choice["token_ids"]
    assert choice["token_ids"][0] != eos_reference[0]
    # another request on the same stack, unbiased, still answers as before (per-lane values)
    assert chat(http, 4)["token_ids"] == eos_reference[:4]


def test_logprobs_reflect_the_bias_as_openais_do(sdk: openai.OpenAI, eos_reference: list[int]) -> None:
    # spec: BND-9
    forced = eos_reference[0] + 17
    plain = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=1, temperature=0,
                                        logprobs=True, top_logprobs=5)
    biased = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=1, temperature=0,
                                         logprobs=True, top_logprobs=5, logit_bias={str(forced): 100})
    plain_top = plain.choices[0].logprobs.content[0]     # type: ignore[union-attr,index]
    biased_top = biased.choices[0].logprobs.content[0]   # type: ignore[union-attr,index]
    assert plain_top.logprob < -0.01 or plain_top.token != biased_top.token
    assert biased_top.logprob > -1e-3                     # the biased token holds nearly all the mass
    assert biased_top.top_logprobs[0].token == biased_top.token


@pytest.mark.parametrize("bias", [
    {"abc": 1}, {"-3": 1}, {"7": 1, "07": 2}, {"5": 100.5}, {"5": -101}, {"49152": 1},
    {str(i): 1 for i in range(301)},
])
def test_bad_logit_bias_is_400_naming_it(http: httpx.Client, bias: dict[str, Any]) -> None:
    # spec: BND-9
    response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 2,
                                                       "logit_bias": bias})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"


# ---- the context split: 400 for what can never fit, 503 for scheduler refusals ----------

LONG = [{"role": "user", "content": "hello " * 700}]  # beyond the 512-token context


# spec: HTTP-18
def test_prompt_beyond_the_context_is_400_naming_the_context_length(sdk: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=SERVED_ID, messages=LONG, max_tokens=4)
    error = info.value.body
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert str(CONTEXT) in error["message"]
    response = http.post("/v1/completions", json={"model": SERVED_ID, "prompt": "hello " * 700, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_output_limit_beyond_the_context_is_400_naming_max_tokens(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION,
                                                       "max_completion_tokens": CONTEXT})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens" and f"{CONTEXT} tokens" in error["message"]
    fits = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 8})
    assert fits.status_code == 200


def _long_stream(http: httpx.Client, started: threading.Event, stop: threading.Event) -> None:
    body = {"model": SERVED_ID, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        started.set()
        for _ in response.iter_bytes():
            if stop.is_set():
                return


# spec: HTTP-19, HTTP-21, HTTP-24, HTTP-26
def test_scheduler_refusal_of_a_fitting_request_stays_503(stack: Stack, http: httpx.Client) -> None:
    stop = threading.Event()
    threads = []
    for expected in (("flare_requests_running", 1), ("flare_requests_waiting", 1), ("flare_requests_waiting", 2)):
        started = threading.Event()
        thread = threading.Thread(target=_long_stream, args=(http, started, stop), daemon=True)
        thread.start()
        threads.append(thread)
        assert wait_until(lambda e=expected: stack.backend_metric(e[0]) == e[1], 60)
    try:
        response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 4})
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "queue_full"
        streamed = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION,
                                                           "max_tokens": 4, "stream": True})
        assert streamed.status_code == 200          # headers first: the refusal is one error event
        frames = [f for f in streamed.text.split("\n\n") if f.strip()]
        assert "data: [DONE]" not in frames
        assert json.loads(frames[-1][len("data: "):])["error"]["code"] == "queue_full"
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert wait_until(lambda: stack.backend_metric("flare_requests_running") == 0, 60)


# ---- completions parameters ----------------------------------------------------------------

def test_completions_default_to_16_tokens(sdk: openai.OpenAI) -> None:
    response = sdk.completions.create(model=SERVED_ID, prompt="Once upon a time", temperature=0,
                                      extra_body={"ignore_eos": True})
    assert response.usage is not None and response.usage.completion_tokens == 16


def test_echo_prepends_the_prompt_and_text_offset_indexes_the_text(sdk: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = sdk.completions.create(model=SERVED_ID, prompt=prompt, max_tokens=6, temperature=0)
    echoed = sdk.completions.create(model=SERVED_ID, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    stream = sdk.completions.create(model=SERVED_ID, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                    stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text
    scored = sdk.completions.create(model=SERVED_ID, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.text_offset is not None and logprobs.tokens is not None
    text = scored.choices[0].text
    assert logprobs.text_offset[0] == 0 and len(logprobs.text_offset) == len(logprobs.tokens)
    for offset, token in zip(logprobs.text_offset, logprobs.tokens):
        assert text[offset:offset + len(token)] == token


def test_echo_with_logprobs_is_400_naming_echo(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": SERVED_ID, "prompt": "hi", "echo": True, "logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


@pytest.mark.parametrize("top_logprobs", [0, 1, 5])
def test_top_logprobs_needs_logprobs_for_every_value(http: httpx.Client, top_logprobs: int) -> None:
    body = {"model": SERVED_ID, "messages": QUESTION, "max_tokens": 2, "top_logprobs": top_logprobs}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    accepted = http.post("/v1/chat/completions", json={**body, "logprobs": True})
    assert accepted.status_code == 200, accepted.text


# ---- structured outputs (vLLM's shapes, enforced by llguidance) ----------------------------

@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    {"guided_regex": "[0-9]{3}-[a-z]{2}"},
])
def test_regex_constraint_shapes_the_answer(http: httpx.Client, fields: dict[str, Any]) -> None:
    chat_choice = chat(http, 20, **fields)
    completion = http.post("/v1/completions", json={"model": SERVED_ID, "prompt": "A code:", "max_tokens": 20,
                                                    "temperature": 0, **fields}).json()["choices"][0]
    for text, reason in ((chat_choice["message"]["content"], chat_choice["finish_reason"]),
                         (completion["text"], completion["finish_reason"])):
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
        assert reason == "stop"


def test_regex_constraint_in_chat(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=20, temperature=0,
                                           extra_body={"guided_regex": "[A-Z][a-z]{2,8} [0-9]{2}"})
    assert re.fullmatch("[A-Z][a-z]{2,8} [0-9]{2}", response.choices[0].message.content or "")


@pytest.mark.parametrize("fields", [{"guided_choice": ["Paris", "Lyon", "Nice"]},
                                    {"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}}])
def test_choice_constraint_answers_one_of_them(sdk: openai.OpenAI, fields: dict[str, Any]) -> None:
    response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=10, temperature=0,
                                           extra_body=fields)
    assert response.choices[0].message.content in ("Paris", "Lyon", "Nice")
    completion = sdk.completions.create(model=SERVED_ID, prompt="My favourite city:", max_tokens=10,
                                        temperature=0.8, seed=3, extra_body=fields)
    assert completion.choices[0].text in ("Paris", "Lyon", "Nice")


def test_json_constraint_follows_the_schema(sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    for fields in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=40, temperature=0,
                                               extra_body=fields)
        assert set(json.loads(response.choices[0].message.content or "")) == {"city"}


LARK_ANSWER = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'


@pytest.mark.parametrize("fields", [{"structured_outputs": {"grammar": LARK_ANSWER}}, {"guided_grammar": LARK_ANSWER}])
def test_lark_grammar_shapes_chat_and_completions(sdk: openai.OpenAI, fields: dict[str, Any]) -> None:
    # spec: FE-41
    chat_text = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=20, temperature=0,
                                            extra_body=fields).choices[0].message.content or ""
    completion = sdk.completions.create(model=SERVED_ID, prompt="Seven times six:", max_tokens=20, temperature=0.7,
                                        seed=1, extra_body=fields).choices[0]
    for text in (chat_text, completion.text):
        assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text), text
    assert completion.finish_reason == "stop"


def test_gbnf_grammar_is_converted_like_vllms(sdk: openai.OpenAI) -> None:
    # spec: FE-41
    response = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=5, temperature=0,
                                           extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert response.choices[0].message.content in ("yes", "no")


DIGIT_OBJECT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"], "additionalProperties": False}


def _tagged(text: str, trigger: str) -> dict[str, Any]:
    """The JSON object the structural tag forces right after the trigger's first occurrence."""
    assert trigger in text, text
    decoder = json.JSONDecoder()
    value, _ = decoder.raw_decode(text[text.index(trigger) + len(trigger):])
    return value


def test_structural_tag_constrains_the_text_after_its_trigger(sdk: openai.OpenAI, http: httpx.Client,
                                                              eos_reference: list[int]) -> None:
    # spec: FE-41
    plain = sdk.chat.completions.create(model=SERVED_ID, messages=QUESTION, max_tokens=64,
                                        temperature=0).choices[0].message.content or ""
    assert "Paris" in plain and not re.search(r"Paris\s*\{", plain)   # unconstrained: no object after it
    tag = {"structures": [{"begin": "Paris", "schema": DIGIT_OBJECT, "end": ""}], "triggers": ["Paris"]}
    for fields in ({"structured_outputs": {"structural_tag": json.dumps(tag)}},
                   {"structural_tag": tag},
                   {"response_format": {"type": "structural_tag", **tag}}):
        choice = chat(http, 64, **fields)
        text = choice["message"]["content"]
        assert text.startswith(plain[:plain.index("Paris")]), (text, plain)   # free text until the trigger
        assert set(_tagged(text, "Paris")) == {"n"}, text


def test_completions_follow_response_format_as_vllms_do(sdk: openai.OpenAI) -> None:
    # spec: FE-41
    for fmt in ({"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT_OBJECT}},
                {"type": "json_object"}):
        completion = sdk.completions.create(model=SERVED_ID, prompt="A JSON object:", max_tokens=40, temperature=0,
                                            extra_body={"response_format": fmt})
        value = json.loads(completion.choices[0].text)
        assert isinstance(value, dict) and (fmt["type"] == "json_object" or set(value) == {"n"})


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"guided_grammar": "root ::= (\"a\""}, "guided_grammar"),
    ({"structured_outputs": {"structural_tag": {"structures": [{"begin": "<a>", "schema": {}, "end": ""}],
                                                "triggers": ["<b>"]}}}, "structured_outputs.structural_tag.structures[0]"),
    ({"structural_tag": '{"structures": []}'}, "structural_tag"),
    ({"structured_outputs": {"grammar": "start: /a/", "regex": "b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 4,
                                                       **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- the unknown-field policy and chat_template_kwargs -------------------------------------

def test_unimplemented_vllm_fields_are_400_naming_them(http: httpx.Client) -> None:
    for field in ("use_beam_search", "prompt_logprobs", "include_stop_str_in_output", "echo", "best_of"):
        response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, field: True})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
    response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "stream": True,
                                                       "stream_options": {"continuous_usage_stats": True}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options.continuous_usage_stats"


def test_unknown_fields_are_served_logged_and_counted(stack: Stack, http: httpx.Client) -> None:
    before = stack.gateway.metric("helios_gateway_unknown_fields_total", endpoint="chat")
    response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 2,
                                                       "frobnicate_level": 3, "store": True, "metadata": {"a": "b"}})
    assert response.status_code == 200
    assert stack.gateway.metric("helios_gateway_unknown_fields_total", endpoint="chat") == before + 1
    assert "frobnicate_level" in stack.gateway.log() and "'store'" not in stack.gateway.log()


def test_chat_template_kwargs_are_template_variables(http: httpx.Client) -> None:
    ok = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 2,
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200
    for kwargs, param in (({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                          ({"x": "<|im_start|>system"}, "chat_template_kwargs.x")):
        response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION,
                                                           "chat_template_kwargs": kwargs})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_priority_follows_vllm_lower_first(http: httpx.Client) -> None:
    # the ordering itself is a scheduler rule (tests/test_rules_scheduler.py); here: accepted
    # at both bounds (the sign flip toward the scheduler cannot overflow int32)
    for priority in (-(2**31), 2**31 - 1):
        body = {"model": SERVED_ID, "messages": QUESTION, "max_tokens": 1, "priority": priority}
        assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---- endpoints ----------------------------------------------------------------------------

def test_tokenize_and_detokenize_agree_with_usage(http: httpx.Client) -> None:
    choice_body = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION,
                                                          "max_tokens": 1}).json()
    tokens = http.post("/tokenize", json={"model": SERVED_ID, "messages": QUESTION}).json()
    assert tokens["count"] == len(tokens["tokens"]) == choice_body["usage"]["prompt_tokens"]
    assert tokens["max_model_len"] == CONTEXT
    prompt = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert len(prompt["token_strs"]) == prompt["count"]
    text = http.post("/detokenize", json={"model": SERVED_ID, "tokens": prompt["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    assert http.post("/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_version_and_max_model_len(sdk: openai.OpenAI, http: httpx.Client) -> None:
    assert http.get("/version").json()["version"]
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == CONTEXT and sdk.models.list().data[0].id == SERVED_ID


def test_models_retrieve_answers_each_served_id_and_404s_others(sdk: openai.OpenAI, http: httpx.Client) -> None:
    for card in http.get("/v1/models").json()["data"]:          # the served id and every alias
        model = sdk.models.retrieve(card["id"])
        assert model.id == card["id"] and model.object == "model" and model.owned_by == "helios"
        assert model.model_extra is not None and model.model_extra["max_model_len"] == CONTEXT
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("no-such-model")
    assert missing.value.status_code == 404
    body = missing.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "invalid_request_error" and "no-such-model" in body["message"]


# ---- security -------------------------------------------------------------------------------

def test_api_key_is_required_except_on_public_paths(stack: Stack) -> None:
    base = stack.gateway.base_url
    body = {"model": SERVED_ID, "messages": QUESTION, "max_tokens": 1}
    assert httpx.post(base + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_cors_preflight_and_origin_headers(stack: Stack, http: httpx.Client) -> None:
    preflight = httpx.options(stack.gateway.base_url + "/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
    foreign = httpx.options(stack.gateway.base_url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert foreign.status_code == 400
    response = http.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert response.headers["access-control-allow-origin"] == "https://ui.example"


# ---- request ids, the access log and status counts --------------------------------------

def test_request_ids_in_responses_and_the_access_log(stack: Stack, http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 1},
                         headers={"X-Request-Id": "client-id-42"})
    assert response.headers["x-request-id"] == "client-id-42"
    assert response.json()["id"] == "chatcmpl-client-id-42"
    fresh = http.get("/v1/models")
    rid = fresh.headers["x-request-id"]
    assert len(rid) == 32 and rid != "client-id-42"
    assert wait_until(lambda: f"{rid} GET /v1/models 200" in stack.gateway.log(), 10)
    assert "client-id-42 POST /v1/chat/completions 200" in stack.gateway.log()


def test_every_response_is_counted_by_status(stack: Stack, http: httpx.Client) -> None:
    def count(status: str) -> float:
        return stack.gateway.metric("helios_gateway_requests_total", endpoint="chat", status=status)

    before = {s: count(s) for s in ("200", "400", "404")}
    http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": 1})
    http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "max_tokens": "x"})
    http.post("/v1/chat/completions", json={"model": SERVED_ID, "messages": QUESTION, "top_logprobs": 1})
    http.post("/v1/chat/completions", json={"model": "nope", "messages": QUESTION})
    assert count("200") == before["200"] + 1
    assert count("400") == before["400"] + 2
    assert count("404") == before["404"] + 1


# ---- bench.serve: JSON and PNG beside the text --------------------------------------

def test_bench_serve_writes_json_and_a_plot_per_concurrency(stack: Stack, tmp_path: Path) -> None:
    from bench import serve as bench_serve

    bench_serve.main(["--gateway", stack.gateway.base_url, "--triton", stack.server.grpc_url, "--api-key", API_KEY,
                      "--num-prompts", "4", "--concurrency", "1,2", "--max-tokens", "5", "--ignore-eos",
                      "--rounds", "2", "--out", str(tmp_path), "--result-name", "run"])
    document = json.loads((tmp_path / "run.json").read_text())
    assert [level["concurrency"] for level in document["levels"]] == [1, 2]
    for level in document["levels"]:
        for phase in ("gateway", "direct"):
            assert level[phase]["successful_requests"] == 4
            assert level[phase]["output_tokens"] == 4 * 5          # ignore_eos: every output is 5 tokens
            assert level[phase]["ttft_ms"]["p50"] > 0
        assert level["gateway_over_direct"]["output_tokens_per_s"] > 0
    png = (tmp_path / "run.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "concurrency 2" in (tmp_path / "run.txt").read_text()


# ---- metrics: vLLM's histograms under a model label; KV usage and prefix hits ------------

def _histogram_count(text: str, name: str) -> float:
    from tests.triton_server import metric_value
    return metric_value(text, name + "_count", model=SERVED_ID)


def test_latency_and_length_histograms_carry_the_model(stack: Stack, http: httpx.Client) -> None:
    names = ("helios_gateway_time_to_first_token_seconds", "helios_gateway_inter_token_latency_seconds",
             "helios_gateway_e2e_request_latency_seconds", "helios_gateway_request_queue_time_seconds",
             "helios_gateway_request_prompt_tokens", "helios_gateway_request_generation_tokens")
    before = {n: _histogram_count(stack.gateway.metrics(), n) for n in names}
    prompt_total = stack.gateway.metric("helios_gateway_prompt_tokens_total")
    body = chat(http, 6, ignore_eos=True, n=2)
    text = stack.gateway.metrics()
    after = {n: _histogram_count(text, n) for n in names}
    assert after["helios_gateway_time_to_first_token_seconds"] == before["helios_gateway_time_to_first_token_seconds"] + 1
    assert after["helios_gateway_e2e_request_latency_seconds"] == before["helios_gateway_e2e_request_latency_seconds"] + 1
    assert after["helios_gateway_request_queue_time_seconds"] == before["helios_gateway_request_queue_time_seconds"] + 1
    assert after["helios_gateway_request_prompt_tokens"] == before["helios_gateway_request_prompt_tokens"] + 1
    assert after["helios_gateway_request_generation_tokens"] == before["helios_gateway_request_generation_tokens"] + 2
    # 2 choices x 6 tokens: every token after a choice's first batch is one gap
    assert after["helios_gateway_inter_token_latency_seconds"] > before["helios_gateway_inter_token_latency_seconds"]
    assert len(body["token_ids"]) == 6
    prompt_tokens = len(http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"])
    # the prompt counts once although two choices were generated from it
    assert stack.gateway.metric("helios_gateway_prompt_tokens_total") == prompt_total + prompt_tokens


def test_backend_reports_kv_usage_prefix_hits_and_queue_time(stack: Stack, http: httpx.Client) -> None:
    from tests.triton_server import metric_value
    for _ in range(2):                      # the second meets the first's pages
        chat(http, 2)
    assert wait_until(lambda: stack.backend_metric("flare_prefix_cache_hit_ratio") > 0, 30)
    text = stack.server.metrics()
    assert 0 < metric_value(text, "flare_prefix_cache_hit_ratio") < 1
    assert 0 <= metric_value(text, "flare_kv_cache_usage_ratio") <= 1
    assert metric_value(text, "flare_request_queue_time_seconds_count") > 0


def test_grafana_dashboard_reads_only_exported_metrics(stack: Stack, http: httpx.Client) -> None:
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs/grafana/helios.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    chat(http, 2)
    exported = stack.gateway.metrics()          # the backend's families and vLLM's names included
    names = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs
             for m in re.findall(r"\b((?:helios_gateway|flare)_[a-z0-9_]+|vllm:[a-z0-9_]+)", e)}
    assert len(names) >= 12
    for name in names:
        assert re.search(rf"^{name}(_bucket|_count|_total)?[{{ ]", exported, re.M), name
