"""Tools for the tests of tool calls: `tool_model` (the `tiny` weights with a tools template of
each family, `models.requests.tool_templates`) and tools whose arguments an untrained model
finishes within a few tokens."""
from __future__ import annotations

from uniun_ray.models.requests.tool_templates import with_tools as tool_model  # noqa: F401 (for the tests)

#: Tools whose arguments an untrained model can finish within a few tokens (closed sets).
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city over the next days.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
