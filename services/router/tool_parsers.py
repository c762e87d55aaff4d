"""Tool calls in a model's free text (``tool_choice: auto``), one parser per tool-call format.

``hermes`` (Qwen2.5 / Qwen2.5-VL / Qwen3-VL): each call is a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block. A block whose JSON does
not parse, names no requested tool or has no object arguments is not a call and stays in
the content, as does any text outside the blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from typing import Any

import msgspec

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ParsedCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # the arguments object as JSON text


class ParsedText(msgspec.Struct, frozen=True):
    content: str  # the text that is not a call, stripped
    calls: tuple[ParsedCall, ...]


def as_call(value: Any, names: Collection[str]) -> ParsedCall | None:
    """``value`` (decoded JSON) as a call of one of ``names``; None when it is not one."""
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if name not in names or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str, names: Collection[str], max_calls: int | None = None) -> ParsedText:
    """The calls of ``names`` in ``text`` (at most ``max_calls``; later blocks stay text)."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    start = 0
    for match in _HERMES_BLOCK.finditer(text):
        try:
            call = as_call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is None or (max_calls is not None and len(calls) >= max_calls):
            continue
        calls.append(call)
        kept.append(text[start : match.start()])
        start = match.end()
    kept.append(text[start:])
    return ParsedText("".join(kept).strip() if calls else text, tuple(calls))


def tool_calls_body(calls: tuple[ParsedCall, ...]) -> list[dict[str, Any]]:
    """The ``message.tool_calls`` of a response."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


TOOL_PARSERS: dict[str, Callable[[str, Collection[str], int | None], ParsedText]] = {
    "hermes": parse_hermes,
}
