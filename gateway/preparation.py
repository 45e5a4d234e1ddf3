"""Request preparation: validated HTTP models -> prompt ids + typed exchange requests.

Runs in a frontend worker slot (CPU: template rendering and tokenization). Every check
that depends on more than one field, or on the served model, lives here and raises
InvalidRequestError naming the parameter (HTTP-18). Nothing here talks to Triton.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from helios_backend.frontend.chat_template import TemplateError
from helios_backend.frontend.logit_bias import LogitBiasError, check_logit_bias, parse_token_keys
from helios_backend.frontend.prompt import PromptIds, UntrustedMarkupError, encode_chat
from helios_backend.frontend.stops import StopMatcher, StopSpecError
from helios_backend.syntax.grammar import (AnswerFormat, ConstraintRequest, InvalidToolChoiceError,
                                                    ToolChoiceMode, ToolSpec)
from helios_backend.syntax.request import RequestSyntax, plan_request
from helios_backend.syntax.schema_check import GrammarRequestError
from helios_backend.frontend.tokenizer import UnrepresentableTextError
from helios_proto import exchange_pb2 as ep

from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.schemas import (INT32_MAX, VLLM_UNSUPPORTED_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                             SamplingFields)
from gateway.structured_outputs import completion_grammar, requested_constraint, response_format_constraint
from gateway.served_model import ServedModel


@dataclass(frozen=True, slots=True)
class Observation:
    token_ids: bool  # return_token_ids
    timestamps: bool  # return_token_timestamps
    include_usage: bool  # stream_options.include_usage
    logprobs: bool
    top_logprobs: int


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompts: tuple[tuple[int, ...], ...]  # one entry per prompt; chat has exactly one
    n: int  # choices per prompt
    generate: ep.GenerateRequest  # shared by every choice; seeds are offset per choice
    stop_strings: tuple[str, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    stream: bool
    observation: Observation
    ingress_ns: int
    syntax: RequestSyntax | None = None  # chat: reasoning/tool parsing and grammar; None: plain text
    echo_texts: tuple[str, ...] = ()  # completions with echo: each prompt's text, which starts its choices

    @property
    def choice_count(self) -> int:
        return len(self.prompts) * self.n

    def stop_matcher(self) -> StopMatcher:
        return StopMatcher(self.stop_strings, self.stop_sequences)

    def choices(self) -> Iterator[tuple[int, tuple[int, ...], ep.GenerateRequest]]:
        """(choice index, prompt ids, exchange request) for each choice; n > 1 fans out
        into n backend requests, seed + i when the request is seeded."""
        for prompt_index, prompt in enumerate(self.prompts):
            for i in range(self.n):
                request = ep.GenerateRequest()
                request.CopyFrom(self.generate)
                index = prompt_index * self.n + i
                request.request_id = f"{self.request_id}-{index}"
                if self.generate.sampling.HasField("seed"):
                    request.sampling.seed = (self.generate.sampling.seed + index) % 2**64
                yield index, prompt, request


def _check_model(body: SamplingFields, served: ServedModel) -> None:
    if not served.serves(body.model):
        raise ModelNotFoundError(f"the model {body.model!r} is not served here; "
                                 f"use {served.served_id!r}", param="model")


def _sampling(body: SamplingFields) -> ep.Sampling:
    """Only explicit request values are set; unset fields take the core's defaults (SRV-17)."""
    sampling = ep.Sampling()
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed"):
        value = getattr(body, field)
        if value is not None:
            setattr(sampling, field, value)
    if body.top_k is not None:
        sampling.top_k = max(body.top_k, 0)  # -1 (vLLM's "off") and 0 both disable top-k
    return sampling


def _stops(body: SamplingFields, served: ServedModel, structured: bool) -> StopMatcher:
    try:
        return StopMatcher.for_request(body.stop, body.stop_token_ids, body.stop_token_sequences,
                                       vocabulary_size=served.vocabulary_size, structured_output=structured)
    except StopSpecError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc


class ContextLengthError(InvalidRequestError):
    """A prompt or an explicit output limit that can never fit the served context: a 400
    (as vLLM and OpenAI), not the scheduler's 503 (docs/spec-resolutions.md)."""

    code = "context_length_exceeded"


def check_context(prompts: Sequence[Sequence[int]], max_tokens: int | None, served: ServedModel,
                  prompt_param: str, max_tokens_param: str) -> None:
    limits = served.limits
    context = limits.context_tokens
    for prompt in prompts:
        # proto3 zeros are "not reported" (assets of older backends): nothing to check against
        if limits.max_prompt_tokens and len(prompt) > limits.max_prompt_tokens:
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens (prompts of at most "
                f"{limits.max_prompt_tokens}); the prompt has {len(prompt)} tokens", param=prompt_param)
        if context and max_tokens is not None and len(prompt) + max_tokens > context:
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens; {len(prompt) + max_tokens} were "
                f"requested ({len(prompt)} in the prompt, {max_tokens} in the completion)", param=max_tokens_param)


def _fixed_length(body: SamplingFields, served: ServedModel, max_tokens: int | None, stops: StopMatcher,
                  generate: ep.GenerateRequest) -> None:
    """vLLM's ignore_eos and min_tokens (the backend withholds EOS and stop ids until
    min_tokens; docs/gateway.md)."""
    generate.ignore_eos = bool(body.ignore_eos)
    min_tokens = body.min_tokens or 0
    if not min_tokens:
        return
    limit = max_tokens if max_tokens is not None else served.limits.max_output_tokens
    if min_tokens > limit:
        raise InvalidRequestError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({limit})",
                                  param="min_tokens")
    if stops.strings or body.stop_token_sequences:
        raise InvalidRequestError("min_tokens cannot be combined with stop strings or stop_token_sequences",
                                  param="min_tokens")
    generate.min_tokens = min_tokens


def _logit_bias(body: SamplingFields, served: ServedModel, generate: ep.GenerateRequest) -> None:
    """OpenAI's logit_bias (token id -> bias in [-100, 100]); the backend checks it again."""
    if not body.logit_bias:
        return
    try:
        ids, biases = check_logit_bias(parse_token_keys(body.logit_bias), served.vocabulary_size,
                                       served.assets.logit_bias_capacity)
    except LogitBiasError as exc:
        raise InvalidRequestError(f"logit_bias: {exc}", param="logit_bias") from None
    generate.logit_bias.update(zip(ids.tolist(), biases.tolist()))


def _common(body: SamplingFields, served: ServedModel, max_tokens: int | None, structured: bool,
            logprobs: bool, top_logprobs: int, top_logprobs_param: str,
            ) -> tuple[ep.GenerateRequest, StopMatcher, Observation]:
    _check_model(body, served)
    unsupported = sorted(set(body.model_extra or ()) & VLLM_UNSUPPORTED_FIELDS)
    if unsupported:
        raise InvalidRequestError(f"{', '.join(unsupported)}: vLLM extension not implemented here",
                                  param=unsupported[0])
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise InvalidRequestError("stream_options.continuous_usage_stats (vLLM) is not implemented here",
                                  param="stream_options.continuous_usage_stats")
    if body.return_token_timestamps and not body.return_token_ids:
        raise InvalidRequestError("return_token_timestamps requires return_token_ids=true",
                                  param="return_token_timestamps")
    if top_logprobs > served.top_logprobs_capacity:
        raise InvalidRequestError(f"at most {served.top_logprobs_capacity} top logprobs are served",
                                  param=top_logprobs_param)
    stops = _stops(body, served, structured)
    # HTTP priority follows vLLM (lower is served first); the scheduler admits higher first
    generate = ep.GenerateRequest(priority=min(-(body.priority or 0), INT32_MAX), sampling=_sampling(body))
    if max_tokens is not None:
        generate.max_tokens = max_tokens
    _fixed_length(body, served, max_tokens, stops, generate)
    _logit_bias(body, served, generate)
    generate.stops.strings.extend(stops.strings)
    generate.stops.token_ids.extend(body.stop_token_ids or ())
    for sequence in body.stop_token_sequences or ():
        generate.stops.token_sequences.add(token_ids=sequence)
    generate.logprobs.logprobs = logprobs
    generate.logprobs.top_logprobs = top_logprobs
    generate.observation.return_token_ids = bool(body.return_token_ids)
    generate.observation.return_token_timestamps = bool(body.return_token_timestamps)
    observation = Observation(
        token_ids=bool(body.return_token_ids), timestamps=bool(body.return_token_timestamps),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        logprobs=logprobs, top_logprobs=top_logprobs)
    return generate, stops, observation


def _check_prompt_bytes(size: int, served: ServedModel, param: str) -> None:
    """Refuse, before tokenizing, text that has more tokens than the context holds for sure."""
    bound = served.prompt_bytes_bound
    if size > bound:
        raise ContextLengthError(
            f"the prompt text has {size} bytes: more than the {served.limits.context_tokens}-token context "
            f"can hold ({bound} bytes at most)", param=param)


# ---- chat --------------------------------------------------------------------------------

def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    content = message.content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if isinstance(part, dict):
                where = f"messages.{index}.content.{part_index}"
                if part.get("type") == "text":   # a text part whose text is missing or not a string
                    raise InvalidRequestError(f"{where}.text must be a string, got "
                                              f"{type(part.get('text')).__name__}", param=f"{where}.text")
                raise InvalidRequestError(
                    f"content part type {part.get('type')!r} is not supported; only 'text' parts are",
                    param=where)
            texts.append(part.text)
        content = "".join(texts)
    out["content"] = content if content is not None else ""
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        calls = []
        for call_index, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    "tool call arguments must be a JSON document",
                    param=f"messages.{index}.tool_calls.{call_index}.function.arguments") from exc
            # templates read arguments as a mapping (HF convention)
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


def _constraints(body: ChatCompletionRequest, served: ServedModel) -> ConstraintRequest:
    """The request fields that shape the output grammar and the parser (the syntax seam)."""
    tools = tuple(ToolSpec(t.function.name, t.function.parameters or {"type": "object", "properties": {}})
                  for t in body.tools or ())
    choice, named = ToolChoiceMode.AUTO, ""
    if isinstance(body.tool_choice, str):
        choice = ToolChoiceMode(body.tool_choice)
    elif body.tool_choice is not None:
        choice, named = ToolChoiceMode.NAMED, body.tool_choice.function.name
    fmt = body.response_format
    answer, schema = AnswerFormat.TEXT, None
    if fmt is not None and fmt.type == "json_object":
        answer = AnswerFormat.JSON_OBJECT
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                      param="response_format.json_schema")
        answer, schema = AnswerFormat.JSON_SCHEMA, fmt.json_schema.schema_
    constraint = requested_constraint(body)
    if fmt is not None and fmt.type == "structural_tag":
        if constraint is not None:
            raise InvalidRequestError("response_format and a structured-output field cannot be combined",
                                      param=constraint.param)
        constraint = response_format_constraint(fmt)
    pattern, choices, grammar = "", tuple[str, ...](), ""
    if constraint is not None:
        if answer is not AnswerFormat.TEXT:
            raise InvalidRequestError("response_format and a structured-output field cannot be combined",
                                      param=constraint.param)
        completion_grammar(constraint, served.grammar_tokenizer)  # validates the regex / schema alone
        answer, schema, pattern, choices, grammar = (constraint.format, constraint.schema, constraint.pattern,
                                                     constraint.choices, constraint.grammar)
    return ConstraintRequest(tools=tools, tool_choice=choice, named_tool=named,
                             parallel_tool_calls=body.parallel_tool_calls is not False,
                             answer_format=answer, answer_schema=schema, answer_pattern=pattern,
                             answer_choices=choices, answer_grammar=grammar,
                             reasoning_max_chars=body.reasoning_max_chars)


_TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


def _template_kwargs(kwargs: dict[str, Any] | None, served: ServedModel) -> dict[str, Any]:
    """chat_template_kwargs as template variables (vLLM). Template variables are trusted
    markup (encode_chat), so a string value may not spell a control token; the names that
    have their own request field are refused rather than silently overridden."""
    out: dict[str, Any] = {}
    for name, value in (kwargs or {}).items():
        param = f"chat_template_kwargs.{name}"
        if name in _TEMPLATE_RESERVED or not name.isidentifier():
            raise InvalidRequestError(f"{name!r} cannot be set through chat_template_kwargs", param=param)
        text = json.dumps(value, ensure_ascii=False)
        if any(special in text for special in served.tokenizer.special_tokens):
            raise InvalidRequestError("template variables may not contain control-token spellings", param=param)
        out[name] = value
    return out


def _plan(body: ChatCompletionRequest, served: ServedModel, prompt_text: str,
          constraints: ConstraintRequest) -> RequestSyntax:
    try:
        return plan_request(served.syntax, prompt_text, constraints, served.grammar_tokenizer)
    except InvalidToolChoiceError as exc:
        raise InvalidRequestError(str(exc), param="tool_choice") from exc
    except GrammarRequestError as exc:
        param = "response_format" if constraints.structured_answer and not body.tools else "tools"
        raise InvalidRequestError(str(exc), param=param) from exc


def chat_prompt(messages: Sequence[ChatMessage], served: ServedModel, tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool | None, continue_final_message: bool | None,
                chat_template_kwargs: dict[str, Any] | None) -> PromptIds:
    """Render the messages with the served chat template and encode them (chat, /tokenize)."""
    rendered = [_message_dict(m, i) for i, m in enumerate(messages)]
    template_args = _template_kwargs(chat_template_kwargs, served)
    if continue_final_message:
        template_args["continue_final_message"] = True
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    try:
        return encode_chat(served.chat_template, served.tokenizer, rendered, tools=tools,
                           add_generation_prompt=add_generation_prompt, **template_args)
    except (UntrustedMarkupError, TemplateError) as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc


def prepare_chat(body: ChatCompletionRequest, served: ServedModel, ingress_ns: int,
                 request_id: str | None = None) -> PreparedRequest:
    constraints = _constraints(body, served)
    top_logprobs = body.top_logprobs or 0
    if body.top_logprobs is not None and not body.logprobs:  # 0 included, as vLLM and OpenAI
        raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    generate, stops, observation = _common(body, served, max_tokens, constraints.structured_answer,
                                           bool(body.logprobs), top_logprobs, "top_logprobs")
    messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
    _check_prompt_bytes(sum(len(str(m["content"]).encode("utf-8", "surrogatepass")) for m in messages),
                        served, "messages")
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    prompt = chat_prompt(body.messages, served, tools, body.add_generation_prompt, body.continue_final_message,
                         body.chat_template_kwargs)
    check_context((prompt.ids,), max_tokens, served, "messages",
                  "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    syntax = _plan(body, served, prompt.text, constraints)
    if syntax.grammar is not None:  # the backend enforces it with llguidance
        generate.grammar.CopyFrom(ep.Grammar(kind=ep.GRAMMAR_KIND_LLGUIDANCE, text=syntax.grammar.grammar))
    return PreparedRequest(
        request_id=f"chatcmpl-{request_id or uuid.uuid4().hex}", prompts=(tuple(prompt.ids),), n=body.n or 1,
        generate=generate, stop_strings=stops.strings, stop_sequences=stops.sequences,
        stream=bool(body.stream), observation=observation, ingress_ns=ingress_ns, syntax=syntax)


# ---- completions -------------------------------------------------------------------------

def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]],
                       served: ServedModel) -> tuple[tuple[int, ...], ...]:
    """The raw completion prompt is the whole model input, so its control-token spellings
    are parsed as control tokens (as HF and vLLM do); chat content never is."""
    prompts: Sequence[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_token_list(prompt):
        prompts = [prompt]
    else:
        prompts = [p for p in prompt if isinstance(p, (str, list))]
    if not prompts:
        raise InvalidRequestError("prompt is empty", param="prompt")
    encoded: list[tuple[int, ...]] = []
    input_size = served.tokenizer.vocab_size
    for item in prompts:
        if isinstance(item, str):
            _check_prompt_bytes(len(item.encode("utf-8", "surrogatepass")), served, "prompt")
        try:
            ids = served.tokenizer.encode_template(item) if isinstance(item, str) else list(item)
        except UnrepresentableTextError as exc:
            raise InvalidRequestError(str(exc), param="prompt") from exc
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if any(not 0 <= t < input_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {input_size})", param="prompt")
        encoded.append(tuple(ids))
    return tuple(encoded)


def _is_token_list(prompt: list[str] | list[int] | list[list[int]]) -> TypeGuard[list[int]]:
    return bool(prompt) and all(isinstance(p, int) for p in prompt)


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default (chat's is the core's max_output_tokens)


def prepare_completion(body: CompletionRequest, served: ServedModel, ingress_ns: int,
                       request_id: str | None = None) -> PreparedRequest:
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo with logprobs would need prompt logprobs, which are not served",
                                  param="echo")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidRequestError("best_of is not supported", param="best_of")
    prompts = completion_prompts(body.prompt, served)
    # only an explicit limit must fit the context; the default is clipped by the backend
    check_context(prompts, body.max_tokens, served, "prompt", "max_tokens")
    max_tokens = body.max_tokens if body.max_tokens is not None else min(
        COMPLETIONS_DEFAULT_MAX_TOKENS, served.limits.max_output_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
    top_logprobs = body.logprobs or 0
    constraint = requested_constraint(body)
    formatted = response_format_constraint(body.response_format)
    if formatted is not None:
        if constraint is not None:
            raise InvalidRequestError("response_format and a structured-output field cannot be combined",
                                      param=constraint.param)
        constraint = formatted
    generate, stops, observation = _common(body, served, max_tokens, constraint is not None,
                                           body.logprobs is not None, top_logprobs, "logprobs")
    if constraint is not None:
        generate.grammar.CopyFrom(completion_grammar(constraint, served.grammar_tokenizer))
    return PreparedRequest(
        request_id=f"cmpl-{request_id or uuid.uuid4().hex}", prompts=prompts,
        n=body.n or 1, generate=generate, stop_strings=stops.strings, stop_sequences=stops.sequences,
        stream=bool(body.stream), observation=observation, ingress_ns=ingress_ns,
        echo_texts=_echo_texts(body.prompt, prompts, served) if body.echo else ())


def _echo_texts(prompt: object, prompts: tuple[tuple[int, ...], ...], served: ServedModel) -> tuple[str, ...]:
    """The prompt as the client wrote it (strings verbatim; token ids decoded)."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(str(p) for p in prompt)
    return tuple(served.tokenizer.decode(ids) for ids in prompts)
