"""A Hermes-style ChatML template for tokenizers whose own template cannot render tools.

SmolLM2's template only prints `role` and `content`: tools, tool calls and tool results would
vanish. This fallback follows Qwen2.5's layout (the common Hermes convention): the tool schemas
go into the system turn inside <tools></tools>, an assistant tool call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and consecutive tool results
share one user turn as <tool_response> blocks. It is ChatML (<|im_start|>/<|im_end|>), so it fits
ChatML tokenizers only; `Renderer` checks that. Reasoning of earlier turns is not re-rendered.
"""

from __future__ import annotations

HERMES_CHATML = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for tc in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


def template_supports_tools(template: str | None) -> bool:
    """A template that never mentions `tools` or `tool_calls` drops them silently."""
    return bool(template) and "tools" in template and "tool_call" in template
