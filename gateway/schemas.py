"""Pydantic models at the HTTP edge: OpenAI chat/completions requests and response shapes.

Requests validate strictly (no "1" -> 1 coercion; observation flags are booleans or null
only, OBS-28) so a bad field becomes a 400 naming it. No field is silently dropped
(docs/gateway.md, "Request fields"): OpenAI fields accepted without effect are declared in
OPENAI_UNUSED_FIELDS; vLLM extension fields not implemented here are refused by name
(VLLM_UNSUPPORTED_FIELDS); any other top-level field is kept in `model_extra`, so newer SDKs
keep working, and the gateway logs and counts it. Cross-field rules (stops vs token stops vs
structured output, timestamps requiring ids, ...) live in preparation, which names the
parameter in its error. Response models exist for the OpenAPI document; handlers build
plain dicts (presentation.py) so streaming stays cheap.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

_REQUEST_CONFIG = ConfigDict(strict=True, extra="ignore")
_TOP_LEVEL_CONFIG = ConfigDict(strict=True, extra="allow")  # unknown names are seen, then logged

# OpenAI request fields accepted and not acted on (docs/gateway.md lists them with the reason).
OPENAI_UNUSED_FIELDS = ("user", "store", "metadata", "service_tier", "prediction", "modalities", "audio",
                        "web_search_options", "reasoning_effort", "verbosity", "prompt_cache_key",
                        "safety_identifier", "functions", "function_call")
# vLLM extension fields this gateway does not implement: a 400 naming them, never a silent no-op.
VLLM_UNSUPPORTED_FIELDS = frozenset({
    "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "guided_decoding_backend", "guided_whitespace_pattern",
    "documents", "chat_template", "mm_processor_kwargs", "media_io_kwargs", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "return_tokens_as_token_ids", "add_special_tokens", "logits_processors",
    "thinking_token_budget", "prompt_embeds", "request_id", "return_prompt_text",
    # fields of the other endpoint (declared there, so only ever unknown here): vLLM's chat
    # `echo` (prepend the last message) and `best_of`
    "echo", "best_of",
})

UINT64_MAX = 2**64 - 1
# integers travel in int32/uint32 protobuf fields: larger values are a 400, never a 500
INT32_MAX = 2**31 - 1


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # OpenAI: no obfuscation padding is sent here
    continuous_usage_stats: StrictBool | None = None  # vLLM: not implemented (400 when true)


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = _REQUEST_CONFIG
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    model_config = _REQUEST_CONFIG
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # text or text parts; images are refused in preparation (no image layout served here)
    content: StrictStr | list[TextContentPart | dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class FunctionDefinition(BaseModel):
    model_config = _REQUEST_CONFIG
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(BaseModel):
    model_config = _REQUEST_CONFIG
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["function"]
    function: NamedToolChoiceFunction


class JsonSchemaFormat(BaseModel):
    model_config = _REQUEST_CONFIG
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")   # required, as OpenAI requires it
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag response format (gateway/structured_outputs.py)
    structures: list[dict[str, Any]] | None = None
    triggers: list[StrictStr] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object; exactly one constraint (checked in preparation). Its
    other vLLM options are kept in `model_extra` and refused there, never dropped."""
    model_config = ConfigDict(strict=True, extra="allow")
    json_: StrictStr | dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    json_object: StrictBool | None = None
    grammar: StrictStr | None = None
    structural_tag: StrictStr | dict[str, Any] | None = None


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class SamplingFields(BaseModel):
    """Fields shared by chat and completions; None = take the core's prepared default."""

    model_config = _TOP_LEVEL_CONFIG
    model: StrictStr
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 and 0 = off
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=UINT64_MAX)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    stop_token_sequences: list[list[TokenId]] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool | None = None
    return_token_timestamps: StrictBool | None = None
    ignore_eos: StrictBool | None = None  # vLLM: EOS does not end the output
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None  # vLLM: EOS/stop ids withheld until then
    logit_bias: dict[str, float] | None = None
    # accepted, no effect (OPENAI_UNUSED_FIELDS): any JSON value
    user: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prediction: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    functions: Any = None
    function_call: Any = None
    # vLLM structured outputs (gateway/structured_outputs.py)
    structured_outputs: StructuredOutputs | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None
    structural_tag: StrictStr | dict[str, Any] | None = None
    priority: Annotated[StrictInt, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] | None = None
    # OpenAI's (chat) and vLLM's (completions too)
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM)
    reasoning_max_chars: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None  # Helios: reasoning budget (grammar)


class CompletionRequest(SamplingFields):
    # a string, a list of strings, token ids, or a list of token-id lists (one choice set each)
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None


# ---- responses (documentation of the shapes presentation.py builds) -----------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class Performance(BaseModel):
    ingress_ns: int
    enqueue_ns: int
    reused_prompt_tokens: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text (newer clients read this name)
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None
    token_timestamps_ns: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    reused_prompt_tokens: int | None = None
    performance: Performance | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None
    token_timestamps_ns: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int] | list[list[int]] | None = None
    reused_prompt_tokens: int | None = None
    performance: Performance | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None  # the served context (prompt + output), as vLLM reports it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
