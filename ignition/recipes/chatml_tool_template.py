"""A ChatML chat template that tells the model about tools in the JSON-call syntax.

For recipes whose checkpoint template is plain ChatML and ignores `tools` (SmolLM2's does): the
tools are listed in the system turn, with instructions to answer in the syntax the frontend
declares (helios_backend/syntax/tables.py `json_call_tags`), and the conversation's own
tool calls and tool results render in that syntax. The wording follows the tool section of the
Qwen2.5 chat templates (Apache-2.0), which instruction-tuned models commonly saw in training.

Without tools the rendering equals the checkpoint's ChatML template for string contents
(tests/test_chat_template_tools.py checks it against the GGUF's own template), so prompts, prefix
caching and every earlier measurement are unchanged for requests without tools.
"""
from __future__ import annotations

from helios_proto import contract_pb2 as C

from helios_backend.syntax.tables import chatml_prefix_rules, preset
from helios_backend.syntax.validate import validate_frontend

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>")


def chatml_tool_template(default_system: str) -> str:
    """The template source; `default_system` is the system prompt used when the request has none."""
    def quoted(text: str) -> str:
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"

    return (
        "{%- set default_system = " + quoted(default_system) + " %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- default_system }}{%- endif %}"
        "{{- " + quoted(TOOLS_PREAMBLE) + " }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- " + quoted(TOOLS_INSTRUCTIONS) + " + '<|im_end|>\\n' }}"
        "{%- elif messages[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' and loop.first and tools %}"
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
        "{{- '<|im_start|>assistant' }}"
        "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
        "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def chatml_frontend(tool_parser: C.ToolParser.ValueType, template_tokens: C.TemplateTokens) -> C.FrontendContract:
    """The FrontendContract of a ChatML recipe without images or reasoning: `tool_parser`'s
    syntax table (JSON-call for these templates, or TOOL_PARSER_NONE), ChatML prefix rules."""
    contract = C.FrontendContract(image_preparation=C.IMAGE_PREPARATION_NONE, image_layout=C.IMAGE_LAYOUT_NONE,
                                  template_tokens=template_tokens)
    syntax = preset(tool_parser, C.REASONING_PARSER_NONE, prefix_rules=chatml_prefix_rules())
    validate_frontend(syntax)
    syntax.apply_to(contract)
    return contract
