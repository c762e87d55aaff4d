"""Tools and tool turns written into a chat the way Qwen2.5's chat template writes them
(hermes style), as plain message text, so any Qwen-family template renders them.

The tools go in the system message (the first message's, else Qwen2.5's default system
text) inside ``<tools></tools>``, one JSON object a line; an assistant turn's tool calls
follow its text as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
blocks; consecutive tool results form one user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.common.types import ChatMessage, TextPart

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def to_json(value: Any) -> str:
    """JSON as the templates' ``tojson`` filter writes it."""
    return json.dumps(value, ensure_ascii=False)


def tool_call(name: str, arguments: Any) -> str:
    call = f'{{"name": {to_json(name)}, "arguments": {to_json(arguments)}}}'
    return f"<tool_call>\n{call}\n</tool_call>"


def tool_response(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


def with_tools(messages: Sequence[ChatMessage], tools: Sequence[Any]) -> tuple[ChatMessage, ...]:
    """``messages`` with ``tools`` (the request's tool objects) listed in the system message."""
    if not tools:
        return tuple(messages)
    listing = TextPart(_TOOLS_HEAD + "".join("\n" + to_json(t) for t in tools) + _TOOLS_TAIL)
    if messages and messages[0].role == "system":
        first = ChatMessage("system", (*messages[0].content, listing))
        return (first, *messages[1:])
    return (ChatMessage("system", (TextPart(DEFAULT_SYSTEM), listing)), *messages)
