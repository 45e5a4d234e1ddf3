"""Small faithful copies of the chat templates the checkpoint families ship (tests only).

Each keeps the structure of the family's published template: its turn envelopes, where the
tools go and the spelling of assistant tool calls and reasoning; wording of long instructions
and rarely used branches (images, documents, multi-step reasoning bookkeeping) are cut.
"""
from __future__ import annotations

# Qwen3: ChatML; tools listed in the system turn; <think> reasoning; <tool_call> JSON calls
QWEN3 = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- set content = message.content or '' %}
{%- set reasoning_content = message.reasoning_content or '' %}
{{- '<|im_start|>assistant\\n' }}
{%- if reasoning_content %}{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}
{{- content.lstrip('\\n') }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# Mistral (tekken templates, Nemo / Small): [INST] turns, [AVAILABLE_TOOLS] before the last user
# turn, [TOOL_CALLS] followed by a JSON list of calls, [TOOL_RESULTS] for tool messages
MISTRAL = """
{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message["role"] == "user" %}
{%- if tools is not none and (message == user_messages[-1]) %}
{{- "[AVAILABLE_TOOLS][" }}
{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
{{- "][/AVAILABLE_TOOLS]" }}
{%- endif %}
{%- if loop.last and system_message is defined %}
{{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
{%- else %}
{{- "[INST]" + message["content"] + "[/INST]" }}
{%- endif %}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- "[TOOL_CALLS][" }}
{%- for tool_call in message.tool_calls %}
{%- set out = tool_call.function | tojson %}
{{- out[:-1] }}
{%- if not tool_call.id is defined or tool_call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
{{- ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
{%- endfor %}
{%- elif message["role"] == "assistant" %}
{{- message["content"] + eos_token }}
{%- elif message["role"] == "tool" %}
{{- '[TOOL_RESULTS]{"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
{%- endif %}
{%- endfor %}
"""

# Gemma 3 (instruction-tuned): <start_of_turn> turns, the system message heads the first user
# turn, the assistant speaks as "model"; no tool syntax
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif -%}
{%- if message['role'] == 'assistant' -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
{{- message['content'] | trim }}
{{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

# Llama 3.1: header envelopes, tools in the first user turn, a call is a bare JSON object with
# "parameters", tool results in an ipython turn
LLAMA31 = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
{%- if messages | length != 0 %}{%- set first_user_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}{{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{{- "Do not use variables.\\n\\n" }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", ' }}
{{- '"parameters": ' }}
{{- tool_call.arguments | tojson }}
{{- "}" }}
{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{{- message.content }}
{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
