"""Tools and tool turns written into a chat as plain message text, the way the chat template of
the model's tool-call format (``ToolFormat``) writes them, so any Qwen-family template renders
them.

``hermes`` (Qwen2.5's template): the tools go in the system message (after the first
message's text, else after Qwen2.5's default system text) inside ``<tools></tools>``, one JSON
object a line; an assistant turn's calls follow its text, one
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` block a line.

``qwen3_coder`` (Qwen3.5's template; Qwen3-Coder's writes the same calls): the system
message opens with the tools, one JSON object a line, and the XML call format's
instructions, then the first message's text (none by default); the calls are
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n
</tool_call>`` blocks, a blank line after the turn's text, one a line; a value is its text
(objects and arrays as JSON, other values as the template's ``string`` filter writes them).

In both, consecutive tool results form one user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.common.types import ChatMessage, TextPart
from services.router.tool_parsers import ToolFormat

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOLS_HEAD = {
    ToolFormat.HERMES: (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    ),
    ToolFormat.QWEN3_CODER: "# Tools\n\nYou have access to the following functions:\n\n<tools>",
}
_TOOLS_TAIL = {
    ToolFormat.HERMES: (
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
    ToolFormat.QWEN3_CODER: (
        "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format "
        "with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        "<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
        "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
        "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
        "<function=...></function> block must be nested within <tool_call></tool_call> XML "
        "tags\n- Required parameters MUST be specified\n- You may provide optional reasoning "
        "for your function call in natural language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your "
        "current knowledge and do not tell the user about function calls\n</IMPORTANT>"
    ),
}
_BEFORE_CALLS = {ToolFormat.HERMES: "\n", ToolFormat.QWEN3_CODER: "\n\n"}


def to_json(value: Any) -> str:
    """JSON as the templates' ``tojson`` filter writes it."""
    return json.dumps(value, ensure_ascii=False)


def tool_call(name: str, arguments: dict[str, Any], style: ToolFormat = ToolFormat.HERMES) -> str:
    """One call's block."""
    if style is ToolFormat.HERMES:
        call = f'{{"name": {to_json(name)}, "arguments": {to_json(arguments)}}}'
        return f"<tool_call>\n{call}\n</tool_call>"
    parameters = "".join(
        f"<parameter={key}>\n{_parameter_text(value)}\n</parameter>\n"
        for key, value in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def _parameter_text(value: Any) -> str:
    if isinstance(value, dict | list):
        return to_json(value)
    return str(value)  # Jinja's string filter: True, None, 1.5


def tool_calls(
    calls: Sequence[tuple[str, dict[str, Any]]],
    *,
    after_text: bool,
    style: ToolFormat = ToolFormat.HERMES,
) -> str:
    """An assistant turn's calls (name, arguments), one block a line; ``after_text``: the
    turn has text before them."""
    blocks = "\n".join(tool_call(name, arguments, style) for name, arguments in calls)
    return (_BEFORE_CALLS[style] if after_text else "") + blocks


def tool_response(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


def with_tools(
    messages: Sequence[ChatMessage],
    tools: Sequence[Any],
    style: ToolFormat = ToolFormat.HERMES,
) -> tuple[ChatMessage, ...]:
    """``messages`` with ``tools`` (the request's tool objects) listed in the system message."""
    if not tools:
        return tuple(messages)
    listing = _TOOLS_HEAD[style] + "".join("\n" + to_json(t) for t in tools) + _TOOLS_TAIL[style]
    has_system = bool(messages) and messages[0].role == "system"
    system = messages[0].content if has_system else ()
    rest = messages[1:] if has_system else messages
    if style is ToolFormat.HERMES:
        parts = (*(system if has_system else (TextPart(DEFAULT_SYSTEM),)), TextPart(listing))
    elif all(isinstance(p, TextPart) for p in system):
        text = "".join(p.text for p in system if isinstance(p, TextPart)).strip()
        parts = (TextPart(listing + ("\n\n" + text if text else "")),)
    else:
        parts = (TextPart(listing + "\n\n"), *system)
    return (ChatMessage("system", parts), *rest)
