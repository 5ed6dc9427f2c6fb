"""Chat templates that take tools, one per tool-call format `tools` reads, shortened from the real
ones (Qwen2.5-Instruct's hermes, Llama-3.1-Instruct's JSON, Mistral-7B-Instruct-v0.3's
[TOOL_CALLS]), and `with_tools`, which gives a model folder one of them.

No embedded model takes tools (SmolLM2's template has none), so this is how a fresh clone runs
tool calls offline: an embedded model's weights with a tools template. The agent workload
(`jobs/gana_agent.py`) runs SmolLM2-135M-Instruct's under the hermes template (SmolLM2 speaks
ChatML, the template's own tokens), so what it answers after a tool's result reads as an answer.
The tests run the untrained `tiny` under each template: it writes no call of its own, but a
forced one (`tool_choice` "required" or a name) is a valid call.
"""
from __future__ import annotations

import shutil
from pathlib import Path

HERMES = """{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}
{{- tool_call.function.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_JSON = """{%- if tools %}<|start_header_id|>system<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in message.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{%- for message in messages %}
{%- if message.role == "user" %}{% if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS][{% for c in message.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL}


def with_tools(source: Path, folder: Path, family: str = "hermes") -> Path:
    """A copy of the model folder ``source`` at ``folder`` whose chat template is ``family``'s
    (kept if it is there already)."""
    if not (folder / "chat_template.jinja").exists():
        shutil.copytree(source, folder, dirs_exist_ok=True)
        (folder / "chat_template.jinja").write_text(TEMPLATES[family])
    return folder
